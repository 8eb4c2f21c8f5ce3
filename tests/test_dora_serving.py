"""Serving DoRA adapters (PEFT's ``use_dora``), with HF PEFT as the oracle: greedy tokens and logprobs, in a batch
mixing a DoRA adapter, a plain LoRA one and the base model; and bad DoRA files refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from coserve import LLM, SamplingParams
from coserve.peft import AdapterError
from peft_helpers import hf_greedy, make_dora_adapter, make_lora_adapter, peft_model

PROMPTS = ["The quick brown fox", "def add(a, b):", "Scheduling decides which tokens run", "Once upon"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases (DoRA scales all but the bias)
def test_dora_beside_lora_and_base_matches_peft(model_factory, hf_model_cache, tmp_path, arch):
    model_dir = model_factory(arch)
    dora = make_dora_adapter(model_dir, tmp_path / "dora", seed=3, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    lora = make_lora_adapter(model_dir, tmp_path / "lora", seed=4, r=8, lora_alpha=16,
                             target_modules=["q_proj", "down_proj"])
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=13)
    llm.load_adapter("dora", dora)
    llm.load_adapter("lora", lora)
    which = ["dora", "lora", None, "dora"]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), adapter=which)
    oracles = {None: hf_model_cache(model_dir), "dora": peft_model(model_dir, dora),
               "lora": peft_model(model_dir, lora)}
    for out, name in zip(outs, which):
        assert out.token_ids == hf_greedy(oracles[name], out.prompt_token_ids, 16), (name, out.prompt)
    assert outs[0].token_ids != hf_greedy(oracles[None], outs[0].prompt_token_ids, 16), "DoRA should change outputs"
    ids = outs[3].prompt_token_ids
    ours = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5), adapter="dora")[0]
    with torch.inference_mode():
        ref = oracles["dora"](torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    lp = ours.outputs[0].logprobs[0]
    for token, value in lp.top.items():
        assert abs(value - ref[token].item()) <= 1e-4


def test_bad_dora_files_name_the_field(model_factory, tmp_path):
    model_dir = model_factory("llama")
    llm = LLM(model_dir, dtype="float32", device="cpu")
    good = make_dora_adapter(model_dir, tmp_path / "good", seed=5, r=2, lora_alpha=4, target_modules=["q_proj"])
    tensors = load_file(good / "adapter_model.safetensors")
    magnitude = next(k for k in tensors if "magnitude" in k)

    def variant(name: str, drop: str | None = None, reshape: bool = False, config: dict | None = None):
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((good / "adapter_config.json").read_text()) | (config or {})
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        t = {k: (v[:-1] if reshape and k == magnitude else v) for k, v in tensors.items() if k != drop}
        save_file(t, d / "adapter_model.safetensors")
        return d

    for path, message in ((variant("missing", drop=magnitude), "has no lora_magnitude_vector"),
                          (variant("shape", reshape=True), "lora_magnitude_vector' has shape"),
                          (variant("unflagged", config={"use_dora": False}), "does not set use_dora"),
                          (variant("flag", config={"use_dora": "yes"}), "field 'use_dora' must be true or false")):
        with pytest.raises(AdapterError, match=message):
            llm.load_adapter("bad", path)
    llm.load_adapter("good", good)  # and the engine serves on
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), adapter="good")[0].outputs[0].token_ids


def test_a_dora_adapter_trained_by_coserve_is_served_as_peft_serves_it(model_factory, hf_model_cache, tmp_path):
    """``coserve finetune --use-dora`` writes what PEFT loads (use_dora, magnitudes), and the engine serves it with
    PEFT's greedy tokens."""
    from coserve.cli import main
    model_dir = model_factory("qwen2")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i} " * 6}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    assert main(["finetune", "--model", str(model_dir), "--data", str(data), "--output", str(out), "--use-dora",
                 "--target-modules", "q_proj,v_proj,down_proj", "--lora-r", "4", "--lr", "0.05", "--max-steps", "3",
                 "--batch-size", "2"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    assert any(k.endswith("lora_magnitude_vector") for k in load_file(out / "adapter_model.safetensors"))
    llm = LLM(model_dir, dtype="float32", device="cpu")
    llm.load_adapter("mine", out)
    ids = llm.tokenizer("The scheduler decides")["input_ids"]
    ours = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), adapter="mine")[0]
    assert ours.outputs[0].token_ids == hf_greedy(peft_model(model_dir, out), ids, 12)
