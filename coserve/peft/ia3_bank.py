"""Device-resident IA3 slots and the per-token application of many IA3 adapters at once."""

from __future__ import annotations

import torch

from coserve.peft.ia3_adapter import IA3Adapter
from coserve.peft.slot_table import SlotBank


class IA3Bank(SlotBank):
    """``max_adapters`` slots of IA3 vectors per (layer, module), behind a row of ones for every other token.

    Slot ``s`` of module ``m``'s output scales at layer ``l`` is row ``s + 1`` of ``output[m][l]``
    (``[1 + slots, out]``); row 0 is all ones, and so is every row of a slot whose adapter leaves ``m``
    alone, so a token of the base model or of another adapter is multiplied by exactly 1 (bitwise its
    own value). Input scales (PEFT's feed-forward placement) live in ``input[m]`` the same way. The
    vectors stay float32 whatever the model's dtype, as PEFT keeps them over a low-precision base.
    """

    def __init__(self, module_shapes: dict[str, tuple[int, int]], num_layers: int, max_adapters: int,
                 device: torch.device) -> None:
        super().__init__(max_adapters)
        self.module_shapes = module_shapes
        self.num_layers = num_layers
        self.max_adapters = max_adapters
        self.device = device
        self.output: dict[str, torch.Tensor] = {}  # module -> [layers, 1 + slots, out]
        self.input: dict[str, torch.Tensor] = {}  # module -> [layers, 1 + slots, in]
        # per slot: (modules whose output it scales, modules whose input it scales)
        self.slot_modules: list[tuple[frozenset[str], frozenset[str]]] = [(frozenset(), frozenset())] * max_adapters

    def _table(self, tables: dict[str, torch.Tensor], module: str, width: int) -> torch.Tensor:
        if module not in tables:
            tables[module] = torch.ones(self.num_layers, 1 + self.max_adapters, width, device=self.device)
        return tables[module]

    def _write(self, slot: int, adapter: IA3Adapter) -> None:
        self._clear(slot)
        for (layer, module), vec in adapter.output_scales.items():
            self._table(self.output, module, self.module_shapes[module][1])[layer, slot + 1] = vec.to(self.device)
        for (layer, module), vec in adapter.input_scales.items():
            self._table(self.input, module, self.module_shapes[module][0])[layer, slot + 1] = vec.to(self.device)
        self.slot_modules[slot] = (frozenset(m for _, m in adapter.output_scales),
                                   frozenset(m for _, m in adapter.input_scales))

    def _clear(self, slot: int) -> None:
        for table in (*self.output.values(), *self.input.values()):
            table[:, slot + 1] = 1
        self.slot_modules[slot] = (frozenset(), frozenset())

    def batch(self, token_slots: torch.Tensor) -> IA3Batch | None:
        """The adapters of one batch, given each token's slot ``[T]`` (-1 = none of this bank's)."""
        used = sorted(set(token_slots.unique().tolist()) - {-1})
        if not used:
            return None
        output_modules = frozenset().union(*(self.slot_modules[s][0] for s in used))
        input_modules = frozenset().union(*(self.slot_modules[s][1] for s in used))
        return IA3Batch(self, token_slots + 1, output_modules, input_modules)


class IA3Batch:
    """Applies the bank's vectors to a batch (a ``Bypass``): each token's output or input times its own vector."""

    def __init__(self, bank: IA3Bank, rows: torch.Tensor, output_modules: frozenset[str],
                 input_modules: frozenset[str]) -> None:
        self.bank = bank
        self.rows = rows  # [T]: each token's row of the bank's tables (0 = ones)
        self.output_modules = output_modules
        self.input_modules = input_modules
        self.modules = output_modules | input_modules

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` times each token's input scale of ``module`` (PEFT's feed-forward placement)."""
        if module not in self.input_modules:
            return x
        return _scaled(x, self.bank.input[module][layer], self.rows)

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The frozen output ``y`` ``[T, out]`` times each token's output scale of ``module``."""
        if module not in self.output_modules:
            return y
        return _scaled(y, self.bank.output[module][layer], self.rows)


def _scaled(x: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, n]`` times row ``rows[t]`` of ``table`` ``[1 + slots, n]``, cast back to x's dtype as PEFT does.

    ``x`` may hold only the leading rows of the batch (a co-served call scales the inference rows apart from
    the finetuning rows, without the padding): the product is elementwise, so no row depends on another.
    """
    return (x * table[rows[:x.shape[0]]]).to(x.dtype)
