"""The flat batch's index tensors: built through int64 arrays, equal to ``torch.tensor`` of the same lists."""

from __future__ import annotations

from array import array

import torch

from coserve.model.forward_batch import SequenceChunk, build_forward_batch, long_tensor


def test_long_tensor_equals_torch_tensor():
    cpu = torch.device("cpu")
    for values in ([], [0], [5, -3, 2**40], list(range(1000))):
        expected = torch.tensor(values, dtype=torch.long)
        for given in (values, array("q", values), iter(values)):
            got = long_tensor(given, cpu)
            assert got.dtype == torch.long and torch.equal(got, expected)


def test_a_decode_group_holds_each_sequence_s_blocks_padded_with_block_0():
    chunks = [SequenceChunk(0, 1, 9, [7, 3, 5]), SequenceChunk(1, 2, 30, [1, 2, 4, 6, 8, 10, 12, 14]),
              SequenceChunk(2, 4, 6, [11, 13])]  # a 2-token chunk: not in a decode group
    batch = build_forward_batch([[1], [2], [3, 4]], chunks, 4, [0, 1, 3], torch.device("cpu"))
    assert batch.token_ids.tolist() == [1, 2, 3, 4]
    assert batch.positions.tolist() == [8, 29, 4, 5]
    assert batch.slot_mapping.tolist() == [5 * 4 + 0, 14 * 4 + 1, 13 * 4 + 0, 13 * 4 + 1]
    assert batch.logits_rows.tolist() == [0, 1, 3]
    assert sorted(r for g in batch.single_groups for r in g.rows.tolist()) == [0, 1]
    for g in batch.single_groups:  # each as wide as its longest sequence's blocks
        assert g.block_tables.shape[1] == max(-(-n // 4) for n in g.context_lens.tolist())
        for row, table, n in zip(g.rows.tolist(), g.block_tables.tolist(), g.context_lens.tolist()):
            blocks = chunks[row].block_table
            assert table[:len(blocks)] == blocks[:len(table)] and set(table[len(blocks):]) <= {0}
            assert n == chunks[row].context_len
