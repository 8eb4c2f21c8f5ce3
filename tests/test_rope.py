"""Rotary embeddings: the rotation is HF's bit for bit, and the finetuning backward's transpose of it is autograd's."""

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary

from coserve.model.config import ModelConfig, RopeConfig
from coserve.model.rope import RotaryEmbedding, rope_row, sequence_rows


def hf_tables(positions: torch.Tensor, head_dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own cos and sin ``[T, D]`` (float32) for ``positions``, from its Llama rotary embedding."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=10000.0,
                         max_position_embeddings=64)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_hfs_bit_for_bit(dtype):
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 16, 64, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 7, 8, 40, 63])
    q = torch.randn(6, 4, 16, generator=g).to(dtype)
    k = torch.randn(6, 2, 16, generator=g).to(dtype)
    cos, sin = (t.to(dtype) for t in hf_tables(positions))
    assert torch.equal(cos, rope.cos[positions])  # the same table, so that the rotations can be compared bit for bit
    # HF's layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    q_ours, k_ours = rope(q, k, positions)
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1))
    assert torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_backward_of_the_rotation_is_autograds():
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 16, 64, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(5, 13)
    x = torch.randn(8, 3, 16, generator=g, requires_grad=True)
    dy = torch.randn(8, 3, 16, generator=g)
    cos, sin = hf_tables(positions)
    half = 8
    hf = x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]
    hf.backward(dy)

    out = torch.empty_like(dy)
    rope.rotate_backward(dy, positions, out)
    assert torch.equal(out, x.grad)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},  # Qwen2.5/3's long contexts
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},  # DeepSeek's attention factor
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.25},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_yarn_is_hfs_bit_for_bit(scaling, dtype):
    """YaRN's frequencies and attention factor against transformers' own Llama rotary embedding: the tables and
    the rotations bit for bit, in float32 and bfloat16."""
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "rope_scaling": dict(scaling)}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope.rope_type == "yarn"
    hf_rope = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    positions = torch.tensor([0, 1, 7, 15, 16, 40, 100, 255])
    cos, sin = hf_rope(torch.zeros(1, dtype=dtype), positions[None])
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 256, torch.device("cpu"), dtype)
    assert torch.equal(rope.cos[positions], cos[0])
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(8, 4, 16, generator=g).to(dtype), torch.randn(8, 2, 16, generator=g).to(dtype)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = rope(q, k, positions)
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1)) and torch.equal(k_ours, k_hf[0].transpose(0, 1))


def test_yarn_needs_its_factor():
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 16}}
    with pytest.raises(ValueError, match="field 'rope_scaling': yarn needs 'factor'"):
        ModelConfig.from_dict(raw)


def phi3_config(rope_scaling: dict | None, partial: float) -> dict:
    """A small Phi-3 config.json (head_dim 16) with ``partial_rotary_factor`` and, optionally, LongRoPE."""
    raw = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "original_max_position_embeddings": 64, "partial_rotary_factor": partial}
    if rope_scaling is not None:
        raw["rope_scaling"] = dict(rope_scaling)  # a copy: transformers writes into the one it is given
    return raw


LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [4.0, 5.0, 6.0, 7.0]}


@pytest.mark.parametrize("scaling,partial", [(None, 0.5), (LONGROPE, 0.5), ({**LONGROPE, "short_factor": [1.0, 1.1, 1.3,
                                                                                                          1.7, 2.0, 2.6,
                                                                                                          3.0, 4.0],
                                                                              "long_factor": [2.0] * 8}, 1.0)])
