"""Decode attention's CUDA form (K/V heads repeated by the gather, an additive mask made once per batch) against the
form CPU runs (grouped heads, a boolean mask): the same outputs, on whatever device is here."""

from __future__ import annotations

import torch

from coserve.model import attention
from coserve.model.attention import PagedKVCache
from coserve.model.forward_batch import SequenceChunk, build_forward_batch


def _cache(device, num_blocks=12, block_size=4, kv_heads=2, dim=8):
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, dim, device, torch.float32)
    g = torch.Generator(device="cpu").manual_seed(0)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    return cache


def test_gather_repeated_repeats_each_kv_head_for_its_query_heads():
    cache = _cache(torch.device("cpu"))
    tables = torch.tensor([[3, 1, 0], [5, 7, 2]])
    k, v = cache.gather(0, tables)  # [2, 12, Hkv, D]
    kr, vr = cache.gather_repeated(0, tables, num_heads=6)
    assert kr.shape == (2, 12, 6, 8)
    assert torch.equal(kr, k.repeat_interleave(3, dim=2)) and torch.equal(vr, v.repeat_interleave(3, dim=2))


def test_the_cuda_decode_form_equals_the_cpu_form():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = _cache(device)
    chunks = [SequenceChunk(0, 1, 9, [3, 1, 0]), SequenceChunk(1, 2, 7, [5, 7]), SequenceChunk(2, 3, 6, [2, 4])]
    batch = build_forward_batch([[1], [2], [3]], chunks, cache.block_size, [0, 1, 2], device)
    [group] = batch.single_groups
    q = torch.randn(3, 6, 8, generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    cuda_form = attention._single_token_attention_cuda(q, 0, cache, group, 0.35)
    k, v = cache.gather(0, group.block_tables)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.valid, scale=0.35,
        enable_gqa=True).squeeze(2)
    torch.testing.assert_close(cuda_form, reference, rtol=1e-5, atol=1e-5)
    assert group.bias is not None and group.bias.stride(-2) % 16 == 0  # made once, aligned for the kernel
