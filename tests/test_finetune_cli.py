"""``coserve finetune`` end to end: a data file in, a PEFT adapter that PEFT and the engine both load, out."""

from __future__ import annotations

import json

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.cli import main
from peft_helpers import peft_model

RECORDS = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]},
    {"instruction": "Name a colour.", "output": "Blue."},
]


@pytest.mark.parametrize("peft_kind", ["lora", "ia3"])
def test_finetune_writes_an_adapter_peft_loads_identically(model_factory, tmp_path, capsys, peft_kind):
    model_dir = model_factory("qwen2")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n{not json\n")
    out = tmp_path / "adapter"
    args = ["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(out), "--peft", peft_kind,
            "--max-steps", "2", "--batch-size", "2", "--lr", "0.05", "--window-schedule", "random:3",
            "--memory-report", str(tmp_path / "mem.json"), "--no-progress", "--validation-data", str(data),
            "--eval-steps", "1"]
    if peft_kind == "lora":
        args += ["--lora-r", "4", "--target-modules", "q_proj,down_proj"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "4 examples" in printed and "1 malformed (line 5)" in printed
    log = [json.loads(x) for x in (out / "training_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2]
    assert "valid_loss" not in log[0] and log[1]["valid_loss"] > 0  # the last step (mid-epoch): the whole set
    assert log[0]["valid_batch_loss"] > 0 and "valid_batch_loss" not in log[1]  # --eval-steps 1: a batch
    assert "validation: 4 examples" in printed
    mem = json.loads((tmp_path / "mem.json").read_text())
    assert set(mem) >= {"kept_bytes_per_token", "keep_all_bytes_per_token", "autograd_bytes_per_token",
                        "peak_rss_bytes"}
    assert 0 < mem["kept_bytes_per_token"] < mem["autograd_bytes_per_token"]

    from coserve.model.loader import load_model
    from coserve.peft.trainable import load_trainable
    from coserve.finetune.window_attention import window_attention
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    bypass = load_trainable(out, model.module_shapes(), model.cfg.num_layers, model.device)
    ids = torch.tensor([0, 17, 99, 402, 7, 1234, 55])
    x = model.embed[ids]
    with torch.no_grad():
        for layer in model.layers:
            x, _, _ = model.layer_forward(layer, x, torch.arange(len(ids)),
                                          lambda q, k, v, i: window_attention(q, k, v, model.attention[i]),
                                          bypass)
        ours = model.logits(model.final_norm(x))
        ref = peft_model(model_dir, out)(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    if peft_kind == "lora":  # and the engine serves it
        llm = LLM(model_dir, dtype="float32", device="cpu")
        llm.load_adapter("ft", out)
        out_tokens = llm.generate([ids.tolist()], SamplingParams(max_tokens=1, temperature=0), adapter="ft")[0]
        assert out_tokens.token_ids == [int(ref[-1].argmax())]


def test_finetune_bad_data_is_one_clear_error(model_factory, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text("{not json\n[1, 2]\n")
    rc = main(["finetune", "--model", str(model_factory("llama")), "--data", str(data), "--output",
               str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "line 1" in err
    rc = main(["finetune", "--model", str(model_factory("llama")), "--data", str(data), "--output",
               str(tmp_path / "o"), "--target-modules", "lm_head", "--no-progress"])
    assert rc == 2


def test_the_memory_target_trades_kept_bytes_for_flops(model_factory, tmp_path, capsys):
    model_dir = model_factory("llama")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    kept = {}
    for budget in ("1", "0.5"):
        report = tmp_path / f"mem{budget}.json"
        assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(tmp_path / budget),
                     "--max-steps", "1", "--memory-target", budget, "--memory-report", str(report),
                     "--no-progress"]) == 0
        kept[budget] = json.loads(report.read_text())["kept_bytes_per_token"]
    assert kept["1"] > kept["0.5"]  # with no target the projections are kept rather than recomputed
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(tmp_path / "x"),
                 "--memory-target", "0", "--no-progress"]) == 2
    assert "memory_target" in capsys.readouterr().err


def test_save_steps_writes_resumable_numbered_checkpoints(model_factory, tmp_path, capsys):
    """HF Trainer's save_steps / save_total_limit: OUTPUT/checkpoint-STEP every N steps (the newest K kept), each an
    adapter directory that --init-adapter resumes from, at that step."""
    model_dir = model_factory("llama")
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out = tmp_path / "adapter"
    common = ["--model", str(model_dir), "--data", str(data), "--lora-r", "4", "--batch-size", "1", "--no-progress",
              "--no-shuffle", "--lr", "0.01"]
    assert main(["finetune", *common, "--output", str(out), "--max-steps", "5", "--save-steps", "2",
                 "--save-total-limit", "1"]) == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-4"]
    assert (out / "checkpoint-4" / "adapter_config.json").is_file()
    assert json.loads((out / "checkpoint-4" / "training_state.json").read_text())["step"] == 4
    resumed = tmp_path / "resumed"
    assert main(["finetune", *common, "--output", str(resumed), "--max-steps", "5",
                 "--init-adapter", str(out / "checkpoint-4")]) == 0
    log = [json.loads(x) for x in (resumed / "training_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [5]
    first = [json.loads(x) for x in (out / "training_log.jsonl").read_text().splitlines()]
    assert log[0]["loss"] == pytest.approx(first[4]["loss"], rel=1e-6)  # the same fifth step
    capsys.readouterr()
    assert main(["finetune", *common, "--output", str(tmp_path / "x"), "--save-steps", "-1"]) == 2
    assert "save_steps: must be a non-negative integer" in capsys.readouterr().err


def test_start_adapter_trains_on_from_a_finished_adapter_as_peft_does(model_factory, tmp_path, capsys):
    """``--start-adapter``: the job trains a copy of a finished adapter (its own config: r 4 on v/up_proj, not the
    CLI's defaults) with a fresh optimizer and schedule; one SGD step equals HF PEFT's on that adapter loaded
    trainable (loss and adapter)."""
    import torch.nn.functional as F

    from coserve.finetune.build import load_training, starting_bypass
    from coserve.finetune.config import FinetuneConfig
    from coserve.finetune.sequence_state import IGNORE_INDEX
    from coserve.model.loader import load_model
    from coserve.model.tokenizer import load_tokenizer
    from coserve.peft.config import LoraConfig
    from coserve.peft.trainable import load_trainable
    from peft_helpers import PeftTraining, make_lora_adapter
    model_dir = model_factory("llama")
    start = make_lora_adapter(model_dir, tmp_path / "start", seed=4, r=4, lora_alpha=8,
                              target_modules=["v_proj", "up_proj"])
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out = tmp_path / "more"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(out),
                 "--start-adapter", str(start), "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "4",
                 "--max-steps", "1", "--no-shuffle", "--window-schedule", "random:5", "--no-progress"]) == 0
    log = [json.loads(x) for x in (out / "training_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1]  # a new job's first step, not a resume
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4

    cfg = FinetuneConfig(output_dir="-", optimizer="sgd", lr=0.1, batch_size=4)
    examples, _ = load_training(data, load_tokenizer(model_dir), cfg)
    peft = PeftTraining(model_dir, start, cfg, steps=1)
    total = sum(t != IGNORE_INDEX for e in examples for t in e.targets)
    loss = sum(F.cross_entropy(peft.model(input_ids=torch.tensor([e.token_ids])).logits[0], torch.tensor(e.targets),
                               ignore_index=IGNORE_INDEX, reduction="sum") for e in examples) / total
    assert log[0]["loss"] == pytest.approx(peft.step(loss), rel=1e-5)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    ours = load_trainable(out, model.module_shapes(), model.cfg.num_layers, model.device).state_dict()
    before = load_trainable(start, model.module_shapes(), model.cfg.num_layers, model.device).state_dict()
    for name, ref in peft.state().items():
        assert not torch.equal(ours[name], before[name])  # trained
        assert (ours[name] - ref).norm() / ref.norm() <= 1e-5, name

    with pytest.raises(ValueError, match=r"^peft: a job from an adapter \(start_adapter\)"):
        starting_bypass(LoraConfig(), model, FinetuneConfig(output_dir="o", start_adapter=str(start)))
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a resume and a new start are two different things
        main(["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(tmp_path / "x"),
              "--start-adapter", str(start), "--init-adapter", str(start)])
    assert "not allowed with argument" in capsys.readouterr().err
