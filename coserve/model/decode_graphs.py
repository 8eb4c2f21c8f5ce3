"""CUDA graphs of the decode forward: a decode-only iteration replays one recorded graph instead of launching a few
hundred kernels from Python.

On a GPU a decode step of a small model is bound by the host: measured on an H100 (``small``, float32, 64
requests), 365 kernel launches took 9.8 ms while the GPU worked 1.7 ms. vLLM records the decode forward as CUDA
graphs for a set of batch sizes; so does coserve, for iterations whose chunks are all single tokens with no
adapter and no finetuning window sharing the forward (those run eagerly, as before).

A graph is recorded per (rows, seqs, blocks): ``rows``, the row count of its matmul calls, is the eager forward's
(``DecoderModel.padded_rows``: whole GEMM tiles where tiles are on) rounded up to a power of two (of tiles);
``seqs``, the rows that run attention, is the batch's size rounded up to a power of two (the other rows are zero
there, as in the eager forward); ``blocks``, the KV blocks each of them gathers, is the longest sequence's count
rounded up to the next of 4, 6, 8, 12, 16, 24, ... A row's result does not depend on the rows beside it where the
engine's matmuls are batch-invariant (the probe at start: ``batch_invariance.py``), so a replay gives the eager
forward's outputs bit for bit (tested on CUDA). Rows past the batch (up to ``seqs``) are dummies: token 0 at
position 0, writing its K/V to a scratch block that the block manager never hands out, attending to that slot
alone. ``record_all`` records every bucket at engine start (as vLLM captures its graphs), into one memory pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from coserve.model.attention import PagedKVCache
from coserve.model.decoder import DecoderModel
from coserve.model import forward_batch
from coserve.model.forward_batch import ForwardBatch, SequenceChunk, SingleTokenGroup, VarlenKeys, long_tensor
from coserve.model.rope import rope_row

MIN_GRAPH_BLOCKS = 4  # the smallest block bucket (a power of two)


def block_bucket(blocks: int, max_blocks: int) -> int:
    """The blocks a graph gathers for sequences of up to ``blocks`` blocks: the first of 4, 6, 8, 12, 16, 24, ...
    (steps of at most 1.5x, so that padding costs at most half the gather) that covers them, and at most the bucket
    that covers ``max_blocks``."""
    for size in _block_buckets(max_blocks):
        if size >= blocks:
            break
    return size


def _block_buckets(upto: int):
    """4, 6, 8, 12, 16, 24, ... up to the first that reaches ``upto``."""
    b = MIN_GRAPH_BLOCKS
    while True:
        for size in (b, b * 3 // 2):
            yield size
            if size >= upto:
                return
        b *= 2


def row_bucket(rows: int, unit: int) -> int:
    """A graph's row count for an eager call of ``rows`` rows (a multiple of ``unit``): ``unit`` times a power of
    two."""
    b = unit
    while b < rows:
        b *= 2
    return b


@dataclass(slots=True)
class _Graph:
    rows: int  # the matmuls' rows
    seqs: int  # the rows that run attention (the others are padding, zero there, as in the eager forward)
    blocks: int
    inputs: torch.Tensor  # [4 * seqs + seqs * blocks] long on the device: tokens, positions, slots, lengths, tables
    host: torch.Tensor  # the same, pinned on the host (filled, then copied in one transfer)
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # [rows, H] final hidden states, written by each replay
    copied: torch.cuda.Event | None = None  # recorded after the last transfer out of ``host``


class DecodeGraphs:
    """Recorded decode forwards for one model and KV cache (the last block of ``cache`` is the scratch block)."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {model.device}")
        self.model = model
        self.cache = cache
        self.scratch_block = cache.num_blocks - 1
        self.unit = model.gemm_tile_rows or 1  # eager call sizes are multiples of this
        self.max_num_seqs = max_num_seqs  # the most requests an iteration runs
        self.max_seqs = row_bucket(max_num_seqs, 1)  # the most rows a graph attends for
        self.max_blocks = max_blocks_per_seq
        self.graphs: dict[tuple[int, int, int], _Graph] = {}  # by (rows, seqs, blocks)
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # forwards served by a graph (tests and benchmarks read it)

    def covers_lengths(self, chunks) -> bool:
        """Whether a graph may run these inference chunks (anything with ``token_ids``): all single tokens, no more
        of them than the engine runs at once."""
        return bool(chunks) and len(chunks) <= self.max_num_seqs and all(len(c.token_ids) == 1 for c in chunks)

    def _fits(self, seqs: int, blocks: int) -> bool:
        """Whether a graph gathering ``blocks`` blocks for each of ``seqs`` rows gathers no more than the KV cache
        holds (its gathered K/V live in the graphs' memory pool; a batch past that runs eagerly)."""
        return seqs * blocks <= self.cache.num_blocks

    def forward(self, token_ids: list[int], chunks: list[SequenceChunk], min_rows: int) -> torch.Tensor | None:
        """``model.forward`` of single-token ``chunks`` (``token_ids``, one each) padded to ``min_rows`` rows: their
        final hidden states ``[len(chunks), H]`` (a view of the graph's output, valid until the next replay), or None
        where no graph fits (the caller runs the eager forward)."""
        t = len(chunks)
        rows = row_bucket(max(min_rows, self.model.padded_rows(t)), self.unit)
        seqs = row_bucket(t, 1)
        bs = self.cache.block_size
        blocks = block_bucket(max(-(-c.context_len // bs) for c in chunks), self.max_blocks)
        if not self._fits(seqs, blocks):
            return None
        g = self.graphs.get((rows, seqs, blocks))
        if g is None:
            g = self.graphs[(rows, seqs, blocks)] = self._record(rows, seqs, blocks)
        self._load(g, token_ids, chunks)
        g.graph.replay()
        self.replays += 1
        return g.out[:t]

    def record_all(self) -> float:
        """Record a graph for every (rows, seqs, blocks) bucket a batch can fall in; returns the seconds it took."""
        start = time.perf_counter()
        seqs = 1
        while seqs <= self.max_seqs:
            rows = row_bucket(self.model.padded_rows(seqs), self.unit)  # as forward() finds for (seqs/2, seqs]
            for blocks in _block_buckets(self.max_blocks):
                if (rows, seqs, blocks) not in self.graphs and self._fits(seqs, blocks):
                    self.graphs[(rows, seqs, blocks)] = self._record(rows, seqs, blocks)
            seqs *= 2
        return time.perf_counter() - start

    def _load(self, g: _Graph, token_ids: list[int], chunks: list[SequenceChunk]) -> None:
        seqs, blocks, t, bs = g.seqs, g.blocks, len(chunks), self.cache.block_size
        scratch = self.scratch_block
        positions = [c.context_len - 1 for c in chunks]
        slots = [c.block_table[p // bs] * bs + p % bs for c, p in zip(chunks, positions)]
        positions = [rope_row(p, c.long_rope, self.model.long_rope_from) for c, p in zip(chunks, positions)]
        tables: list[int] = []
        for c in chunks:
            table = c.block_table[:blocks]
            tables += table + [scratch] * (blocks - len(table))
        pad = seqs - t
        values = (token_ids + [0] * pad + positions + [0] * pad + slots + [scratch * bs] * pad
                  + [c.context_len for c in chunks] + [1] * pad + tables + [scratch] * (pad * blocks))
        # the transfer is asynchronous: two loads with no synchronisation between them (chunks run again one by one
        # after a failed forward, each replaying the same graph) would rewrite the pinned buffer under the last
        # transfer, which the device may not have made yet: the likely cause of wrong tokens seen on an H200 there
        if g.copied is not None:
            g.copied.synchronize()
        g.host.copy_(long_tensor(values, g.host.device))
        g.inputs.copy_(g.host, non_blocking=True)
        if g.copied is None:
            g.copied = torch.cuda.Event()
        g.copied.record()

    def _record(self, rows: int, seqs: int, blocks: int) -> _Graph:
        device = self.model.device
        size = 4 * seqs + seqs * blocks
        g = _Graph(rows, seqs, blocks, torch.zeros(size, dtype=torch.long, device=device),
                   torch.zeros(size, dtype=torch.long).pin_memory())
        # every row a dummy while recording: only the scratch block is written
        self._load(g, [], [])  # rows of token 0, position 0, the scratch slot, length 1
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up (kernels' workspaces, the allocator) off the capture
                self._static_forward(g)
        torch.cuda.current_stream(device).wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = self._static_forward(g)
        return g

    def _static_forward(self, g: _Graph) -> torch.Tensor:
        """The forward a graph records: attention laid out as the eager forward lays out a batch on CUDA (one
        variable-length call, here over ``blocks`` blocks a row, of which it reads its context; or the decode group,
        padded to ``blocks``, where ``CUDA_VARLEN`` is off), so that a replay rounds as the eager forward does."""
        seqs, blocks, bs = g.seqs, g.blocks, self.cache.block_size
        device = g.inputs.device
        tokens, positions, slots, lengths, tables = g.inputs.split([seqs, seqs, seqs, seqs, seqs * blocks])
        batch = ForwardBatch(token_ids=tokens, positions=positions, slot_mapping=slots, chunks=[],
                             logits_rows=tokens[:0])
        if forward_batch.CUDA_VARLEN:
            starts = torch.arange(seqs + 1, device=device, dtype=torch.int32)
            batch.varlen = VarlenKeys(blocks=tables, cu_q=starts, cu_k=starts * (blocks * bs),
                                      seqlen_k=lengths.to(torch.int32), max_q=1, max_k=blocks * bs)
        else:
            span = torch.arange(blocks * bs, device=device)
            batch.single_groups = [SingleTokenGroup(
                rows=torch.arange(seqs, device=device), block_tables=tables.view(seqs, blocks), context_lens=lengths,
                valid=(span.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :])]
        return self.model.forward(batch, self.cache, None, min_rows=g.rows)
