"""Co-serving exactness: a finetuning job riding in the inference iterations changes no inference
output, and trains the same adapter as the same job run alone."""

from __future__ import annotations

import random

import pytest
import torch

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import Example, FinetuneJob
from coserve.finetune.runner import run_job
from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora
from coserve.scheduler import SamplingParams
from coserve.scheduler.finetune_work import FORWARD


def _examples(vocab: int, seed: int, n: int = 4) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(5, vocab) for _ in range(rng.randint(20, 60))]
        out.append(Example(ids, ids[1:] + [IGNORE_INDEX]))
    return out


def _job(engine: LLMEngine, out_dir, seed: int = 0, max_steps: int = 2, use_dora: bool = False,
         targets: tuple[str, ...] = ("q_proj", "down_proj")) -> FinetuneJob:
    model = engine.model
    cfg = FinetuneConfig(output_dir=str(out_dir), batch_size=2, max_steps=max_steps, epochs=max_steps, lr=1e-2,
                         optimizer="sgd", lr_scheduler="constant", seed=seed, shuffle=False)
    bypass = TrainableLora(LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), use_dora=use_dora),
                           model.module_shapes(), model.cfg.num_layers, model.device,
                           torch.Generator().manual_seed(seed), base_weight=model.module_weight if use_dora else None)
    return FinetuneJob(model, bypass, _examples(model.cfg.vocab_size, seed), cfg)


def _engine(model_dir, device: str = "cpu", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device=device, num_kv_blocks=64,
                                  block_size=4, max_num_batched_tokens=48, **kw))


def _generate(engine: LLMEngine, prompts: list[list[int]], steps_log: list | None = None) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if steps_log is not None:  # iterations that carried finetuning work beside requests
            steps_log.append(bool(engine.last_plan.chunks and engine.last_plan.finetune))
    return {rid: done[rid] for rid in ids}


# A slice in every iteration (FlexLLM's hybrid token scheduler, the GPU default) and bursts (the CPU default).
BURSTS = pytest.mark.parametrize("burst_ms", [0.0, 100.0], ids=["slices", "bursts"])


@BURSTS
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral:window=8", "gemma2", "gemma3", "granite"])
def test_greedy_outputs_unchanged_by_a_concurrent_finetuning_job(model_factory, config_variant, tmp_path, arch,
                                                                  burst_ms):
    """``mistral:window=8``: every layer slides over 8 positions (requests and training sequences are longer)."""
    model_dir = config_variant("mistral", sliding_window=8) if ":window=" in arch else model_factory(arch)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 200) for _ in range(rng.randint(3, 30))] for _ in range(12)]
    alone = _generate(_engine(model_dir), prompts)
    # A TPOT target no machine misses: the job then runs beside the requests however slow this machine is (on a
    # loaded one, a 50 ms target left it no iteration beside them)
    engine = _engine(model_dir, finetune_burst_ms=burst_ms, slo_tpot_ms=60_000.0, first_token_slice_ms=float("inf"))
    job_id = engine.add_finetune_job(_job(engine, tmp_path / "job"))
    log: list[bool] = []
    together = _generate(engine, prompts, log)
    assert sum(log) >= 3, "the job should have run alongside the requests for several iterations"
    assert list(together.values()) == list(alone.values())
    while engine.has_running_jobs():
        engine.step()
    assert engine.job_states[job_id].status == "succeeded"
    assert (tmp_path / "job" / "adapter_model.safetensors").is_file()


@BURSTS
@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_coserved_job_trains_the_same_adapter_as_alone(model_factory, tmp_path, use_dora, burst_ms):
    model_dir = model_factory("llama")
    engine = _engine(model_dir, finetune_burst_ms=burst_ms)
    solo = _job(engine, tmp_path / "solo", use_dora=use_dora)
    run_job(solo, progress=False)
    job = _job(engine, tmp_path / "co", use_dora=use_dora)
    job_id = engine.add_finetune_job(job)
    rng = random.Random(5)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    while engine.has_running_jobs():  # requests keep arriving while the job trains
        if rng.random() < 0.5:
            engine.add_request([rng.randrange(5, 200) for _ in range(rng.randint(2, 20))], params)
        engine.step()
    assert engine.job_states[job_id].status == "succeeded"
    assert job.step == solo.step == 2
    for a, b in zip(job.bypass.parameters(), solo.bypass.parameters()):
        rel = (a - b).norm() / b.norm()
        assert rel <= 1e-5, float(rel)
    assert [r.loss for r in job.log] == pytest.approx([r.loss for r in solo.log], rel=1e-5)


