"""gpt-oss beyond the parity tests every architecture runs (conftest's ARCHS: HF's logits and greedy tokens, PEFT's
training, windows against autograd, co-served logprobs bit for bit; its experts' LoRA in test_expert_lora.py): its
MXFP4 experts dequantized as transformers dequantizes them, its clamped SwiGLU's backward, and PEFT's names on it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from coserve.model.loader import load_model
from coserve.model.moe import clamped_glu, clamped_glu_backward
from coserve.model.mxfp4 import dequantize_mxfp4
from coserve.peft.config import LoraConfig, for_model
from tests.test_model_parity import _flat_logits
from tests.test_moe import _hf_written


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``[*shape, 16]`` of random codes and scales ``shape`` of exponents around 2**-4."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 126, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_blocks_dequantize_as_transformers_dequantizes_them(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    blocks, scales = _random_mxfp4((3, 10, 4), seed=1)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 4 * 32, 10) and ours.dtype == dtype
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    with pytest.raises(ValueError, match="MXFP4 blocks .* and scales .* do not pair"):
        dequantize_mxfp4(blocks, scales[:, :, :3])


def test_an_mxfp4_checkpoint_runs_as_its_dequantized_weights(tmp_path):
    """The tiny gpt-oss (its experts 64 wide, whole MXFP4 blocks) with its experts replaced by MXFP4 ones: coserve
    reading the blocks and scales gives HF's logits over the same weights written dense."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    src = _hf_written(tmp_path / "src", "gpt_oss", intermediate_size=64)
    dense, packed = tmp_path / "dense", tmp_path / "mxfp4"
    for out in (dense, packed):
        shutil.copytree(src, out)
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    dense_state, packed_state = dict(state), dict(state)
    for layer in range(cfg["num_hidden_layers"]):
        for n, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            name = f"model.layers.{layer}.mlp.experts.{n}"
            blocks, scales = _random_mxfp4((e, rows, cols // 32), seed=10 * layer + len(n))
            dense_state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            del packed_state[name]
            packed_state[name + "_blocks"], packed_state[name + "_scales"] = blocks, scales
    save_file(dense_state, str(dense / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    ids = [[5, 17, 300, 41, 9, 2200, 77, 1000, 3]]
    with torch.inference_mode():
        want = hf(torch.tensor(ids)).logits[0]
    got = _flat_logits(packed, ids)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert not torch.allclose(got, _flat_logits(src, ids)[0], atol=1e-2)  # the experts changed the logits


def test_the_clamped_swiglus_backward_is_autograds():
    """Through both clamps (values past the limit on either side) and the shifted up."""
    gen = torch.Generator().manual_seed(0)
    gate, up = [torch.randn(64, 24, generator=gen, dtype=torch.float64).mul(2).requires_grad_() for _ in range(2)]
    alpha, limit = 1.702, 1.5
    assert (gate > limit).any() and (up.abs() > limit).any()
    dm = torch.randn(64, 24, generator=gen, dtype=torch.float64)
    clamped_glu(gate, up, alpha, limit).backward(dm)
    dgate, dup = torch.empty_like(dm), torch.empty_like(dm)
    clamped_glu_backward(dm, gate.detach(), up.detach(), alpha, limit, dgate, dup)
    torch.testing.assert_close(dgate, gate.grad)
    torch.testing.assert_close(dup, up.grad)


def test_its_all_linear_is_the_attention_and_it_has_no_transformers_4_names(model_factory):
    """As PEFT 0.21 on transformers 5: ``all-linear`` is the attention alone (its router no module PEFT adapts, its
    experts left out); ``down_proj``, which names the experts of the models transformers 4 held per expert, names
    nothing here (PEFT: no such module); its experts' parameters take LoRA by ``target_parameters``."""
    model = load_model(model_factory("gpt_oss"), torch.float32, torch.device("cpu"))
    shapes, experts = model.module_shapes(), model.expert_shapes()
    config = for_model(LoraConfig(target_modules="all-linear"), shapes, experts)
    assert config.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"] and not config.target_parameters
    for targets in (["down_proj"], ["router"]):
        with pytest.raises(ValueError, match="target_modules"):
            for_model(LoraConfig(target_modules=targets), shapes, experts)
    config = for_model(LoraConfig(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]), shapes,
                       experts)
    assert config.target_parameters == ["experts.gate_up_proj"]


def test_its_gate_up_loras_rows_are_read_and_written_in_pefts_interleaved_order():
    """PEFT's ``lora_B`` of gpt-oss's gate/up has gate's and up's rows alternating; coserve holds gate's then up's,
    and writes them back as they came."""
    from coserve.peft.expert_lora import b_from_peft, b_to_peft
    experts, out, r = 3, 8, 2
    b = torch.arange(out * r * experts, dtype=torch.float32).reshape(out, r * experts)
    ours = b_from_peft(b, experts, interleaved=True)
    plain = b_from_peft(b, experts)
    assert torch.equal(ours[:, :out // 2], plain[:, 0::2]) and torch.equal(ours[:, out // 2:], plain[:, 1::2])
    assert torch.equal(b_to_peft(ours, interleaved=True), b)


def test_gpt_oss_20bs_config_reads_as_transformers_reads_it():
    """The fields of gpt-oss-20b's config.json (transformers 4.55's spelling, its MXFP4 quantization config beside
    them): every other layer sliding over 128 positions, YaRN by 32 over 4,096 untruncated, 32 experts 4 a token, the
    output projection's bias, SwiGLU clamped at 7."""
    from transformers import GptOssConfig

    from coserve.model.config import ModelConfig
    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}
    cfg = ModelConfig.from_dict(raw)
    hf = GptOssConfig.from_dict({k: v for k, v in raw.items() if k != "quantization_config"})
    assert cfg.attention_windows == tuple(128 if kind == "sliding_attention" else None for kind in hf.layer_types)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size) == (32, 4, 2880)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("yarn", 32.0, 150000.0)
    assert cfg.rope.original_max_position_embeddings == 4096 and not cfg.rope.truncate
    assert cfg.o_bias and cfg.qkv_bias and cfg.attn_sinks and (cfg.glu_alpha, cfg.glu_limit) == (1.702, 7.0)
    assert (cfg.q_size, cfg.kv_size) == (64 * 64, 8 * 64)


def test_the_clamped_swiglu_gives_each_row_the_same_bits_whatever_the_row_count():
    """An expert's call holds as many rows as were routed to it, a co-served window's among them: each row's gated
    unit must not depend on how many rows are beside it (as ``moe_mlp`` calls it, on the halves of one gate/up
    buffer, 88 wide as the tiny model's)."""
    gen = torch.Generator().manual_seed(1)
    gu = torch.randn(40, 2 * 88, generator=gen)
    alone = [clamped_glu(*gu[:rows].chunk(2, dim=-1), 1.702, 0.25) for rows in range(1, 41)]
    for rows, out in enumerate(alone, start=1):
        assert torch.equal(out, alone[-1][:rows]), rows


@pytest.mark.parametrize("form", ["causal-chunk", "chunk-after-prefix", "grouped-decode"])
def test_serving_attention_with_sinks_on_the_flash_kernel_is_the_written_out_form(form):
    """A CPU serves attention with sinks by the flash kernel (its output times ``sigmoid(lse - sink)``, no scores
    held), the written-out form being what autograd runs: the two agree on a prompt's chunk, a chunk after a
    prefix, and a CPU's grouped decode (the K/V heads' query heads as rows)."""
    from coserve.model.attention import explicit_attention
    from coserve.model.forward_batch import causal_mask
    gen = torch.Generator().manual_seed(2)
    sinks = (0.5, -1.0, 2.0, 0.0)
    if form == "grouped-decode":  # 3 sequences, 2 K/V heads of 2 query heads each, 7 keys (the last 2 of one masked)
        q, k, v = (torch.randn(*s, generator=gen) for s in ((3, 2, 2, 8), (3, 2, 7, 8), (3, 2, 7, 8)))
        mask = torch.ones(3, 1, 1, 7, dtype=torch.bool)
        mask[1, ..., 5:] = False
        kwargs = {"attn_mask": mask, "scale": 0.35}
    else:
        p = 0 if form == "causal-chunk" else 4
        q, k, v = (torch.randn(*s, generator=gen) for s in ((1, 4, 5, 8), (1, 2, 5 + p, 8), (1, 2, 5 + p, 8)))
        kwargs = ({"is_causal": True} if not p else {"attn_mask": causal_mask(5, p, q.device)}) | {
            "scale": 0.35, "enable_gqa": True}
    with torch.no_grad():
        served = explicit_attention(q, k, v, sinks=sinks, **kwargs)
    written = explicit_attention(q.requires_grad_(), k, v, sinks=sinks, **kwargs)  # under autograd: written out
    torch.testing.assert_close(served, written.detach(), atol=1e-6, rtol=1e-5)
