"""Block manager properties: no block leaked or shared wrongly over any sequence of operations."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.kvcache import BlockManager, OutOfBlocks

ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "append", "free", "preempt"]),
              st.integers(0, 5), st.integers(1, 40)),
    max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8), ops=ops)
def test_no_block_leaked_or_shared(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    lengths: dict[str, int] = {}  # tokens each live sequence holds
    for op, seq, n in ops:
        sid = f"s{seq}"
        if op in ("allocate", "append"):
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
        else:  # free and preempt both return every block of the sequence
            held = len(bm.block_table(sid))
            assert bm.free(sid) == held
            lengths.pop(sid, None)
            assert not bm.has(sid)
        bm.check_invariants()
        owned = [b for s in lengths for b in bm.block_table(s)]
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
