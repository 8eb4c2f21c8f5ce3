"""Rotary embeddings: the rotation is HF's bit for bit, and the finetuning backward's transpose of it is autograd's."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from coserve.finetune.pruned_layer import _rope_backward_into
from coserve.model.config import RopeConfig
from coserve.model.rope import RotaryEmbedding


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

    class Model:  # what _rope_backward_into reads of a model
        pass

    model = Model()
    model.rope = rope
    out = torch.empty_like(dy)
    _rope_backward_into(model, dy, positions, out)
    assert torch.equal(out, x.grad)
