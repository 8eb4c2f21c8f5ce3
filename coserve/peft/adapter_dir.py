"""An HF PEFT adapter directory on disk: ``adapter_config.json`` + ``adapter_model.safetensors``.

Reading both files with errors that name the file, shared by the LoRA and IA3 loaders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from coserve.model.config import read_json_file
from coserve.model.linear_modules import module_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The decoder-layer part of a PEFT tensor name: "...layers.<i>.<self_attn|mlp>.<module>.<rest>" (Qwen2-MoE's shared
# expert's modules: "mlp.shared_expert.<module>"; Mixtral's MLP in transformers 4: "block_sparse_moe")
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp|block_sparse_moe)\.((?:shared_expert\.)?\w+)\.")


class AdapterError(ValueError):
    """An adapter directory that does not load or does not fit the model."""


def write_adapter_files(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """``adapter_model.safetensors`` (CPU tensors under their HF PEFT names) and ``adapter_config.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def read_adapter_config(path: Path) -> dict:
    """``adapter_config.json`` of the directory ``path`` as a dict."""
    config = read_json_file(path / CONFIG_FILE, "the adapter directory", AdapterError)
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE}: must hold a JSON object, got {type(config).__name__}")
    return config


def peft_type(config: dict) -> str:
    """The config's ``peft_type``, upper-cased (``LORA``, ``IA3``, ...; empty when absent)."""
    return str(config.get("peft_type", "")).upper()


def check_target_names(cfg_file: Path, targets: list, kind: str, modules: Iterable[str]) -> None:
    """A ``target_modules`` list names only modules of the model (``modules``: ``DecoderModel.module_shapes``' keys)."""
    modules = list(modules)
    unknown = sorted({module_name(t) for t in targets} - set(modules))
    if unknown:
        raise AdapterError(f"{cfg_file}: field 'target_modules' names {unknown}, which this model "
                           f"does not have as {kind} targets ({', '.join(modules)})")


def read_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``adapter_model.safetensors`` (on the CPU); refuses a missing, unreadable or empty file."""
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise AdapterError(f"{weights_file}: missing (only safetensors adapters are supported)")
    try:
        tensors = load_file(str(weights_file), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise AdapterError(f"{weights_file}: cannot read safetensors file ({e})") from e
    if not tensors:
        raise AdapterError(f"{weights_file}: holds no tensors")
    return tensors


def layer_module(weights_file: Path, key: str, module_shapes: dict[str, tuple[int, int]],
                 num_layers: int) -> tuple[int, str]:
    """The ``(layer, module)`` a tensor name belongs to, checked against the model's layers and modules."""
    m = _LAYER_KEY.search(key)
    if m is None:
        raise AdapterError(f"{weights_file}: tensor {key!r} does not belong to a decoder layer's "
                           f"{', '.join(module_shapes)}")
    layer, module = int(m.group(1)), m.group(2)
    if module not in module_shapes:
        raise AdapterError(f"{weights_file}: tensor {key!r} targets {module!r}, which the model lacks")
    if layer >= num_layers:
        raise AdapterError(f"{weights_file}: tensor {key!r} is for layer {layer}; the model has {num_layers} layers")
    return layer, module
