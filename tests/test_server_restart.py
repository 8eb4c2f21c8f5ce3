"""A server killed (SIGKILL) in the middle of a fine-tuning job and restarted on the same state directory:
the job resumes from its last checkpoint and finishes with the adapter an uninterrupted run gives; no file,
job, model or upload part is lost."""

from __future__ import annotations

import io
import time

import openai
import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file

from server_helpers import CHAT_EXAMPLES, chat_jsonl, start_server, wait_for_job

BASE = "tiny"
HYPER = {"n_epochs": 6, "batch_size": 1, "learning_rate_multiplier": 50}
DATA = CHAT_EXAMPLES * 4  # 144 steps: the job is still running when its first checkpoint shows
OPTIONS = {"coserve": {"optimizer": "sgd", "lr_scheduler": "constant", "target_modules": ["v_proj", "down_proj"]}}


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def adapter(srv, job_id: str) -> dict[str, torch.Tensor]:
    return load_file(srv.state_dir / "jobs" / job_id / "model" / "adapter_model.safetensors")


def reference_then_twin(srv, c: OpenAI, hyper: dict):
    """Upload the data, run a reference job to its end, then start its twin (same data, seed and settings):
    ``(file, reference job, its adapter, twin job)``."""
    f = c.files.create(file=("train.jsonl", io.BytesIO(chat_jsonl(DATA))), purpose="fine-tune")
    reference = c.fine_tuning.jobs.create(model=BASE, training_file=f.id, seed=5, hyperparameters=hyper,
                                          extra_body=OPTIONS)
    assert wait_for_job(c, reference.id).status == "succeeded"
    twin = c.fine_tuning.jobs.create(model=BASE, training_file=f.id, seed=5, hyperparameters=hyper,
                                     extra_body=OPTIONS)
    return f, reference, adapter(srv, reference.id), twin


