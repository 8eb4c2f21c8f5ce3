"""The sliding layers' KV blocks of a model whose layers mix sliding windows with whole-context attention (Gemma 2
and 3; Qwen with ``max_window_layers``): plain integers, no torch.

The whole-context layers keep a block of the main pool for every position a sequence holds (``BlockManager``). The
sliding layers need a position's K/V only while some query still reads it: those layers keep theirs in a smaller
pool of their own, one *storage* per main block that a running sequence reads within its window. The attention maps
a main block to its storage (``PagedKVCache``'s ``window_of``, fed from ``changes``). A storage whose main block
nobody reads any longer is freed, or, where the main block is in the prefix cache, kept (idle) for a later request
with that prefix, until a storage is wanted and none is free (the longest idle goes first).
"""

from __future__ import annotations

from collections import OrderedDict


class WindowPool:
    """Storages of the sliding layers, each lent to one main block."""

    def __init__(self, num_storages: int) -> None:
        if num_storages <= 0:
            raise ValueError(f"num_storages must be positive, got {num_storages}")
        self.num_storages = num_storages
        self._free: list[int] = list(range(num_storages - 1, -1, -1))
        self.storage_of: dict[int, int] = {}  # main block -> its storage
        self._readers: dict[int, int] = {}  # main block -> sequences reading it within their window (> 0)
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached main blocks with a storage, no reader; oldest first
        self.changes: list[tuple[int, int]] = []  # (main block, storage) lent since the attention last heard

    @property
    def available(self) -> int:
        """Storages a new reader may take: free ones, and idle ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_held(self) -> int:
        """Storages lent to a main block someone reads."""
        return len(self.storage_of) - len(self._idle)

    def has(self, block: int) -> bool:
        """Whether main block ``block`` has its sliding layers' K/V."""
        return block in self.storage_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def read(self, block: int) -> None:
        """One more sequence reads main block ``block`` within its window: it keeps its storage, or is lent one
        (its K/V are about to be written)."""
        n = self._readers.get(block, 0)
        if not n:
            if block in self.storage_of:
                self._idle.pop(block, None)
            else:
                storage = self._take()
                self.storage_of[block] = storage
                self.changes.append((block, storage))
        self._readers[block] = n + 1

    def unread(self, block: int, cached: bool) -> None:
        """A sequence no longer reads ``block`` within its window; with no reader left its storage goes free, or
        idle where the block is ``cached`` (its K/V may serve a later request's prefix)."""
        n = self._readers[block] - 1
        if n:
            self._readers[block] = n
            return
        del self._readers[block]
        if cached:
            self._idle[block] = None
        else:
            self._free.append(self.storage_of.pop(block))

    def forget(self, block: int) -> None:
        """Main block ``block`` left the prefix cache (evicted, or freed): its storage, if any, goes free."""
        if block in self._readers:
            raise ValueError(f"main block {block} is still read within a window")
        self._idle.pop(block, None)
        storage = self.storage_of.pop(block, None)
        if storage is not None:
            self._free.append(storage)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._idle:
            raise RuntimeError("no sliding-layer storage is free or idle")
        block, _ = self._idle.popitem(last=False)
        return self.storage_of.pop(block)

    def drain(self) -> list[tuple[int, int]]:
        """The (main block, storage) pairs lent since the last call."""
        changes, self.changes = self.changes, []
        return changes

    def check_invariants(self, readers: dict[int, int], cached: set[int]) -> None:
        """Assert the pool agrees with ``readers`` (main block -> the sequences whose window spans it) and the
        main pool's ``cached`` blocks (used by tests)."""
        assert self._readers == readers, "readers disagree with the sequences' windows"
        storages = list(self.storage_of.values())
        assert len(set(storages)) == len(storages), "a storage is lent twice"
        assert not set(storages) & set(self._free), "a lent storage is free"
        assert len(storages) + len(self._free) == self.num_storages, "a storage is lost"
        assert set(self._idle) == {b for b in self.storage_of if b not in readers}, "idle is not 'lent, unread'"
        assert set(self._idle) <= cached, "an idle storage's block is not cached"
