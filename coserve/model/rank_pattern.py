"""PEFT's per-module ranks: ``rank_pattern`` and ``alpha_pattern`` of a ``LoraConfig`` (torch-free).

Each key is a regular expression PEFT matches against a targeted module's (or parameter's) path, ``(.*\\.)?(KEY)$``,
the first key that matches giving that module's ``r`` (and ``lora_alpha``). PEFT 0.21 writes them itself when it
turns transformers 4's names of a mixture's experts into transformers 5's parameters: targeting both ``gate_proj`` and
``up_proj`` (Mixtral's ``w1`` and ``w3``) adapts the fused ``experts.gate_up_proj`` at twice the rank and twice the
alpha (``{".*\\.gate_up_proj": 2r}``), so that it holds as much as the two did. coserve applies one scaling per
adapter, so a pattern must keep ``lora_alpha / r`` as the adapter has it; and one rank per module across layers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from coserve.model.linear_modules import EXPERT_MODULES


def module_path(layer: int, module: str) -> str:
    """The path PEFT matches patterns against: ``model.layers.<i>.self_attn.q_proj``, ``...mlp.experts.down_proj``."""
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def _pattern_key(patterns: dict, path: str) -> str | None:
    """PEFT's ``get_pattern_key``: the first key whose expression ends ``path`` at a dot, else None."""
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", path)), None)


def check_patterns(rank_pattern: dict, alpha_pattern: dict) -> None:
    """Each pattern a regular expression with a positive rank (or alpha); errors name the field and key."""
    for name, patterns, kind in (("rank_pattern", rank_pattern, int), ("alpha_pattern", alpha_pattern, float)):
        if not isinstance(patterns, dict):
            raise ValueError(f"{name}: must be an object of pattern -> value, got {type(patterns).__name__}")
        for key, value in patterns.items():
            try:
                re.compile(key)
            except (re.error, TypeError) as e:
                raise ValueError(f"{name}: key {key!r} is not a regular expression ({e})") from e
            ok = isinstance(value, int) if kind is int else isinstance(value, (int, float)) and math.isfinite(value)
            if isinstance(value, bool) or not ok or value <= 0:
                raise ValueError(f"{name}: {key!r} must map to a positive {'integer' if kind is int else 'number'}, "
                                 f"got {value!r}")


def module_ranks(r: int, lora_alpha: float, use_rslora: bool, rank_pattern: dict, alpha_pattern: dict,
                 modules: Iterable[str], num_layers: int) -> dict[str, int]:
    """Each of ``modules``' rank (``r`` where no pattern matches it). A pattern that gives a module other ranks at
    other layers, or a scaling other than the adapter's ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), is refused
    naming the field."""
    def scaling(rank: int, alpha: float) -> float:
        return alpha / (math.sqrt(rank) if use_rslora else rank)

    ranks = {}
    for module in modules:
        seen = set()
        for layer in range(num_layers):
            path = module_path(layer, module)
            rank_key, alpha_key = _pattern_key(rank_pattern, path), _pattern_key(alpha_pattern, path)
            seen.add((rank_pattern[rank_key] if rank_key is not None else r,
                      alpha_pattern[alpha_key] if alpha_key is not None else lora_alpha))
        if len(seen) > 1:
            raise ValueError(f"rank_pattern: gives {module} ranks or alphas {sorted(seen)} at different layers; "
                             "coserve takes one rank per module")
        rank, alpha = seen.pop() if seen else (r, lora_alpha)
        if not math.isclose(scaling(rank, alpha), scaling(r, lora_alpha), rel_tol=1e-12):
            raise ValueError(f"alpha_pattern: {module} at r={rank}, lora_alpha={alpha} scales its update by "
                             f"{scaling(rank, alpha):g}, not the adapter's {scaling(r, lora_alpha):g}; coserve applies "
                             "one scaling per adapter")
        ranks[module] = rank
    return ranks


def expert_targets_from_v4(targets: list[str], names: tuple[str, str, str], r: int, lora_alpha: float,
                           all_linear: bool) -> tuple[list[str], list[str], dict, dict]:
    """``target_modules`` of a mixture as PEFT 0.21 reads them on transformers 5: transformers 4's names of its experts
    (``names``: gate, up, down; ``ExpertShapes.v4_names``) become ``target_parameters``, gate and up together the fused
    ``experts.gate_up_proj`` at twice the rank and alpha (one without the other is refused, as PEFT refuses it), down
    ``experts.down_proj``. ``all_linear``: PEFT's ``all-linear``, which takes both. Returns the modules left, the expert
    parameters, and the rank and alpha patterns."""
    gate, up, down = names
    named = {gate, up, down} if all_linear else set(targets)
    if (gate in named) != (up in named):
        raise ValueError(f"target_modules: {gate if gate in named else up} without {up if gate in named else gate}: "
                         f"the experts' two are fused into {EXPERT_MODULES[0]} (adapt both, as PEFT requires)")
    parameters, rank_pattern, alpha_pattern = [], {}, {}
    if gate in named:
        parameters.append(EXPERT_MODULES[0])
        rank_pattern[r".*\.gate_up_proj"], alpha_pattern[r".*\.gate_up_proj"] = 2 * r, 2 * lora_alpha
    if down in named:
        parameters.append(EXPERT_MODULES[1])
    return [t for t in targets if t not in names], parameters, rank_pattern, alpha_pattern