def test_phi3_partial_rotation_and_longrope_are_hfs_bit_for_bit(scaling, partial):
    """Phi-3's rotation of the first dimensions of each head (``partial_rotary_factor``), with LongRoPE's short factors
    and attention factor within the original context, against transformers' own Phi-3 rotary embedding."""
    raw = phi3_config(scaling, partial)
    cfg = ModelConfig.from_dict(raw)
    hf_cfg = Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 64, torch.device("cpu"), torch.float32, cfg.rotary_dim)
    assert rope.rotary_dim == int(16 * partial)
    positions = torch.tensor([0, 3, 7, 8, 40, 63])
    cos, sin = Phi3RotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    assert torch.equal(rope.cos[positions], cos[0])
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    q_hf, k_hf = phi3_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = rope(q, k, positions)
    assert torch.equal(q_ours, q_hf[0].transpose(0, 1)) and torch.equal(k_ours, k_hf[0].transpose(0, 1))
    x = q.clone().requires_grad_()
    dy = torch.randn(6, 4, 16, generator=g)
    phi3_rotary(x.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)[0][0].transpose(0, 1).backward(dy)
    out = torch.empty_like(dy)
    rope.rotate_backward(dy, positions, out)
    assert torch.allclose(out, x.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("partial", [0.5, 1.0])
def test_longrope_long_rows_are_hfs_past_the_original_context(partial):
    """Past the original context (64 positions) transformers rotates a whole forward by the long factors: coserve's
    long rows (``rope_row``) are its tables bit for bit, for a prompt's forward (every token) and for a decode step
    at or past position 64; a forward within 64 keeps to the short rows."""
    scaling = LONGROPE if partial == 0.5 else {**LONGROPE, "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.6, 3.0, 4.0],
                                               "long_factor": [2.0, 3.0, 5.0, 8.0, 9.0, 11.0, 16.0, 20.0]}
    raw = phi3_config(scaling, partial)
    cfg = ModelConfig.from_dict(raw)
    hf_rope = Phi3RotaryEmbedding(Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"}))
    cpu = torch.device("cpu")
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, 512, cpu, torch.float32, cfg.rotary_dim, cfg.long_rope_from)
    assert cfg.long_rope_from == rope.long_from == 64 and rope.cos.shape[0] == 64 + 512
    g = torch.Generator().manual_seed(3)
    for n in (40, 64, 65, 300):  # one forward over a sequence of n tokens
        cos, sin = hf_rope(torch.zeros(1), torch.arange(n)[None])
        rows = sequence_rows(n, 64, cpu)
        assert rows.tolist() == [rope_row(p, n > 64, 64) for p in range(n)]
        assert torch.equal(rope.cos[rows], cos[0])
        q, k = torch.randn(n, 4, 16, generator=g), torch.randn(n, 2, 16, generator=g)
        q_hf, k_hf = phi3_rotary(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        q_ours, k_ours = rope(q, k, rows)
        assert torch.equal(q_ours, q_hf[0].transpose(0, 1)) and torch.equal(k_ours, k_hf[0].transpose(0, 1))
    for p in (0, 63, 64, 200, 511):  # a decode step: HF's forward of that position (a sequence at 64 or past it
        cos, _ = hf_rope(torch.zeros(1), torch.tensor([[p]]))  # is long: the scheduler computed it again so)
        assert torch.equal(rope.cos[rope_row(p, p >= 64, 64)], cos[0, 0])
    within = RotaryEmbedding(cfg.rope, cfg.head_dim, 64, cpu, torch.float32, cfg.rotary_dim, cfg.long_rope_from)
    assert within.long_from is None and within.cos.shape[0] == 64  # a context kept within 64: no long rows


def test_longrope_needs_both_factors_and_bad_factors_are_named():
    assert ModelConfig.from_dict(phi3_config(LONGROPE, 0.5)).long_rope_from == 64
    assert ModelConfig.from_dict({**phi3_config(LONGROPE, 0.5), "max_position_embeddings": 64}).long_rope_from is None
    with pytest.raises(ValueError, match="longrope's long_factor must be a list of numbers, got None"):
        ModelConfig.from_dict(phi3_config({k: v for k, v in LONGROPE.items() if k != "long_factor"}, 0.5))
    with pytest.raises(ValueError, match="short_factor has 3 values; the model rotates 8 dimensions, so 4"):
        ModelConfig.from_dict(phi3_config({**LONGROPE, "short_factor": [1.0, 2.0, 3.0]}, 0.5))
    with pytest.raises(ValueError, match="long_factor has 5 values; the model rotates 8 dimensions, so 4"):
        ModelConfig.from_dict(phi3_config({**LONGROPE, "long_factor": [1.0] * 5}, 0.5))
    with pytest.raises(ValueError, match="short_factor must be a list of numbers"):
        ModelConfig.from_dict(phi3_config({**LONGROPE, "short_factor": "x"}, 0.5))
    with pytest.raises(ValueError, match="long_factor must be a list of numbers"):
        ModelConfig.from_dict(phi3_config({**LONGROPE, "long_factor": [1, "2", 3, 4]}, 0.5))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.1 leaves 1 of 16"):
        ModelConfig.from_dict(phi3_config(None, 0.1))
    with pytest.raises(ValueError, match="field 'hidden_act': 'gelu'"):
        ModelConfig.from_dict({**phi3_config(None, 1.0), "hidden_act": "gelu"})
