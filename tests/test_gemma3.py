"""Gemma 3 (text): finetuning windows, pruned (the plan's keeps; through the norms around the attention's and the
MLP's outputs, tanh-GELU and the sliding layers' own RoPE) or recomputed under autograd, exact against one
whole-sequence backward past the sliding window; what coserve does not run is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

from coserve.model.config import ModelConfig, ModelConfigError
from coserve.model.loader import load_model
from coserve.peft.config import IA3Config, LoraConfig
from window_helpers import check_windows_match_autograd, perturbed_bypass

BYPASSES = {
    "lora-dropout": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["all-linear"]),
    "dora": LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "ia3": IA3Config(target_modules=["k_proj", "v_proj", "o_proj", "down_proj"], feedforward_modules=["o_proj"]),
}


@pytest.fixture(scope="module")
def gemma(model_factory):
    return load_model(model_factory("gemma3"), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", list(BYPASSES))
@pytest.mark.parametrize("remat", ["all", "cheap", "cheap:none", "cheap:every"])
def test_window_schedules_match_one_whole_sequence_backward_past_the_window(gemma, kind, remat):
    """``cheap``: the plan's keeps for this sequence; ``cheap:none`` recomputes q, the residual, gate and up;
    ``cheap:every`` keeps them and attention's output (its kept-output backward under the sliding mask). 47 tokens:
    past the sliding layer's 32 positions."""
    assert gemma.cfg.attention_windows == (32, None) and gemma.cfg.kv_window is None  # a full layer keeps every block
    bypass = perturbed_bypass(BYPASSES[kind], gemma, seed=4)
    check_windows_match_autograd(gemma, bypass, 47, remat, (5, 1, 30, 11), [1, 3, 16, 47], seed=1, dropout_seed=2)


@pytest.mark.parametrize("field,value", [("use_bidirectional_attention", True), ("hidden_activation", "gelu"),
                                         ("final_logit_softcapping", -1.0)])
def test_what_is_not_run_is_refused_naming_the_field(model_factory, field, value):
    raw = json.loads((model_factory("gemma3") / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=f"field '{field}'"):
        ModelConfig.from_dict({**raw, field: value})


def test_gemma3_caps_its_logits_where_set_and_never_its_scores_as_hf_does(config_variant, hf_model_cache):
    """Gemma 3's attention ignores ``attn_logit_softcapping`` (Gemma 2's scores are capped); its LM head caps the
    logits where ``final_logit_softcapping`` is set: logits and greedy tokens as HF's."""
    from coserve import LLM, SamplingParams
    path = config_variant("gemma3", attn_logit_softcapping=1.0, final_logit_softcapping=4.0)
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.model_config.attn_softcap is None and llm.engine.model_config.final_softcap == 4.0
    hf = hf_model_cache(path)
    ids = list(range(5, 45))
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3))[0]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    assert out.token_ids == ref.argmax(-1).tolist()
    for step, lp in enumerate(out.outputs[0].logprobs):
        for token, value in lp.top.items():
            assert abs(value - ref[step, token].item()) <= 1e-4


def test_the_memory_its_sliding_layers_leave_goes_to_the_main_blocks(model_factory):
    """``kv_cache_memory_gb`` sizes both pools: the sliding layers' for ``max_num_seqs`` windows and one iteration's
    tokens, the main blocks whatever memory is left, more of them than if every layer kept K/V in them; the two
    together within the memory given."""
    from coserve import LLM
    from coserve.model.attention import PagedKVCache
    path = model_factory("gemma3")
    cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))

    def per_block(layers: int) -> int:
        return PagedKVCache.bytes_per_block(layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)

    memory = 100 * per_block(cfg.num_layers)
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
              kv_cache_memory_gb=memory / 2**30)
    storages, blocks = llm.engine.window_storages, llm.engine.scheduler.blocks.num_blocks
    assert storages == 2 * (-(-31 // 4) + 2) + 4 == llm.engine.scheduler.blocks.windows.num_storages
    assert blocks == (memory - storages * per_block(1)) // per_block(1) > 100  # one whole-context layer of two
    assert blocks * per_block(1) + storages * per_block(1) <= memory
