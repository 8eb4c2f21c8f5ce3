"""Attention's CUDA form against the forms CPU runs: every chunk of a batch in one variable-length call over its
blocks, K/V heads repeated by the gather (the layout checked anywhere, the kernel on CUDA)."""

from __future__ import annotations

import pytest
import torch

from coserve.model import attention
from coserve.model.attention import PagedKVCache
from coserve.model.attention_spec import AttentionSpec
from coserve.model import forward_batch
from coserve.model.forward_batch import SequenceChunk, build_forward_batch, varlen_keys


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
    flat, _ = cache.gather_repeated(0, tables.reshape(-1), num_heads=6)  # a flat list of blocks: end to end
    assert torch.equal(flat, kr.reshape(-1, 6, 8))


# Decode tokens, a whole prompt, a chunk after a cached prefix, a speculative chunk (a token and two drafts).
_MIXED = [SequenceChunk(0, 1, 9, [3, 1, 0]), SequenceChunk(1, 6, 5, [4, 6]), SequenceChunk(6, 7, 6, [2, 8]),
          SequenceChunk(7, 10, 11, [5, 7, 9]), SequenceChunk(10, 13, 8, [10, 11])]


def test_varlen_keys_lay_each_chunk_s_blocks_end_to_end():
    keys = varlen_keys(_MIXED, 4, torch.device("cpu"))
    assert keys.blocks.tolist() == [3, 1, 0, 4, 6, 2, 8, 5, 7, 9, 10, 11]  # the blocks covering each context
    assert keys.cu_q.tolist() == [0, 1, 6, 7, 10, 13]
    assert keys.cu_k.tolist() == [0, 12, 20, 28, 40, 48]  # whole blocks
    assert keys.seqlen_k.tolist() == [9, 5, 6, 11, 8]
    assert (keys.max_q, keys.max_k) == (5, 11)
    assert keys.cu_q.dtype == keys.cu_k.dtype == keys.seqlen_k.dtype == torch.int32
    empty = varlen_keys([], 4, torch.device("cpu"))  # no inference rows (a finetuning window's forward alone)
    assert empty.cu_q.tolist() == empty.cu_k.tolist() == [0] and (empty.max_q, empty.max_k) == (0, 0)
    with pytest.raises(ValueError, match="in order"):
        varlen_keys([_MIXED[1], _MIXED[0]], 4, torch.device("cpu"))


