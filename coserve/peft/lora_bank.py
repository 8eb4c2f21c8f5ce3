"""Device-resident LoRA slots and the batched, per-token application of many adapters at once."""

from __future__ import annotations

import torch

from coserve.model.linear_modules import ExpertShapes
from coserve.peft.lora_adapter import LoraAdapter
from coserve.peft.slot_table import SlotBank


class LoraBank(SlotBank):
    """``max_loras`` slots of stacked LoRA weights per (layer, module), ranks zero-padded to ``max_rank``.

    Slot ``s`` of module ``m`` at layer ``l`` lives in rows ``s*R:(s+1)*R`` of ``a[m][l]``
    (``[slots*R, in]``) and columns ``s*R:(s+1)*R`` of ``b[m][l]`` (``[out, slots*R]``), so one
    matmul pair covers every adapter in a batch; padding rows are zero and add exact zeros. A mixture's experts
    (``experts``) have such slots per expert: ``ea[m][l, e]`` ``[slots*R, in]`` and ``eb[m][l, e]`` ``[out, slots*R]``.
    """

    def __init__(self, module_shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int,
                 max_rank: int, device: torch.device, dtype: torch.dtype,
                 experts: ExpertShapes | None = None) -> None:
        super().__init__(max_loras)
        self.module_shapes = module_shapes
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.a: dict[str, torch.Tensor] = {}  # module -> [layers, slots*R, in]
        self.b: dict[str, torch.Tensor] = {}  # module -> [layers, out, slots*R]
        self.experts = experts
        self.ea: dict[str, torch.Tensor] = {}  # expert module -> [layers, E, slots*R, in]
        self.eb: dict[str, torch.Tensor] = {}  # expert module -> [layers, E, out, slots*R]
        self.scaling = [0.0] * max_loras
        self.slot_modules: list[frozenset[str]] = [frozenset()] * max_loras
        # DoRA: per module [layers, slots + 1, out] output scales and bias terms; row ``max_loras`` (base-model
        # tokens) and every plain-LoRA slot hold scale 1 and term 0, so their rows come out exactly as without
        self.dora_scale: dict[str, torch.Tensor] = {}
        self.dora_offset: dict[str, torch.Tensor] = {}
        self.slot_dora: list[frozenset[str]] = [frozenset()] * max_loras  # modules a slot's DoRA scales

    def activate(self, adapters: list[LoraAdapter]) -> dict[str, int]:
        """Make every adapter resident in a slot (evicting the least recently used others)."""
        for adapter in adapters:
            if adapter.rank > self.max_rank:
                raise ValueError(f"adapter {adapter.name!r} has r={adapter.rank}; max_lora_rank is {self.max_rank}")
        return super().activate(adapters)

    def _module_tensors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        if module not in self.a:
            fan_in, fan_out = self.module_shapes[module]
            width = self.max_loras * self.max_rank
            self.a[module] = torch.zeros(self.num_layers, width, fan_in, device=self.device, dtype=self.dtype)
            self.b[module] = torch.zeros(self.num_layers, fan_out, width, device=self.device, dtype=self.dtype)
        return self.a[module], self.b[module]

    def _expert_tensors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        if module not in self.ea:
            fan_in, fan_out = self.experts.modules[module]
            width, n = self.max_loras * self.max_rank, self.experts.num_experts
            self.ea[module] = torch.zeros(self.num_layers, n, width, fan_in, device=self.device, dtype=self.dtype)
            self.eb[module] = torch.zeros(self.num_layers, n, fan_out, width, device=self.device, dtype=self.dtype)
        return self.ea[module], self.eb[module]

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        self._clear(slot)
        lo = slot * self.max_rank
        for (layer, module), a in adapter.expert_a.items():  # a module's own rank (PEFT's rank_pattern)
            bank_a, bank_b = self._expert_tensors(module)
            bank_a[layer, :, lo:lo + a.shape[1]] = a.to(self.device, self.dtype)
            bank_b[layer, :, :, lo:lo + a.shape[1]] = adapter.expert_b[(layer, module)].to(self.device, self.dtype)
        for (layer, module), a in adapter.a.items():
            bank_a, bank_b = self._module_tensors(module)
            bank_a[layer, lo:lo + a.shape[0]] = a.to(self.device, self.dtype)
            bank_b[layer, :, lo:lo + a.shape[0]] = adapter.b[(layer, module)].to(self.device, self.dtype)
        for (layer, module), scale in adapter.dora_scale.items():
            bank_scale, bank_offset = self._dora_tensors(module)
            bank_scale[layer, slot] = scale.to(self.device, self.dtype)
            bank_offset[layer, slot] = adapter.dora_offset[(layer, module)].to(self.device, self.dtype)
        self.scaling[slot] = adapter.scaling
        self.slot_modules[slot] = adapter.target_modules
        self.slot_dora[slot] = frozenset(m for _, m in adapter.dora_scale)

    def _dora_tensors(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        if module not in self.dora_scale:
            fan_out = self.module_shapes[module][1]
            shape = (self.num_layers, self.max_loras + 1, fan_out)
            self.dora_scale[module] = torch.ones(shape, device=self.device, dtype=self.dtype)
            self.dora_offset[module] = torch.zeros(shape, device=self.device, dtype=self.dtype)
        return self.dora_scale[module], self.dora_offset[module]

    def _clear(self, slot: int) -> None:
        lo, hi = slot * self.max_rank, (slot + 1) * self.max_rank
        for module in self.a:
            self.a[module][:, lo:hi] = 0
            self.b[module][:, :, lo:hi] = 0
        for module in self.ea:
            self.ea[module][:, :, lo:hi] = 0
            self.eb[module][:, :, :, lo:hi] = 0
        for module in self.dora_scale:
            self.dora_scale[module][:, slot] = 1
            self.dora_offset[module][:, slot] = 0
        self.scaling[slot] = 0.0
        self.slot_modules[slot] = frozenset()
        self.slot_dora[slot] = frozenset()

    def batch(self, token_slots: torch.Tensor) -> "LoraBatch | None":
        """The adapters of one batch, given each token's slot ``[T]`` (-1 = base model)."""
        used = sorted(set(token_slots.unique().tolist()) - {-1})
        if not used:
            return None
        num_slots = used[-1] + 1
        scale_of_slot = torch.tensor(self.scaling[:num_slots], device=self.device, dtype=self.dtype)
        onehot = token_slots.unsqueeze(1) == torch.arange(num_slots, device=self.device).unsqueeze(0)
        token_scale = onehot.to(self.dtype) * scale_of_slot  # [T, num_slots]
        modules = frozenset().union(*(self.slot_modules[s] for s in used))
        dora = frozenset().union(*(self.slot_dora[s] for s in used))
        rows = torch.where(token_slots < 0, self.max_loras, token_slots) if dora else None
        return LoraBatch(self, token_scale, num_slots, modules, dora, rows)


class LoraBatch:
    """Applies the bank's adapters to a batch (a ``Bypass``): ``y + ((x @ A^T) * scale[token, slot]) @ B^T``, then
    for DoRA modules times each token's slot's output scale plus its bias term (1 and 0 for every other token)."""

    def __init__(self, bank: LoraBank, token_scale: torch.Tensor, num_slots: int,
                 modules: frozenset[str], dora: frozenset[str] = frozenset(),
                 token_rows: torch.Tensor | None = None) -> None:
        self.bank = bank
        self.token_scale = token_scale  # [T, num_slots]: the slot's scaling where the token uses it, else 0
        self.num_slots = num_slots
        self.modules = modules
        self.dora = dora  # modules where some token's adapter is DoRA
        self.token_rows = token_rows  # [T]: each token's row of the DoRA tables (its slot, or the base row)

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        return x  # LoRA leaves the frozen module's input alone

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each token's own adapter's LoRA output for input ``x`` ``[T, in]``."""
        if module not in self.modules:
            return y
        width = self.num_slots * self.bank.max_rank
        a = self.bank.a[module][layer, :width]  # [S*R, in]
        b = self.bank.b[module][layer, :, :width]  # [out, S*R]
        xa = (x @ a.T).view(x.shape[0], self.num_slots, self.bank.max_rank)
        xa = xa * self.token_scale.unsqueeze(-1)
        y = y + xa.view(x.shape[0], width) @ b.T
        if module not in self.dora:
            return y
        rows = self.token_rows
        return y * self.bank.dora_scale[module][layer, rows] + self.bank.dora_offset[module][layer, rows]

    def expert_output(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each row's own adapter's LoRA of ``expert``'s ``module`` (an ``EXPERT_MODULES`` name) for its
        input ``x`` ``[P, in]``: the batch's rows ``rows`` ``[n]`` in an expert's call, then ``P - n`` padding rows
        (which no adapter touches)."""
        if module not in self.modules:
            return y
        width, n, pad = self.num_slots * self.bank.max_rank, rows.numel(), x.shape[0] - rows.numel()
        a = self.bank.ea[module][layer, expert, :width]  # [S*R, in]
        b = self.bank.eb[module][layer, expert, :, :width]  # [out, S*R]
        scale = self.token_scale[rows]
        if pad:
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        xa = (x @ a.T).view(n + pad, self.num_slots, self.bank.max_rank) * scale.unsqueeze(-1)
        return y + xa.view(n + pad, width) @ b.T
