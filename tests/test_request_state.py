"""A finished request leaves nothing behind in the engine, however it ended (its length, a stop, an abort at any
step, an error of its own, a preemption on the way): no KV block, no seeded generator, no guide cursor, no text
state, no scheduler entry. A long-running server would otherwise grow with every request it ever served."""

from __future__ import annotations

import random

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.scheduler import SamplingParams
from tests.test_coserving import _job

SETTINGS = [
    dict(temperature=0),
    dict(temperature=0.8, seed=5),
    dict(temperature=0.8, top_k=20, top_p=0.9, logprobs=3),
    dict(temperature=0, prompt_logprobs=2),
    dict(temperature=0.7, seed=9, guided_regex="[ab]{2,9}"),
    dict(temperature=0, guided_json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    dict(temperature=0.5, seed=1, repetition_penalty=1.3, frequency_penalty=0.5, stop=["e"]),
    dict(temperature=1.0, allowed_token_ids=[1, 2, 3], guided_regex="[ab]+"),  # masks that leave a row no token
    dict(temperature=0.9, min_tokens=3, stop_token_ids=[5, 6]),
]


def test_nothing_is_left_behind_by_finished_requests(model_factory, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(model_factory("llama")), dtype="float32", device="cpu",
                                    num_kv_blocks=24, block_size=4, max_num_batched_tokens=48))  # small: preemptions
    job = engine.add_finetune_job(_job(engine, tmp_path / "job", max_steps=2))  # co-served beside them
    rng = random.Random(3)
    live: list[str] = []
    ended, reasons, preempted = 0, set(), 0
    for step in range(400):
        if step < 60 and rng.random() < 0.6:
            prompt = [rng.randrange(5, 300) for _ in range(rng.randint(2, 30))]
            params = SamplingParams(max_tokens=rng.randint(3, 16), **rng.choice(SETTINGS))
            live.append(engine.add_request(prompt, params))
        if live and rng.random() < 0.08:  # an abort at whatever point the request has reached
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                ended += 1
                reasons.add(out.outputs[0].finish_reason)
                preempted += out.num_preemptions > 0
                if out.request_id in live:
                    live.remove(out.request_id)
        if step >= 60 and not engine.has_unfinished_requests() and not engine.has_running_jobs():
            break
    assert ended >= 30 and not live and not engine.has_unfinished_requests()
    assert reasons == {"stop", "abort", "length"} and preempted >= 1  # every way of ending, on the way too
    assert engine.job_states[job].status == "succeeded"
    engine.step()  # the last plan's finished requests are released by the executor at the next iteration
    s = engine.scheduler
    assert s.requests == {} and s.running == [] and list(s.waiting) == [] and s._queued_at == {}
    assert s.blocks.usage == 0 and all(n == 0 for n in s._tenant_work.values())
    assert engine.executor.generators == {}
    assert engine.outputs._texts == {}
    assert engine.executor.guided is None or engine.executor.guided._cursors == {}
