"""Serving DoRA adapters (PEFT's ``use_dora``), with HF PEFT as the oracle: greedy tokens and logprobs, in a batch
mixing a DoRA adapter, a plain LoRA one and the base model; and bad DoRA files refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from coserve import LLM, SamplingParams
from coserve.peft import AdapterError
from peft_helpers import hf_greedy, make_lora_adapter, peft_model

PROMPTS = ["The quick brown fox", "def add(a, b):", "Scheduling decides which tokens run", "Once upon"]


def make_dora_adapter(model_dir, out_dir, seed: int, **lora_kwargs):
    """A PEFT DoRA adapter with random B and magnitudes moved away from the base weights' norms."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(use_dora=True, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
    model.save_pretrained(str(out_dir))
    return out_dir


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
    oracles = {None: hf_model_cache(model_dir), "dora": peft_model(model_dir, dora), "lora": peft_model(model_dir, lora)}
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
