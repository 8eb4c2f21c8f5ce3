"""Paged attention over a flat batch: write new K/V into the cache, attend to each sequence's own prefix."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from coserve.model.attention_spec import AttentionSpec
from coserve.model.row_invariant import elementwise_sigmoid
from coserve.model.forward_batch import (ForwardBatch, SequenceChunk, SingleTokenGroup, VarlenKeys, causal_mask,
                                         long_tensor)

#: The attention kernels coserve lets ``scaled_dot_product_attention`` choose from. cuDNN's
#: (which torch picks first for bfloat16/float16 on an H100) builds a graph for every new shape,
#: about 90 ms each measured on an H100; an engine sees new shapes all the time (every prompt
#: length, every context length): with it, bf16 prefill of the generation benchmark ran at
#: 1,520 tokens/s on an H100, without it at 29,900.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

EFFICIENT_CAUSAL_FROM_BOTTOM_RIGHT = 2  # the memory-efficient kernel's ``custom_mask_type`` for chunks after a prefix


def sdpa(q: torch.Tensor, *args, softcap: float | None = None, sinks: tuple[float, ...] | None = None,
         **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to :data:`SDPA_BACKENDS` on CUDA (elsewhere there is no cuDNN
    kernel to keep out, and entering the restriction costs ~11 us a call on this CPU, per layer per iteration); with
    ``softcap`` (Gemma 2's) or ``sinks`` (gpt-oss's), ``explicit_attention``."""
    if softcap is not None or sinks is not None:
        return explicit_attention(q, *args, softcap=softcap, sinks=sinks, **kwargs)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, *args, **kwargs)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, *args, **kwargs)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                       is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                       softcap: float | None = None, sinks: tuple[float, ...] | None = None) -> torch.Tensor:
    """Attention written out in torch, ``scaled_dot_product_attention``'s arguments (a boolean ``attn_mask``): the
    scaled scores soft-capped, ``cap * tanh(s / cap)``, before the mask (Gemma 2, as HF's eager attention); each query
    head's sink logit a last column of the softmax, dropped after it (gpt-oss, as HF's eager attention). The softmax
    in float32. K/V heads shared by several query heads are repeated. ``q`` ``[..., Hq, n, D]``; under a CPU's
    grouped decode, ``[D, Hkv, Hq // Hkv, Dh]`` with K/V ``[D, Hkv, L, Dh]``: its sinks then by K/V head and
    group. Sinks without a cap on a CPU, where autograd records nothing (serving), run on the flash kernel instead
    (``_flash_with_sinks``): no scores held."""
    if sinks is not None and softcap is None and not q.is_cuda and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):  # the kernel's lse takes no grad
        return _flash_with_sinks(q, k, v, attn_mask, is_causal, scale, sinks)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        attn_mask = causal_mask(q.shape[-2], k.shape[-2] - q.shape[-2], q.device)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = _sinks_by_row(sinks, q).unsqueeze(-1)
    combined = torch.cat([scores.float(), sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.matmul(torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype), v)


def _flash_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                      is_causal: bool, scale: float | None, sinks: tuple[float, ...]) -> torch.Tensor:
    """``explicit_attention`` with sinks on a CPU, by the flash kernel (no scores held): its output times what each
    row's sink leaves of the softmax, ``sigmoid(lse - sink)`` (element by element as a softmax, so that a row's bits
    do not depend on the rows beside it)."""
    mask = None
    if attn_mask is not None:
        mask = torch.zeros(attn_mask.shape, device=q.device, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask,
                                                                         scale=scale)
    return out * elementwise_sigmoid(lse.float() - _sinks_by_row(sinks, q)).unsqueeze(-1).to(out.dtype)


def _sinks_by_row(sinks: tuple[float, ...], q: torch.Tensor) -> torch.Tensor:
    """The sink logit of each of ``q``'s heads and rows, ``[heads, 1]`` (``q`` ``[..., Hq, n, D]``), or ``[Hkv, G]``
    under a CPU's grouped decode (``q`` ``[D, Hkv, G, Dh]``, the K/V heads' query heads as rows)."""
    heads = q.shape[-3]
    return sink_logits(sinks, q.device).view(heads, -1 if heads != len(sinks) else 1)


