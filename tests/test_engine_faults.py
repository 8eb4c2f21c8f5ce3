"""An iteration that raises fails what it carried, and nothing else: the engine and the server keep serving,
the requests beside a failed job come out as if it had never run, and a failed job writes no adapter."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from coserve.engine import executor as executor_module
from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.model.sampling import sample
from coserve.scheduler import SamplingParams
from coserve.server.app import build_app
from coserve.server.config import ServerConfig
from tests.test_coserving import _engine, _generate, _job

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


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
        assert http.get("/health").status_code == 503
