"""Trainable bypass networks over the frozen base (LoRA, IA3), saved and loaded in HF PEFT format."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from coserve.model.linear_modules import ALL_TARGET_MODULES, ROUTER, ROUTER_PARAMETER, ExpertShapes, module_name
from coserve.model.rank_pattern import module_ranks
from coserve.peft.config import IA3Config, LoraConfig, for_model
from coserve.peft.dropout import keep_mask, mix_seed
from coserve.peft.adapter_dir import CONFIG_FILE as ADAPTER_CONFIG
from coserve.peft.adapter_dir import WEIGHTS_FILE as ADAPTER_WEIGHTS
from coserve.peft.adapter_dir import AdapterError, write_adapter_files
from coserve.peft.expert_lora import a_from_peft, a_to_peft, b_from_peft, b_to_peft, peft_prefix, v4_to_peft
from coserve.peft.lora_adapter import BaseWeight, dora_row_norm


def _prefix(layer: int, module: str) -> str:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}"


class TrainableBypass(ABC):
    """Parameters keyed by ``(layer, module)``; a ``Bypass`` the decoder applies on the fly. ``config``'s modules are
    resolved against the model's (``module_shapes``' keys: ``all-linear``, a module the model lacks refused)."""

    def __init__(self, config: LoraConfig | IA3Config, module_shapes: dict[str, tuple[int, int]],
                 num_layers: int, experts: ExpertShapes | None = None) -> None:
        config = for_model(config, module_shapes, experts)
        self.config = config
        self.experts = experts
        self.num_layers = num_layers
        self.modules = frozenset(config.target_modules) | frozenset(getattr(config, "target_parameters", ()))
        self._rows: tuple[int, torch.Tensor] | None = None  # (dropout seed, positions) of a training window

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors, in a fixed order (for the optimizer and gradient clipping)."""
        return [p for _, p in self.named_parameters()]

    @abstractmethod
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(HF PEFT name, tensor)`` of every trainable tensor, in a fixed order."""

    @contextmanager
    def training_rows(self, seed: int, positions: torch.Tensor) -> Iterator[None]:
        """While a training window runs: its rows' positions and the sequence's dropout seed."""
        self._rows = (seed, positions)
        try:
            yield
        finally:
            self._rows = None

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def scales_input(self, module: str) -> bool:
        """Whether the bypass acts on ``module``'s input (its gradient then needs dL/d(input))."""
        return False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under their HF PEFT names, in PEFT's layout."""
        return {name: self._saved(name, p.detach()).contiguous() for name, p in self.named_parameters()}

    def _saved(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter as PEFT's file holds it (``_loaded``'s inverse)."""
        return tensor

    def _loaded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of PEFT's file in the layout of the parameter ``name``."""
        return tensor

    def save_pretrained(self, out_dir: str | Path, base_model: str = "") -> None:
        """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``out_dir`` (see
        ``coserve.finetune.checkpoint`` for the atomic checkpoint around it)."""
        write_adapter_files(Path(out_dir), self.state_dict(), self.peft_config(base_model))

    @abstractmethod
    def peft_config(self, base_model: str) -> dict:
        """The ``adapter_config.json`` contents."""

    # ---- hand-written backward (the pruned executor; see coserve.finetune.pruned_layer) ----------
    # output_keep(layer, module, x, y) -> (y', kept): the bypassed output and what its backward needs.
    # output_backward(layer, module, x, kept, dy') -> (dy, dx or None): the gradient for the frozen
    #   output and any extra gradient for the module input; parameter gradients accumulate in .grad.
    # input_backward(layer, module, x, dx') -> dx: for modules whose input the bypass scales.

    def load_state(self, tensors: dict[str, torch.Tensor], source: Path) -> None:
        """Copy saved tensors in; errors name the file and tensor."""
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(tensors))
        unexpected = sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise AdapterError(f"{source}: tensors do not match the adapter config "
                               f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        with torch.no_grad():
            for name, p in own.items():
                want = self._saved(name, p.detach()).shape
                if tensors[name].shape != want:
                    raise AdapterError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                                       f"expected {tuple(want)}")
                p.copy_(self._loaded(name, tensors[name]))


