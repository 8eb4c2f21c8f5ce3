"""The decoder's linear modules by the names adapters target, per architecture (torch-free: the graph planner and
the server read them too).

Llama, Qwen and Mistral checkpoints hold q/k/v and gate/up as separate modules; Phi-3's hold each group as one
(``qkv_proj``, ``gate_up_proj``), and a PEFT adapter of Phi-3 adapts the fused module as a whole: one LoRA ``A``
over the input and one ``B`` over every row of q, k and v, one IA3 vector over them all. coserve runs the fused
weights either way; a model's adapters name its own modules (``DecoderModel.module_shapes``' keys).
"""

from __future__ import annotations

from collections.abc import Iterable

# Llama-family modules, in layer order.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused modules, each with its parts in the order of its output rows.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Every name any model has (indices are stable: LoRA dropout seeds mix them in).
ALL_TARGET_MODULES = TARGET_MODULES + tuple(FUSED_PARTS)
# Modules whose input a bypass may rescale (IA3's feed-forward placement): each has its own matmul.
INPUT_SCALABLE_MODULES = ("o_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear module of the decoder layers (not the LM head)


def ordered(modules: Iterable[str]) -> list[str]:
    """``modules`` in layer order (``ALL_TARGET_MODULES``'s, fused modules beside their parts)."""
    order = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
    chosen = set(modules)
    return [m for m in order if m in chosen]


def attention_only(modules: Iterable[str]) -> bool:
    """Whether a model's adaptable modules are its attention's alone (a mixture of experts: no MLP module of its
    takes an adapter, ``DecoderModel.module_shapes``)."""
    return "down_proj" not in set(modules)


def resolve_targets(targets: Iterable[str], available: Iterable[str], field: str = "target_modules") -> list[str]:
    """``targets`` as the model's own module names, in layer order (``ordered``: the order PEFT wraps them in, whatever
    order they were given in): ``all-linear`` (alone) is every one of ``available``; a name the model lacks is
    refused, naming ``field`` and what the model has. A mixture of experts (no adaptable MLP module) refuses
    ``all-linear``: PEFT's wraps its router and experts too, which coserve does not adapt."""
    targets, available = list(targets), list(available)
    if targets == [ALL_LINEAR]:
        if attention_only(available):
            raise ValueError(f"{field}: 'all-linear' on a mixture of experts is, in PEFT, the attention, the router "
                             f"and the experts; coserve adapts the attention alone: name them ({', '.join(available)})")
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


def split_fused(modules: Iterable[str]) -> list[str]:
    """``modules`` with each fused one replaced by its parts (how the graph planner prices a fused module's bypass:
    the same tensors kept, the same inputs recomputed)."""
    return ordered(p for m in modules for p in FUSED_PARTS.get(m, (m,)))