@functools.lru_cache(maxsize=256)
def sink_logits(sinks: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A layer's sink logits ``[Hq]`` in float32 on ``device``, made once."""
    return torch.tensor(sinks, dtype=torch.float32, device=device)


class PagedKVCache:
    """Per-layer K and V block pools: ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    K is stored after RoPE, so attention never re-rotates the prefix.

    With ``window_storages``, the ``window_layers`` (sliding layers beside whole-context ones) keep theirs in a
    smaller pool of their own, ``[window_storages + 1, ...]`` (the last a scratch storage never lent): a main block's
    K/V in those layers live at storage ``window_of[block]`` (``kvcache/window_pool.py`` lends them; ``map_window``
    records each loan). Batches keep naming main blocks; reads and writes of those layers go through the map.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype, window_layers: tuple[int, ...] = (),
                 window_storages: int = 0) -> None:
        self.windowed = frozenset(window_layers) if window_storages else frozenset()

        def pool(layer: int) -> torch.Tensor:
            n = window_storages + 1 if layer in self.windowed else num_blocks
            return torch.zeros((n, block_size, num_kv_heads, head_dim), device=device, dtype=dtype)

        self.k = [pool(i) for i in range(num_layers)]
        self.v = [pool(i) for i in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        # main block -> its storage in the window layers' pools (the scratch storage until one is lent)
        self.window_of = (torch.full((num_blocks,), window_storages, dtype=torch.long, device=device)
                          if self.windowed else None)

    def map_window(self, pairs: list[tuple[int, int]]) -> None:
        """Record storages lent to main blocks: ``(block, storage)`` pairs, in order (a later one wins)."""
        if pairs and self.window_of is not None:
            blocks, storages = zip(*dict(pairs).items())  # (a block lent twice keeps its last: one write each)
            self.window_of[long_tensor(blocks, self.window_of.device)] = long_tensor(storages, self.window_of.device)

    def _blocks(self, layer: int, blocks: torch.Tensor, memo: dict | None) -> torch.Tensor:
        """``blocks`` as layer ``layer``'s pool indexes them: through ``window_of`` for a window layer (made once per
        forward where ``memo``, the batch's, is given)."""
        if layer not in self.windowed:
            return blocks
        return _memoised(memo, blocks, lambda: self.window_of[blocks])

    def _slots(self, layer: int, slots: torch.Tensor, memo: dict | None) -> torch.Tensor:
        if layer not in self.windowed:
            return slots
        bs = self.block_size
        return _memoised(memo, slots, lambda: self.window_of[slots // bs] * bs + slots % bs)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Memory one block takes over all layers, K and V."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, memo: dict | None = None
              ) -> None:
        """Store ``k``/``v`` ``[T, Hkv, D]`` at flat ``slots`` ``[T]``."""
        slots = self._slots(layer, slots, memo)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        self.k[layer].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)

    def gather_repeated(self, layer: int, blocks: torch.Tensor, num_heads: int, memo: dict | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the blocks ``blocks`` ``[..., nb]`` as ``[..., nb * block_size, num_heads, Dh]``, each K/V head
        repeated for the ``num_heads // Hkv`` query heads it serves (as HF's ``repeat_kv``), in one gather each."""
        blocks = self._blocks(layer, blocks, memo)
        k, v = (_gather_heads_repeated(pool, blocks, num_heads) for pool in (self.k[layer], self.v[layer]))
        return k.flatten(-4, -3), v.flatten(-4, -3)

    def gather(self, layer: int, block_table: torch.Tensor, memo: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the blocks ``block_table`` ``[..., nb]`` as ``[..., nb * block_size, Hkv, D]``.

        ``index_select`` copies whole blocks; advanced indexing (``pool[block_table]``) computes an offset per
        element and on CPU took 3.6x as long for the same copy (48 against 13 us for 150 blocks of the
        ``small`` preset, 2-core AMD EPYC): most of a decode step's attention time."""
        index = self._blocks(layer, block_table, memo).reshape(-1)
        lead = block_table.shape[:-1]
        k, v = (pool[layer].index_select(0, index) for pool in (self.k, self.v))
        return (k.view(*lead, -1, k.shape[-2], k.shape[-1]),
                v.view(*lead, -1, v.shape[-2], v.shape[-1]))


def _memoised(memo: dict | None, key: torch.Tensor, make) -> torch.Tensor:
    """``make()``, kept in ``memo`` under ``key``'s identity (the batch's tensors live as long as its memo)."""
    if memo is None:
        return make()
    hit = memo.get(id(key))
    if hit is None or hit[0] is not key:
        hit = memo[id(key)] = (key, make())
    return hit[1]


def _gather_heads_repeated(pool: torch.Tensor, index: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``pool[index]`` for a pool ``[N, ..., Hkv, Dh]``, each of its K/V heads repeated for the query heads it serves
    (``[*index.shape, ..., num_heads, Dh]``), in one gather: the repeat is a stride-0 view until indexed."""
    kv_heads, dim = pool.shape[-2:]
    repeated = pool.unsqueeze(-2).expand(*pool.shape[:-1], num_heads // kv_heads, dim)[index]
    return repeated.flatten(-3, -2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, cache: PagedKVCache,
                    batch: ForwardBatch, spec: AttentionSpec) -> torch.Tensor:
    """Causal attention of each chunk's queries over its sequence's cached keys and values, as the layer's ``spec``
    says (its sliding window; its soft cap, which needs the batch laid out per chunk, not ``varlen``).

    Args:
        q: ``[T, Hq, D]`` rotated queries of the new tokens.
        k, v: ``[T, Hkv, D]`` rotated keys and values of the new tokens; written into ``cache``.

    Returns:
        ``[T, Hq * D]`` attention outputs in row order.
    """
    memo = batch.window_maps
    cache.write(layer, batch.slot_mapping, k, v, memo)
    window = spec.window
    if batch.varlen is not None:
        if spec.explicit:
            raise ValueError("paged_attention: a soft cap or sinks need the batch laid out per chunk "
                             "(build_forward_batch(..., varlen=False))")
        return _varlen_attention(q, layer, cache, batch.varlen, spec, memo).reshape(q.shape[0], -1)
    out = torch.empty_like(q)
    for group in batch.single_groups:
        out[group.rows] = _single_token_attention(q[group.rows], layer, cache, group, spec, memo)
    for chunk in batch.multi_chunks:  # a whole prompt (or its first chunk): causal over its own rows
        kc, vc = k[chunk.start:chunk.end], v[chunk.start:chunk.end]
        if window is not None and _in_pieces(chunk.num_new, chunk.num_new, window):
            _sliding_pieces(q, kc, vc, chunk, window, spec, out)
            continue
        mask = _windowed_mask(chunk.num_new, 0, window, q.device) if window is not None else None
        _chunk_attention(q, kc, vc, chunk, mask, spec, out)
    for pc in batch.prefixed_chunks:  # a later prefill chunk: over the cached prefix and itself
        if window is None:
            table, keys, mask = pc.block_table, pc.chunk.context_len, pc.mask
        else:  # from the block of its first query's first key
            table, keys, mask = pc.within(window, cache.block_size)
        kc, vc = cache.gather(layer, table, memo)
        if window is not None and _in_pieces(pc.chunk.num_new, keys, window):
            _sliding_pieces(q, kc[:keys], vc[:keys], pc.chunk, window, spec, out)
            continue
        _chunk_attention(q, kc[:keys], vc[:keys], pc.chunk, mask, spec, out)
    return out.reshape(q.shape[0], -1)


@functools.lru_cache(maxsize=8)
def _windowed_mask(n: int, p: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The mask of ``n`` queries after ``p`` cached positions under a sliding ``window`` (``causal_mask``), or None
    where the window reaches back past the first position (plain causal attention); kept for the batch's other
    layers (the same sizes come back in every layer of a forward)."""
    if window is None or p + n <= window:
        return None
    return causal_mask(n, p, device, window)


def _varlen_attention(q: torch.Tensor, layer: int, cache: PagedKVCache, keys: VarlenKeys, spec: AttentionSpec,
                      memo: dict | None = None) -> torch.Tensor:
    """Every chunk in one variable-length call of the memory-efficient kernel (CUDA), causal from the bottom right
    (query ``i`` of a chunk after a prefix of ``p`` sees keys ``<= p + i``; a decode token sees its whole context),
    under a sliding window the last ``window`` of them (the kernel's ``window_size``: keys ``> p + i - window``).
    Keys and values: the chunks' blocks gathered whole with their heads repeated (the kernel wants as many K/V heads
    as query heads), each chunk reading its first ``seqlen_k`` slots. Each (chunk, head, block of queries) is one
    thread block over that chunk's keys alone, so a row's result does not depend on the chunks beside it. Returns
    ``[T, Hq, D]``."""
    k, v = cache.gather_repeated(layer, keys.blocks, q.shape[1], memo)  # [B * block_size, Hq, D]
    o = torch.ops.aten._efficient_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, keys.cu_q, keys.cu_k, keys.max_q, keys.max_k, 0.0,
        EFFICIENT_CAUSAL_FROM_BOTTOM_RIGHT, False, scale=spec.scale, seqlen_k=keys.seqlen_k,
        window_size=spec.window)[0]  # [1, T, Hq, D]
    return o[0]


def _chunk_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunk: SequenceChunk,
                     mask: torch.Tensor | None, spec: AttentionSpec, out: torch.Tensor) -> None:
    """One chunk's queries over keys/values ``[L, Hkv, D]``: causal without ``mask``, else as it says."""
    qc = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    o = sdpa(qc, kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0),
             attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=True, softcap=spec.softcap,
             sinks=spec.sinks)
    out[chunk.start:chunk.end] = o[0].transpose(0, 1)


# A sliding layer's long chunk attends in pieces of this many queries, each over its own keys within the window
# (``_sliding_pieces``): a 2,000-token prompt under a 128-token window took 17.5 against 59.4 ms a layer on a 2-core
# Xeon (the ``small`` preset's 8 heads of 64, 4 K/V heads; the whole chunk masked to the window against pieces of 256).
SLIDING_PIECE = 256


def _in_pieces(n: int, keys: int, window: int) -> bool:
    """Whether a chunk of ``n`` queries over ``keys`` keys (its own last) attends in pieces: it is longer than a
    piece, and a piece's keys (its own and the window before it) are fewer than the chunk's."""
    return n > SLIDING_PIECE and SLIDING_PIECE + window - 1 < keys


def _sliding_pieces(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, chunk: SequenceChunk, window: int,
                    spec: AttentionSpec, out: torch.Tensor) -> None:
    """A sliding layer's chunk whose queries are the last ``chunk.num_new`` of keys ``kc``/``vc`` ``[L, Hkv, D]``,
    ``SLIDING_PIECE`` queries at a time, each piece over the keys from its first query's first key within the
    window to its last query's own: the scores shrink from the whole chunk's to a piece's window."""
    n, keys = chunk.num_new, kc.shape[0]
    for a in range(0, n, SLIDING_PIECE):
        b = min(n, a + SLIDING_PIECE)
        last = keys - n + b  # one past the piece's last query's own key
        first = max(0, keys - n + a - window + 1)
        piece = SequenceChunk(chunk.start + a, chunk.start + b, last, [])
        mask = causal_mask(b - a, keys - n + a - first, q.device, window)
        _chunk_attention(q, kc[first:last], vc[first:last], piece, mask, spec, out)


def _single_token_attention(q: torch.Tensor, layer: int, cache: PagedKVCache, group: SingleTokenGroup,
                            spec: AttentionSpec, memo: dict | None = None) -> torch.Tensor:
    """A group of one-token chunks at once: ``q`` ``[D, Hq, Dh]`` over padded gathered prefixes.

    On a CPU the query heads that share a K/V head are that head's rows of queries (``[D, Hkv, Hq // Hkv, Dh]``;
    query head ``i`` reads K/V head ``i // (Hq // Hkv)``, as HF's ``repeat_kv``), so the kernel reads each K/V
    head once rather than a copy per query head (``enable_gqa``): 157 against 342 us for 10 sequences of 400
    tokens of ``small``, 1.05 against 2.08 ms for 40 of 512 (2-core Zen 4). CUDA (decode graphs, the tests'
    per-chunk forms) keeps ``enable_gqa``: the grouped form is not yet measured there."""
    tables, valid = group.within(spec.window, cache.block_size)  # under a window, its blocks alone
    kc, vc = cache.gather(layer, tables, memo)  # [D, L, Hkv, Dh]
    k, v = kc.transpose(1, 2), vc.transpose(1, 2)  # [D, Hkv, L, Dh]
    if q.is_cuda:  # [D, Hq, 1, Dh]
        return sdpa(q.unsqueeze(2), k, v, attn_mask=valid, scale=spec.scale, enable_gqa=True,
                    softcap=spec.softcap, sinks=spec.sinks).squeeze(2)
    d, hq, dh = q.shape
    grouped = q.view(d, k.shape[1], hq // k.shape[1], dh)  # [D, Hkv, Hq // Hkv, Dh]
    return sdpa(grouped, k, v, attn_mask=valid, scale=spec.scale, softcap=spec.softcap,
                sinks=spec.sinks).reshape(d, hq, dh)
