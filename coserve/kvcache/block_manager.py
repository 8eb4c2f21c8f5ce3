"""Fixed-size KV blocks and per-sequence block tables (plain integers; no torch here), with automatic prefix
caching: full blocks are remembered by the content that led to them and shared by later sequences.

A full block's *key* names everything its K/V depend on: the key of the block before it, the tokens in it,
and a salt (the caller's: tenant and adapter). A sequence whose first blocks' keys are cached starts with
those blocks in its table (their reference counts raised) and computes only the rest. A block nobody holds
any longer stays cached, evictable, until a new allocation needs it (least recently freed first). Cached
blocks are full, and no sequence writes a position it has not reached, so a shared block is never written.

Where no layer reads further back than a sliding window, a running sequence gives up its first blocks once every
position in them has left the window (``release_front``): their places in its table read ``RELEASED_BLOCK``.
Where sliding layers sit beside whole-context ones, the main blocks serve the whole-context layers, and the sliding
layers keep K/V only for the blocks some sequence reads within its window, in a pool of their own (``window_pool``;
``cover``, ``uncover_front``).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import accumulate

from coserve.kvcache.window_pool import WindowPool


#: What a released block's place in a table reads: block 0, which attention gathers and masks out as it does the
#: padding of a short table (the cache is zero-initialised and holds only finite K/V, so a masked read adds zero).
RELEASED_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """Raised when an allocation needs more free blocks than there are."""


def block_key(parent: int | None, tokens: tuple[int, ...], salt: str) -> int:
    """The key of a full block holding ``tokens`` after the block keyed ``parent`` (None: the first block)."""
    return hash((parent, salt, tokens))


class BlockManager:
    """Hands out KV-cache blocks to sequences.

    A sequence holding ``n`` tokens owns ``ceil(n / block_size)`` blocks, listed in position order in its
    block table. With ``enable_caching``, full blocks registered under a key (``register``) are shared with
    sequences allocated with that prefix (``match``, then ``allocate(..., prefix=...)``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, window_storages: int = 0,
                 window: int | None = None) -> None:
        """``window``: how far back (positions) a query reads where layers slide: with ``window_storages`` the
        sliding layers' own pool (sliding layers beside whole-context ones), else every layer slides and a sequence
        gives up the main blocks behind it (None: every block is kept to the end)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window is not None and not (isinstance(window, int) and window > 0):
            raise ValueError(f"window must be None or a positive number of positions, got {window!r}")
        if window_storages and window is None:
            raise ValueError("window_storages needs the window its layers slide over")
        self.window = window
        self.windows = WindowPool(window_storages) if window_storages else None
        self._spans: dict[str, list[int]] = {}  # seq -> [lo, hi): places of its table it reads within its window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Free blocks are a stack: the most recently freed block is reused first (warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}  # seq -> how many of its first blocks it has given up (release_front)
        self._refs = [0] * num_blocks  # sequences holding each block
        self._cached: dict[int, int] = {}  # key -> block
        self._key_of: dict[int, int] = {}  # block -> key, for cached blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used, or cached but held by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_of(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - self.num_blocks_of(seq_id))

    @property
    def releases(self) -> bool:
        """Whether sequences give up the blocks behind their window (every layer slides: ``release_front``)."""
        return self.window is not None and self.windows is None

    def held_for(self, start: int, end: int) -> int:
        """Blocks a sequence holds while it computes positions ``[start, end)``: every block up to ``end``, or,
        where it gives up those behind its window, those its first query reads on."""
        return self.blocks_for(end) - (self._window_start(start) if self.releases else 0)

    def most_held(self, num_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` positions holds at once computed a token at a time (its
        decode steps): all of them, or, where it gives up those behind its window, a window's span (``held_for``)."""
        n = self.blocks_for(num_tokens)
        return min(n, self.blocks_for(self.window) + 1) if self.releases else n

    def can_admit(self, seq_id: str, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Whether a sequence can start on ``num_tokens`` known tokens (after a cached ``prefix``): its whole table
        fits the free blocks, or, where it gives up the blocks behind its window, what it holds at once decoding
        (``most_held``; the prefix blocks other sequences hold cost none). Its prompt's chunks are then cut to the
        free blocks (``fit_tokens``)."""
        if not self.releases:
            return self.can_allocate(seq_id, num_tokens, prefix)
        shared = sum(1 for b in prefix if b is not None and self._refs[b] > 0)
        return self.most_held(num_tokens) - shared <= self.num_free_blocks

    def fit_tokens(self, seq_id: str, start: int, n: int, prefix: list[int] = ()) -> int:
        """The most of ``n`` positions from ``start`` that ``seq_id`` can take blocks for from the free ones
        (``allocate``; a sequence not yet allocated: after ``prefix``); 0 if none."""
        table = len(self._tables.get(seq_id, ())) or len(prefix)
        revived = sum(1 for b in prefix if b is not None and self._refs[b] == 0)
        return max(0, min(n, (table + self.num_free_blocks - revived) * self.block_size - start))

    def can_allocate(self, seq_id: str, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Whether ``allocate(seq_id, num_tokens, prefix)`` would succeed."""
        return self._cost(seq_id, num_tokens, prefix) <= self.num_free_blocks

    def _cost(self, seq_id: str, num_tokens: int, prefix) -> int:
        """Free blocks an allocation takes: new ones, and cached prefix blocks it revives from the evictable."""
        if not prefix:
            return self.blocks_needed(seq_id, num_tokens)
        return max(0, self.blocks_for(num_tokens) - len(prefix)) + sum(1 for b in prefix
                                                                       if b is not None and self._refs[b] == 0)

    def match(self, keys: list[int]) -> list[int | None]:
        """The cached blocks of the longest run of ``keys`` from the first (empty without caching); with a window
        pool, cut to the longest run whose last blocks within the window have their sliding layers' K/V (the first
        position after the run reads them). Where every layer slides, the longest prefix whose last window is
        cached, the places before it None (no layer reads them: the sequence starts without them)."""
        if self.releases:
            return self._match_window(keys)
        out = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            out.append(block)
        if self.windows is None or not out:
            return out
        missing = [0, *accumulate(0 if self.windows.has(b) else 1 for b in out)]
        for cut in range(len(out), 0, -1):
            if missing[cut] == missing[self._window_start(cut * self.block_size)]:
                return out[:cut]
        return []

    def _match_window(self, keys: list[int]) -> list[int | None]:
        found = [self._cached.get(key) for key in keys]
        missing = [0, *accumulate(1 if b is None else 0 for b in found)]
        for cut in range(len(found), 0, -1):
            first = self._window_start(cut * self.block_size)
            if missing[cut] == missing[first]:
                return [None] * first + found[first:cut]
        return []

    def _window_start(self, position: int) -> int:
        """The first place (block index) a query at ``position`` reads within the window (0 with no window)."""
        return 0 if self.window is None else max(0, (position - self.window + 1) // self.block_size)

    def allocate(self, seq_id: str, num_tokens: int, prefix: list[int] = ()) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; returns the new block ids. ``prefix`` (from
        ``match``, for a sequence that holds no blocks yet) becomes the start of its table, shared; its None places
        (behind a window) are given up from the start.

        Allocates nothing and raises OutOfBlocks when there are too few free blocks.
        """
        cost = self._cost(seq_id, num_tokens, prefix)
        if cost > self.num_free_blocks:
            raise OutOfBlocks(f"{seq_id}: needs {cost} blocks, {self.num_free_blocks} free")
        table = self._tables.setdefault(seq_id, [])
        if prefix:
            if table:
                raise ValueError(f"{seq_id}: a cached prefix can only start an empty block table")
            behind = sum(1 for b in prefix if b is None)
            if any(b is None for b in prefix[behind:]):
                raise ValueError(f"{seq_id}: a prefix's places behind its window must come first")
            for b in prefix[behind:]:
                if self._refs[b] == 0:
                    del self._evictable[b]
                self._refs[b] += 1
            table.extend([RELEASED_BLOCK] * behind + list(prefix[behind:]))
            if behind:
                self._released[seq_id] = behind
        new = [self._take() for _ in range(self.blocks_needed(seq_id, num_tokens))]
        for b in new:
            self._refs[b] = 1
        table.extend(new)
        return new

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._key_of.pop(block)]
        if self.windows is not None:
            self.windows.forget(block)
        return block

    def register(self, seq_id: str, index: int, key: int) -> None:
        """Remember ``seq_id``'s full block ``index`` under ``key`` (nothing without caching, or when another
        block already holds that content)."""
        if not self.enable_caching or key in self._cached:
            return
        block = self._tables[seq_id][index]
        if block in self._key_of or index < self._released.get(seq_id, 0):
            return
        self._cached[key] = block
        self._key_of[block] = key

    def free(self, seq_id: str) -> int:
        """Release all of ``seq_id``'s blocks; returns how many it still held. Unknown ids free nothing. Cached
        blocks stay cached until reused, its last blocks first in line."""
        span = self._spans.pop(seq_id, None)
        if span is not None:
            self._unread(self._tables[seq_id], span[0], span[1])
        table = self._tables.pop(seq_id, [])
        held = table[self._released.pop(seq_id, 0):]
        for b in reversed(held):
            self._drop(b)
        return len(held)

    # ---- sliding windows --------------------------------------------------------
    def pass_window(self, seq_id: str, position: int) -> None:
        """``seq_id``'s next query is at ``position``: the places wholly behind its window are no longer read, so
        their blocks are given up (every layer slides) or their sliding layers' storages let go (a window pool);
        nothing without a window. (Called once the prefix cache has registered the blocks.)"""
        if self.window is None:
            return
        count = self._window_start(position)
        if self.releases:
            self.release_front(seq_id, count)
        else:
            self.uncover_front(seq_id, count)

    def window_places(self, start: int, end: int) -> tuple[int, int]:
        """The places a chunk of positions ``[start, end)`` reads within the window: its queries' keys."""
        return self._window_start(start), self.blocks_for(end)

    def can_cover(self, seq_id: str, lo: int, hi: int, prefix: list[int] = ()) -> bool:
        """Whether ``cover(seq_id, lo, hi)`` will find storages for the places it adds (a sequence not yet
        allocated: its table will start with ``prefix``, then new blocks)."""
        if self.windows is None:
            return True
        table = self._tables.get(seq_id) or list(prefix)
        span = self._spans.get(seq_id)
        need = revive = 0
        for i in range(max(lo, span[1]) if span else lo, hi):
            block = table[i] if i < len(table) else None
            if block is None or not self.windows.has(block):
                need += 1
            elif self.windows.is_idle(block):
                revive += 1
        return need <= self.windows.available - revive

    def covers(self, seq_id: str, hi: int) -> bool:
        """Whether ``seq_id`` already reads every place below ``hi`` it will read (true without a window pool)."""
        if self.windows is None:
            return True
        span = self._spans.get(seq_id)
        return span is not None and span[1] >= hi

    def cover(self, seq_id: str, lo: int, hi: int) -> None:
        """``seq_id`` reads places ``[lo, hi)`` of its table within its window from now on (its next chunk's keys):
        the places it adds are lent storages (or keep theirs), the places before ``lo`` it no longer reads."""
        if self.windows is None:
            return
        table = self._tables[seq_id]
        if hi > len(table):
            raise ValueError(f"{seq_id}: covers place {hi - 1} of a table of {len(table)}")
        span = self._spans.setdefault(seq_id, [lo, lo])
        self.uncover_front(seq_id, lo)
        for i in range(span[1], hi):
            self.windows.read(table[i])
        span[1] = max(span[1], hi)

    def uncover_front(self, seq_id: str, count: int) -> None:
        """``seq_id`` no longer reads its first ``count`` places within its window."""
        span = self._spans.get(seq_id)
        if span is None or count <= span[0]:
            return
        self._unread(self._tables[seq_id], span[0], min(count, span[1]))
        span[0] = count
        span[1] = max(span[1], count)

    def _unread(self, table: list[int], lo: int, hi: int) -> None:
        for i in range(lo, hi):
            self.windows.unread(table[i], table[i] in self._key_of)

    def drain_window_changes(self) -> list[tuple[int, int]]:
        """The (main block, storage) pairs lent since the last call, for the attention's map."""
        return self.windows.drain() if self.windows is not None else []

    def release_front(self, seq_id: str, count: int) -> int:
        """Give up ``seq_id``'s first ``count`` blocks (those not given up already), which no position it will
        compute reads (under a sliding window); their places in its table then read ``RELEASED_BLOCK``. The table
        keeps its length: later positions keep their blocks, and growing it counts every position. Returns how
        many blocks this freed."""
        table = self._tables.get(seq_id)
        done = self._released.get(seq_id, 0)
        if table is None or count <= done:
            return 0
        count = min(count, len(table))
        for i in range(done, count):
            self._drop(table[i])
            table[i] = RELEASED_BLOCK
        self._released[seq_id] = count
        return count - done

    def num_released(self, seq_id: str) -> int:
        """How many of ``seq_id``'s first blocks it has given up (``release_front``)."""
        return self._released.get(seq_id, 0)

    def num_held(self, seq_id: str) -> int:
        """Blocks ``seq_id`` holds: its table less the places it has given up."""
        return self.num_blocks_of(seq_id) - self.num_released(seq_id)

    def _drop(self, b: int) -> None:
        """One holder fewer for block ``b``: with none left, evictable if cached, else free."""
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)
                if self.windows is not None:
                    self.windows.forget(b)

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of ``seq_id``'s blocks in position order."""
        return list(self._tables.get(seq_id, ()))

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def check_invariants(self) -> None:
        """Assert no block is lost, duplicated, or counted wrongly (used by tests)."""
        refs = [0] * self.num_blocks
        held_by = {seq: table[self._released.get(seq, 0):] for seq, table in self._tables.items()}
        assert set(self._released) <= set(self._tables), "a finished sequence's releases are remembered"
        for seq, table in self._tables.items():
            assert all(b == RELEASED_BLOCK for b in table[:self._released.get(seq, 0)]), "a released place is held"
        for table in held_by.values():
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for b in table:
                refs[b] += 1
        assert refs == self._refs, "reference counts disagree with the tables"
        held = {b for b in range(self.num_blocks) if refs[b]}
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a free block is listed twice"
        assert not (held & free) and not (held & evictable) and not (free & evictable), "a block is in two pools"
        assert len(held) + len(free) + len(evictable) == self.num_blocks, "a block is lost"
        assert evictable <= set(self._key_of), "an evictable block is not cached"
        assert all(self._cached[k] == b for b, k in self._key_of.items()) and len(self._cached) == len(self._key_of)
        assert not (free & set(self._key_of)), "a free block is still cached"
        for table in held_by.values():
            if not self.enable_caching:
                assert all(refs[b] == 1 for b in table), "a block is shared without caching"
        if self.windows is not None:
            readers: dict[int, int] = {}
            for seq, (lo, hi) in self._spans.items():
                assert 0 <= lo <= hi <= len(self._tables[seq]), "a window spans places its table lacks"
                for b in self._tables[seq][lo:hi]:
                    readers[b] = readers.get(b, 0) + 1
            self.windows.check_invariants(readers, set(self._key_of))
