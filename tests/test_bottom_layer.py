"""The bottom layer's backward cost, measured on a job's own model and plan: the measurement leaves the job
exactly as it was (position, gradients, and so every later step), for every rematerialisation policy."""

from __future__ import annotations

import pytest
import torch

from coserve.finetune.bottom_layer import MIN_SHARE, measure_bottom_layer_cost
from coserve.finetune.job import FinetuneJob
from coserve.finetune.runner import run_job
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import TrainableIA3
from test_finetune_job import _cfg, setup  # noqa: F401  (the fixture)


def _adapter(bypass) -> list[torch.Tensor]:
    return [p.detach().clone() for p in bypass.parameters()]


@pytest.mark.parametrize("remat", ["cheap", "all"])
def test_measuring_leaves_the_job_exactly_as_it_was(setup, tmp_path, remat):
    model_dir, model, examples, bypass = setup
    def started(bp, out):  # mid-sequence, with gradients of a partial backward to keep
        j = FinetuneJob(model, bp, examples, _cfg(tmp_path / out, rematerialize=remat))
        j.forward(j.pending_tokens())
        j.backward(3)
        return j

    plain = bypass()
    run_job(started(plain, "plain"), progress=False)
    measured = bypass()
    job = started(measured, "measured")
    grads = [None if p.grad is None else p.grad.clone() for p in measured.parameters()]
    position = job.position()
    share = measure_bottom_layer_cost(job, tokens=16)
    assert MIN_SHARE <= share <= 1.0
    assert job.position() == position
    for p, g in zip(measured.parameters(), grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    run_job(job, progress=False)
    for a, b in zip(_adapter(plain), _adapter(measured)):
        assert torch.equal(a, b)


def test_an_ia3_job_and_short_sequences_are_measured_too(setup, tmp_path):
    model_dir, model, examples, _ = setup
    ia3 = TrainableIA3(IA3Config(), model.module_shapes(), model.cfg.num_layers, model.device)
    job = FinetuneJob(model, ia3, [e for e in examples][:2], _cfg(tmp_path / "ia3"))
    assert MIN_SHARE <= measure_bottom_layer_cost(job, tokens=10_000) <= 1.0  # capped at the longest sequence
    assert all(p.grad is None for p in ia3.parameters())


def test_a_coserving_engine_prices_the_bottom_layer_with_the_measurement(setup, tmp_path):
    from coserve.engine.config import EngineConfig
    from coserve.engine.llm_engine import LLMEngine
    model_dir, model, examples, bypass = setup
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", auto_profile=False))
    job = FinetuneJob(engine.model, bypass(), examples, _cfg(tmp_path / "engine"))
    jid = engine.add_finetune_job(job)
    assert MIN_SHARE <= job.bottom_layer_cost <= 1.0
    assert engine.scheduler.jobs[jid].bottom_layer_cost == job.bottom_layer_cost
