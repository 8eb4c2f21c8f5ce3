"""HF PEFT IA3 adapter files: learned vectors that scale a module's output, or a feed-forward module's input.

PEFT saves one ``ia3_l`` tensor per adapted module and layer: ``[out, 1]`` for a module whose output it
scales, ``[1, in]`` for a feed-forward module (``feedforward_modules``), whose input it scales. On Llama,
PEFT's default placement scales the outputs of k_proj and v_proj and the input of down_proj.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coserve.model.linear_modules import INPUT_SCALABLE_MODULES
from coserve.peft.adapter_dir import (CONFIG_FILE, WEIGHTS_FILE, AdapterError, check_target_names, layer_module,
                                      peft_type, read_adapter_config, read_adapter_tensors)

_PEFT_PREFIX = "base_model.model."  # PeftModel's prefix before the base model's own module names


@dataclass(slots=True)
class IA3Adapter:
    """One IA3 adapter's vectors on the CPU in float32, keyed by (layer, module)."""

    name: str
    path: Path
    output_scales: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [out]: y * l
    input_scales: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # [in]: W (x * l)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(m for _, m in (*self.output_scales, *self.input_scales))


@dataclass(slots=True)
class _Placement:
    """What ``adapter_config.json`` says about where the vectors go."""

    targets: list[str] | None  # plain module names, or None when the config gives a regex
    feedforward: list[str] | str  # names (PEFT matches them as suffixes) or a regex (full match)
    complete: bool  # every listed target must have a vector in every layer (no exclude_modules)

    def is_feedforward(self, module_key: str) -> bool:
        """PEFT's own rule (``IA3Model._check_target_module_feedforward``) for a base-model module name."""
        if isinstance(self.feedforward, str):
            return re.fullmatch(self.feedforward, module_key) is not None
        return any(module_key.endswith(name) for name in self.feedforward)


def load_ia3_adapter(name: str, path: str | Path, module_shapes: dict[str, tuple[int, int]],
                     num_layers: int) -> IA3Adapter:
    """Read and check a PEFT IA3 adapter against the model's shapes; errors name the file and field."""
    path = Path(path)
    placement = _read_placement(path, module_shapes)
    adapter = IA3Adapter(name=name, path=path)
    weights_file = path / WEIGHTS_FILE
    for key, tensor in read_adapter_tensors(path).items():
        if not key.endswith(".ia3_l"):
            raise AdapterError(f"{weights_file}: tensor {key!r} is not an IA3 vector (ia3_l)")
        layer, module = layer_module(weights_file, key, module_shapes, num_layers)
        if placement.targets is not None and module not in placement.targets:
            raise AdapterError(f"{weights_file}: tensor {key!r} adapts {module}, which field 'target_modules' "
                               f"of {path / CONFIG_FILE} does not list ({placement.targets})")
        if not tensor.is_floating_point():
            raise AdapterError(f"{weights_file}: tensor {key!r} has dtype {tensor.dtype}; IA3 vectors are floats")
        module_key = key.removeprefix(_PEFT_PREFIX).removesuffix(".ia3_l")
        scales_input = placement.is_feedforward(module_key)
        if scales_input and module not in INPUT_SCALABLE_MODULES:
            raise AdapterError(f"{path / CONFIG_FILE}: field 'feedforward_modules' makes {module} input-scaled; "
                               f"input scaling is supported on {', '.join(INPUT_SCALABLE_MODULES)} only")
        fan_in, fan_out = module_shapes[module]
        want = (1, fan_in) if scales_input else (fan_out, 1)
        if tuple(tensor.shape) != want:
            role = "input scale (a feed-forward module)" if scales_input else "output scale"
            raise AdapterError(f"{weights_file}: tensor {key!r} has shape {tuple(tensor.shape)}; as {module}'s "
                               f"{role}, per field 'feedforward_modules', the model needs {want}")
        (adapter.input_scales if scales_input else adapter.output_scales)[(layer, module)] = tensor.float().flatten()
    if placement.complete:
        _check_complete(adapter, placement.targets, num_layers, weights_file)
    return adapter


def _read_placement(path: Path, module_shapes: dict[str, tuple[int, int]]) -> _Placement:
    config = read_adapter_config(path)
    cfg_file = path / CONFIG_FILE
    if peft_type(config) != "IA3":
        raise AdapterError(f"{cfg_file}: field 'peft_type' = {config.get('peft_type')!r}; expected IA3")
    if config.get("fan_in_fan_out", False):
        raise AdapterError(f"{cfg_file}: field 'fan_in_fan_out' = {config['fan_in_fan_out']!r} is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{cfg_file}: field 'modules_to_save' is not supported (saved modules)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        check_target_names(cfg_file, targets, "IA3", module_shapes)
    elif not isinstance(targets, str):
        raise AdapterError(f"{cfg_file}: field 'target_modules' must be a list of module names or a regex, "
                           f"got {targets!r}")
    feedforward = config.get("feedforward_modules") or []
    if not isinstance(feedforward, (list, str)):
        raise AdapterError(f"{cfg_file}: field 'feedforward_modules' must be a list of module names or a regex, "
                           f"got {feedforward!r}")
    if isinstance(feedforward, list) and isinstance(targets, list) and not set(feedforward) <= set(targets):
        raise AdapterError(f"{cfg_file}: field 'feedforward_modules' names {sorted(set(feedforward) - set(targets))}, "
                           "which field 'target_modules' does not")
    return _Placement(targets if isinstance(targets, list) else None, feedforward,
                      complete=isinstance(targets, list) and not config.get("exclude_modules"))


def _check_complete(adapter: IA3Adapter, targets: list[str], num_layers: int, weights_file: Path) -> None:
    """Every listed module has a vector in every layer (PEFT would silently leave a missing one at its init)."""
    have = set(adapter.output_scales) | set(adapter.input_scales)
    for layer in range(num_layers):
        for module in targets:
            if (layer, module) not in have:
                raise AdapterError(f"{weights_file}: no ia3_l vector for layer {layer} {module}, "
                                   "which field 'target_modules' lists")
