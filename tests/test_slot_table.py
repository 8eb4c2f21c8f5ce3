"""The slot table both adapter banks share: lowest free slot first, then least recently used out."""

from __future__ import annotations

import pytest

from coserve.peft.slot_table import SlotTable


def test_lowest_free_slot_then_least_recently_used():
    table = SlotTable(2)
    assert table.place("a", {"a"}) == (0, True)
    assert table.place("b", {"b"}) == (1, True)
    assert table.place("a", {"a"}) == (0, False)  # resident: no write, now the most recently used
    assert table.place("c", {"c"}) == (1, True)  # b was the least recently used
    assert table.slot_of("b") is None and table.slot_of("c") == 1
    assert table.release("a") == 0 and table.release("a") is None
    assert table.place("d", {"d"}) == (0, True)  # the freed slot, before evicting anyone


def test_kept_adapters_are_never_evicted():
    table = SlotTable(2)
    table.place("a", {"a", "b"})
    table.place("b", {"a", "b"})
    with pytest.raises(ValueError, match="2 slots"):
        table.place("c", {"a", "b", "c"})
