"""HF PEFT LoRA adapter files: ``adapter_config.json`` + ``adapter_model.safetensors``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coserve.model.decoder import TARGET_MODULES
from coserve.peft.adapter_dir import (CONFIG_FILE, WEIGHTS_FILE, AdapterError, check_target_names, layer_module,
                                      peft_type, read_adapter_config, read_adapter_tensors)

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

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


def load_lora_adapter(name: str, path: str | Path, module_shapes: dict[str, tuple[int, int]],
                      num_layers: int) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter against the model's shapes; errors name the file and field."""
    path = Path(path)
    config = read_adapter_config(path)
    cfg_file = path / CONFIG_FILE
    if peft_type(config) != "LORA":
        raise AdapterError(f"{cfg_file}: field 'peft_type' = {config.get('peft_type')!r}; expected LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{cfg_file}: field 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"{cfg_file}: field 'lora_alpha' must be a number, got {alpha!r}")
    for fld, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(fld, ok) != ok:
            raise AdapterError(f"{cfg_file}: field {fld!r} = {config[fld]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{cfg_file}: field 'bias' = {config['bias']!r} is not supported (only 'none')")
    for fld in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(fld):
            raise AdapterError(f"{cfg_file}: field {fld!r} is not supported (per-module ranks or saved modules)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        check_target_names(cfg_file, targets, "LoRA")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoraAdapter(name=name, path=path, rank=rank, scaling=float(scaling),
                          target_modules=frozenset())
    _read_weights(adapter, path, module_shapes, num_layers)
    return adapter


def _read_weights(adapter: LoraAdapter, path: Path, module_shapes: dict[str, tuple[int, int]],
                  num_layers: int) -> None:
    weights_file = path / WEIGHTS_FILE
    tensors = read_adapter_tensors(path)
    targets = set()
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{weights_file}: tensor {key!r} is not a LoRA weight of a decoder "
                               f"layer's {', '.join(TARGET_MODULES)}")
        layer, module = layer_module(weights_file, key, module_shapes, num_layers)
        which = m.group(3)
        fan_in, fan_out = module_shapes[module]
        want = (adapter.rank, fan_in) if which == "A" else (fan_out, adapter.rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"{weights_file}: tensor {key!r} has shape {tuple(tensor.shape)}, "
                               f"the model and r={adapter.rank} need {want}")
        (adapter.a if which == "A" else adapter.b)[(layer, module)] = tensor.float()
        targets.add(module)
    for key in set(adapter.a) ^ set(adapter.b):
        raise AdapterError(f"{weights_file}: layer {key[0]} {key[1]} has only one of lora_A and lora_B")
    adapter.target_modules = frozenset(targets)