def test_the_varlen_layout_gives_the_attention_of_the_per_chunk_forms():
    """What the variable-length kernel computes from ``VarlenKeys`` (each chunk's first ``seqlen_k`` gathered keys,
    causal from the bottom right), written out in plain attention, equals the CPU forms' output."""
    device = torch.device("cpu")
    g = torch.Generator(device="cpu").manual_seed(5)
    rows = _MIXED[-1].end
    q, k, v = torch.randn(rows, 6, 8, generator=g), torch.randn(rows, 2, 8, generator=g), torch.randn(rows, 2, 8,
                                                                                                    generator=g)
    cache = _cache(device)
    batch = build_forward_batch([[1] * c.num_new for c in _MIXED], _MIXED, cache.block_size, [0], device)
    expected = attention.paged_attention(q, k, v, 0, cache, batch, AttentionSpec(0.35)).view(rows, 6, 8)
    keys = varlen_keys(_MIXED, cache.block_size, device)
    kg, vg = cache.gather_repeated(0, keys.blocks, 6)  # [B * block_size, Hq, D], K/V written above
    for i, c in enumerate(_MIXED):
        start, n = keys.cu_k[i].item(), keys.seqlen_k[i].item()
        kc, vc = kg[start:start + n].transpose(0, 1), vg[start:start + n].transpose(0, 1)  # [Hq, n, D]
        sees = torch.arange(n).unsqueeze(0) <= torch.arange(c.num_new).unsqueeze(1) + (n - c.num_new)
        out = torch.nn.functional.scaled_dot_product_attention(q[c.start:c.end].transpose(0, 1), kc, vc,
                                                               attn_mask=sees, scale=0.35)
        torch.testing.assert_close(out.transpose(0, 1), expected[c.start:c.end], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the variable-length kernel is CUDA's")
def test_one_variable_length_call_equals_the_per_chunk_forms(monkeypatch):
    """On CUDA every chunk (decode tokens, prompts, chunks after a prefix, drafts) attends in one call."""
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(3)
    rows = _MIXED[-1].end
    q = torch.randn(rows, 6, 8, generator=g).to(device)
    k, v = torch.randn(rows, 2, 8, generator=g).to(device), torch.randn(rows, 2, 8, generator=g).to(device)
    outs = []
    for varlen in (True, False):
        monkeypatch.setattr(forward_batch, "CUDA_VARLEN", varlen)
        cache = _cache(device)
        batch = build_forward_batch([[1] * c.num_new for c in _MIXED], _MIXED, cache.block_size, [4], device)
        assert (batch.varlen is not None) == varlen and bool(batch.single_groups) != varlen
        outs.append(attention.paged_attention(q, k, v, 0, cache, batch, AttentionSpec(0.35)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 4, 5, 9, 40])
def test_a_sliding_layer_reads_only_the_blocks_of_its_window(window):
    """Decode tokens and prompt chunks after a prefix, under a sliding window: the CPU forms gather only the blocks
    holding each query's last ``window`` positions (``SingleTokenGroup.within``, ``PrefixedChunk.within``), and give
    the attention a plain masked softmax over the whole context gives (contexts shorter and longer than the window,
    on and off block boundaries)."""
    torch.manual_seed(0)
    cache = PagedKVCache(1, 40, 4, 2, 8, torch.device("cpu"), torch.float32)
    cache.k[0].normal_()
    cache.v[0].normal_()
    spec = AttentionSpec(scale=8 ** -0.5, window=window)
    lengths, news = [23, 16, 5, 17, 7, 24], [1, 1, 1, 1, 3, 6]  # decode tokens, then two chunks after a prefix
    chunks, row, block = [], 0, 0
    for n, new in zip(lengths, news):
        nb = -(-n // 4)
        chunks.append(SequenceChunk(row, row + new, n, list(range(block, block + nb))[::-1]))
        row, block = row + new, block + nb
    batch = build_forward_batch([[0] * c.num_new for c in chunks], chunks, 4, [], torch.device("cpu"), varlen=False)
    assert len(batch.prefixed_chunks) == 2 and sum(len(g.rows) for g in batch.single_groups) == 4
    full = max(-(-n // 4) for n in lengths[:4])
    gathered = [g.within(window, 4)[0].shape[1] for g in batch.single_groups]
    assert all(w <= min(full, -(-window // 4) + 1) for w in gathered)
    q = torch.randn(row, 4, 8)
    keys = torch.randn(row, 2, 8)  # the new tokens' K/V (written into their slots first)
    out = attention.paged_attention(q, keys, keys, 0, cache, batch, spec).view(row, 4, 8)
    for c in chunks:  # one query at a time, over its whole context, masked to its window
        k = cache.k[0][c.block_table].reshape(-1, 2, 8)[:c.context_len].repeat_interleave(2, dim=1)
        v = cache.v[0][c.block_table].reshape(-1, 2, 8)[:c.context_len].repeat_interleave(2, dim=1)
        for i in range(c.num_new):
            p = c.context_len - c.num_new + i
            seen = torch.arange(c.context_len)
            allowed = (seen <= p) & (seen > p - window)
            scores = torch.einsum("hd,khd->hk", q[c.start + i], k) * spec.scale
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            torch.testing.assert_close(out[c.start + i], torch.einsum("hk,khd->hd", weights, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [5, 100, 300])
def test_a_sliding_layer_attends_a_long_chunk_in_pieces_as_one_masked_softmax_does(window):
    """A long prompt (or its first chunk) and a long chunk after a prefix, under a sliding window: queries in pieces
    of ``SLIDING_PIECE``, each over its own window's keys (``_sliding_pieces``), give what one masked softmax over
    the whole context gives."""
    torch.manual_seed(1)
    bs = 16
    cache = PagedKVCache(1, 128, bs, 2, 8, torch.device("cpu"), torch.float32)
    cache.k[0].normal_()
    cache.v[0].normal_()
    spec = AttentionSpec(scale=8 ** -0.5, window=window)
    first = SequenceChunk(0, 700, 700, list(range(0, 44)))  # a whole prompt
    after = SequenceChunk(700, 1300, 900, list(range(44, 101))[::-1])  # 600 tokens after 300 cached
    batch = build_forward_batch([[0] * 700, [0] * 600], [first, after], bs, [], torch.device("cpu"), varlen=False)
    keys_after = batch.prefixed_chunks[0].within(window, bs)[1]
    assert attention._in_pieces(700, 700, window) and attention._in_pieces(600, keys_after, window)
    q, kv = torch.randn(1300, 4, 8), torch.randn(1300, 2, 8)
    out = attention.paged_attention(q, kv, kv, 0, cache, batch, spec).view(1300, 4, 8)
    for c in (first, after):
        k = cache.k[0][c.block_table].reshape(-1, 2, 8)[:c.context_len].repeat_interleave(2, dim=1)
        v = cache.v[0][c.block_table].reshape(-1, 2, 8)[:c.context_len].repeat_interleave(2, dim=1)
        positions = torch.arange(c.context_len - c.num_new, c.context_len).unsqueeze(1)
        seen = torch.arange(c.context_len).unsqueeze(0)
        allowed = (seen <= positions) & (seen > positions - window)
        scores = torch.einsum("qhd,khd->hqk", q[c.start:c.end], k) * spec.scale
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        want = torch.einsum("hqk,khd->qhd", weights, v)
        torch.testing.assert_close(out[c.start:c.end], want, atol=1e-5, rtol=0)
