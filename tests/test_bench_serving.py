"""``coserve bench``: the request stream, the policy options, and short real runs on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from coserve.bench.serving import parse_policy, parse_split
from coserve.bench.serving_run import FinetuneSpec, RunSpec, run_one, split_cores
from coserve.bench.serving_workload import serving_workload
from coserve.bench.workload import fit_length, load_sharegpt
from coserve.model.tokenizer import load_tokenizer


def _alpaca(path, n=6):
    rows = [{"instruction": f"Say {i} twice.", "input": "", "output": f"{i} {i}, and once more {i}."}
            for i in range(n)]
    path.write_text(json.dumps(rows))
    return path


def _sharegpt(path, entries):
    path.write_text(json.dumps({"entries": entries}))
    return path


def test_fit_length_cuts_or_repeats_the_body():
    assert fit_length([9, 1, 2], 7) == [9, 1, 2, 1, 2, 1, 2]
    assert fit_length([9, 1, 2], 2) == [9, 1]
    assert fit_length([5], 3) == [5, 5, 5]
    with pytest.raises(ValueError):
        fit_length([], 3)


def test_workload_lengths_are_scaled_to_the_context_and_fit_it(model_factory, tmp_path):
    tok = load_tokenizer(model_factory("llama"))
    trace = _sharegpt(tmp_path / "sg.json", [
        {"prompt": "hello there", "prompt_length": 400, "response_length": 200},
        {"prompt": "a long one", "prompt_length": 4000, "response_length": 800}])
    w = serving_workload(tok, 256, rate=20.0, duration_s=2.0, prompts=trace, seed=1)
    assert w.requests and w.lengths == str(trace) and w.arrivals == "poisson"
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 2.0
    first = w.requests[0]
    assert (len(first.prompt), first.max_tokens) == (25, 12)  # 400 and 200 scaled by 256 / 4096
    long = w.requests[1]
    assert len(long.prompt) == 250 and len(long.prompt) + long.max_tokens <= 256  # clipped to fit
    assert serving_workload(tok, 256, 0.0, 2.0).requests == []
    synthetic = serving_workload(tok, 256, 20.0, 2.0, burstiness=0.5, seed=3)
    assert synthetic.lengths == "synthetic" and synthetic.arrivals == "gamma(burstiness=0.5)"
    assert all(1 <= len(r.prompt) < 256 and len(r.prompt) + r.max_tokens <= 256 for r in synthetic.requests)


def test_bad_prompt_files_name_the_entry(tmp_path):
    with pytest.raises(ValueError, match="entries"):
        load_sharegpt(_sharegpt(tmp_path / "a.json", []))
    with pytest.raises(ValueError, match=r"entries\[1\]"):
        load_sharegpt(_sharegpt(tmp_path / "b.json", [{"prompt": "x", "prompt_length": 3, "response_length": 2},
                                                      {"prompt": "y", "prompt_length": 3}]))
    (tmp_path / "c.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_sharegpt(tmp_path / "c.json")


def test_policy_and_split_options():
    assert parse_policy("temporal:128", (50, 50))["temporal_interval"] == 128
    assert parse_policy("temporal", (50, 50))["label"] == "temporal:64"
    assert parse_policy("separate", (30, 70))["label"] == "separate 30:70"
    for bad in ("fast", "temporal:0", "temporal:x", "coserve:3"):
        with pytest.raises(ValueError, match="--policy"):
            parse_policy(bad, (50, 50))
    assert parse_split("25:75") == (25, 75)
    for bad in ("50", "0:100", "a:b"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert split_cores((50, 50), [0, 1]) == ([0], [1])
    assert split_cores((25, 75), [0, 1, 2, 3]) == ([0], [1, 2, 3])
    assert split_cores((90, 10), [0, 1, 2, 3]) == ([0, 1, 2], [3])  # finetuning keeps at least one core
    with pytest.raises(ValueError, match="2 cores"):
        split_cores((50, 50), [0])


@pytest.mark.parametrize("policy, cut", [("coserve", False), ("coserve", True), ("spatial", False)],
                         ids=["coserve", "coserve-cut-for-arrivals", "spatial"])
def test_a_short_run_serves_every_request_and_trains(model_factory, tmp_path, policy, cut):
    model = model_factory("llama")
    tok = load_tokenizer(model)
    w = serving_workload(tok, 128, rate=8.0, duration_s=1.5, seed=0)
    spec = RunSpec(model=str(model), policy=policy, label=policy, rate=8.0, duration_s=1.5, requests=w.requests,
                   finetune=FinetuneSpec(str(_alpaca(tmp_path / "a.json")), max_seq_len=64), slo_tpot_ms=1000.0,
                   ttft_limit_s=60.0, drain_s=30.0, max_model_len=128, progress=False, cut_for_arrivals=cut)
    row = run_one(spec)
    assert row["cut_for_arrivals"] is cut and row["cut_iterations"] == sum(it["cut"] for it in row["iterations"])
    assert row["finetune_memory_target"] == 0.5  # the job's (FinetuneSpec's default)
    if not cut:  # nothing watches arrivals: no iteration is cut
        assert row["cut_iterations"] == 0
    assert row["policy"] == policy and row["num_requests"] == len(w.requests) > 0
    assert row["num_completed"] == row["num_requests"] and row["num_failed"] == 0
    assert row["slo_attainment"] == 1.0  # a generous SLO on a tiny model
    assert row["finetune_tokens"] > 0 and row["finetune_tokens_per_s"] > 0
    assert row["iterations"] and 0 <= row["idle_fraction"] <= 1
    if policy == "coserve":  # finetuning rode in the engine's iterations, sized by a (brief) latency profile
        assert any(it["finetune_forward_tokens"] or it["finetune_backward_tokens"] for it in row["iterations"])
        assert any(it["predicted_s"] > 0 for it in row["iterations"])
    else:  # trained beside the engine: its iterations carry inference only
        assert all(it["finetune_forward_tokens"] == it["finetune_backward_tokens"] == 0 for it in row["iterations"])
    assert row["finetune_stream"] == ("default" if policy == "spatial" else None)  # a CPU has no streams


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a CUDA device")
def test_spatial_trains_on_a_cuda_stream_of_its_own(model_factory, tmp_path, monkeypatch):
    import coserve.bench.serving_run as serving_run
    streams = []
    train = serving_run._train_until
    monkeypatch.setattr(serving_run, "_train_until",
                        lambda job, stop, deadline: streams.append(torch.cuda.current_stream()) or train(job, stop,
                                                                                                        deadline))
    model = model_factory("llama")
    w = serving_workload(load_tokenizer(model), 128, rate=8.0, duration_s=1.5, seed=0)
    spec = RunSpec(model=str(model), policy="spatial", label="spatial", rate=8.0, duration_s=1.5, requests=w.requests,
                   finetune=FinetuneSpec(str(_alpaca(tmp_path / "a.json")), max_seq_len=64), slo_tpot_ms=1000.0,
                   ttft_limit_s=60.0, drain_s=30.0, max_model_len=128, progress=False, device="cuda")
    row = run_one(spec)
    assert row["finetune_stream"] == "own" and row["num_failed"] == 0 and row["finetune_tokens"] > 0
    assert streams and streams[0] != torch.cuda.default_stream()


def test_the_bench_command_writes_rows_and_plots(model_factory, tmp_path, capsys):
    """Also: the headline takes the zero-load run from an earlier file (``--with-results``)."""
    from coserve.cli import main
    model = model_factory("llama")
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    idle = tmp_path / "idle.json"
    idle.write_text(json.dumps({"results": [_row("finetune-only", 0, 1.0, 500.0, idle=1.0)]}))
    code = main(["bench", "--model", str(model), "--policy", "coserve", "--policy", "inference-only",
                 "--rate", "6", "--duration", "1", "--drain", "20", "--max-model-len", "128",
                 "--finetune-data", str(_alpaca(tmp_path / "a.json")), "--finetune-seq-len", "64",
                 "--slo-tpot-ms", "1000", "--out", str(out), "--plot", str(plots), "--no-progress",
                 "--fuse-finetuning", "never", "--repeats", "2", "--with-results", str(idle)])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    # every run a row; the second repeat runs the policies in the other order
    assert [(r["policy"], r["repeat"]) for r in rows] == [("coserve", 1), ("inference-only", 1),
                                                          ("inference-only", 2), ("coserve", 2)]
    assert rows[0]["batch_invariant"] and rows[0]["fused_finetuning"] is False  # as asked
    assert rows[0]["gemm_tile_rows"] == 0  # no tiles on CPU
    assert rows[1]["finetune_tokens_per_s"] is None and rows[0]["finetune_tokens_per_s"] > 0
    assert rows[0]["num_requests"] == rows[1]["num_requests"]  # the same stream for both
    assert {p.name for p in plots.iterdir()} >= {"slo_attainment.png", "finetune_throughput.png",
                                                 "inference_throughput.png", "token_mix_coserve_6.png"}
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| 6 |"))
    assert not line.endswith("| - |")  # the harvest ratio, from the earlier file's finetune-only rate
    assert main(["bench", "--model", str(model), "--policy", "nope", "--no-progress"]) == 2
    assert main(["bench", "--model", str(model), "--repeats", "0", "--no-progress"]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "--model", str(model), "--with-results", str(bad), "--no-progress"]) == 2
    assert "bad.json is not a coserve bench --out file" in capsys.readouterr().err


def test_repeated_runs_rotate_the_policy_order_and_the_headline_pools_them():
    from coserve.bench.headline import headline, markdown
    from coserve.bench.repeats import policy_order, pool_rows
    assert [policy_order(["a", "b", "c"], k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"],
                                                                    ["c", "a", "b"], ["a", "b", "c"]]
    assert policy_order([], 3) == []

    def run(policy, slo, ft, requests=10):
        return {**_row(policy, 2, slo, ft), "num_requests": requests}

    rows = [run("coserve", 1.0, 600.0), run("dts", 1.0, 500.0), run("dts", 0.8, 700.0, requests=30),
            run("coserve", 0.9, 900.0, requests=30)]
    pooled = pool_rows(rows)
    assert [(r["policy"], r["runs"]) for r in pooled] == [("coserve", 2), ("dts", 2)]  # first-seen order
    (two,) = headline(rows)
    assert two["finetune_tokens_per_s"]["coserve"] == 750.0 and two["coserve_range"] == [600.0, 900.0]
    assert two["attainment"]["dts"] == pytest.approx(0.85)  # 34 of 40 requests: dts no longer holds 90%
    assert two["best_temporal"] is None and two["coserve_holds"]  # 37 of 40
    assert "| 2 | - / 92% | 750 (2 runs: 600-900) | - (none holds) | - (none holds) | - |" in markdown([two])
    (one,) = headline(rows[:2])  # single runs: as they are
    assert one["vs_temporal"] == 600 / 500 and one["coserve_range"] is None


def _row(policy, rate, slo, ft, idle=0.5):
    return {"policy": policy, "rate": rate, "slo_attainment": slo, "finetune_tokens_per_s": ft,
            "idle_fraction": idle}


def test_headline_compares_against_the_best_baseline_that_holds_the_slo():
    from coserve.bench.headline import headline, markdown
    rows = [_row("finetune-only", 0, 1.0, 1000.0), _row("coserve", 0, 1.0, 950.0),
            _row("inference-only", 2, 1.0, None, idle=0.6), _row("coserve", 2, 0.95, 800.0),
            _row("temporal:64", 2, 0.99, 700.0), _row("dts", 2, 0.92, 640.0), _row("temporal:32", 2, 0.5, 900.0),
            _row("separate 50:50", 2, 0.80, 600.0),
            _row("inference-only", 4, 0.93, None, idle=0.2), _row("coserve", 4, 0.91, 500.0),
            _row("separate 50:50", 4, 0.95, 250.0)]
    zero, two, four = headline(rows)
    assert zero["vs_finetune_only"] == 0.95
    assert two["best_temporal"] == "temporal:64" and two["vs_temporal"] == 800 / 700  # temporal:32 misses the SLO
    assert two["best_separate"] is None and two["vs_separate"] is None  # no split holds 90%
    assert two["harvest"] == 800 / (1000 * 0.6)
    assert four["vs_separate"] == 2.0 and four["inference_only_holds"] and four["coserve_holds"]
    table = markdown(headline(rows))
    assert "| 2 | 100% / 95% | 800 | - (none holds) | 1.14x (temporal:64) | 1.33x |" in table
    below = markdown(headline([_row("coserve", 3, 0.85, 500.0), _row("dts", 3, 0.95, 600.0)]))
    assert "| 3 | - / 85% (below 90%) | 500 | - (none holds) | 0.83x (dts) | - |" in below  # inference-only not run


def test_a_sweep_report_takes_named_policies_per_file_and_later_rows_replace_earlier(tmp_path, capsys, monkeypatch):
    from coserve.bench.sweep_report import main, select

    def write(name, rows):
        path = tmp_path / name
        path.write_text(json.dumps({"results": [{**r, "ttft_s": {"p50": 0.02}, "tpot_s": {"p50": 0.01}}
                                                for r in rows]}))
        return str(path)

    old = write("old.json", [_row("coserve", 1.0, 0.9, 100), _row("dts", 1.0, 1.0, 80), _row("coserve", 2.0, 0.5, 9)])
    new = write("new.json", [_row("coserve", 1.0, 1.0, 120), _row("inference-only", 1.0, 1.0, None)])
    rows = select([old + ":dts", new])  # the old coserve rows are left out, even where new.json has none
    assert [(r["policy"], r["rate"], r["finetune_tokens_per_s"]) for r in rows] == [
        ("coserve", 1.0, 120), ("dts", 1.0, 80), ("inference-only", 1.0, None)]
    assert [r["finetune_tokens_per_s"] for r in select([old, new]) if r["policy"] == "coserve"] == [120, 9]
    with pytest.raises(ValueError, match="missing.json"):
        select([str(tmp_path / "missing.json")])
    monkeypatch.setattr("sys.argv", ["sweep_report", old + ":dts", new])
    main()
    out = capsys.readouterr().out
    assert "1.50x (dts)" in out and "| coserve | 1 | 100.0% | 20 | 10.0 | 120 | 50% |" in out


def test_a_pooled_sweep_report_averages_repeated_runs_of_each_policy_and_rate(tmp_path, capsys, monkeypatch):
    from coserve.bench.repeats import pool
    from coserve.bench.sweep_report import main, select

    def run(policy, slo, ft, requests, ttft, idle=0.5):
        return {**_row(policy, 2.0, slo, ft, idle), "num_requests": requests, "ttft_s": {"p50": ttft, "p90": 1.0},
                "tpot_s": {"p50": 0.01}, "inference_tokens_per_s": 10.0 * requests}

    first = tmp_path / "first.json"
    first.write_text(json.dumps({"results": [run("coserve", 1.0, 100.0, 30, 0.02), run("dts", 0.9, 80.0, 30, 0.04),
                                             run("inference-only", 1.0, None, 30, 0.01, idle=0.6)]}))
    second = tmp_path / "second.json"
    second.write_text(json.dumps({"results": [run("coserve", 0.8, 140.0, 10, 0.04), run("dts", 1.0, 90.0, 30, 0.02)]}))
    rows = {r["policy"]: r for r in select([str(first), str(second)], pooled=True)}
    co = rows["coserve"]
    assert co["runs"] == 2 and co["num_requests"] == 40
    assert co["slo_attainment"] == pytest.approx((30 * 1.0 + 10 * 0.8) / 40)  # over all requests, not a mean of runs
    assert co["finetune_tokens_per_s"] == 120.0 and co["finetune_tokens_per_s_range"] == [100.0, 140.0]
    assert co["ttft_s"] == {"p50": pytest.approx(0.03)} and co["inference_tokens_per_s"] == 200.0
    assert rows["inference-only"]["idle_fraction"] == 0.6 and "runs" not in rows["inference-only"]  # one run: as is
    assert [r["finetune_tokens_per_s"] for r in select([str(first), str(second)])] == [140.0, 90.0, None]  # replaced
    assert pool([run("coserve", 1.0, 100.0, 30, 0.02)])["finetune_tokens_per_s"] == 100.0
    assert pool([run("coserve", 1.0, 100.0, 30, 0.02), run("coserve", 1.0, 0.0, 30, 0.02)])[
        "finetune_tokens_per_s"] == 50.0  # a run that trained nothing counts
    monkeypatch.setattr("sys.argv", ["sweep_report", str(first), str(second), "--pool"])
    main()
    out = capsys.readouterr().out
    assert "| 2 | 100% / 95% | 120 (2 runs: 100-140) | - (none holds) | 1.41x (dts) | - |" in out  # 120 / mean(80, 90)
    assert "| coserve | 2 | 95.0% | 30 | 10.0 | 120 | 50% | 2 | 100-140 |" in out


def test_every_policys_job_takes_the_memory_target_and_a_bad_one_is_refused(model_factory, tmp_path, capsys):
    from coserve.bench.serving_run import _make_job
    from coserve.cli import main
    from coserve.model.loader import load_model
    model = model_factory("llama")
    data = str(_alpaca(tmp_path / "a.json"))
    m = load_model(model, torch.float32, torch.device("cpu"))
    job = _make_job(m, load_tokenizer(model), FinetuneSpec(data, max_seq_len=64, memory_target=0.8), str(tmp_path / "j"))
    assert job.cfg.memory_target == 0.8 and job.plan.memory_target == 0.8
    default = _make_job(m, load_tokenizer(model), FinetuneSpec(data, max_seq_len=64), str(tmp_path / "k"))
    assert default.plan.memory_target == 0.5
    assert main(["bench", "--model", str(model), "--policy", "coserve", "--rate", "1", "--finetune-data", data,
                 "--finetune-memory-target", "1.5"]) == 2
    assert "--finetune-memory-target: must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_a_bad_finetuning_data_set_is_refused_before_any_run(model_factory, tmp_path, capsys):
    """It failed in each run's child process, a traceback naming the child rather than the flag."""
    from coserve.cli import main
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    assert main(["bench", "--model", str(model_factory("llama")), "--policy", "coserve", "--rate", "1",
                 "--duration", "1", "--finetune-data", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--finetune-data: {bad}: no valid training example" in err and "Traceback" not in err