def test_finetune_only_and_inference_only_policies(model_factory, tmp_path):
    model_dir = model_factory("llama")
    for policy in ("inference-only", "finetune-only"):
        engine = _engine(model_dir, policy=policy)
        job_id = engine.add_finetune_job(_job(engine, tmp_path / policy))
        rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        first = engine.step()
        for _ in range(200):
            engine.step()
        assert not engine.has_unfinished_requests()
        if policy == "inference-only":  # the baseline without finetuning: the job never runs
            assert first and first[0].request_id == rid
            assert engine.executor.jobs[job_id].tokens_done == 0
            assert engine.job_states[job_id].status == "running"
        else:  # the job runs first, the request waits for it
            assert not first
            while engine.has_running_jobs():  # its adapter is written off the engine thread
                engine.step()
            assert engine.job_states[job_id].status == "succeeded"


def test_a_failing_job_stops_alone_and_the_engine_keeps_serving(model_factory, tmp_path):
    engine = _engine(model_factory("llama"))
    job = _job(engine, tmp_path / "bad")
    with torch.no_grad():  # every loss becomes non-finite
        for p in job.bypass.parameters():
            p.fill_(float("nan"))
    job.cfg.max_nonfinite_steps = 1
    job_id = engine.add_finetune_job(job)
    outs = _generate(engine, [[5, 6, 7, 8]])
    while engine.has_running_jobs():
        engine.step()
    assert engine.job_states[job_id].status == "failed"
    assert "non-finite" in engine.job_states[job_id].error
    assert len(next(iter(outs.values()))) == 12
    with pytest.raises(ValueError, match="already failed"):
        engine.cancel_finetune_job(job_id)


def test_the_engine_loads_a_profiled_latency_model_that_fits(model_factory, tmp_path):
    from coserve.engine.profiler import latency_key
    from coserve.scheduler.latency_model import FEATURE_NAMES, LatencyModel, save_models
    model_dir = model_factory("llama")
    key = latency_key(model_dir, torch.device("cpu"), torch.float32, fused=True)
    fitted = LatencyModel(key, [1e-3] + [1e-5] * (len(FEATURE_NAMES) - 1))
    other = LatencyModel({**key, "dtype": "bfloat16"}, [2e-3] + [1e-5] * (len(FEATURE_NAMES) - 1))
    path = tmp_path / "latency.json"
    save_models(path, [other, fitted])
    engine = _engine(model_dir, latency_model=str(path))
    assert engine.scheduler.latency.coefficients == fitted.coefficients
    engine.add_finetune_job(_job(engine, tmp_path / "job"))
    plan = engine.scheduler.schedule()  # idle: the slice fills the SLO budget as the model predicts it
    assert plan.finetune and 0 < plan.predicted_s <= 0.045 + 1e-12
    wide = _engine(model_dir, latency_model=str(path), slo_margin=0.3)  # the operator's margin reaches the scheduler
    assert wide.scheduler.config.slo_margin == 0.3
    with pytest.raises(ValueError, match="slo_margin"):
        EngineConfig(model=model_dir, slo_margin=1.0)
    with pytest.raises(ValueError, match="slo_margin_max"):
        EngineConfig(model=model_dir, slo_margin=0.2, slo_margin_max=0.1)
    for bad in (-1.0, True, "100"):
        with pytest.raises(ValueError, match="finetune_burst_ms"):
            EngineConfig(model=model_dir, finetune_burst_ms=bad)
    assert wide.finetune_burst_ms == 100.0 and wide.scheduler.config.finetune_burst_s == 0.1  # a CPU's default
    assert _engine(model_dir, finetune_burst_ms=0).scheduler.config.finetune_burst_s == 0.0
    assert wide.first_token_slice_ms == 5.0 and wide.scheduler.config.first_token_slice_s == 0.005  # a CPU's default
    assert _engine(model_dir, first_token_slice_ms=float("inf")).scheduler.config.first_token_slice_s is None
    for bad in (-1.0, True, "5"):
        with pytest.raises(ValueError, match="first_token_slice_ms"):
            EngineConfig(model=model_dir, first_token_slice_ms=bad)
    assert _engine(model_dir, latency_model=str(tmp_path / "none.json")).scheduler.latency is None
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="latency_model"):
        _engine(model_dir, latency_model=str(tmp_path / "bad.json"))


