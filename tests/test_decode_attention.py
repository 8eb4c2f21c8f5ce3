"""Attention's CUDA forms against the forms CPU runs: decode (K/V heads repeated by the gather, an additive mask made
once per batch; checked on whatever device is here) and prefill chunks in one variable-length call (CUDA)."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("tables", [[3, 1, 0], [[3, 1, 0], [5, 7, 2]]])
def test_gather_lays_the_blocks_of_a_table_end_to_end(tables):
    cache = _cache(torch.device("cpu"))
    tables = torch.tensor(tables)
    k, v = cache.gather(0, tables)
    lead = tuple(tables.shape[:-1])
    assert k.shape == (*lead, tables.shape[-1] * 4, 2, 8)
    blocks = [cache.k[0][b] for b in tables.reshape(-1).tolist()]  # one block at a time, by plain indexing
    assert torch.equal(k.reshape(-1, 2, 8), torch.cat(blocks))
    assert torch.equal(v, cache.v[0][tables].reshape(*lead, -1, 2, 8))


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length kernel is CUDA's")
def test_prefill_chunks_in_one_variable_length_call_equal_one_call_each(monkeypatch):
    """On CUDA every chunk of 2+ tokens (whole prompts, and chunks after a cached prefix) attends in one call."""
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(3)
    chunks = [SequenceChunk(0, 5, 5, [0, 1]), SequenceChunk(5, 6, 7, [2, 3]),  # a prompt, a decode token
              SequenceChunk(6, 9, 10, [4, 5, 6]), SequenceChunk(9, 11, 2, [7])]  # after a prefix of 7, a prompt
    q = torch.randn(11, 6, 8, generator=g).to(device)
    k, v = torch.randn(11, 2, 8, generator=g).to(device), torch.randn(11, 2, 8, generator=g).to(device)
    outs = []
    for varlen in (True, False):
        monkeypatch.setattr(attention, "VARLEN_PREFILL", varlen)
        cache = _cache(device)
        batch = build_forward_batch([[1] * (c.end - c.start) for c in chunks], chunks, cache.block_size, [4], device)
        outs.append(attention.paged_attention(q, k, v, 0, cache, batch, 0.35))
        assert (batch.prefill is not None) == varlen
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
