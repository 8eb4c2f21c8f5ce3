"""A server killed (SIGKILL) in the middle of a fine-tuning job and restarted on the same state directory:
the job resumes from its last checkpoint and finishes with the adapter an uninterrupted run gives; no file,
job or model is lost."""

from __future__ import annotations

import io
import os
import signal
import time

import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file

from server_helpers import CHAT_EXAMPLES, chat_jsonl, start_server, wait_for_job

BASE = "tiny"
HYPER = {"n_epochs": 12, "batch_size": 1, "learning_rate_multiplier": 50}
DATA = CHAT_EXAMPLES * 4  # 288 steps: the job is still running when its first checkpoint shows
OPTIONS = {"coserve": {"optimizer": "sgd", "lr_scheduler": "constant", "target_modules": ["v_proj", "down_proj"]}}


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)


def adapter(srv, job_id: str) -> dict[str, torch.Tensor]:
    return load_file(srv.state_dir / "jobs" / job_id / "model" / "adapter_model.safetensors")


def test_sigkill_mid_job_then_resume(model_factory, tmp_path):
    model = model_factory("llama")
    state = tmp_path / "state"
    srv = start_server(model, state, "--served-model-name", BASE, "--checkpoint-steps", "1")
    try:
        c = client(srv)
        f = c.files.create(file=("train.jsonl", io.BytesIO(chat_jsonl(DATA))), purpose="fine-tune")
        reference = c.fine_tuning.jobs.create(model=BASE, training_file=f.id, seed=5, hyperparameters=HYPER,
                                              extra_body=OPTIONS)
        assert wait_for_job(c, reference.id).status == "succeeded"
        expected = adapter(srv, reference.id)
        job = c.fine_tuning.jobs.create(model=BASE, training_file=f.id, seed=5, hyperparameters=HYPER,
                                        extra_body=OPTIONS)
        deadline = time.monotonic() + 120
        while not c.fine_tuning.jobs.checkpoints.list(job.id).data:
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.05)
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
    finally:
        srv.stop(kill=True)

    again = start_server(model, state, "--served-model-name", BASE, "--checkpoint-steps", "1")
    try:
        c = client(again)
        assert f.id in [x.id for x in c.files.list().data]
        assert c.fine_tuning.jobs.retrieve(reference.id).status == "succeeded"
        done = wait_for_job(c, job.id)
        assert done.status == "succeeded", done.error
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
        # both models are servable after the restart
        for name in (done.fine_tuned_model, c.fine_tuning.jobs.retrieve(reference.id).fine_tuned_model):
            out = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert out.choices[0].message.content is not None
    finally:
        again.stop()
