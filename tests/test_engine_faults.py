"""An iteration that raises fails what it carried, and nothing else: the engine and the server keep serving,
the requests beside a failed job come out as if it had never run, and a failed job writes no adapter."""

from __future__ import annotations

import random

import pytest
import torch
from fastapi.testclient import TestClient

from coserve.engine import executor as executor_module
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.finetune.runner import run_job
from coserve.model.sampling import sample
from coserve.scheduler import SamplingParams
from coserve.server.app import build_app
from coserve.server.config import ServerConfig
from tests.test_coserving import _engine, _generate, _job
from tests.test_decode_graphs import _EagerStandIn

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Tests that count forward calls a finetuning window shares: a TPOT target no iteration here comes near, a slice in
# every iteration and no cap on one beside a first token, so the window's size is the token budget's, not what the
# latency model allows on a machine that happens to be slow (a small window runs in calls of its own:
# ``ModelExecutor._inference``)
SHARED = {"slo_tpot_ms": 60_000.0, "finetune_burst_ms": 0.0, "first_token_slice_ms": float("inf")}


def _prompts(n: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def _fail_once(engine: LLMEngine, attr: str, when=lambda *a, **k: True) -> list[int]:
    """Make ``engine.executor.<attr>`` raise the first time ``when(*args)`` holds; returns a call counter."""
    calls = [0]
    original = getattr(engine.executor, attr)

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 0 and when(*args, **kwargs):
            calls[0] = -10**9  # once
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)
    setattr(engine.executor, attr, faulty)
    return calls


def _run(engine: LLMEngine, ids: list[str]) -> dict:
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_failed_inference_iteration_fails_its_requests_only(model_factory):
    model_dir = model_factory("llama")
    prompts = _prompts(6)
    plain = _engine(model_dir)
    reference = _run(plain, [plain.add_request(p, PARAMS) for p in prompts])
    engine = _engine(model_dir, max_num_seqs=2)  # two run, four wait outside the failing iteration
    _fail_once(engine, "_inference")
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    outs = _run(engine, ids)
    failed = [rid for rid in ids if outs[rid].outputs[0].finish_reason == "error"]
    assert failed == ids[:2]
    for rid in failed:
        assert "RuntimeError: injected fault" in outs[rid].error
        assert engine.scheduler.blocks.block_table(rid) == []  # its KV blocks are back
    expected = [o.token_ids for o in reference.values()]
    for i, rid in enumerate(ids[2:], start=2):
        assert outs[rid].error is None and outs[rid].token_ids == expected[i]
    again = [engine.add_request(p, PARAMS) for p in prompts[:2]]  # the engine serves on, exactly
    assert [o.token_ids for o in _run(engine, again).values()] == expected[:2]
    assert not engine.scheduler.has_unfinished() and engine.scheduler.blocks.usage == 0


def test_a_job_whose_iteration_fails_stops_alone_and_the_requests_beside_it_are_exact(model_factory, tmp_path):
    model_dir = model_factory("llama")
    prompts = _prompts(8, seed=9)
    reference = _generate(_engine(model_dir), prompts)
    engine = _engine(model_dir)
    job_id = engine.add_finetune_job(_job(engine, tmp_path / "job"))
    steps = [0]

    def third_mixed_iteration(plan, result, forward):
        steps[0] += forward is not None
        return steps[0] == 3
    _fail_once(engine, "_inference", third_mixed_iteration)
    together = _generate(engine, prompts)
    assert steps[0] >= 3, "the job should have ridden in the inference iterations"
    assert list(together.values()) == list(reference.values())
    state = engine.job_states[job_id]
    assert state.status == "failed" and "injected fault" in state.error
    assert not (tmp_path / "job" / "adapter_model.safetensors").exists()
    assert not engine.has_running_jobs() and job_id not in engine.scheduler.jobs
    second = engine.add_finetune_job(_job(engine, tmp_path / "second"))  # later jobs still run
    while engine.has_running_jobs():
        engine.step()
    assert engine.job_states[second].status == "succeeded"


def _faulty_forward(engine: LLMEngine, when) -> list[bool]:
    """Make the executor's forward call raise where ``when(plan, fused_window)`` holds; returns, for each forward
    that raised, whether a finetuning window shared it."""
    raised = []
    original = engine.executor._eager_forward

    def eager_forward(plan, result, fused_window, rows):
        if when(plan, fused_window):
            raised.append(fused_window is not None)
            raise RuntimeError("injected forward fault")
        return original(plan, result, fused_window, rows)
    engine.executor._eager_forward = eager_forward
    return raised


