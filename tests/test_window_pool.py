"""The sliding layers' own pool beside the main blocks (``coserve/kvcache/window_pool.py``): every block a sequence
reads within its window has one storage, none is lent twice or lost, idle ones serve a later prefix until wanted;
over any operations (hypothesis), with the prefix cache."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.kvcache import BlockManager, block_key
from coserve.kvcache.window_pool import WindowPool

BS = 4


def keys_of(tokens: list[int]) -> list[int]:
    keys: list[int] = []
    for i in range(len(tokens) // BS):
        keys.append(block_key(keys[-1] if keys else None, tuple(tokens[i * BS:(i + 1) * BS]), ""))
    return keys


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(4, 24), storages=st.integers(2, 12), window=st.integers(1, 14),
       ops=st.lists(st.tuples(st.sampled_from(["start", "step", "free"]), st.integers(0, 4), st.integers(0, 3),
                              st.integers(1, 12)), max_size=60))
def test_every_block_read_within_a_window_has_one_storage(num_blocks, storages, window, ops):
    """Sequences from four prompt families run chunk by chunk as the scheduler runs them: a chunk's keys
    (``window_places``) are covered when ``can_cover`` says so, which must then succeed; the places behind the
    window are let go; registered blocks stay cached. After every operation the pools agree (``check_invariants``)
    and every place a sequence reads within its window has its own block's storage."""
    bm = BlockManager(num_blocks, BS, enable_caching=True, window_storages=storages, window=window)
    families = [[random.Random(f).randrange(50) for _ in range(60)] for f in range(4)]
    live: dict[str, tuple[int, int]] = {}  # seq -> (family, positions computed)
    for op, seq, family, n in ops:
        sid = f"s{seq}"
        if op == "start" and sid not in live:
            tokens = families[family][:n + 8]
            prefix = bm.match(keys_of(tokens)[:(len(tokens) - 1) // BS])
            start = len(prefix) * BS
            lo, hi = bm.window_places(start, min(start + n, len(tokens)))
            if bm.can_allocate(sid, len(tokens), prefix) and bm.can_cover(sid, lo, hi, prefix):
                for b in prefix[lo:]:  # the first position after a prefix reads its window's sliding K/V
                    assert bm.windows.has(b)
                bm.allocate(sid, len(tokens), prefix)
                bm.cover(sid, lo, hi)
                live[sid] = (family, min(start + n, len(tokens)))
        elif op == "step" and sid in live:
            f, done = live[sid]
            end = min(done + n, 60)
            lo, hi = bm.window_places(done, end)
            if bm.can_allocate(sid, end) and bm.can_cover(sid, lo, hi):
                bm.allocate(sid, end)
                bm.cover(sid, lo, hi)
                keys = keys_of(families[f][:end])
                for i, key in enumerate(keys):
                    bm.register(sid, i, key)
                bm.uncover_front(sid, bm.window_places(end, end + 1)[0])  # behind the next query's window
                live[sid] = (f, end)
        elif op == "free" and sid in live:
            bm.free(sid)
            del live[sid]
        bm.check_invariants()
        for sid in live:
            lo, hi = bm._spans[sid]
            for b in bm.block_table(sid)[lo:hi]:
                assert bm.windows.has(b)
        assert len(bm.drain_window_changes()) <= storages * 60
    for sid in list(live):
        bm.free(sid)
    bm.check_invariants()
    assert bm.windows.num_held == 0 and bm.num_free_blocks == num_blocks


def test_an_idle_storage_serves_a_later_prefix_until_one_is_wanted():
    pool = WindowPool(2)
    pool.read(10)
    pool.read(11)
    assert pool.drain() == [(10, 0), (11, 1)] and pool.available == 0
    pool.unread(10, cached=True)  # a cached block nobody reads: idle, kept
    pool.unread(11, cached=False)  # not cached: its storage goes free
    assert pool.has(10) and not pool.has(11) and pool.available == 2 and pool.num_held == 0
    pool.read(10)  # a later request with that prefix reads it again: the same storage
    assert pool.storage_of[10] == 0 and pool.drain() == []
    pool.unread(10, cached=True)
    pool.read(12)
    pool.read(13)  # none free: the idle one's storage goes to the new block
    assert not pool.has(10) and pool.drain() == [(12, 1), (13, 0)]
    with pytest.raises(RuntimeError, match="no sliding-layer storage"):
        pool.read(14)
    with pytest.raises(ValueError, match="still read"):
        pool.forget(12)


def test_a_prefix_is_cut_where_its_window_lost_its_sliding_k_v():
    """A cached run is matched only as far as the window before its end still has its storages (the first position
    after it reads them): idle storages go oldest first, and once one within the last window goes, no shorter cut
    has its window whole either."""
    bm = BlockManager(16, BS, enable_caching=True, window_storages=3, window=6)
    tokens = list(range(100, 124))  # 6 blocks
    keys = keys_of(tokens)
    bm.allocate("a", 24)
    for i in range(6):
        bm.cover("a", *bm.window_places(i * BS, (i + 1) * BS))
        bm.register("a", i, keys[i])
    bm.free("a")  # its last window's blocks (3, 4 and 5) keep their storages, idle
    assert len(bm.match(keys)) == 6  # position 24 reads positions 19-23: blocks 4 and 5
    bm.allocate("b", 8)
    bm.cover("b", 0, 1)  # takes the oldest idle storage, block 3's
    assert len(bm.match(keys)) == 6 and len(bm.match(keys[:5])) == 0  # position 20 reads blocks 3 and 4
    bm.cover("b", 0, 2)  # then block 4's
    assert bm.match(keys) == []
    bm.check_invariants()


def test_a_window_needs_its_width():
    with pytest.raises(ValueError, match="window_storages needs the window"):
        BlockManager(8, 4, window_storages=4)
    with pytest.raises(ValueError, match="window must be None or a positive"):
        BlockManager(8, 4, window=0)
    with pytest.raises(ValueError, match="num_storages must be positive"):
        WindowPool(0)
