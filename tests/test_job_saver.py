"""A finished job's adapter is written off the engine thread (coserve/engine/job_saver.py): requests keep being
served while the disk is slow, the job succeeds only once its files are whole, and a failed write fails it."""

from __future__ import annotations

import threading

from coserve.engine import job_saver
from coserve.engine.llm import LLM
from coserve.peft import load_peft_adapter
from coserve.scheduler import SamplingParams
from tests.test_coserving import _engine, _job

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _train_to_the_last_step(engine, job_id: str) -> None:
    while job_id in engine.executor.jobs:
        engine.step()


def test_requests_are_served_while_a_finished_jobs_adapter_is_written(model_factory, tmp_path, monkeypatch):
    release, writing = threading.Event(), threading.Event()
    real_write = job_saver.write_checkpoint

    def slow_write(out_dir, snap):
        writing.set()
        assert release.wait(30)
        real_write(out_dir, snap)

    monkeypatch.setattr(job_saver, "write_checkpoint", slow_write)
    engine = _engine(model_factory("llama"))
    job = _job(engine, tmp_path / "job")
    job_id = engine.add_finetune_job(job)
    _train_to_the_last_step(engine, job_id)
    assert writing.wait(30)
    state = engine.job_states[job_id]
    assert state.status == "running" and engine.has_running_jobs()  # nothing may read a half-written adapter
    ids = [engine.add_request([5, 6, 7, 8], PARAMS) for _ in range(3)]
    finished = set()
    while len(finished) < len(ids):  # the engine serves on while the write is held
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert state.status == "running" and not (tmp_path / "job" / "adapter_model.safetensors").exists()
    release.set()
    while engine.has_running_jobs():
        engine.step()
    assert state.status == "succeeded" and state.error is None
    adapter = load_peft_adapter("trained", tmp_path / "job", engine.model.module_shapes(),
                                engine.model_config.num_layers)
    assert adapter.rank == 4


def test_a_failed_adapter_write_fails_the_job_and_names_why(model_factory, tmp_path, monkeypatch):
    def full_disk(out_dir, snap):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(job_saver, "write_checkpoint", full_disk)
    engine = _engine(model_factory("llama"))
    job_id = engine.add_finetune_job(_job(engine, tmp_path / "job"))
    while engine.has_running_jobs():
        engine.step()
    state = engine.job_states[job_id]
    assert state.status == "failed" and "saving the adapter failed" in state.error
    assert "No space left on device" in state.error
    request = engine.add_request([5, 6, 7], PARAMS)  # and serves on
    while not any(o.finished and o.request_id == request for o in engine.step()):
        pass


def test_the_python_api_waits_for_the_adapter_to_be_written(model_factory, tmp_path, monkeypatch):
    """``job.wait()`` returns once the files are whole, though the engine loop is idle while they are written."""
    from coserve import FinetuneConfig, LoraConfig

    release = threading.Event()
    real_write = job_saver.write_checkpoint

    def held_write(out_dir, snap):
        assert release.wait(30)
        real_write(out_dir, snap)

    monkeypatch.setattr(job_saver, "write_checkpoint", held_write)
    llm = LLM(str(model_factory("llama")), dtype="float32", device="cpu")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "one two three four five six"}\n' * 2)
    job = llm.finetune(str(data), peft=LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]),
                       config=FinetuneConfig(output_dir=str(tmp_path / "api"), max_steps=1, batch_size=2))
    assert job.wait(timeout=1.0)["status"] == "running"  # trained, but its files are not whole yet
    release.set()
    assert job.wait(timeout=30)["status"] == "succeeded"
    assert (tmp_path / "api" / "adapter_model.safetensors").is_file()
