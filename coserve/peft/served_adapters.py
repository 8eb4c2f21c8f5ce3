"""Serving both kinds of HF PEFT adapter: loading by ``peft_type``, each kind's device slots, one batch for both."""

from __future__ import annotations

from pathlib import Path

import torch

from coserve.model.linear_modules import ExpertShapes
from coserve.peft.adapter_dir import CONFIG_FILE, AdapterError, peft_type, read_adapter_config
from coserve.peft.ia3_adapter import IA3Adapter, load_ia3_adapter
from coserve.peft.ia3_bank import IA3Bank, IA3Batch
from coserve.peft.lora_adapter import BaseWeight, LoraAdapter, load_lora_adapter
from coserve.peft.lora_bank import LoraBank, LoraBatch

ServedAdapter = LoraAdapter | IA3Adapter


def load_peft_adapter(name: str, path: str | Path, module_shapes: dict[str, tuple[int, int]],
                      num_layers: int, base_weight: BaseWeight | None = None,
                      experts: ExpertShapes | None = None) -> ServedAdapter:
    """A LoRA (DoRA too, given ``base_weight``; a mixture's experts too, given ``experts``) or IA3 adapter directory
    (told apart by ``peft_type``), checked against the model's shapes."""
    path = Path(path)
    config = read_adapter_config(path)
    kind = peft_type(config)
    if kind == "LORA":
        return load_lora_adapter(name, path, module_shapes, num_layers, base_weight, experts)
    if kind == "IA3":
        return load_ia3_adapter(name, path, module_shapes, num_layers)
    raise AdapterError(f"{path / CONFIG_FILE}: field 'peft_type' = {config.get('peft_type')!r}; "
                       "inference serves LORA and IA3 adapters")


class AdapterSlots:
    """The device slots of both kinds: LoRA weights in a ``LoraBank``, IA3 vectors in an ``IA3Bank``.

    Each bank has ``max_loras`` slots, so any mix of at most ``max_loras`` distinct adapters (the
    scheduler's bound per batch) fits; IA3 slots hold vectors only and cost next to nothing.
    """

    def __init__(self, lora: LoraBank, ia3: IA3Bank) -> None:
        self.lora = lora
        self.ia3 = ia3

    def evict(self, name: str) -> None:
        """Drop an adapter from whichever slot holds it (after unloading or replacing it)."""
        self.lora.evict(name)
        self.ia3.evict(name)

    def batch(self, adapters: list[ServedAdapter], runs: list[tuple[str | None, int]]
              ) -> LoraBatch | IA3Batch | MixedAdapterBatch | None:
        """The bypass of one batch, or None when every row is the base model's.

        ``adapters``: the distinct adapters the batch uses; ``runs``: in row order, each run of rows'
        adapter name (None = the base model) and length. A batch of one kind gets that kind's own batch
        object, so LoRA-only batches run exactly as they would without IA3 support.
        """
        lora = _kind_batch(self.lora, [a for a in adapters if isinstance(a, LoraAdapter)], runs)
        ia3 = _kind_batch(self.ia3, [a for a in adapters if isinstance(a, IA3Adapter)], runs)
        if lora is None or ia3 is None:
            return ia3 if lora is None else lora
        return MixedAdapterBatch(lora, ia3)


def _kind_batch(bank: LoraBank | IA3Bank, adapters: list, runs: list[tuple[str | None, int]]):
    """One bank's batch: its adapters' rows get their slot, every other row -1 (base model for this bank)."""
    if not adapters:
        return None
    slots = bank.activate(adapters)
    per_token = []
    for name, n in runs:
        per_token.extend([slots.get(name, -1)] * n)
    return bank.batch(torch.tensor(per_token, dtype=torch.long, device=bank.device))


class MixedAdapterBatch:
    """A batch with LoRA rows and IA3 rows (a ``Bypass``): both applied to every row, each the identity on the
    other kind's rows (LoRA adds an exact zero, IA3 multiplies by exactly one), so every row gets only its own."""

    def __init__(self, lora: LoraBatch, ia3: IA3Batch) -> None:
        self.lora = lora
        self.ia3 = ia3
        self.modules = lora.modules | ia3.modules

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        return self.ia3.input(layer, module, x)  # LoRA leaves inputs alone

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.ia3.output(layer, module, x, self.lora.output(layer, module, x, y))

    def expert_output(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
        return self.lora.expert_output(layer, module, expert, rows, x, y)  # IA3 adapts no expert