def _same_adapter(job, solo) -> None:
    assert job.step == solo.step
    for a, b in zip(job.bypass.parameters(), solo.bypass.parameters(), strict=True):
        assert float((a - b).detach().norm() / b.detach().norm()) <= 1e-5
    assert [r.loss for r in job.log] == pytest.approx([r.loss for r in solo.log], rel=1e-5)


def _needs_fusion(engine: LLMEngine) -> None:
    """Skips a test of forward calls that a finetuning window shares where this machine's engine shares none: its
    matmuls were found not batch-invariant (seen on a 16-core host whose GEMMs were oneDNN's: the LM head's rows
    rounded by the call's size), so windows run in calls of their own."""
    if not engine.executor.fuse_finetuning:
        pytest.skip("this machine's matmuls are not batch-invariant: no forward call is shared with a window")


def _beside_a_job(model_dir, tmp_path, prompts: list[list[int]], **engine_kw):
    """The fault-free reference: ``(outputs of prompts on a plain engine, a job run alone to its end, an engine
    co-serving the same job (unstarted), that job, its id)``."""
    plain = _engine(model_dir)
    reference = _run(plain, [plain.add_request(p, PARAMS) for p in prompts])
    solo = _job(plain, tmp_path / "solo")
    run_job(solo, progress=False)
    engine = _engine(model_dir, **engine_kw)
    job = _job(engine, tmp_path / "co")
    return reference, solo, engine, job, engine.add_finetune_job(job)


def test_a_forward_that_raises_for_a_requests_rows_fails_that_request_alone(model_factory, tmp_path):
    """A shared forward call that raises is run again in parts: each request's chunk alone, then the finetuning
    window alone. Only the request whose own rows raise fails; its batch-mates' tokens are exact, and the job that
    shared the call trains on to the adapter it trains alone."""
    model_dir = model_factory("llama")
    prompts = _prompts(6, seed=13)
    reference, solo, engine, job, job_id = _beside_a_job(model_dir, tmp_path, prompts, **SHARED)
    _needs_fusion(engine)
    engine.step()  # the job is under way: its forward windows ride in the requests' iterations
    for _ in range(200):  # to a forward window's start (how far the first step went is the machine's speed's)
        if job.next_work() == "forward" and job.pending_tokens() >= 8:
            break
        engine.step()
    assert job.next_work() == "forward"
    poisoned = set()
    raised = _faulty_forward(engine, lambda plan, window: poisoned & {c.request_id for c in plan.chunks})
    bad_prompt = list(range(20, 31))  # two full KV blocks and more
    bad = engine.add_request(bad_prompt, PARAMS)  # first: its chunk rides with the job's next forward window
    poisoned.add(bad)
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    outs = _run(engine, [*ids, bad])
    assert raised == [True, False], "the shared call, then the request's chunk alone"
    assert outs[bad].outputs[0].finish_reason == "error" and "injected forward fault" in outs[bad].error
    assert engine.scheduler.blocks.block_table(bad) == []
    again = engine.add_request(bad_prompt, PARAMS)  # no block of the failed chunk was cached as computed
    plain = _engine(model_dir)
    expected = plain.add_request(bad_prompt, PARAMS)
    assert _run(engine, [again])[again].token_ids == _run(plain, [expected])[expected].token_ids
    assert [outs[r].token_ids for r in ids] == [o.token_ids for o in reference.values()]
    assert all(outs[r].error is None for r in ids) and engine.num_failed_iterations == 1
    while engine.has_running_jobs():
        engine.step()
    assert engine.job_states[job_id].status == "succeeded"
    _same_adapter(job, solo)


class _ReplayedStandIn(_EagerStandIn):
    """Decode graphs' stand-in whose output is, as a CUDA graph replay's, a view of one buffer that the next replay
    overwrites."""

    def forward(self, token_ids, chunks, min_rows):
        hidden = super().forward(token_ids, chunks, min_rows)
        if getattr(self, "out", None) is None:
            self.out = hidden.new_empty(512, hidden.shape[1])
        self.out[:len(hidden)] = hidden
        return self.out[:len(hidden)]


@pytest.mark.parametrize("device", [
    "cpu", "cpu, replayed graphs",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))])
