"""The flat, unpadded batch that one model forward call takes."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from coserve.model.rope import rope_row


def long_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long, device=device)`` for Python ints, through an ``array`` of int64:
    about 3.5x faster (``torch.tensor`` checks every element; 12,000 block ids took 644 us against 176 here), and a
    batch builds a few of these for every request at every step."""
    buf = values if isinstance(values, array) else array("q", values)
    if not buf:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(buf, dtype=torch.long).to(device)  # on the CPU the tensor keeps ``buf`` alive


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's new tokens in the flat batch: rows ``[start, end)`` of every ``[T, ...]`` tensor."""

    start: int  # first row of this chunk in the flat batch
    end: int  # one past its last row
    context_len: int  # tokens of the sequence in the cache once this chunk is written (prefix + chunk)
    block_table: list[int]  # the sequence's KV blocks, in position order
    long_rope: bool = False  # the sequence is past LongRoPE's original context: every token rotates by the long
    #   factors (``rope_row``)

    @property
    def num_new(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class SingleTokenGroup:
    """One-token chunks of similar context length, attended in one padded call."""

    rows: torch.Tensor  # [D] rows of these chunks in the flat batch
    block_tables: torch.Tensor  # [D, max_blocks] long, padded with block 0
    context_lens: torch.Tensor  # [D] long
    valid: torch.Tensor  # [D, 1, 1, max_blocks * block_size] bool: the gathered positions each chunk attends to
    lengths: tuple[int, ...] = ()  # the context lengths on the host (none in a decode graph's group)
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # window -> ``within``'s

    def within(self, window: int | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks each chunk's query reads and which of their positions it attends to (``[D, nb]``, ``[D, 1, 1,
        nb * block_size]``): under a sliding ``window`` only the blocks that hold its last ``window`` positions (the
        gather and the scores shrink from the context to the window), else the whole table; made once a batch. A
        decode graph's group (no host ``lengths``) keeps its whole table, masked to the window."""
        if window is None:
            return self.block_tables, self.valid
        hit = self.windowed.get(window)
        if hit is not None:
            return hit
        device, max_blocks = self.block_tables.device, self.block_tables.shape[1]
        firsts = [max(0, n - window) // block_size for n in self.lengths]
        width = max((-(-n // block_size) - f for n, f in zip(self.lengths, firsts)), default=max_blocks)
        if width >= max_blocks:  # nothing to skip: the whole table, masked to the window
            positions = torch.arange(max_blocks * block_size, device=device)
            recent = positions.unsqueeze(0) >= (self.context_lens - window).unsqueeze(1)
            hit = self.windowed[window] = (self.block_tables, self.valid & recent[:, None, None, :])
            return hit
        index = (long_tensor(firsts, device).unsqueeze(1) + torch.arange(width, device=device))  # [D, width]
        tables = self.block_tables.gather(1, index.clamp(max=max_blocks - 1))  # (past a row's end: masked below)
        positions = (index.unsqueeze(2) * block_size + torch.arange(block_size, device=device)).flatten(1)
        lens = self.context_lens.unsqueeze(1)
        valid = (positions < lens) & (positions >= lens - window)
        hit = self.windowed[window] = (tables, valid[:, None, None, :])
        return hit


@dataclass(slots=True)
class PrefixedChunk:
    """A chunk of 2+ tokens after a cached prefix, with what its attention reads in every layer, built once per
    batch (on a GPU each tensor built from a list is a host-to-device copy)."""

    chunk: SequenceChunk
    block_table: torch.Tensor  # [blocks covering context_len] long
    mask: torch.Tensor  # [num_new, context_len] bool: row i sees positions <= prefix + i
    windowed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=dict)  # ``within``'s

    def within(self, window: int, block_size: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Under a sliding ``window``: the blocks from the one holding the first query's first key on, how many of
        their positions the keys run to, and the mask of the queries over those keys (made once a batch)."""
        hit = self.windowed.get(window)
        if hit is None:
            n, context = self.chunk.num_new, self.chunk.context_len
            first = max(0, context - n - window + 1) // block_size
            skipped = first * block_size
            hit = self.windowed[window] = (self.block_table[first:], context - skipped,
                                           causal_mask(n, context - n - skipped, self.mask.device, window))
        return hit


def causal_mask(n: int, p: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """``[n, p + n]`` bool: whether query ``i`` (position ``p + i``) attends to key ``j``: ``j <= p + i``, and
    within a sliding ``window`` also ``j > p + i - window`` (the last ``window`` positions, its own included, as
    transformers' sliding-window masks have it)."""
    rows = torch.arange(n, device=device).unsqueeze(1) + p
    keys = torch.arange(p + n, device=device).unsqueeze(0)
    allowed = keys <= rows
    return allowed if window is None else allowed & (keys > rows - window)


@dataclass(slots=True)
class VarlenKeys:
    """Every chunk of a batch (decode tokens, prompt chunks, chunks after a cached prefix) for one variable-length
    attention call on CUDA: the KV blocks each chunk attends to, whole, chunk after chunk, and where each chunk's
    queries and keys start. A chunk's keys are the first ``seqlen_k`` of its blocks' slots: its context, up to and
    including its own new tokens (written into the cache before attention)."""

    blocks: torch.Tensor  # [B] long: chunk after chunk, the blocks covering its context
    cu_q: torch.Tensor  # [C + 1] int32: where each chunk's rows start in the flat batch
    cu_k: torch.Tensor  # [C + 1] int32: where each chunk's keys start among the gathered blocks' slots
    seqlen_k: torch.Tensor  # [C] int32: each chunk's context length
    max_q: int  # the longest chunk
    max_k: int  # the longest context


def varlen_keys(chunks: list[SequenceChunk], block_size: int, device: torch.device) -> VarlenKeys:
    """``VarlenKeys`` of ``chunks``, which must cover the batch's rows in order from row 0."""
    blocks = array("q")
    cu_q, cu_k, lengths = array("i", [0]), array("i", [0]), array("i")
    for c in chunks:
        if c.start != cu_q[-1]:
            raise ValueError(f"chunks must cover the rows in order: a chunk starts at row {c.start}, "
                             f"not {cu_q[-1]}")
        nb = -(-c.context_len // block_size)
        blocks.extend(c.block_table[:nb])
        cu_q.append(c.end)
        cu_k.append(cu_k[-1] + nb * block_size)
        lengths.append(c.context_len)
    ints = torch.frombuffer(cu_q + cu_k + lengths, dtype=torch.int32).to(device)  # one copy to the device
    n = len(chunks) + 1
    return VarlenKeys(long_tensor(blocks, device), ints[:n], ints[n:2 * n], ints[2 * n:],
                      max((c.num_new for c in chunks), default=0), max((c.context_len for c in chunks), default=0))


# On CUDA a batch is laid out for one variable-length attention call over every chunk (``VarlenKeys``): per layer,
# one gather of K and one of V and one kernel, where the per-length decode groups and prompt chunks took a few
# calls each (``benchmarks/mixed_step.py``, ``medium`` bfloat16 on an H200, 48 decode tokens and a 256-token prompt
# chunk: 1,463 against 2,650 aten operators, 16.4 against 46.3 ms a forward). False: the groups and chunks, as on
# CPU (tests compare the two).
CUDA_VARLEN = True


# A group of one-token chunks takes sequences down to this fraction of its longest context, so that padding adds
# about a tenth at most to the attention work while the number of calls stays small. On the CPU a group's K/V is
# gathered and then read by the attention kernel, so a smaller group also stays in cache between the two. With decode
# attention reading each K/V head once (``attention._single_token_attention``), 32 decoding requests of `small` with
# contexts of 64-1,400 tokens took 40.1, 42.7, 44.9 and 61.8 ms a step (medians) at 0.9 against 44.0, 44.7, 48.0
# and 61.4 at 0.75 (four runs, the ratios alternating step by step in one engine; 2-core Zen 4); at 0.5 56.2 ms, at
# 1.0 (equal lengths only) 48.3 against 44.1 at 0.95. Greedy tokens do not depend on it; logprobs not bit for bit
# (a row's padded length changes how the kernel blocks its keys).
GROUP_LENGTH_RATIO = 0.9


@dataclass(slots=True)
class ForwardBatch:
    """Token ids and everything attention needs, for several sequences at once.

    Each sequence contributes a chunk of new tokens that attends to its own cached
    prefix: a decode token (chunk of 1) and prefill chunks of any size mix freely.
    """

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, each token's row of the rotary tables: its position in its own sequence
    #   (``rope_row``: LongRoPE's long rows follow the short ones)
    slot_mapping: torch.Tensor  # [T] long, flat KV-cache slot (block * block_size + offset) per token
    chunks: list[SequenceChunk]  # one per sequence, in row order
    logits_rows: torch.Tensor  # [N] long, rows whose next-token logits are wanted
    # Derived once per batch for attention (see attention.py): on CUDA ``varlen`` alone, elsewhere the rest.
    varlen: VarlenKeys | None = None  # every chunk, for one variable-length call (CUDA)
    single_groups: list[SingleTokenGroup] = field(default_factory=list)  # 1-token chunks, by length
    multi_chunks: list[SequenceChunk] = field(default_factory=list)  # chunks of 2+ tokens without a prefix
    prefixed_chunks: list[PrefixedChunk] = field(default_factory=list)  # chunks of 2+ tokens after a prefix
    window_maps: dict = field(default_factory=dict)  # a window pool's block and slot maps, made once a forward
    #   (``PagedKVCache``; every sliding layer reads the same)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_forward_batch(chunks_tokens: list[list[int]], chunks: list[SequenceChunk], block_size: int,
                        logits_rows: list[int], device: torch.device, varlen: bool = True,
                        long_rope_from: int | None = None) -> ForwardBatch:
    """Assemble a ForwardBatch from per-sequence token lists and chunk descriptions; ``varlen`` False lays it out
    per chunk on CUDA too (a model whose attention caps its scores: ``paged_attention`` caps those);
    ``long_rope_from``: the model's LongRoPE original context where its rotary tables have long rows
    (``DecoderModel.long_rope_from``)."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for tokens, chunk in zip(chunks_tokens, chunks):
        first = chunk.context_len - chunk.num_new
        shift = rope_row(0, chunk.long_rope, long_rope_from)  # the same for every token of the chunk
        for pos in range(first, chunk.context_len):
            positions.append(pos + shift)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        token_ids.extend(tokens)
    batch = ForwardBatch(token_ids=long_tensor(token_ids, device), positions=long_tensor(positions, device),
                         slot_mapping=long_tensor(slots, device), chunks=chunks,
                         logits_rows=long_tensor(logits_rows, device))
    if device.type == "cuda" and CUDA_VARLEN and varlen:
        batch.varlen = varlen_keys(chunks, block_size, device) if chunks else None  # none: a window's forward alone
        return batch
    singles = sorted((c for c in chunks if c.num_new == 1), key=lambda c: -c.context_len)
    batch.single_groups = [_group(g, block_size, device) for g in _split_by_length(singles)]
    batch.multi_chunks = [c for c in chunks if c.num_new > 1 and c.context_len == c.num_new]
    batch.prefixed_chunks = [_prefixed(c, block_size, device) for c in chunks
                             if c.num_new > 1 and c.context_len > c.num_new]
    return batch


def _prefixed(chunk: SequenceChunk, block_size: int, device: torch.device) -> PrefixedChunk:
    nb = -(-chunk.context_len // block_size)
    return PrefixedChunk(chunk, long_tensor(chunk.block_table[:nb], device),
                         causal_mask(chunk.num_new, chunk.context_len - chunk.num_new, device))


def _split_by_length(singles: list[SequenceChunk]) -> list[list[SequenceChunk]]:
    """Cut chunks sorted by descending context length into groups of similar length."""
    groups: list[list[SequenceChunk]] = []
    for c in singles:
        if groups and c.context_len >= GROUP_LENGTH_RATIO * groups[-1][0].context_len:
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _group(chunks: list[SequenceChunk], block_size: int, device: torch.device) -> SingleTokenGroup:
    max_blocks = -(-chunks[0].context_len // block_size)  # the first is the longest
    tables = array("q")  # [D, max_blocks], flat
    for c in chunks:
        table = c.block_table[:max_blocks]
        tables.extend(table)
        if len(table) < max_blocks:
            tables.extend([0] * (max_blocks - len(table)))
    context_lens = long_tensor([c.context_len for c in chunks], device)
    positions = torch.arange(max_blocks * block_size, device=device)
    return SingleTokenGroup(
        rows=long_tensor([c.start for c in chunks], device),
        block_tables=long_tensor(tables, device).view(len(chunks), max_blocks), context_lens=context_lens,
        valid=(positions.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :],
        lengths=tuple(c.context_len for c in chunks))
