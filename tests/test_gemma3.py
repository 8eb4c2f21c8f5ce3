"""Gemma 3 (text): finetuning windows, pruned (the plan's keeps; through the norms around the attention's and the
MLP's outputs, tanh-GELU and the sliding layers' own RoPE) or recomputed under autograd, exact against one
whole-sequence backward past the sliding window; what coserve does not run is refused naming the field."""

from __future__ import annotations

import json
import random

import pytest
import torch

from coserve.finetune.pruned_layer import BASE_KEEPS, executor_plan, new_keeps, planned_keeps
from coserve.finetune.reference import whole_sequence_loss
from coserve.finetune.sequence_state import IGNORE_INDEX, new_sequence_state
from coserve.finetune.token_windows import backward_window, forward_window
from coserve.model.config import ModelConfig, ModelConfigError
from coserve.model.loader import load_model
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import TrainableIA3, TrainableLora

BYPASSES = {
    "lora-dropout": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["all-linear"]),
    "dora": LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "ia3": IA3Config(target_modules=["k_proj", "v_proj", "o_proj", "down_proj"], feedforward_modules=["o_proj"]),
}


@pytest.fixture(scope="module")
def gemma(model_factory):
    return load_model(model_factory("gemma3"), torch.float32, torch.device("cpu"))


def _bypass(kind: str, model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cfg = BYPASSES[kind]
    if isinstance(cfg, IA3Config):
        bypass = TrainableIA3(cfg, model.module_shapes(), model.cfg.num_layers, model.device)
    else:
        bypass = TrainableLora(cfg, model.module_shapes(), model.cfg.num_layers, model.device, gen,
                               base_weight=model.module_weight)
    with torch.no_grad():  # every parameter away from its init, so that every path carries gradient
        for p in bypass.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return bypass


@pytest.mark.parametrize("kind", list(BYPASSES))
@pytest.mark.parametrize("remat", ["all", "cheap", "cheap:none", "cheap:every"])
def test_window_schedules_match_one_whole_sequence_backward_past_the_window(gemma, kind, remat):
    """``cheap``: the plan's keeps for this sequence; ``cheap:none`` recomputes q, the residual, gate and up;
    ``cheap:every`` keeps them and attention's output (its kept-output backward under the sliding mask)."""
    model = gemma
    assert model.cfg.attention_windows == (32, None)
    bypass = _bypass(kind, model, seed=4)
    rng = random.Random(1)
    n = 47  # past the sliding layer's 32 positions
    ids = [rng.randrange(5, model.cfg.vocab_size) for _ in range(n)]
    targets = [t if rng.random() > 0.3 else IGNORE_INDEX for t in ids[1:]] + [IGNORE_INDEX]
    total = sum(t != IGNORE_INDEX for t in targets)
    bypass.zero_grad()
    (whole_sequence_loss(model, bypass, ids, targets, dropout_seed=2) / total).backward()
    ref = [p.grad.clone() for p in bypass.parameters()]
    bypass.zero_grad()
    state = new_sequence_state(ids, targets, model.cfg.num_layers, model.cfg.hidden_size, model.cfg.num_kv_heads,
                               model.cfg.head_dim, model.device, model.dtype)
    state.dropout_seed = 2
    if remat != "all":
        names = {"cheap": planned_keeps(executor_plan(model, bypass.config, "cheap", max_tokens=n)),
                 "cheap:none": (), "cheap:every": BASE_KEEPS}[remat]
        state.keeps = new_keeps(model, n, names)
    for size in (5, 1, 30, 11):
        forward_window(model, bypass, state, size, 1.0 / total)
    while not state.finished:
        backward_window(model, bypass, state, rng.choice([1, 3, 16, 47]))
    for p, r in zip(bypass.parameters(), ref):
        assert r.abs().max() > 0
        assert (p.grad - r).norm() / r.norm() <= 1e-5


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
