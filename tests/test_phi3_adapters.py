"""Phi-3's fused modules (``qkv_proj``, ``gate_up_proj``) adapted as HF PEFT adapts them: one LoRA or IA3 over all
of q, k and v, or of gate and up. PEFT is the oracle for serving and for training; a whole-sequence autograd
backward for every window schedule."""

from __future__ import annotations

import re

import pytest
import torch

from coserve import LLM, SamplingParams
from coserve.model.loader import load_model
from coserve.peft import AdapterError
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import TrainableIA3, load_trainable
from peft_helpers import hf_greedy, make_dora_adapter, make_ia3_adapter, make_lora_adapter, peft_model
from window_helpers import check_windows_match_autograd, perturbed_bypass

PROMPTS = ["The quick brown fox", "def add(a, b):", "A", "Scheduling decides which tokens run",
           "JSON: {\"key\": [1, 2", "Once upon"]


@pytest.fixture(scope="module")
def phi3(model_factory):
    return model_factory("phi3")


@pytest.fixture(scope="module")
def phi3_adapters(phi3, tmp_path_factory):
    """PEFT-made adapters of the tiny Phi-3: LoRA on the fused attention projection, rsLoRA on the rest, IA3 on
    qkv_proj's output and down_proj's input, DoRA on both fused modules."""
    root = tmp_path_factory.mktemp("phi3_adapters")
    return {
        "qkv": make_lora_adapter(phi3, root / "qkv", seed=1, r=8, lora_alpha=16, target_modules=["qkv_proj"]),
        "mlp": make_lora_adapter(phi3, root / "mlp", seed=2, r=4, lora_alpha=8, use_rslora=True,
                                 target_modules=["o_proj", "gate_up_proj", "down_proj"]),
        "ia3": make_ia3_adapter(phi3, root / "ia3", seed=3, target_modules=["qkv_proj", "down_proj"],
                                feedforward_modules=["down_proj"]),
        "dora": make_dora_adapter(phi3, root / "dora", seed=4, r=4, lora_alpha=8,
                                  target_modules=["qkv_proj", "gate_up_proj"]),
    }


def test_fused_adapters_in_one_batch_generate_as_peft_does(phi3, hf_model_cache, phi3_adapters):
    llm = LLM(phi3, dtype="float32", device="cpu", max_num_batched_tokens=11)
    for name, path in phi3_adapters.items():
        llm.load_adapter(name, path)
    which = ["qkv", "mlp", None, "ia3", "dora", "qkv"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, adapter=which)
    oracles = {None: hf_model_cache(phi3), **{n: peft_model(phi3, p) for n, p in phi3_adapters.items()}}
    differs = 0
    for out, name in zip(outs, which):
        assert out.token_ids == hf_greedy(oracles[name], out.prompt_token_ids, 16), (name, out.prompt)
        ids = out.prompt_token_ids + out.token_ids
        with torch.inference_mode():
            ref = oracles[name](torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1].log_softmax(-1)
        for step, lp in enumerate(out.outputs[0].logprobs):
            for token, value in lp.top.items():
                assert abs(value - ref[step, token].item()) <= 1e-4, (name, step)
        if name is not None:
            differs += out.token_ids != hf_greedy(oracles[None], out.prompt_token_ids, 16)
    assert differs >= 3, "the adapters should change the outputs"


def test_an_adapter_of_split_modules_is_refused_on_phi3_naming_what_it_has(phi3, model_factory, tmp_path):
    llama_style = make_lora_adapter(model_factory("llama"), tmp_path / "llama", r=4, target_modules=["q_proj"])
    llm = LLM(phi3, dtype="float32", device="cpu")
    with pytest.raises(AdapterError, match=re.escape("names ['q_proj'], which this model does not have as LoRA "
                                                     "targets (qkv_proj, o_proj, gate_up_proj, down_proj)")):
        llm.load_adapter("wrong", llama_style)
    with pytest.raises(ValueError, match=re.escape("target_modules: ['k_proj', 'v_proj'] are not modules of this "
                                                   "model, which has qkv_proj, o_proj, gate_up_proj, down_proj (its "
                                                   "qkv_proj holds q_proj, k_proj, v_proj)")):
        TrainableIA3(IA3Config(), llm.engine.model.module_shapes(), 2, torch.device("cpu"))


FUSED_BYPASSES = {
    "lora": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["qkv_proj", "gate_up_proj"]),
    "ia3": IA3Config(target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                     feedforward_modules=["o_proj"]),
    "dora": LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["all-linear"]),
}


@pytest.mark.parametrize("kind", list(FUSED_BYPASSES))
@pytest.mark.parametrize("remat", ["all", "cheap", "cheap:none"])
def test_window_schedules_of_fused_bypasses_match_whole_sequence_autograd(phi3, kind, remat):
    model = load_model(phi3, torch.float32, torch.device("cpu"))
    bypass = perturbed_bypass(FUSED_BYPASSES[kind], model, seed=7)
    assert bypass.config.target_modules[0] in ("qkv_proj", "o_proj")  # all-linear: the model's own names
    check_windows_match_autograd(model, bypass, 19, remat, (3, 1, 7, 8), [1, 2, 5, 19], seed=3, dropout_seed=5)


def test_a_trained_fused_adapter_is_served_as_peft_serves_it(phi3, hf_model_cache, tmp_path):
    """An adapter coserve trained on Phi-3's fused modules is a PEFT adapter of them: saved under their names, it
    loads in PEFT and generates there as coserve serves it; it loads back as a trainable copy, tensor for tensor."""
    model = load_model(phi3, torch.float32, torch.device("cpu"))
    bypass = perturbed_bypass(FUSED_BYPASSES["lora"], model, seed=2)
    bypass.save_pretrained(tmp_path / "trained", base_model=str(phi3))
    names = set(bypass.state_dict())
    assert "base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight" in names
    assert "base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight" in names
    again = load_trainable(tmp_path / "trained", model.module_shapes(), model.cfg.num_layers, model.device)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), bypass.parameters()))
    llm = LLM(phi3, dtype="float32", device="cpu")
    llm.load_adapter("trained", tmp_path / "trained")
    oracle = peft_model(phi3, tmp_path / "trained")
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), adapter="trained")
    for out in outs:
        assert out.token_ids == hf_greedy(oracle, out.prompt_token_ids, 12)
    assert any(o.token_ids != hf_greedy(hf_model_cache(phi3), o.prompt_token_ids, 12) for o in outs)
