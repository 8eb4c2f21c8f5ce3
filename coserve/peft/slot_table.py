"""Which adapter holds which of a bank's device slots, least recently used first, and the banks built on it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict


class SlotTable:
    """``num_slots`` slots given to adapters by name; a full table gives up its least recently used one."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot, LRU order

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def place(self, name: str, keep: set[str]) -> tuple[int, bool]:
        """``name``'s slot, now the most recently used, and whether it was just given (to be written).

        A new adapter takes the lowest free slot, else the least recently used one not in ``keep``.
        """
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            return self._slot_of[name], False
        slot = self._free_slot(keep)
        self._slot_of[name] = slot
        return slot, True

    def release(self, name: str) -> int | None:
        """Forget ``name``; returns the slot it held, if any."""
        return self._slot_of.pop(name, None)

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self._slot_of.values())
        for slot in range(self.num_slots):
            if slot not in used:
                return slot
        for name, slot in self._slot_of.items():  # least recently used first
            if name not in keep:
                del self._slot_of[name]
                return slot
        raise ValueError(f"{len(keep)} adapters kept in {self.num_slots} slots")


class SlotBank(ABC):
    """A bank of device slots for one kind of adapter: ``activate`` places a batch's adapters, writing the new ones."""

    def __init__(self, num_slots: int) -> None:
        self.slots = SlotTable(num_slots)

    def slot_of(self, name: str) -> int | None:
        return self.slots.slot_of(name)

    def activate(self, adapters: list) -> dict[str, int]:
        """Make every adapter (each with a ``name``) resident in a slot, evicting the least recently used others."""
        if len(adapters) > self.slots.num_slots:
            raise ValueError(f"{len(adapters)} adapters in one batch; max_loras is {self.slots.num_slots}")
        wanted = {a.name for a in adapters}
        placed = {}
        for adapter in adapters:
            slot, fresh = self.slots.place(adapter.name, wanted)
            if fresh:
                self._write(slot, adapter)
            placed[adapter.name] = slot
        return placed

    def evict(self, name: str) -> None:
        """Drop an adapter from its slot (after unloading or replacing it)."""
        slot = self.slots.release(name)
        if slot is not None:
            self._clear(slot)

    @abstractmethod
    def _write(self, slot: int, adapter) -> None:
        """Copy ``adapter`` into ``slot`` (whatever it held before is overwritten)."""

    @abstractmethod
    def _clear(self, slot: int) -> None:
        """Make ``slot`` the identity (zero LoRA weights, IA3 vectors of ones)."""
