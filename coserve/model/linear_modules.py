"""The decoder's linear modules by the names adapters target, per architecture (torch-free: the graph planner and
the server read them too).

Llama, Qwen and Mistral checkpoints hold q/k/v and gate/up as separate modules; Phi-3's hold each group as one
(``qkv_proj``, ``gate_up_proj``), and a PEFT adapter of Phi-3 adapts the fused module as a whole: one LoRA ``A``
over the input and one ``B`` over every row of q, k and v, one IA3 vector over them all. coserve runs the fused
weights either way; a model's adapters name its own modules (``DecoderModel.module_shapes``' keys).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Llama-family modules, in layer order.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused modules, each with its parts in the order of its output rows.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# A mixture's router, by the name its PEFT module has (``mlp.gate``: ``[E, H]``), and as a parameter
ROUTER = "gate"
ROUTER_PARAMETER = "gate.weight"
# Qwen2-MoE's shared expert's modules and its gate, by their PEFT paths under the MLP (PEFT's gate_proj, up_proj and
# down_proj there: no expert's, these)
SHARED_EXPERT_MODULES = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                         "shared_expert_gate")
# Every name any model has (indices are stable: LoRA dropout seeds mix them in).
ALL_TARGET_MODULES = TARGET_MODULES + tuple(FUSED_PARTS) + (ROUTER,) + SHARED_EXPERT_MODULES
# A mixture's experts' gate, up and down modules in transformers 4 (Mixtral's: w1, w3, w2), which PEFT 0.21 reads as
# its experts' parameters on transformers 5 (``rank_pattern.expert_targets_from_v4``)
V4_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
# Modules whose input a bypass may rescale (IA3's feed-forward placement): each has its own matmul.
INPUT_SCALABLE_MODULES = ("o_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear module of the decoder layers (not the LM head)
# A mixture's experts, as PEFT's ``target_parameters`` name them (transformers 5 holds each layer's experts as two
# parameters, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``): the names
# coserve keys their adapters by, in the order of the experts' parameters (the order PEFT nests its wrappers in).
EXPERT_MODULES = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True, slots=True)
class ExpertShapes:
    """A mixture of experts' adaptable parameters: ``(in_features, out_features)`` of each expert's matrix by its
    ``EXPERT_MODULES`` name, and how many experts each layer has."""

    num_experts: int
    modules: dict[str, tuple[int, int]]
    shared_expert: bool = False  # Qwen2-MoE's, beside the experts (its modules: SHARED_EXPERT_MODULES)
    v4_names: tuple[str, ...] = V4_EXPERT_NAMES  # its experts' modules by transformers 4's names (gpt-oss: none, and
    #   PEFT's all-linear leaves its experts out)
    layers: tuple[int, ...] = ()  # the layers holding the mixture where others have a dense MLP (empty: every layer)
    gate_up_interleaved: bool = False  # PEFT's gate/up interleaves gate's and up's rows (gpt-oss's: expert_lora.py)

    def in_layer(self, module: str, layer: int) -> bool:
        """Whether ``layer`` has ``module``: a mixture's (its router, experts and shared expert) only where the layer
        holds it; any other in every layer."""
        return not self.layers or layer in self.layers or module not in (ROUTER, *SHARED_EXPERT_MODULES,
                                                                          *EXPERT_MODULES)

    def interleaves(self, module: str) -> bool:
        """Whether PEFT's ``lora_B`` of expert parameter ``module`` holds gate's and up's rows alternately (gpt-oss's
        gate/up: ``coserve/peft/expert_lora.py``)."""
        return module == EXPERT_MODULES[0] and self.gate_up_interleaved


def shared_expert_shapes(hidden: int, size: int) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of Qwen2-MoE's shared expert's modules (``SHARED_EXPERT_MODULES``) for its
    intermediate ``size`` (none where 0)."""
    if not size:
        return {}
    return dict(zip(SHARED_EXPERT_MODULES, ((hidden, size), (hidden, size), (size, hidden), (hidden, 1))))


def module_name(target: str) -> str:
    """A saved adapter's ``target_modules`` entry as a module name: PEFT writes the ones ``all-linear`` found as full
    paths (``model.layers.0.mlp.shared_expert.down_proj``), which end in the module's name under its block."""
    return re.sub(r"^(?:.*\.)?layers\.\d+\.(?:self_attn|mlp)\.", "", target)


