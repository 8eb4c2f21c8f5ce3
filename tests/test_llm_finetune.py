"""``LLM.finetune``: a job co-served with ``generate`` calls, the engine in a background thread."""

from __future__ import annotations

import json

import pytest

from coserve import LLM, FinetuneConfig, LoraConfig, SamplingParams


def _data(path, n=6):
    rows = [{"instruction": f"Count to {i}.", "input": "", "output": " ".join(str(j) for j in range(i + 3))}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_finetune_runs_beside_generate_and_the_adapter_serves(model_factory, tmp_path):
    model_dir = model_factory("llama")
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = llm.generate([[5, 6, 7, 8]] * 3, params)
    job = llm.finetune(_data(tmp_path / "d.jsonl"), LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]),
                       FinetuneConfig(output_dir=str(tmp_path / "out"), max_steps=3, batch_size=2, lr=5e-2,
                                      seed=1), validation=_data(tmp_path / "v.jsonl", n=2))
    assert job.status()["status"] in ("running", "succeeded")  # it trains in the background
    during = llm.generate([[5, 6, 7, 8]] * 3, params)  # served while the job trains
    assert [o.token_ids for o in during] == [o.token_ids for o in before]
    final = job.wait(timeout=120)
    assert final["status"] == "succeeded" and final["step"] == 3 and final["error"] is None
    assert (job.output_dir / "adapter_model.safetensors").is_file()
    lines = (job.output_dir / "training_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert ["valid_loss" in json.loads(line) for line in lines] == [False, False, True]  # 3 steps: the last
    llm.load_adapter("tuned", job.output_dir)  # servable right away
    tuned = llm.generate([[5, 6, 7, 8]], params, adapter="tuned")
    assert len(tuned[0].token_ids) == 8
    with pytest.raises(ValueError, match="already succeeded"):
        job.cancel()


def test_cancel_and_bad_config(model_factory, tmp_path):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="config"):
        llm.finetune(_data(tmp_path / "d.jsonl"))
    job = llm.finetune(_data(tmp_path / "d.jsonl", n=40), config=FinetuneConfig(output_dir=str(tmp_path / "o"),
                                                                              epochs=50))
    job.cancel()
    assert job.wait(timeout=30)["status"] == "cancelled"
    with pytest.raises(ValueError, match="^r: must be a positive integer"):
        LoraConfig(r=True)
    with pytest.raises(ValueError, match=r"^r: a rank-\d+ LoRA on down_proj has [\d,]+ parameters, which cannot"):
        llm.finetune(_data(tmp_path / "d.jsonl"), LoraConfig(r=2**63), FinetuneConfig(output_dir=str(tmp_path / "o3")))
    for schedule in (7, 1.5, True, "random", "random:x"):  # a non-string was an AttributeError
        with pytest.raises(ValueError, match="^window_schedule: expected 'random:SEED'"):
            FinetuneConfig(output_dir=str(tmp_path / "o"), window_schedule=schedule)


def test_requests_and_jobs_are_charged_to_their_tenants(model_factory, tmp_path):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=32, auto_profile=False)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), tenant="acme")
    vtc = llm.engine.scheduler.vtc
    assert vtc.counter("acme") == 4 * 1.0 + 3 * 2.0  # 4 prompt tokens (w_p = 1), 3 outputs (w_q = 2)
    job = llm.finetune(_data(tmp_path / "d.jsonl"), LoraConfig(r=4, lora_alpha=8),
                       FinetuneConfig(output_dir=str(tmp_path / "out"), max_steps=1), tenant="globex")
    job.wait(timeout=120)
    assert vtc.counter("globex") > 0 and vtc.counter("acme") == 10.0
    with pytest.raises(ValueError, match="inference-only"):
        LLM(model_factory("llama"), dtype="float32", device="cpu", policy="inference-only").finetune(
            _data(tmp_path / "e.jsonl"), config=FinetuneConfig(output_dir=str(tmp_path / "o2")))


def test_a_co_served_jobs_numbered_checkpoints_are_written_off_the_engine_thread(model_factory, tmp_path,
                                                                                   monkeypatch):
    import threading

    import coserve.finetune.job as job_module
    writers = []
    real = job_module.write_checkpoint

    def recording(out_dir, snap):
        writers.append((out_dir.name, threading.current_thread().name))
        real(out_dir, snap)

    monkeypatch.setattr(job_module, "write_checkpoint", recording)
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    job = llm.finetune(_data(tmp_path / "d.jsonl"), LoraConfig(r=4, target_modules=["down_proj"]),
                       FinetuneConfig(output_dir=str(tmp_path / "out"), max_steps=5, lr=1e-2, save_steps=2,
                                      save_total_limit=1))
    assert job.wait(timeout=120)["status"] == "succeeded"
    assert [name for name, _ in writers] == ["checkpoint-2", "checkpoint-4"]
    assert all(thread.startswith("coserve-save") for _, thread in writers)
    assert sorted(p.name for p in job.output_dir.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4"]
    assert (job.output_dir / "checkpoint-4" / "adapter_model.safetensors").is_file()


def test_a_job_resumed_from_its_checkpoint_trains_on_as_one_that_never_stopped(model_factory, tmp_path):
    """``LLM.finetune(..., resume_from=DIR)``: the checkpoint's adapter, optimizer state and step (as ``coserve
    finetune --init-adapter``); two steps then two more equal four at once (a constant learning rate: a schedule's
    length is the job's)."""
    from coserve.peft.adapter_dir import read_adapter_tensors
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    data = _data(tmp_path / "d.jsonl")

    def cfg(out: str, steps: int) -> FinetuneConfig:
        return FinetuneConfig(output_dir=str(tmp_path / out), max_steps=steps, batch_size=2, lr=5e-2, seed=4,
                              lr_scheduler="constant")

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"])
    assert llm.finetune(data, peft, cfg("whole", 4)).wait(120)["status"] == "succeeded"
    assert llm.finetune(data, peft, cfg("part", 2)).wait(120)["status"] == "succeeded"
    with pytest.raises(ValueError, match="peft: a resumed job trains the checkpoint's adapter"):
        llm.finetune(data, peft, cfg("part", 4), resume_from=tmp_path / "part")
    with pytest.raises(ValueError, match="resume_from: .*nowhere is not a directory"):
        llm.finetune(data, None, cfg("part", 4), resume_from=tmp_path / "nowhere")
    rest = llm.finetune(data, None, cfg("part", 4), resume_from=tmp_path / "part")
    assert rest.wait(120)["step"] == 4
    lines = (tmp_path / "part" / "training_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    a, b = read_adapter_tensors(tmp_path / "whole"), read_adapter_tensors(tmp_path / "part")
    for name in a:
        assert float((a[name] - b[name]).norm() / a[name].norm()) <= 1e-6, name