def test_sigkill_mid_job_then_resume(model_factory, tmp_path):
    model = model_factory("llama")
    state = tmp_path / "state"
    # as a user runs it (`python -m coserve.cli serve`), where the other live servers are forked
    srv = start_server(model, state, "--served-model-name", BASE, "--checkpoint-steps", "1", fork=False)
    try:
        c = client(srv)
        f, reference, expected, job = reference_then_twin(srv, c, HYPER)
        gone = c.fine_tuning.jobs.retrieve(reference.id).fine_tuned_model
        assert c.models.delete(gone).deleted  # a deleted model stays deleted across the crash
        data = chat_jsonl(DATA)  # an upload in parts, half sent
        upload = c.uploads.create(bytes=len(data), filename="more.jsonl", mime_type="application/jsonl",
                                  purpose="fine-tune")
        first = c.uploads.parts.create(upload.id, data=data[:1000])
        deadline = time.monotonic() + 120
        while not c.fine_tuning.jobs.checkpoints.list(job.id).data:
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        srv.crash()
    finally:
        srv.stop(kill=True)

    again = start_server(model, state, "--served-model-name", BASE, "--checkpoint-steps", "1")
    try:
        c = client(again)
        assert f.id in [x.id for x in c.files.list().data]
        second = c.uploads.parts.create(upload.id, data=data[1000:])
        made = c.uploads.complete(upload.id, part_ids=[first.id, second.id])
        assert made.status == "completed" and c.files.content(made.file.id).read() == data
        assert c.fine_tuning.jobs.retrieve(reference.id).status == "succeeded"
        done = wait_for_job(c, job.id)
        assert done.status == "succeeded", done.error
        assert done.trained_tokens == c.fine_tuning.jobs.retrieve(reference.id).trained_tokens
        events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))  # every page
        messages = [e.message for e in events]
        assert any(m.startswith("The server restarted") for m in messages)
        resumed = [m for m in messages if "resumed at step" in m]
        assert resumed and not resumed[0].startswith("Fine-tuning job resumed at step 0")
        steps = sorted(e.data["step"] for e in events if e.type == "metrics")
        assert steps == list(range(1, HYPER["n_epochs"] * len(DATA) + 1))  # every step once, none repeated after the resume
        got = adapter(again, job.id)
        assert got.keys() == expected.keys()
        for k in expected:
            err = (got[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-12)
            assert err <= 1e-4, (k, float(err))
        # the resumed job's model is servable after the restart; the one deleted before the crash is not
        out = c.chat.completions.create(model=done.fine_tuned_model, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3)
        assert out.choices[0].message.content is not None
        assert gone not in [m.id for m in c.models.list().data]
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model=gone, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    finally:
        again.stop()


def test_pause_then_resume_trains_the_adapter_an_uninterrupted_job_does(model_factory, tmp_path):
    """OpenAI's pause and resume: a paused job leaves the engine with a checkpoint of its last step (servable),
    trains no more, keeps its files; resumed, it goes on from that step and ends with the same adapter."""
    import httpx

    model = model_factory("llama")
    hyper = {**HYPER, "n_epochs": 12}  # 288 steps: still running when the test pauses it, on a loaded machine too
    srv = start_server(model, tmp_path / "state", "--served-model-name", BASE, "--checkpoint-steps", "1000")
    try:
        c = client(srv)
        f, reference, expected, job = reference_then_twin(srv, c, hyper)
        deadline = time.monotonic() + 120
        while len([e for e in c.fine_tuning.jobs.list_events(job.id, limit=100).data if e.type == "metrics"]) < 5:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.05)
        paused = c.fine_tuning.jobs.pause(job.id)
        assert paused.status == "paused"
        steps = [e.data["step"] for e in c.fine_tuning.jobs.list_events(job.id, limit=100).data
                 if e.type == "metrics"]
        checkpoints = c.fine_tuning.jobs.checkpoints.list(job.id).data
        assert [ck.step_number for ck in checkpoints] == [max(steps)]  # the pause's own: no periodic one yet
        assert any(e.message == f"Fine-tuning job paused at step {max(steps)}"
                   for e in c.fine_tuning.jobs.list_events(job.id, limit=5).data)
        trained = c.fine_tuning.jobs.retrieve(job.id).trained_tokens
        time.sleep(0.5)
        assert c.fine_tuning.jobs.retrieve(job.id).trained_tokens == trained  # paused: nothing trains
        out = c.chat.completions.create(model=checkpoints[0].fine_tuned_model_checkpoint, max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content is not None  # the pause's checkpoint is servable
        http = httpx.Client(base_url=srv.url, timeout=30)
        assert http.delete(f"/v1/files/{f.id}").status_code == 409  # a paused job still needs its file
        for path, code in ((f"/v1/fine_tuning/jobs/{job.id}/pause", "job_not_pausable"),
                           (f"/v1/fine_tuning/jobs/{reference.id}/pause", "job_not_pausable"),
                           (f"/v1/fine_tuning/jobs/{reference.id}/resume", "job_not_paused")):
            r = http.post(path)
            assert r.status_code == 409 and r.json()["error"]["code"] == code, (path, r.text)
        assert http.post("/v1/fine_tuning/jobs/ftjob-000000000000000000000000/pause").status_code == 404
        assert c.fine_tuning.jobs.resume(job.id).status == "queued"
        done = wait_for_job(c, job.id)
        assert done.status == "succeeded", done.error
        assert done.trained_tokens == c.fine_tuning.jobs.retrieve(reference.id).trained_tokens
        events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))
        assert sorted(e.data["step"] for e in events if e.type == "metrics") == list(
            range(1, hyper["n_epochs"] * len(DATA) + 1))  # every step once
        assert any(m.message.startswith(f"Fine-tuning job resumed at step {max(steps)}") for m in events)
        got = adapter(srv, job.id)
        for k in expected:
            err = (got[k] - expected[k]).norm() / expected[k].norm().clamp_min(1e-12)
            assert err <= 1e-4, (k, float(err))
    finally:
        srv.stop()


def test_a_background_response_a_crash_cut_short_is_failed_at_restart(model_factory, tmp_path):
    """A background response still generating when the server is SIGKILLed is not left queued or in progress for
    ever: the restarted server marks it failed, saying why; a finished one is kept as it was."""
    model = model_factory("llama")
    srv = start_server(model, tmp_path / "state", "--served-model-name", BASE)
    try:
        c = client(srv)
        done = c.responses.create(model=BASE, input="Hi.", max_output_tokens=3, background=True)
        deadline = time.monotonic() + 60
        while c.responses.retrieve(done.id).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        finished = c.responses.retrieve(done.id)
        cut = c.responses.create(model=BASE, input="Count.", max_output_tokens=450, background=True)
        srv.crash()
    finally:
        srv.stop()
    again = start_server(model, tmp_path / "state", "--served-model-name", BASE)
    try:
        c = client(again)
        failed = c.responses.retrieve(cut.id)
        assert failed.status == "failed" and "stopped before" in failed.error.message
        assert c.responses.retrieve(done.id) == finished
    finally:
        again.stop()