def ordered(modules: Iterable[str]) -> list[str]:
    """``modules`` in layer order (``ALL_TARGET_MODULES``'s, fused modules beside their parts)."""
    order = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", ROUTER, *SHARED_EXPERT_MODULES, "gate_proj",
             "up_proj", "gate_up_proj", "down_proj")
    chosen = set(modules)
    return [m for m in order if m in chosen]


def attention_only(modules: Iterable[str]) -> bool:
    """Whether a model's adaptable modules are its attention's (and its router's) alone: a mixture of experts, whose
    experts are parameters (``DecoderModel.module_shapes``, ``expert_shapes``)."""
    return "down_proj" not in set(modules)


def resolve_targets(targets: Iterable[str], available: Iterable[str], field: str = "target_modules") -> list[str]:
    """``targets`` as the model's own module names, in layer order (``ordered``: the order PEFT wraps them in, whatever
    order they were given in): ``all-linear`` (alone) is every one of ``available`` (on a mixture of experts, the
    attention and the router; PEFT's also takes the experts, as ``target_parameters``: ``peft.config.for_model``); a
    name the model lacks is refused, naming ``field`` and what the model has."""
    targets, available = list(targets), list(available)
    if targets == [ALL_LINEAR]:
        return available
    missing = [m for m in targets if m not in available]
    if missing:
        hint = ""
        fused = [f for f, parts in FUSED_PARTS.items() if set(missing) & set(parts) and f in available]
        split = [p for m in missing for p in FUSED_PARTS.get(m, ()) if p in available]
        if fused:
            hint = " (" + "; ".join(f"its {f} holds {', '.join(FUSED_PARTS[f])}" for f in fused) + ")"
        elif split:
            hint = f" (its {', '.join(split)} are separate modules)"
        raise ValueError(f"{field}: {missing} are not modules of this model, which has {', '.join(available)}"
                         f"{hint}")
    return ordered(targets)


def is_router_parameter(name: str) -> bool:
    """Whether a ``target_parameters`` name is a mixture's router weight (``gate.weight``: PEFT 0.21 with transformers
    5 adapts Mixtral's router, named ``gate`` among ``target_modules``, as that parameter; its tensors are named as a
    module's, ``mlp.gate.lora_A.weight``, and it is the ``ROUTER`` module here)."""
    return isinstance(name, str) and f".mlp.{ROUTER_PARAMETER}".endswith(f".{name}")


def resolve_expert_targets(targets: Iterable[str], experts: ExpertShapes | None,
                           field: str = "target_parameters") -> list[str]:
    """PEFT's ``target_parameters`` as ``EXPERT_MODULES`` names: each matches as PEFT matches it, a parameter's name
    ending in it (``gate_up_proj``, ``experts.gate_up_proj`` or ``mlp.experts.gate_up_proj``, and the same of
    ``down_proj``); the router's weight (``is_router_parameter``) is left out, being the ``ROUTER`` module. A model
    without experts, a name that is no expert parameter, or one of some layers only (``7.mlp.experts.down_proj``) is
    refused, naming ``field``."""
    targets = [t for t in targets if not is_router_parameter(t)]
    if targets and experts is None:
        raise ValueError(f"{field}: {targets} name experts' parameters; this model is no mixture of experts")
    return expert_parameter_names(targets, field)


def expert_parameter_names(targets: Iterable[str], field: str = "target_parameters") -> list[str]:
    """``resolve_expert_targets`` without a model: each name as its ``EXPERT_MODULES`` name (the router's weight left
    out), a name that is no expert parameter refused, naming ``field``."""
    out = set()
    targets = [t for t in targets if not is_router_parameter(t)]
    for t in targets:
        found = [m for m in EXPERT_MODULES if isinstance(t, str) and f".mlp.{m}".endswith(f".{t}")]
        if not found:
            raise ValueError(f"{field}: {t!r} is not an expert parameter coserve adapts; choose from "
                             f"{', '.join(EXPERT_MODULES)} (every layer's)")
        out.add(found[0])
    return [m for m in EXPERT_MODULES if m in out]


def split_fused(modules: Iterable[str]) -> list[str]:
    """``modules`` with each fused one replaced by its parts (how the graph planner prices a fused module's bypass:
    the same tensors kept, the same inputs recomputed)."""
    return ordered(p for m in modules for p in FUSED_PARTS.get(m, (m,)))
