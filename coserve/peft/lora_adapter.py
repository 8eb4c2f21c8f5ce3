"""HF PEFT LoRA adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coserve.model.linear_modules import ExpertShapes, resolve_expert_targets
from coserve.model.rank_pattern import check_patterns, module_ranks
from coserve.peft.adapter_dir import (CONFIG_FILE, WEIGHTS_FILE, AdapterError, check_target_names, layer_module,
                                      peft_type, read_adapter_config, read_adapter_tensors)
from coserve.peft.expert_lora import EXPERT_KEY, V4_EXPERT_KEY, a_from_peft, b_from_peft, from_v4

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp|block_sparse_moe)\.((?:shared_expert\.)?\w+)\.lora_(?:([AB])\."
                  r"weight|(magnitude_vector))$")
# (layer, module) -> the frozen module's weight [out, in] and bias (or None), to compute DoRA's column norms with
BaseWeight = Callable[[int, str], tuple[torch.Tensor, torch.Tensor | None]]

__all__ = ["AdapterError", "LoraAdapter", "load_lora_adapter"]


@dataclass(slots=True)
class LoraAdapter:
    """One LoRA adapter's weights on the CPU, keyed by (layer, module)."""

    name: str
    path: Path
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    target_modules: frozenset[str]  # modules with weights, e.g. {"q_proj", "down_proj"}
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [r, in]
    b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [out, r]
    # DoRA (``use_dora``): y = bias + s * (x W^T + scaling x A^T B^T), s = magnitude / ||W + scaling B A|| (row norms,
    # PEFT's DoraLinearLayer), served as y' = s * (y + lora) + (1 - s) * bias: per (layer, module), s and (1 - s) * bias
    dora_scale: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [out]
    dora_offset: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [out]
    # a mixture's experts (PEFT's ``target_parameters``), per (layer, "experts.gate_up_proj" | "experts.down_proj"):
    # each expert's A and B (``expert_lora.py``); those modules are in ``target_modules`` too
    expert_a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [E, r, in]
    expert_b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [E, out, r]


