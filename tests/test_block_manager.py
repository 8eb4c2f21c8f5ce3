"""Block manager properties: no block leaked or shared wrongly over any sequence of operations, a sliding window's
releases of a sequence's first blocks included."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.kvcache import BlockManager, OutOfBlocks
from coserve.kvcache.block_manager import RELEASED_BLOCK

ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "append", "free", "preempt", "release"]),
              st.integers(0, 5), st.integers(1, 40)),
    max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8), ops=ops)
def test_no_block_leaked_or_shared(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    lengths: dict[str, int] = {}  # tokens each live sequence holds
    released: dict[str, int] = {}  # its first blocks given up
    for op, seq, n in ops:
        sid = f"s{seq}"
        if op == "release":
            count = n % 6
            free_before, was = bm.num_free_blocks, released.get(sid, 0)
            gone = bm.release_front(sid, count)
            if sid in lengths:
                released[sid] = max(was, min(count, bm.blocks_for(lengths[sid])))
            assert gone == released.get(sid, 0) - was == bm.num_free_blocks - free_before
            assert bm.block_table(sid)[:released.get(sid, 0)] == [RELEASED_BLOCK] * released.get(sid, 0)
        elif op in ("allocate", "append"):
            want = lengths.get(sid, 0) + (n if op == "allocate" else 1)
            free_before = bm.num_free_blocks
            table_before = bm.block_table(sid)
            if bm.can_allocate(sid, want):
                new = bm.allocate(sid, want)
                lengths[sid] = want
                assert bm.block_table(sid) == table_before + new  # grows at the end, keeps order
                assert len(new) == bm.blocks_for(want) - len(table_before)
            else:
                with pytest.raises(OutOfBlocks):
                    bm.allocate(sid, want)
                assert bm.num_free_blocks == free_before  # a failed allocation takes nothing
                assert bm.block_table(sid) == table_before
        else:  # free and preempt both return every block the sequence still holds
            held = len(bm.block_table(sid)) - released.pop(sid, 0)
            assert bm.num_held(sid) == held
            assert bm.free(sid) == held
            lengths.pop(sid, None)
            assert not bm.has(sid)
        bm.check_invariants()
        owned = [b for s in lengths for b in bm.block_table(s)[released.get(s, 0):]]
        assert len(owned) == len(set(owned)), "a block is owned by two sequences"
        assert bm.num_free_blocks == num_blocks - len(owned)
        for s, length in lengths.items():
            assert len(bm.block_table(s)) == bm.blocks_for(length)


def test_everything_freed_returns_the_whole_pool():
    bm = BlockManager(8, 4)
    bm.allocate("a", 9)
    bm.allocate("b", 4)
    assert bm.num_free_blocks == 4
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_released_blocks_go_back_to_the_pool_and_their_places_keep_the_tables_length():
    bm = BlockManager(8, 4)
    first = bm.allocate("a", 20)  # 5 blocks
    assert bm.release_front("a", 2) == 2 and bm.num_free_blocks == 5
    assert bm.release_front("a", 2) == 0 and bm.release_front("a", 1) == 0  # given up once
    assert bm.block_table("a") == [RELEASED_BLOCK] * 2 + first[2:]
    assert bm.blocks_needed("a", 21) == 1  # position 20 goes in a sixth block, after the five places
    bm.allocate("b", 20)  # the two released blocks serve another sequence
    assert bm.release_front("a", 99) == 3 and bm.num_held("a") == 0 and bm.num_released("a") == 5
    bm.check_invariants()
    assert bm.free("a") == 0 and bm.num_free_blocks == 3 and bm.release_front("gone", 3) == 0
    bm.check_invariants()


def test_a_released_place_is_never_registered_and_a_released_cached_block_stays_cached():
    bm = BlockManager(4, 4, enable_caching=True)
    table = bm.allocate("a", 12)
    bm.register("a", 0, 100)
    bm.release_front("a", 2)
    bm.register("a", 1, 101)  # released before it was registered: not cached
    assert bm.match([100, 101]) == [table[0]]  # the registered block is evictable, still found
    assert bm.num_free_blocks == 3
    bm.allocate("b", 8, bm.match([100]))  # revived from the evictable
    assert bm.block_table("b")[0] == table[0]
    bm.check_invariants()


@pytest.mark.parametrize("field,args", [("num_blocks", (0, 4)), ("block_size", (4, 0))])
def test_bad_sizes_name_the_field(field, args):
    with pytest.raises(ValueError, match=field):
        BlockManager(*args)


def test_block_manager_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, coserve.kvcache, coserve.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