class LowRank(NamedTuple):
    """A gradient ``left @ right`` left unmultiplied, for the caller to add with one ``addmm_``."""

    left: torch.Tensor
    right: torch.Tensor

    def add_to(self, t: torch.Tensor) -> torch.Tensor:
        return t.addmm_(self.left, self.right)


def add_grads(t: torch.Tensor, *extras) -> torch.Tensor:
    """``t`` (a fresh tensor of a backward's, added into in place) plus each extra gradient: a tensor, a ``LowRank``
    product (one ``addmm_``), or None."""
    for e in extras:
        if isinstance(e, LowRank):
            t = e.add_to(t)
        elif e is not None:
            t = t.add_(e)
    return t


def _frozen(t: torch.Tensor) -> torch.Tensor:
    """``t`` cut from autograd where it would record (grad mode on); as it is where it records nothing anyway (the
    finetuning executors' forward and backward windows run without grad): a dispatched ``detach`` fewer."""
    return t.detach() if torch.is_grad_enabled() else t


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` (as autograd would)."""
    if param.grad is None:
        param.grad = grad.detach().to(param.dtype).clone()
    else:
        param.grad.add_(grad.detach().to(param.dtype))


def _expert_grad(param: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert``'s slice of ``param.grad`` (``[E, ...]``), the gradient made (zeros) where there is none."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad[expert]


def _accumulate_product(param: torch.Tensor, left: torch.Tensor, right: torch.Tensor, alpha: float = 1.0) -> None:
    """Add ``alpha * left @ right`` into ``param.grad`` in one matmul (a window's share of a LoRA gradient)."""
    if param.grad is not None and left.dtype == param.dtype:
        param.grad.addmm_(_frozen(left), _frozen(right), alpha=alpha)
        return
    product = torch.mm(left, right)
    if alpha != 1.0:
        product.mul_(alpha)
    if param.grad is None and not product.requires_grad:  # a fresh tensor of its own: the gradient as it is
        param.grad = product.to(param.dtype)
    else:
        _accumulate(param, product)


class TrainableLora(TrainableBypass):
    """LoRA matrices ``A`` ``[r, in]`` and ``B`` ``[out, r]`` per targeted module and layer.

    With ``use_dora`` (PEFT's DoRA) also a magnitude ``m`` ``[out]`` (the frozen weight's row norms at init):
    ``y' = s (y - bias + scaling (x A^T) B^T) + bias`` with ``s = m / ||W + scaling B A||`` by row, the norm
    detached from the graph as PEFT does (DoRA paper §4.3); ``base_weight`` gives each module's ``W`` and bias.
    The norms are computed once per parameter update (keyed by A's and B's in-place version counters).
    """

    def __init__(self, config: LoraConfig, module_shapes: dict[str, tuple[int, int]], num_layers: int,
                 device: torch.device, generator: torch.Generator | None = None,
                 base_weight: BaseWeight | None = None, experts: ExpertShapes | None = None) -> None:
        super().__init__(config, module_shapes, num_layers, experts)
        config = self.config
        self.dropout = config.lora_dropout
        self.scaling = config.scaling
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.m: dict[tuple[int, str], torch.Tensor] = {}  # DoRA magnitudes
        self.base: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}  # DoRA: W and bias
        self._norms: dict[tuple[int, str], tuple[tuple[int, int], torch.Tensor]] = {}  # DoRA: versions -> norm
        self._transposed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if config.use_dora and base_weight is None:
            raise ValueError("use_dora: DoRA needs the base model's weights (base_weight)")
        # each module's rank (PEFT's rank_pattern; the scaling is the adapter's)
        self.ranks = module_ranks(config.r, config.lora_alpha, config.use_rslora, config.rank_pattern,
                                  config.alpha_pattern, [*config.target_modules, *config.target_parameters], num_layers)
        for layer in range(num_layers):
            for module in config.target_modules:
                if experts is not None and not experts.in_layer(module, layer):  # a dense layer: no router there
                    continue
                fan_in, fan_out = module_shapes[module]
                rank = self.ranks[module]
                a = torch.empty(rank, fan_in)
                # nn.Linear's default init, as PEFT uses for A: Kaiming-uniform with a = sqrt(5).
                bound = 1 / math.sqrt(fan_in)
                a.uniform_(-bound, bound, generator=generator)
                self.a[(layer, module)] = a.to(device).requires_grad_()
                self.b[(layer, module)] = torch.zeros(fan_out, rank, device=device, requires_grad=True)
                if config.use_dora:
                    weight, bias = base_weight(layer, module)
                    self.base[(layer, module)] = (weight, bias)
                    norm = torch.linalg.norm(weight.float(), dim=1)
                    self.m[(layer, module)] = norm.to(device).requires_grad_()
        # a mixture's experts (PEFT's target_parameters): per expert an A [r, in] and a B [out, r], as one [E, r, in]
        # and one [E, out, r] (coserve/peft/expert_lora.py); A drawn as PEFT's nn.Linear(in, E * r) draws it
        self.ea: dict[tuple[int, str], torch.Tensor] = {}
        self.eb: dict[tuple[int, str], torch.Tensor] = {}
        self._expert_names: dict[str, tuple[tuple[int, str], str]] = {}  # PEFT name -> (key, "A" | "B")
        for layer in range(num_layers):
            for module in config.target_parameters:
                if not experts.in_layer(module, layer):  # a dense layer: no experts there
                    continue
                fan_in, fan_out = experts.modules[module]
                n, rank = experts.num_experts, self.ranks[module]
                a = torch.empty(n * rank, fan_in)
                a.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in), generator=generator)
                self.ea[(layer, module)] = a.view(n, rank, fan_in).to(device).requires_grad_()
                self.eb[(layer, module)] = torch.zeros(n, fan_out, rank, device=device, requires_grad=True)
                prefix = peft_prefix(layer, module, config.target_parameters)
                self._expert_names[f"{prefix}.lora_A.weight"] = ((layer, module), "A")
                self._expert_names[f"{prefix}.lora_B.weight"] = ((layer, module), "B")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for key in sorted(self.a):
            out.append((f"{_prefix(*key)}.lora_A.weight", self.a[key]))
            out.append((f"{_prefix(*key)}.lora_B.weight", self.b[key]))
            if key in self.m:
                out.append((f"{_prefix(*key)}.lora_magnitude_vector", self.m[key]))
        for name, (key, which) in self._expert_names.items():
            out.append((name, (self.ea if which == "A" else self.eb)[key]))
        return out

    def _saved(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in self._expert_names:
            return tensor
        (_, module), which = self._expert_names[name]
        return a_to_peft(tensor) if which == "A" else b_to_peft(tensor, self.experts.interleaves(module))

    def _loaded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in self._expert_names:
            return tensor
        key, which = self._expert_names[name]
        n = self.ea[key].shape[0]
        return a_from_peft(tensor, n) if which == "A" else b_from_peft(tensor, n, self.experts.interleaves(key[1]))

    def _weights_t(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A^T, B^T)`` cut from autograd. Without grad (the finetuning executors' windows) the views are made once
        per parameter tensor and kept, a dispatched transpose fewer each per call: they share the parameters'
        storage, so the optimizer's in-place steps show through them. With grad, fresh ones of detached tensors."""
        a, b = self.a[key], self.b[key]
        if torch.is_grad_enabled():
            return a.detach().T, b.detach().T
        cached = self._transposed.get(key)
        if cached is None or cached[0] is not a or cached[1] is not b:
            cached = self._transposed[key] = (a, b, a.T, b.T)
        return cached[2], cached[3]

    def _dora_norm(self, key: tuple[int, str]) -> torch.Tensor:
        """``||W + scaling B A||`` by row (detached; recomputed after A or B changed)."""
        a, b = self.a[key], self.b[key]
        versions = (a._version, b._version)
        cached = self._norms.get(key)
        if cached is None or cached[0] != versions:
            with torch.no_grad():
                norm = dora_row_norm(self.base[key][0], a, b, self.scaling)
            cached = self._norms[key] = (versions, norm)
        return cached[1]

    def _dora_scale(self, key: tuple[int, str]) -> torch.Tensor:
        """``m / ||W + scaling B A||`` (differentiable in ``m`` only)."""
        return self.m[key] / self._dora_norm(key)

    def _dora_out(self, key: tuple[int, str], y: torch.Tensor, pre: torch.Tensor, scale: torch.Tensor
                  ) -> torch.Tensor:
        """``scale * pre + bias``, ``pre`` being the output less its bias plus the LoRA term."""
        bias = self.base[key][1]
        out = pre * scale
        return (out if bias is None else out + bias.float()).to(y.dtype)

    def _pre(self, key: tuple[int, str], y: torch.Tensor, lora: torch.Tensor) -> torch.Tensor:
        bias = self.base[key][1]
        return (y.float() if bias is None else y.float() - bias.float()) + lora

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def _mask(self, layer: int, module: str, width: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The dropout mask of the current training window's rows, or None (no dropout, inference)."""
        if self.dropout == 0 or self._rows is None:
            return None
        seed, positions = self._rows
        return keep_mask(mix_seed(seed, layer, ALL_TARGET_MODULES.index(module)), positions, width, self.dropout, dtype)

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        key = (layer, module)
        a, b = self.a[key], self.b[key]
        x = x.to(a.dtype)
        mask = self._mask(layer, module, x.shape[1], x.dtype)
        x = x if mask is None else x * mask
        lora = x @ a.T @ b.T * self.scaling
        if key in self.m:
            return self._dora_out(key, y, self._pre(key, y, lora), self._dora_scale(key))
        return y + lora.to(y.dtype)

    def output_keep(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``y + (dropout(x) A^T) B^T * s``, keeping ``dropout(x) A^T`` ``[T, r]`` for dB (DoRA: the output then
        scaled, also keeping the unscaled output less its bias ``[T, out]`` beside it, for dm)."""
        key = (layer, module)
        a_t, b_t = self._weights_t(key)
        x = x.to(a_t.dtype)
        mask = self._mask(layer, module, x.shape[1], x.dtype)
        xa = (x if mask is None else x * mask) @ a_t
        if key in self.m:
            with torch.no_grad():
                pre = self._pre(key, y, xa @ b_t * self.scaling)
                return self._dora_out(key, y, pre, self._dora_scale(key)), torch.cat([xa, pre], dim=1)
        if y.dtype == xa.dtype:  # one pass: y + s * (xA^T) B^T
            return torch.addmm(y, xa, b_t, alpha=self.scaling), xa
        return y + (xa @ b_t * self.scaling).to(y.dtype), xa

    def output_backward(self, layer: int, module: str, x: torch.Tensor, xa: torch.Tensor, dy: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, module)
        a, b = self.a[key], self.b[key]
        if key in self.m:  # DoRA: dm from the kept unscaled output; the rest is LoRA's under dy * scale
            xa, pre = xa[:, :a.shape[0]], xa[:, a.shape[0]:]
            m = self.m[key]
            with torch.no_grad():
                scale = self._dora_scale(key)
                _accumulate(m, (dy.float() * pre).sum(0) / self._dora_norm(key))  # d(m / norm)/dm = 1 / norm
                dy = (dy.float() * scale).to(dy.dtype)
        out_dtype = x.dtype  # the model's; the adapter computes in its own dtype
        dyf = dy.to(a.dtype)
        x = x.to(a.dtype)
        mask = self._mask(layer, module, x.shape[1], x.dtype)
        _accumulate_product(b, dyf.T, xa, self.scaling)  # [out, r]
        dxa = dyf @ _frozen(b)  # [T, r]
        if self.scaling != 1.0:
            dxa.mul_(self.scaling)
        _accumulate_product(a, dxa.T, x if mask is None else x * mask)  # [r, in]
        if mask is None and out_dtype == dxa.dtype:
            return dy, LowRank(dxa, _frozen(a))  # the caller adds dxa A into its input gradient in place
        dx = dxa @ _frozen(a)
        return dy, (dx if mask is None else dx * mask).to(out_dtype)

    def input_backward(self, layer: int, module: str, x: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        return dx  # LoRA leaves the input alone

    # ---- a mixture's experts (``moe.moe_mlp`` calls these over each expert's rows; no dropout, as PEFT's) --------
    def expert_output(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
        """``y + (x A_e^T) B_e^T * s`` (differentiable: the ``all`` executor runs it under autograd)."""
        a, b = self.ea[(layer, module)][expert], self.eb[(layer, module)][expert]
        return y + (x.to(a.dtype) @ a.T @ b.T * self.scaling).to(y.dtype)

    def expert_output_keep(self, layer: int, module: str, expert: int, rows: torch.Tensor, x: torch.Tensor,
                           y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``expert_output``, keeping ``x A_e^T`` ``[n, r]`` of ``rows`` (dB_e reads it)."""
        a, b = _frozen(self.ea[(layer, module)][expert]), _frozen(self.eb[(layer, module)][expert])
        xa = x.to(a.dtype) @ a.T
        out = (torch.addmm(y, xa, b.T, alpha=self.scaling) if y.dtype == xa.dtype
               else y + (xa @ b.T * self.scaling).to(y.dtype))
        return out, xa[:rows.numel()]

    def expert_backward(self, layer: int, module: str, expert: int, x: torch.Tensor, xa: torch.Tensor | None,
                        dy: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's ``module`` on rows ``x`` ``[n, in]`` (``xa``: their ``x A_e^T`` kept, or None): accumulates
        dA_e and dB_e for the gradient ``dy * row_scale`` at its output (``row_scale`` ``[n, 1]``: each row's routing
        weight, or None), and returns what its LoRA adds to dL/dx for ``dy`` itself, ``s (dy B_e) A_e``."""
        key = (layer, module)
        a, b = _frozen(self.ea[key][expert]), _frozen(self.eb[key][expert])
        x, dyf = x.to(a.dtype), dy.to(a.dtype)
        if xa is None:
            xa = x @ a.T
        t = dyf @ b  # [n, r]
        scaled_t = t if row_scale is None else (t * row_scale).to(a.dtype)
        scaled_dy = dyf if row_scale is None else (dyf * row_scale).to(a.dtype)
        _expert_grad(self.ea[key], expert).addmm_(scaled_t.T, x, alpha=self.scaling)  # [r, in]
        _expert_grad(self.eb[key], expert).addmm_(scaled_dy.T, xa, alpha=self.scaling)  # [out, r]
        return (t @ a).mul_(self.scaling).to(dy.dtype)

    def peft_config(self, base_model: str) -> dict:
        c = self.config
        # a mixture's router as PEFT 0.21 adapts it: a parameter (Qwen2-MoE's router is no module PEFT wraps)
        router = [ROUTER_PARAMETER] if ROUTER in c.target_modules else []
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
                "target_modules": sorted(set(c.target_modules) - ({ROUTER} if router else set())),
                "use_rslora": c.use_rslora, "bias": "none",
                "target_parameters": router + list(c.target_parameters) or None,
                "rank_pattern": dict(c.rank_pattern), "alpha_pattern": dict(c.alpha_pattern),
                "fan_in_fan_out": False, "use_dora": c.use_dora, "init_lora_weights": True,
                "inference_mode": True, "modules_to_save": None}


class TrainableIA3(TrainableBypass):
    """IA3 vectors: ``[out, 1]`` scaling a module's output, ``[1, in]`` a feed-forward module's input."""

    def __init__(self, config: IA3Config, module_shapes: dict[str, tuple[int, int]], num_layers: int,
                 device: torch.device) -> None:
        super().__init__(config, module_shapes, num_layers)
        config = self.config
        self.feedforward = frozenset(config.feedforward_modules)
        self.vectors: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(num_layers):
            for module in config.target_modules:
                fan_in, fan_out = module_shapes[module]
                shape = (1, fan_in) if module in self.feedforward else (fan_out, 1)
                self.vectors[(layer, module)] = torch.ones(shape, device=device, requires_grad=True)

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{_prefix(*key)}.ia3_l", self.vectors[key]) for key in sorted(self.vectors)]

    def scales_input(self, module: str) -> bool:
        return module in self.feedforward

    def input(self, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
        if module not in self.feedforward:
            return x
        return (x * self.vectors[(layer, module)].flatten()).to(x.dtype)

    def output(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if module in self.feedforward:
            return y
        return (y * self.vectors[(layer, module)].flatten()).to(y.dtype)

    def output_keep(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scaled output, keeping the frozen output ``y`` (dl reads it)."""
        if module in self.feedforward:
            return y, None
        return (y * _frozen(self.vectors[(layer, module)]).flatten()).to(y.dtype), y

    def output_backward(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor | None,
                        dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        if module in self.feedforward:
            return dy, None
        vec = self.vectors[(layer, module)]
        _accumulate(vec, (dy.float() * y.float()).sum(0).unsqueeze(1))  # [out, 1]
        return (dy * _frozen(vec).flatten()).to(dy.dtype), None

    def input_backward(self, layer: int, module: str, x: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        """``x`` is the unscaled input; returns the gradient for it."""
        if module not in self.feedforward:
            return dx
        vec = self.vectors[(layer, module)]
        _accumulate(vec, (dx.float() * x.float()).sum(0).unsqueeze(0))  # [1, in]
        return (dx * _frozen(vec).flatten()).to(dx.dtype)

    def peft_config(self, base_model: str) -> dict:
        c = self.config
        return {"peft_type": "IA3", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                "target_modules": sorted(c.target_modules), "feedforward_modules": sorted(c.feedforward_modules),
                "fan_in_fan_out": False, "init_ia3_weights": True, "inference_mode": True,
                "modules_to_save": None}


def load_trainable(path: str | Path, module_shapes: dict[str, tuple[int, int]], num_layers: int,
                   device: torch.device, base_weight: BaseWeight | None = None,
                   experts: ExpertShapes | None = None) -> TrainableBypass:
    """A saved LoRA (DoRA too: give ``base_weight``; a mixture's experts: give ``experts``) or IA3 adapter (HF PEFT
    format) as a trainable bypass, e.g. to resume training."""
    path = Path(path)
    cfg_file = path / ADAPTER_CONFIG
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{cfg_file}: cannot read the adapter config ({e})") from e
    kind = str(raw.get("peft_type", "")).upper()
    if kind == "LORA":
        config = LoraConfig(r=raw["r"], lora_alpha=raw["lora_alpha"], lora_dropout=raw.get("lora_dropout", 0.0),
                            target_modules=list(dict.fromkeys(map(module_name, raw.get("target_modules") or []))),
                            use_rslora=bool(raw.get("use_rslora")), use_dora=bool(raw.get("use_dora")),
                            target_parameters=list(raw.get("target_parameters") or []),
                            rank_pattern=raw.get("rank_pattern") or {}, alpha_pattern=raw.get("alpha_pattern") or {})
        if config.use_dora and base_weight is None:
            raise AdapterError(f"{cfg_file}: a DoRA adapter (use_dora) needs the base model's weights to be loaded")
        bypass: TrainableBypass = TrainableLora(config, module_shapes, num_layers, device, base_weight=base_weight,
                                                experts=experts)
    elif kind == "IA3":
        config = IA3Config(target_modules=list(raw["target_modules"]),
                           feedforward_modules=list(raw.get("feedforward_modules") or []))
        bypass = TrainableIA3(config, module_shapes, num_layers, device)
    else:
        raise AdapterError(f"{cfg_file}: field 'peft_type' = {raw.get('peft_type')!r} is not LORA or IA3")
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS), device=str(device))
    except Exception as e:  # safetensors raises several kinds for a bad file
        raise AdapterError(f"{path / ADAPTER_WEIGHTS}: cannot read ({e})") from e
    if experts is not None:  # a mixture's experts in transformers 4's layout, as PEFT 0.21 converts them
        try:
            tensors = v4_to_peft(tensors, experts.v4_names, experts.num_experts, str(path / ADAPTER_WEIGHTS))
        except ValueError as e:
            raise AdapterError(str(e)) from e
    bypass.load_state(tensors, path / ADAPTER_WEIGHTS)
    return bypass


def load_model_trainable(path: str | Path, model) -> TrainableBypass:
    """``load_trainable`` for a ``DecoderModel``: its modules, layers, device, frozen weights (DoRA) and experts."""
    return load_trainable(path, model.module_shapes(), model.cfg.num_layers, model.device, model.module_weight,
                          model.expert_shapes())