def test_forwards_run_again_apart_give_the_same_tokens_and_logprobs(model_factory, device):
    """Every batched eager forward raises (a flaky device): each chunk then runs alone, speculative chunks' draft rows
    and prompt scoring included, and every token and logprob is what the batched forwards give (the engine's matmuls
    are batch-invariant: on CUDA by GEMM tiles where cuBLAS is not; its decode-only iterations replay CUDA graphs,
    whose output each chunk run alone must copy before the next replay overwrites it)."""
    from tests.test_speculative import REPEATING
    model_dir = model_factory("llama")
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),  # speculated
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)]
    prompts = REPEATING + _prompts(3, seed=21)

    def run(faulty: bool):
        engine = _engine(model_dir, device=device.split(",")[0], speculative_tokens=4)
        if device.endswith("replayed graphs"):
            engine.executor.graphs = _ReplayedStandIn(engine)
        raised = _faulty_forward(engine, lambda plan, window: faulty and len(plan.chunks) > 1)
        ids = [engine.add_request(p, params[i % 3]) for i, p in enumerate(prompts)]
        outs = _run(engine, ids)
        return [outs[r] for r in ids], engine, raised

    plain, _, _ = run(False)
    apart, engine, raised = run(True)
    assert len(raised) == engine.num_failed_iterations > 5 and engine.scheduler.num_draft_tokens > 0
    for a, b in zip(plain, apart, strict=True):
        assert b.error is None and a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs and a.prompt_logprobs == b.prompt_logprobs


def test_random_forward_faults_fail_only_what_raises_alone(model_factory, tmp_path):
    """Forward calls raise at random (a tenth of them, batched or alone) while requests with prefix sharing, speculation
    and logprobs are served beside a finetuning job: every request ends, those that did not fail give the fault-free
    run's tokens and logprobs, the failed ones name the fault, no KV block is left held, and the job either trains the
    adapter it trains alone or fails naming the fault."""
    from tests.test_speculative import REPEATING
    model_dir = model_factory("llama")
    rng = random.Random(4)
    shared = [rng.randrange(5, 200) for _ in range(12)]  # a prefix several prompts share (prefix caching)
    prompts = REPEATING + [shared + [rng.randrange(5, 200) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)]

    def run(fault_rate: float, job_dir):
        engine = _engine(model_dir, speculative_tokens=3)
        job = _job(engine, job_dir)
        job_id = engine.add_finetune_job(job)
        draws = random.Random(7)
        raised = _faulty_forward(engine, lambda plan, window: draws.random() < fault_rate)
        ids = [engine.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
        outs = _run(engine, ids)
        while engine.has_running_jobs():
            engine.step()
        assert not engine.scheduler.has_unfinished() and engine.scheduler.blocks.usage == 0
        return [outs[r] for r in ids], engine.job_states[job_id], job, raised

    clean, clean_state, solo, _ = run(0.0, tmp_path / "clean")
    assert clean_state.status == "succeeded"
    faulty, state, job, raised = run(0.1, tmp_path / "faulty")
    assert len(raised) >= 5
    failed = [o for o in faulty if o.error is not None]
    assert failed and len(failed) < len(faulty), "some requests fail alone, the others stand"
    for a, b in zip(clean, faulty, strict=True):
        if b.error is not None:
            assert b.outputs[0].finish_reason == "error" and "injected forward fault" in b.error
        else:
            assert (a.token_ids, a.outputs[0].logprobs) == (b.token_ids, b.outputs[0].logprobs)
    if state.status == "failed":
        assert "injected forward fault" in state.error
    else:
        assert state.status == "succeeded"
        _same_adapter(job, solo)


@pytest.mark.parametrize("window_alone", ["raises", "runs"])
def test_a_shared_forward_that_raises_for_the_jobs_window_fails_the_job_alone(model_factory, tmp_path,
                                                                            window_alone):
    """When the finetuning window raises alone too, the job fails alone; when only the shared call raised (a
    device briefly out of memory), the job trains on to the adapter it trains alone. The requests that shared the
    call lose nothing either way: each one's chunk runs again alone, exactly."""
    model_dir = model_factory("llama")
    prompts = _prompts(8, seed=9)
    reference = _generate(_engine(model_dir), prompts)
    solo = _job(_engine(model_dir), tmp_path / "solo")
    run_job(solo, progress=False)
    engine = _engine(model_dir, **SHARED)
    _needs_fusion(engine)
    job = _job(engine, tmp_path / "co")
    job_id = engine.add_finetune_job(job)
    fused = [0]

    def third_shared_call(plan, window):
        fused[0] += window is not None and bool(plan.chunks)
        return window is not None and fused[0] == 3
    raised = _faulty_forward(engine, third_shared_call)
    if window_alone == "raises":
        job_forward = job.forward

        def forward(n):
            if raised:
                raise RuntimeError("injected window fault")
            return job_forward(n)
        job.forward = forward
    together = _generate(engine, prompts)
    assert raised == [True] and engine.num_failed_iterations == 1
    assert list(together.values()) == list(reference.values())
    while engine.has_running_jobs():
        engine.step()
    state = engine.job_states[job_id]
    if window_alone == "raises":
        assert state.status == "failed" and "injected window fault" in state.error
        assert not (tmp_path / "co" / "adapter_model.safetensors").exists()
    else:
        assert state.status == "succeeded"
        _same_adapter(job, solo)


def test_an_lm_head_call_that_raises_runs_again_per_request_with_the_same_tokens_and_logprobs(model_factory,
                                                                                             tmp_path):
    """Every batched LM-head call raises (a device out of memory for the whole batch's logits), beside a finetuning
    job, with n-gram speculation, logprobs and seeded sampling: each request's rows then go through it alone, padded
    so that they round as in the batch, and every token and logprob is the fault-free run's. The job, which has no
    part in the LM head's call, trains on to the adapter it trains alone (before, such a fault failed it first)."""
    from tests.test_speculative import REPEATING
    model_dir = model_factory("llama")
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True, logprobs=1)]
    prompts = REPEATING + _prompts(4, seed=23)
    solo = _job(_engine(model_dir), tmp_path / "solo")
    run_job(solo, progress=False)

    def run(faulty: bool):
        engine = _engine(model_dir, speculative_tokens=4)
        job = _job(engine, tmp_path / f"job-{faulty}")
        job_id = engine.add_finetune_job(job)
        batched = []
        logits = engine.executor._logits

        def faulty_logits(hidden, min_rows):
            if faulty and min_rows == 1 and hidden.shape[0] > 1:  # the batched call (alone, calls are padded)
                batched.append(hidden.shape[0])
                raise RuntimeError("injected LM head fault")
            return logits(hidden, min_rows)
        engine.executor._logits = faulty_logits
        ids = [engine.add_request(p, params[i % 3]) for i, p in enumerate(prompts)]
        outs = _run(engine, ids)
        while engine.has_running_jobs():
            engine.step()
        assert engine.job_states[job_id].status == "succeeded"
        return [outs[r] for r in ids], engine, job, batched

    plain, _, _, _ = run(False)
    apart, engine, job, batched = run(True)
    assert len(batched) == engine.num_failed_iterations > 5 and engine.scheduler.num_draft_tokens > 0
    for a, b in zip(plain, apart, strict=True):
        assert b.error is None and a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
    _same_adapter(job, solo)