def test_an_older_coserves_profile_file_is_profiled_over_not_fatal(model_factory, tmp_path):
    """A version-3 file (keys without "gemms", written before this coserve) is as if no fit existed: the engine
    profiles briefly and replaces the file with its own version."""
    import json

    from coserve.scheduler.latency_model import FEATURE_NAMES
    model_dir = model_factory("llama")
    path = tmp_path / "latency.json"
    old_key = {"model": str(model_dir), "device": "cpu", "dtype": "float32", "threads": "2", "fused": "true"}
    path.write_text(json.dumps({"version": 3, "models": [
        {"key": old_key, "feature_names": list(FEATURE_NAMES), "coefficients": [1e-3] * len(FEATURE_NAMES)}]}))
    engine = _engine(model_dir, latency_model=str(path))
    assert engine.scheduler.latency is None
    engine.add_finetune_job(_job(engine, tmp_path / "job"))
    engine.step()  # the first job's iteration profiles briefly and saves
    saved = json.loads(path.read_text())
    assert saved["version"] == 4 and [m["key"] for m in saved["models"]] == [engine.latency_key]


def test_jobs_are_admitted_within_the_finetuning_memory_budget(model_factory, tmp_path):
    from coserve.finetune.memory_budget import job_memory
    model_dir = model_factory("llama")
    probe = _engine(model_dir)
    need = job_memory(_job(probe, tmp_path / "probe"))
    params = sum(p.numel() for p in _job(probe, tmp_path / "probe").bypass.parameters())
    assert need.adapter_bytes == params * 4 * 2  # float32 weights and gradients; SGD keeps no state
    longest = max(len(e.token_ids) for e in _examples(probe.model.cfg.vocab_size, 0))
    assert need.activation_bytes == int(_job(probe, tmp_path / "p").plan.model_kept_bytes_per_token * longest)
    engine = _engine(model_dir, finetune_memory_gb=1.5 * need.total_bytes / 2**30, auto_profile=False)
    first = engine.add_finetune_job(_job(engine, tmp_path / "a"))
    with pytest.raises(ValueError, match="finetune_memory_gb"):  # a second one does not fit beside it
        engine.add_finetune_job(_job(engine, tmp_path / "b"))
    engine.cancel_finetune_job(first)  # its memory is free again
    engine.add_finetune_job(_job(engine, tmp_path / "c"))


@pytest.mark.parametrize("often", [0.5, 1.0], ids=["arrivals-at-random", "an-arrival-always-waiting"])
def test_a_new_request_cuts_the_finetuning_slice_short_and_the_adapter_is_unchanged(model_factory, tmp_path,
                                                                                    monkeypatch, often):
    """Where a request waits to enter the engine (``ModelExecutor.arrivals``), the iteration in flight stops its
    backward slice before the next window, and a forward window without inference runs in pieces and stops
    between two: the request waits one window or piece, not the slice. The job still trains the adapter it
    trains alone (with an arrival always waiting too: every slice still runs its first window or piece, so the
    job cannot starve), and a cut iteration's time does not correct the latency model (it is not the plan's)."""
    from coserve.engine.forward_pieces import ForwardPieces
    monkeypatch.setattr(ForwardPieces, "tokens", lambda self: 8)  # the examples' windows run in 8-token pieces
    model_dir = model_factory("llama")
    engine = _engine(model_dir)
    solo = _job(engine, tmp_path / "solo")
    run_job(solo, progress=False)
    job = _job(engine, tmp_path / "co")
    job_id = engine.add_finetune_job(job)
    rng, arrivals = random.Random(11), random.Random(12)
    engine.executor.arrivals = lambda: arrivals.random() < often
    latency = engine.scheduler.latency
    assert latency is not None  # profiled at start
    cut, corrected_when_cut = [], []
    execute = engine.executor.execute

    forward_cut = []  # forward windows without inference that stopped between two pieces

    def traced(plan):
        result = execute(plan)
        cut.append(result.interrupted)
        windows = [w for w in plan.finetune if w.kind == FORWARD]
        if result.interrupted and windows and not plan.chunks and job.next_work() == "forward":
            forward_cut.append(windows[0].num_tokens)
        return result
    engine.executor.execute = traced
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    while engine.has_running_jobs():
        if rng.random() < 0.2:
            engine.add_request([rng.randrange(5, 200) for _ in range(rng.randint(2, 12))], params)
        before = (latency.correction, dict(latency.kind_corrections))
        engine.step()
        if cut and cut[-1]:
            corrected_when_cut.append(before != (latency.correction, dict(latency.kind_corrections)))
    assert engine.job_states[job_id].status == "succeeded" and job.step == solo.step == 2
    assert 3 <= sum(cut) < len(cut) and forward_cut
    assert corrected_when_cut and not any(corrected_when_cut)  # only whole iterations correct the model
    for a, b in zip(job.bypass.parameters(), solo.bypass.parameters()):
        assert (a - b).norm() / b.norm() <= 1e-5
    assert [r.loss for r in job.log] == pytest.approx([r.loss for r in solo.log], rel=1e-5)


