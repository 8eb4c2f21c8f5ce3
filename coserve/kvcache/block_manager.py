"""Fixed-size KV blocks and per-sequence block tables (plain integers; no torch here)."""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than there are."""


class BlockManager:
    """Hands out KV-cache blocks to sequences.

    A sequence holding ``n`` tokens owns ``ceil(n / block_size)`` blocks, listed in
    position order in its block table. Blocks are never shared between sequences.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free blocks are a stack: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_of(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_of(seq_id))

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; returns the new block ids.

        Allocates nothing and raises OutOfBlocks when there are too few free blocks.
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"{seq_id}: needs {need} blocks, {len(self._free)} free")
        new = [self._free.pop() for _ in range(need)]
        self._tables.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: str) -> int:
        """Return all of ``seq_id``'s blocks to the pool; returns how many. Unknown ids free nothing."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of ``seq_id``'s blocks in position order."""
        return list(self._tables.get(seq_id, ()))

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def check_invariants(self) -> None:
        """Assert no block is lost, duplicated, or owned twice (used by tests)."""
        owned = [b for table in self._tables.values() for b in table]
        every = owned + self._free
        assert len(every) == self.num_blocks, f"{len(every)} blocks accounted for, {self.num_blocks} exist"
        assert sorted(every) == list(range(self.num_blocks)), "a block is duplicated or out of range"