def test_a_request_whose_lm_head_rows_raise_fails_alone_beside_a_job(model_factory, tmp_path):
    """Where one request's rows raise in the LM head even alone, it ends with finish_reason "error" naming the fault;
    its batch-mates' tokens are exact, its KV blocks are freed, and the job riding in the same iterations succeeds
    with the adapter it trains alone."""
    model_dir = model_factory("llama")
    prompts = _prompts(5, seed=17)
    reference, solo, engine, job, job_id = _beside_a_job(model_dir, tmp_path, prompts)
    engine.step()
    poisoned = set()
    tokens = engine.executor._tokens

    def faulty_tokens(hidden, sampling, result, min_rows):
        if poisoned & {c.request_id for c in sampling}:
            raise RuntimeError("injected LM head fault")
        return tokens(hidden, sampling, result, min_rows)
    engine.executor._tokens = faulty_tokens
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    bad = engine.add_request([9, 8, 7, 6], PARAMS)
    poisoned.add(bad)
    outs = _run(engine, [*ids, bad])
    assert outs[bad].outputs[0].finish_reason == "error" and "injected LM head fault" in outs[bad].error
    assert engine.scheduler.blocks.block_table(bad) == [] and engine.num_failed_iterations == 1
    assert [outs[r].token_ids for r in ids] == [o.token_ids for o in reference.values()]
    while engine.has_running_jobs():
        engine.step()
    assert engine.job_states[job_id].status == "succeeded"
    _same_adapter(job, solo)