def load_lora_adapter(name: str, path: str | Path, module_shapes: dict[str, tuple[int, int]],
                      num_layers: int, base_weight: BaseWeight | None = None,
                      experts: ExpertShapes | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter against the model's shapes (``experts``: a mixture's, for adapters of its
    experts, PEFT's ``target_parameters``); errors name the file and field. A DoRA adapter (``use_dora``) needs
    ``base_weight``: its magnitudes are turned into output scales against the frozen weights once, here."""
    path = Path(path)
    config = read_adapter_config(path)
    cfg_file = path / CONFIG_FILE
    if peft_type(config) != "LORA":
        raise AdapterError(f"{cfg_file}: field 'peft_type' = {config.get('peft_type')!r}; expected LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{cfg_file}: field 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{cfg_file}: field 'lora_alpha' must be a finite number, got {alpha!r}")
    if config.get("fan_in_fan_out", False):
        raise AdapterError(f"{cfg_file}: field 'fan_in_fan_out' = {config['fan_in_fan_out']!r} is not supported")
    dora = config.get("use_dora", False)
    if not isinstance(dora, bool):
        raise AdapterError(f"{cfg_file}: field 'use_dora' must be true or false, got {dora!r}")
    if dora and base_weight is None:
        raise AdapterError(f"{cfg_file}: a DoRA adapter (use_dora) needs the base model's weights to be loaded")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{cfg_file}: field 'bias' = {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise AdapterError(f"{cfg_file}: field 'modules_to_save' is not supported (whole modules saved)")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a mixture's experts may be named as transformers 4 had them (Mixtral's w1, ...)
        check_target_names(cfg_file, targets, "LoRA", [*module_shapes, *(experts.v4_names if experts else ())])
    parameters = config.get("target_parameters") or []
    try:
        resolve_expert_targets(parameters if isinstance(parameters, list) else [parameters], experts)
    except ValueError as e:
        raise AdapterError(f"{cfg_file}: field {e}") from e
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:  # each module's rank (PEFT's rank_pattern, alpha_pattern: one scaling per adapter)
        patterns = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        check_patterns(*patterns)
        ranks = module_ranks(rank, alpha, bool(config.get("use_rslora")), *patterns,
                             [*module_shapes, *(experts.modules if experts is not None else ())], num_layers)
    except ValueError as e:
        raise AdapterError(f"{cfg_file}: field {e}") from e
    adapter = LoraAdapter(name=name, path=path, rank=rank, scaling=float(scaling), target_modules=frozenset())
    magnitudes = _read_weights(adapter, path, module_shapes, num_layers, experts, ranks)
    # the largest rank it has (PEFT's rank_pattern; the experts' gate/up of a transformers 4 adapter at twice r)
    adapter.rank = max([a.shape[0] for a in adapter.a.values()] + [a.shape[1] for a in adapter.expert_a.values()]
                       or [rank])
    weights_file = path / WEIGHTS_FILE
    if dora:
        missing = sorted(set(adapter.a) - set(magnitudes))
        if missing:
            raise AdapterError(f"{weights_file}: use_dora is set but layer {missing[0][0]} {missing[0][1]} has no "
                               "lora_magnitude_vector")
        for key, magnitude in magnitudes.items():
            adapter.dora_scale[key], adapter.dora_offset[key] = _dora_terms(adapter, key, magnitude, *base_weight(*key))
    elif magnitudes:
        raise AdapterError(f"{weights_file}: lora_magnitude_vector tensors, but {CONFIG_FILE} does not set use_dora")
    return adapter


def dora_row_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``||W + scaling B A||`` of each output row (PEFT's ``DoraLinearLayer.get_weight_norm``), float32."""
    return torch.linalg.norm(weight.float() + scaling * (b.float() @ a.float()), dim=1)


def _dora_terms(adapter: LoraAdapter, key: tuple[int, str], magnitude: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DoRA's output scale ``magnitude / ||W + scaling B A||`` (rows) and the bias term ``(1 - scale) * bias``."""
    scale = magnitude / dora_row_norm(weight, adapter.a[key], adapter.b[key], adapter.scaling)
    return scale, torch.zeros_like(scale) if bias is None else (1 - scale) * bias.float()


def _read_weights(adapter: LoraAdapter, path: Path, module_shapes: dict[str, tuple[int, int]],
                  num_layers: int, experts: ExpertShapes | None, ranks: dict[str, int]
                  ) -> dict[tuple[int, str], torch.Tensor]:
    """Fill ``adapter.a`` / ``adapter.b`` (and the experts'); returns DoRA's magnitude vectors, by (layer, module)."""
    weights_file = path / WEIGHTS_FILE
    tensors = read_adapter_tensors(path)
    targets = set()
    magnitudes = {}
    wrapped: dict[tuple[int, bool], dict[str, torch.Tensor]] = {}  # (layer, inner) -> {"A": ..., "B": ...}
    per_expert: dict[int, dict[tuple[str, int, str], torch.Tensor]] = {}  # transformers 4's layout, by layer
    for key, tensor in tensors.items():
        v4 = V4_EXPERT_KEY.search(key)
        if v4 is not None:
            layer, expert = int(v4.group(1)), int(v4.group(2))
            if experts is None or layer >= num_layers or expert >= experts.num_experts:
                raise AdapterError(f"{weights_file}: tensor {key!r} adapts an expert this model does not have")
            per_expert.setdefault(layer, {})[(v4.group(3), expert, v4.group(4))] = tensor
            continue
        e = EXPERT_KEY.search(key)
        if e is not None:
            layer = int(e.group(1))
            if experts is None:
                raise AdapterError(f"{weights_file}: tensor {key!r} adapts experts; this model is no mixture of "
                                   "experts")
            if layer >= num_layers:
                raise AdapterError(f"{weights_file}: tensor {key!r} is for layer {layer}; the model has {num_layers} "
                                   "layers")
            wrapped.setdefault((layer, e.group(2) is not None), {})[e.group(3)] = tensor
            continue
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{weights_file}: tensor {key!r} is not a LoRA weight of a decoder "
                               f"layer's {', '.join(module_shapes)}")
        layer, module = layer_module(weights_file, key, module_shapes, num_layers)
        which = m.group(3)
        fan_in, fan_out = module_shapes[module]
        if which is None:  # lora_magnitude_vector
            if tuple(tensor.shape) != (fan_out,):
                raise AdapterError(f"{weights_file}: tensor {key!r} has shape {tuple(tensor.shape)}, the model "
                                   f"needs ({fan_out},)")
            magnitudes[(layer, module)] = tensor.float()
            continue
        want = (ranks[module], fan_in) if which == "A" else (fan_out, ranks[module])
        if tuple(tensor.shape) != want:
            raise AdapterError(f"{weights_file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                               f"the model and r={ranks[module]} need {want}")
        (adapter.a if which == "A" else adapter.b)[(layer, module)] = tensor.float()
        targets.add(module)
    for (layer, _), pair in wrapped.items():
        targets.add(_read_expert_pair(adapter, weights_file, layer, pair, experts, ranks))
    for layer, found in per_expert.items():  # as PEFT converts them: gate/up at twice the rank
        try:
            converted = from_v4(found, experts.v4_names, experts.num_experts, f"{weights_file}: layer {layer}")
        except ValueError as err:
            raise AdapterError(str(err)) from err
        for module, (a, b) in converted.items():
            fan_in, fan_out = experts.modules[module]
            if a.shape[2] != fan_in or b.shape[1] != fan_out or a.shape[1] != b.shape[2]:
                raise AdapterError(f"{weights_file}: layer {layer}'s experts' LoRA of {module} has A {tuple(a.shape)} "
                                   f"and B {tuple(b.shape)}; the model needs [E, r, {fan_in}] and [E, {fan_out}, r]")
            adapter.expert_a[(layer, module)], adapter.expert_b[(layer, module)] = a, b
            targets.add(module)
    for key in set(adapter.a) ^ set(adapter.b):
        raise AdapterError(f"{weights_file}: layer {key[0]} {key[1]} has only one of lora_A and lora_B")
    for key in set(magnitudes) - set(adapter.a):
        raise AdapterError(f"{weights_file}: layer {key[0]} {key[1]} has a lora_magnitude_vector but no lora_A/B")
    adapter.target_modules = frozenset(targets)
    return magnitudes


def _read_expert_pair(adapter: LoraAdapter, weights_file: Path, layer: int, pair: dict[str, torch.Tensor],
                      experts: ExpertShapes, ranks: dict[str, int]) -> str:
    """One layer's ``lora_A`` / ``lora_B`` of one expert parameter into ``adapter.expert_a`` / ``expert_b``, the
    parameter told by the shapes (``expert_lora.py``); returns its name."""
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"{weights_file}: layer {layer}'s experts have a lora_{next(iter(pair))} without its "
                           f"lora_{'B' if 'A' in pair else 'A'}")
    a, b = pair["A"], pair["B"]
    for module, (fan_in, fan_out) in experts.modules.items():
        width = experts.num_experts * ranks[module]
        if tuple(a.shape) == (width, fan_in) and tuple(b.shape) == (fan_out, width):
            if (layer, module) in adapter.expert_a:
                raise AdapterError(f"{weights_file}: layer {layer}'s {module} is adapted twice")
            adapter.expert_a[(layer, module)] = a_from_peft(a.float(), experts.num_experts)
            adapter.expert_b[(layer, module)] = b_from_peft(b.float(), experts.num_experts, experts.interleaves(module))
            return module
    n = experts.num_experts
    want = " or ".join(f"{m} (r={ranks[m]}) A {(n * ranks[m], i)} and B {(o, n * ranks[m])}"
                       for m, (i, o) in experts.modules.items())
    raise AdapterError(f"{weights_file}: layer {layer}'s experts have lora_A {tuple(a.shape)} and lora_B "
                       f"{tuple(b.shape)}; {n} experts need {want}")
