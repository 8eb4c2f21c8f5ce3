"""HF PEFT is the oracle: one batch mixing the bare model and two adapters, request by request."""

from __future__ import annotations

import pytest
import torch

from coserve import LLM, SamplingParams
from peft_helpers import check_mixed_batch_matches_peft, lora_adapters_per_model, peft_model

PROMPTS = ["The quick brown fox", "def add(a, b):", "A", "Scheduling decides which tokens run",
           "JSON: {\"key\": [1, 2", "Once upon"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return lora_adapters_per_model(tmp_path_factory, "adapters", {
        "attn": dict(seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "mlp": dict(seed=2, r=4, lora_alpha=8, use_rslora=True,
                    target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    })


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "smollm3", "olmo2", "olmo3",
                                  "seed_oss"])
def test_mixed_adapter_batch_matches_peft(model_factory, hf_model_cache, adapters, arch):
    model_dir = model_factory(arch)
    check_mixed_batch_matches_peft(model_dir, hf_model_cache(model_dir), adapters(model_dir),
                                   [None, "attn", "mlp", "attn", "mlp", None], PROMPTS, 24)


def test_adapter_logits_match_peft(model_factory, adapters):
    model_dir = model_factory("llama")
    paths = adapters(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    llm.load_adapter("mlp", paths["mlp"])
    ids = llm.tokenizer(PROMPTS[3])["input_ids"]
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5), adapter="mlp")[0]
    with torch.inference_mode():
        ref = peft_model(model_dir, paths["mlp"])(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    top = out.outputs[0].logprobs[0].top
    for token, lp in top.items():
        assert abs(lp - ref[token].item()) < 1e-4


def test_load_and_unload_at_run_time(model_factory, adapters):
    model_dir = model_factory("llama")
    paths = adapters(model_dir)
    llm = LLM(model_dir, dtype="float32", device="cpu", max_loras=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base = llm.generate(PROMPTS[0], params)[0].token_ids
    llm.load_adapter("attn", paths["attn"])
    llm.load_adapter("mlp", paths["mlp"])
    # max_loras=1: two adapters in one call are served one after the other, slots swapped
    a, m = llm.generate([PROMPTS[0], PROMPTS[0]], params, adapter=["attn", "mlp"])
    assert a.token_ids != base or m.token_ids != base
    assert llm.generate(PROMPTS[0], params, adapter="attn")[0].token_ids == a.token_ids
    llm.unload_adapter("attn")
    with pytest.raises(ValueError, match="attn"):
        llm.generate(PROMPTS[0], params, adapter="attn")
    assert llm.generate(PROMPTS[0], params, adapter="mlp")[0].token_ids == m.token_ids
    assert llm.generate(PROMPTS[0], params)[0].token_ids == base