@pytest.mark.parametrize("fault", ["raises", "past the vocabulary"])
def test_a_request_whose_token_cannot_be_sampled_fails_alone_and_its_iteration_stands(model_factory, tmp_path,
                                                                                     monkeypatch, fault):
    """Sampling is the requests' own: when it raises (or draws a token id past the vocabulary, which failed the
    next forward), each row is sampled alone and only the rows that fail end, with finish_reason "error". The
    iteration stands: its batch-mates' tokens, and the finetuning job riding in it (an iteration that raises fails
    its jobs first)."""
    model_dir = model_factory("llama")
    prompts = _prompts(4, seed=11)
    reference = _generate(_engine(model_dir), prompts)
    engine = _engine(model_dir)
    job_id = engine.add_finetune_job(_job(engine, tmp_path / "job", max_steps=3))
    marked = 0.77  # the poisoned request's temperature

    def faulty_sample(logits, rows, generator=None):
        out = sample(logits, rows, generator)
        if any(r.temperature == marked for r in rows):
            if fault == "raises":
                raise RuntimeError("injected sampling fault")
            out = [logits.shape[-1] if r.temperature == marked else t for r, t in zip(rows, out)]
        return out
    monkeypatch.setattr(executor_module, "sample", faulty_sample)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    poisoned = engine.add_request([7, 8, 9], SamplingParams(max_tokens=12, temperature=marked, ignore_eos=True))
    outs = _run(engine, [*ids, poisoned])
    assert outs[poisoned].outputs[0].finish_reason == "error"
    assert ("injected sampling fault" if fault == "raises" else "outside the vocabulary") in outs[poisoned].error
    assert [outs[r].token_ids for r in ids] == list(reference.values())
    assert engine.num_failed_iterations == 0 and engine.scheduler.blocks.block_table(poisoned) == []
    while engine.has_running_jobs():
        engine.step()
    assert engine.job_states[job_id].status == "succeeded"


def test_the_server_answers_an_engine_fault_with_a_500_and_serves_on(model_factory, tmp_path):
    model_dir = model_factory("llama")
    app = build_app(ServerConfig(model=str(model_dir), state_dir=str(tmp_path / "state")),
                    EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4))
    engine = app.state.coserve.client.engine
    _fail_once(engine, "_inference")
    body = {"model": model_dir.name, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    with TestClient(app) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_error" and "injected fault" in r.json()["error"]["message"]
        ok = http.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        _fail_once(engine, "_inference")
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and "engine_error" in lines[-1] and "[DONE]" not in lines[-1]
        assert http.get("/health").status_code == 200
        assert "coserve_failed_iterations_total 2.0" in http.get("/metrics").text
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]


def test_a_fault_in_the_engines_bookkeeping_fails_what_it_held_and_the_server_serves_on(model_factory, tmp_path,
                                                                                      monkeypatch):
    """``step()`` raising outside the model work (the scheduler itself): every request and job then in the engine
    fails naming the error, the engine starts over with free KV blocks, and new requests are served exactly as
    before; faults that keep coming (3 within a minute) stop the loop, and /health says so."""
    from coserve.engine import engine_loop

    model_dir = model_factory("llama")
    app = build_app(ServerConfig(model=str(model_dir), state_dir=str(tmp_path / "state")),
                    EngineConfig(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4))
    engine = app.state.coserve.client.engine
    body = {"model": model_dir.name, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    with TestClient(app) as http:
        before = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        loop = app.state.coserve.client.loop
        job = loop.call(lambda: engine.add_finetune_job(_job(engine, tmp_path / "job", max_steps=10**6)))
        schedule = type(engine.scheduler).schedule
        faults = [1]

        def faulty(self):  # once a request is in the engine (the job alone may be stepping before it arrives)
            if faults[0] > 0 and self.requests:
                faults[0] -= 1
                raise KeyError("injected bookkeeping fault")
            return schedule(self)
        loop.call(lambda: monkeypatch.setattr(type(engine.scheduler), "schedule", faulty))
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 500 and "injected bookkeeping fault" in r.json()["error"]["message"]
        assert engine.job_states[job].status == "failed" and "injected bookkeeping fault" in engine.job_states[job].error
        assert engine.scheduler.blocks.num_free_blocks == 64 and not engine.scheduler.requests
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
        faults[0] = engine_loop.MAX_FAULTS  # faults that keep coming (the first counts too) stop the loop
        codes = [http.post("/v1/completions", json=body).status_code for _ in range(engine_loop.MAX_FAULTS - 1)]
        assert codes == [500] * (engine_loop.MAX_FAULTS - 2) + [503]
        assert http.get("/health").status_code == 503 and http.head("/health").status_code == 503
