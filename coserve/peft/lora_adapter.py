"""HF PEFT LoRA adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coserve.peft.adapter_dir import (CONFIG_FILE, WEIGHTS_FILE, AdapterError, check_target_names, layer_module,
                                      peft_type, read_adapter_config, read_adapter_tensors)

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(?:([AB])\.weight|(magnitude_vector))$")
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


def load_lora_adapter(name: str, path: str | Path, module_shapes: dict[str, tuple[int, int]],
                      num_layers: int, base_weight: BaseWeight | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter against the model's shapes; errors name the file and field. A DoRA
    adapter (``use_dora``) needs ``base_weight``: its magnitudes are turned into output scales against the frozen
    weights once, here."""
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
    for fld in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(fld):
            raise AdapterError(f"{cfg_file}: field {fld!r} is not supported (per-module ranks or saved modules)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        check_target_names(cfg_file, targets, "LoRA", module_shapes)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(name=name, path=path, rank=rank, scaling=float(scaling),
                          target_modules=frozenset())
    magnitudes = _read_weights(adapter, path, module_shapes, num_layers)
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
                  num_layers: int) -> dict[tuple[int, str], torch.Tensor]:
    """Fill ``adapter.a`` / ``adapter.b``; returns DoRA's magnitude vectors, by (layer, module)."""
    weights_file = path / WEIGHTS_FILE
    tensors = read_adapter_tensors(path)
    targets = set()
    magnitudes = {}
    for key, tensor in tensors.items():
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
        want = (adapter.rank, fan_in) if which == "A" else (fan_out, adapter.rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"{weights_file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                               f"the model and r={adapter.rank} need {want}")
        (adapter.a if which == "A" else adapter.b)[(layer, module)] = tensor.float()
        targets.add(module)
    for key in set(adapter.a) ^ set(adapter.b):
        raise AdapterError(f"{weights_file}: layer {key[0]} {key[1]} has only one of lora_A and lora_B")
    for key in set(magnitudes) - set(adapter.a):
        raise AdapterError(f"{weights_file}: layer {key[0]} {key[1]} has a lora_magnitude_vector but no lora_A/B")
    adapter.target_modules = frozenset(targets)
    return magnitudes