def test_a_forward_window_runs_whole_once_a_piece_shows_the_device_is_fast(model_factory, tmp_path, monkeypatch):
    """With arrivals watched, the first forward window without inference runs in pieces of FORWARD_PIECE_TOKENS;
    once a piece of that size is timed, windows run in pieces as long as the device runs in FORWARD_PIECE_S (here
    so long that they run whole). The adapter is the one the job trains alone."""
    import coserve.engine.forward_pieces as forward_pieces
    monkeypatch.setattr(forward_pieces, "FORWARD_PIECE_TOKENS", 8)
    monkeypatch.setattr(forward_pieces, "FORWARD_PIECE_S", 1e6)
    engine = _engine(model_factory("llama"), policy="finetune-only")
    solo = _job(engine, tmp_path / "solo")
    run_job(solo, progress=False)
    job = _job(engine, tmp_path / "co")
    engine.add_finetune_job(job)
    engine.executor.arrivals = lambda: False
    pieces, forward = [], job.forward
    job.forward = lambda n: pieces.append(n) or forward(n)
    windows = []
    while engine.has_running_jobs():
        engine.step()
        windows += [w.num_tokens for w in engine.last_plan.finetune if w.kind == FORWARD]
    first = -(-windows[0] // 8)  # the first window's pieces
    assert windows[0] > 8 and pieces[:first] == [8] * (first - 1) + [windows[0] - 8 * (first - 1)]
    assert engine.executor.pieces.per_token_s > 0
    assert pieces[first:] == windows[1:]  # then every window in one piece
    for a, b in zip(job.bypass.parameters(), solo.bypass.parameters()):
        assert (a - b).norm() / b.norm() <= 1e-5


def test_a_job_stops_between_backward_windows_when_told_but_always_runs_one(model_factory, tmp_path):
    engine = _engine(model_factory("llama"))
    job = _job(engine, tmp_path / "job")
    while job.next_work() != "backward":
        job.forward(64)
    assert engine.model.cfg.num_layers == 2  # a window is at most the rest of one layer: two windows here
    position = job.position()
    assert job.backward_token_layers(10**6, stop=lambda: True) is True  # the first window always runs
    assert job.position() != position and job.next_work() == "backward" and job.pending_tokens() > 0
    assert job.backward_token_layers(10**6, stop=lambda: True) is False  # the last layer's: the pass ended
    assert job.next_work() != "backward"


def test_the_engine_loop_counts_a_handed_over_request_as_an_arrival_until_it_runs(model_factory, tmp_path):
    from coserve.engine.engine_loop import EngineLoop
    engine = _engine(model_factory("llama"))
    loop = EngineLoop(engine)
    try:
        assert engine.executor.arrivals == loop.arrival_waiting and not loop.arrival_waiting()
        seen = []
        with loop.cond:  # the loop is between passes: what is posted waits
            loop.post(lambda: seen.append(loop.arrival_waiting()), arrival=True)
            loop.post(lambda: seen.append("plain"))
            assert loop.arrival_waiting()
        assert loop.post_and_wait(lambda: 42) == 42  # runs after both
        assert seen == [False, "plain"] and not loop.arrival_waiting()  # counted until it ran, not while
        with pytest.raises(ValueError, match="refused"):
            loop.post_and_wait(lambda: (_ for _ in ()).throw(ValueError("refused")), arrival=True)
        assert not loop.arrival_waiting()  # one that raises is no longer waiting either
        request_id = loop.post_and_wait(lambda: engine.add_request([5, 6, 7], SamplingParams(max_tokens=2)),
                                        arrival=True)
        assert [o.request_id for o in loop.wait_for([request_id])] == [request_id]
    finally:
        loop.stop()


def test_greedy_outputs_unchanged_when_prompts_wait_to_share_a_prefill(model_factory):
    """scheduler_delay_factor moves when a prompt is admitted, never what it generates."""
    model_dir = model_factory("llama")
    rng = random.Random(8)
    prompts = [[rng.randrange(5, 200) for _ in range(rng.randint(3, 20))] for _ in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def staggered(engine):  # a new prompt every other step, while earlier ones decode
        ids, done, i = [], {}, 0
        while len(done) < len(prompts):
            if i % 2 == 0 and len(ids) < len(prompts):
                ids.append(engine.add_request(prompts[len(ids)], params))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            i += 1
        return [done[r] for r in ids]

    plain = staggered(_engine(model_dir))
    delayed_engine = _engine(model_dir, scheduler_delay_factor=3.0)
    assert staggered(delayed_engine) == plain
    assert delayed_engine.scheduler.last_prompt_latency_s > 0
