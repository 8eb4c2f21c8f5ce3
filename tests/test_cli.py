"""The ``coserve`` command end to end: create-model, generate (with an adapter), bench-generation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from coserve.cli import main
from peft_helpers import make_ia3_adapter, make_lora_adapter


def test_create_model_then_generate(tmp_path, capsys):
    model = tmp_path / "m"
    assert main(["create-model", str(model), "--preset", "tiny", "--arch", "qwen2", "--seed", "3"]) == 0
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["generate", "--model", str(model), "--prompt", "Hello", "--prompt", "World",
                 "--max-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 2 and "2 requests, 10 tokens" in out
    assert main(["generate", "--model", str(model), "--prompt", "Hello", "--n", "3", "--temperature", "1",
                 "--seed", "4", "--max-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt:") == 1 and out.count("[sequence ") == 3 and "3 requests, 15 tokens" in out


@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_generate_with_an_adapter(model_factory, tmp_path, capsys, kind):
    model = model_factory("llama")
    adapter = (make_lora_adapter(model, tmp_path / "a", r=4, lora_alpha=8, target_modules=["down_proj"])
               if kind == "lora" else make_ia3_adapter(model, tmp_path / "a"))
    assert main(["generate", "--model", str(model), "--prompt", "Hi", "--adapter", f"sql={adapter}",
                 "--max-tokens", "3", "--ignore-eos"]) == 0
    assert "(adapter: sql)" in capsys.readouterr().out


def test_bad_input_is_one_clear_line(model_factory, tmp_path, capsys):
    model = model_factory("llama")
    cmd = [sys.executable, "-m", "coserve.cli", "generate", "--model", str(model), "--prompt", "x",
           "--max-tokens", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)  # the real entry point, once
    assert proc.returncode == 2
    assert "max_tokens must be a positive integer" in proc.stderr and "Traceback" not in proc.stderr
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "Traceback" not in err


def test_a_state_directory_that_cannot_be_made_is_named_before_the_model_loads(model_factory, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["serve", "--model", str(model_factory("llama")), "--state-dir", str(blocker / "state")]) == 2
    assert f"--state-dir: cannot make {blocker / 'state'}" in capsys.readouterr().err


def test_bench_generation_runs_on_tiny_settings(model_factory, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench-generation", "--model", str(model_factory("llama")), "--num-requests", "4",
                 "--max-prompt-len", "32", "--output-len", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_requests"] == 4 and report["output_tokens"] == 16
    assert report["coserve"]["output_tokens_per_s"] > 0 and report["hf"]["output_tokens_per_s"] > 0
    assert report["identical_outputs"] == 4


def test_bench_generation_serves_many_lora_adapters_against_peft(model_factory, tmp_path, capsys):
    """``--adapters K``: K random PEFT LoRA adapters, requests round-robin over them, against PEFT's mixed adapter
    batch: the same greedy tokens, and tokens the adapters changed (they are not no-ops)."""
    out = tmp_path / "bench.json"
    assert main(["bench-generation", "--model", str(model_factory("llama")), "--num-requests", "6",
                 "--max-prompt-len", "32", "--output-len", "6", "--adapters", "3", "--lora-rank", "8",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["adapters"] == 3 and report["lora_rank"] == 8 and report["identical_outputs"] == 6
    assert report["outputs_changed_by_adapters"] >= 3
    assert main(["bench-generation", "--model", str(model_factory("llama")), "--adapters", "2",
                 "--lora-targets", "q_proj,lm_head"]) == 2
    assert "--lora-targets: lm_head" in capsys.readouterr().err


def test_run_batch_answers_each_request_in_order_as_the_server_would(model_factory, tmp_path, capsys):
    """vLLM's run-batch: an OpenAI batch file in, one result line per request out (errors included, in order);
    the replies are the engine's own (greedy completions equal LLM.generate's)."""
    from coserve import LLM, SamplingParams
    model = model_factory("llama")
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model.name, "prompt": f"Item {i}", "max_tokens": 5, "temperature": 0}}
             for i in range(3)]
    lines.insert(1, {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": model.name, "messages": [], "max_tokens": 5}})
    source, out = tmp_path / "in.jsonl", tmp_path / "out" / "results.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["run-batch", "--model", str(model), "-i", str(source), "-o", str(out), "--dtype", "float32",
                 "--device", "cpu"]) == 0
    assert "4 requests, 3 answered, 1 errors" in capsys.readouterr().out
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["c0", "bad", "c1", "c2"]
    assert results[1]["response"]["status_code"] == 400
    llm = LLM(str(model), dtype="float32", device="cpu")
    expected = llm.generate([f"Item {i}" for i in range(3)], SamplingParams(max_tokens=5, temperature=0))
    assert [r["response"]["body"]["choices"][0]["text"] for r in results if r["custom_id"] != "bad"] == [
        o.outputs[0].text for o in expected]
    source.write_text('{"custom_id": "x", "method": "GET"}\n')
    capsys.readouterr()
    assert main(["run-batch", "--model", str(model), "-i", str(source), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 1: method: must be 'POST'" in err and "Traceback" not in err
    source.write_text(json.dumps(lines[0]) + "\n")  # an output that cannot be written: refused before the batch runs
    (tmp_path / "a-file").write_text("")
    capsys.readouterr()
    assert main(["run-batch", "--model", str(model), "-i", str(source), "-o", str(tmp_path / "a-file" / "r.jsonl"),
                 "--dtype", "float32", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "--output-file: cannot make the directory of" in captured.err and "requests" not in captured.out


def test_the_offline_commands_load_no_web_stack():
    """``coserve bench``, profile and finetune run where the server's web stack is not installed: the CLI imports the
    chosen command's module alone (the others are listed with their help). All three in one process (each start
    costs seconds of imports): none of them brings in the web stack."""
    code = ("import sys\nfrom coserve.cli import main\nfor command in ('bench', 'profile', 'finetune'):\n"
            "    try:\n        main([command, '--help'])\n    except SystemExit:\n        pass\n"
            "    print('loaded', command, sorted(m for m in ('fastapi', 'starlette', 'uvicorn', "
            "'coserve.server.middleware') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = [line for line in proc.stdout.splitlines() if line.startswith("loaded ")]
    assert loaded == ["loaded bench []", "loaded profile []", "loaded finetune []"], proc.stdout
    assert proc.stdout.count("--model") >= 3  # each one's own arguments were added


def test_the_command_list_names_every_command():
    proc = subprocess.run([sys.executable, "-m", "coserve.cli", "--help"], capture_output=True, text=True, check=True)
    for name in ("bench", "bench-server", "serve", "profile", "finetune", "run-batch", "create-model"):
        assert name in proc.stdout


def test_the_slo_margin_defaults_are_one_pair_everywhere():
    """The scheduler, the engine, a bench run and the `serve` and `bench` options (one definition:
    coserve/engine/slo_options.py) default to the same margins."""
    import argparse

    from coserve.bench import serving
    from coserve.bench.serving_run import RunSpec
    from coserve.engine.config import EngineConfig
    from coserve.engine.slo_options import slo_settings
    from coserve.scheduler.config import (DEFAULT_LOAD_RESERVE_S, DEFAULT_SLO_MARGIN, DEFAULT_SLO_MARGIN_MAX,
                                         SchedulerConfig)
    from coserve.server import serve_command
    pair = (DEFAULT_SLO_MARGIN, DEFAULT_SLO_MARGIN_MAX)
    assert (SchedulerConfig().slo_margin, SchedulerConfig().slo_margin_max) == pair
    engine = EngineConfig(model="m")
    assert (engine.slo_margin, engine.slo_margin_max) == pair
    spec = RunSpec(model="m", policy="coserve", label="coserve", rate=1.0, duration_s=1.0, requests=[], finetune=None)
    assert (spec.slo_margin, spec.slo_margin_max) == pair
    for module in (serving, serve_command):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        args = p.parse_args(["--model", "m"])
        assert (args.slo_margin, args.slo_margin_max) == pair, module.__name__
        assert args.load_margin_max is None
        assert EngineConfig(model="m", **slo_settings(args)).slo_margin_max == DEFAULT_SLO_MARGIN_MAX  # its fields
        assert p.parse_args(["--model", "m", "--load-margin-max", "0.5"]).load_margin_max == 0.5
        reserve = p.parse_args(["--model", "m", "--load-reserve-ms", "300"])
        assert args.load_reserve_ms == DEFAULT_LOAD_RESERVE_S * 1000 and reserve.load_reserve_ms == 300.0
        assert EngineConfig(model="m", **slo_settings(reserve)).load_reserve_ms == 300.0
    assert engine.load_margin_max is None and EngineConfig(model="m", slo_margin_max=0.8, load_margin_max=0.6)
    with pytest.raises(ValueError, match="load_margin_max"):
        EngineConfig(model="m", load_margin_max=0.9)  # above slo_margin_max
    assert (engine.load_reserve_ms, spec.load_reserve_ms) == (DEFAULT_LOAD_RESERVE_S * 1000,) * 2
    with pytest.raises(ValueError, match="load_reserve_ms"):
        EngineConfig(model="m", load_reserve_ms=-1.0)


def test_the_scheduler_delay_factor_reaches_the_engine_and_a_bench_run():
    import argparse

    from coserve.bench import serving
    from coserve.bench.serving_run import RunSpec
    from coserve.engine.config import EngineConfig
    from coserve.engine.slo_options import slo_settings
    from coserve.server import serve_command
    for module in (serving, serve_command):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        assert p.parse_args(["--model", "m"]).scheduler_delay_factor == 0.0  # off by default, as vLLM's
        args = p.parse_args(["--model", "m", "--scheduler-delay-factor", "2"])
        assert EngineConfig(model="m", **slo_settings(args)).scheduler_delay_factor == 2.0
        assert RunSpec(model="m", policy="coserve", label="coserve", rate=1.0, duration_s=1.0, requests=[],
                       finetune=None, **slo_settings(args)).scheduler_delay_factor == 2.0
    with pytest.raises(ValueError, match="scheduler_delay_factor"):
        EngineConfig(model="m", scheduler_delay_factor=-0.5)
