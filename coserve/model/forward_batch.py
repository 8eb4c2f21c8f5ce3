"""The flat, unpadded batch that one model forward call takes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SequenceChunk:
    """One sequence's new tokens in the flat batch: rows ``[start, end)`` of every ``[T, ...]`` tensor."""

    start: int  # first row of this chunk in the flat batch
    end: int  # one past its last row
    context_len: int  # tokens of the sequence in the cache once this chunk is written (prefix + chunk)
    block_table: list[int]  # the sequence's KV blocks, in position order

    @property
    def num_new(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class ForwardBatch:
    """Token ids and everything attention needs, for several sequences at once.

    Each sequence contributes a chunk of new tokens that attends to its own cached
    prefix: a decode token (chunk of 1) and prefill chunks of any size mix freely.
    """

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, position of each token in its own sequence
    slot_mapping: torch.Tensor  # [T] long, flat KV-cache slot (block * block_size + offset) per token
    chunks: list[SequenceChunk]  # one per sequence, in row order
    logits_rows: torch.Tensor  # [N] long, rows whose next-token logits are wanted
    adapter_scale: torch.Tensor | None = None  # [T, max_loras] LoRA scaling per token and slot (0 = unused)
    # Derived once per batch for the batched single-token path (see attention.py).
    single_rows: torch.Tensor | None = field(default=None)  # [D] rows of the 1-token chunks
    single_block_tables: torch.Tensor | None = field(default=None)  # [D, max_blocks] long
    single_context_lens: torch.Tensor | None = field(default=None)  # [D] long
    multi_chunks: list[SequenceChunk] = field(default_factory=list)  # chunks of 2+ tokens

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_forward_batch(chunks_tokens: list[list[int]], chunks: list[SequenceChunk], block_size: int,
                        logits_rows: list[int], device: torch.device,
                        adapter_scale: torch.Tensor | None = None) -> ForwardBatch:
    """Assemble a ForwardBatch from per-sequence token lists and chunk descriptions."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for tokens, chunk in zip(chunks_tokens, chunks):
        first = chunk.context_len - chunk.num_new
        for pos in range(first, chunk.context_len):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        token_ids.extend(tokens)
    singles = [c for c in chunks if c.num_new == 1]
    batch = ForwardBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        chunks=chunks,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        adapter_scale=adapter_scale,
        multi_chunks=[c for c in chunks if c.num_new > 1],
    )
    if singles:
        max_blocks = max(len(c.block_table) for c in singles)
        tables = [c.block_table + [0] * (max_blocks - len(c.block_table)) for c in singles]
        batch.single_rows = torch.tensor([c.start for c in singles], dtype=torch.long, device=device)
        batch.single_block_tables = torch.tensor(tables, dtype=torch.long, device=device)
        batch.single_context_lens = torch.tensor([c.context_len for c in singles], dtype=torch.long,
                                                 device=device)
    return batch
