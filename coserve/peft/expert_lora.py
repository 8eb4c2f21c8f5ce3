"""LoRA of a mixture's experts in HF PEFT's layout (``LoraConfig(target_parameters=[...])``, PEFT's ``ParamWrapper``).

PEFT adapts an ``[E, out, in]`` expert parameter (transformers 5's ``mlp.experts.gate_up_proj`` and ``down_proj``)
with one ``lora_A`` ``[E * r, in]`` and one ``lora_B`` ``[out, r * E]``: expert ``e``'s delta is ``scaling * B_e A_e``
with ``A_e`` rows ``e * r .. e * r + r - 1`` of ``lora_A`` and ``B_e`` columns ``e, E + e, 2E + e, ...`` of ``lora_B``
(``get_delta_weight``'s reshapes). coserve keeps them per expert, ``A`` ``[E, r, in]`` and ``B`` ``[E, out, r]``.

Where both parameters of a layer's experts are adapted, PEFT nests one wrapper in the other, in the order of the
module's parameters: gate/up's tensors are named ``mlp.experts.base_layer.lora_A.weight``, down's
``mlp.experts.lora_A.weight``; with one adapted, it is ``mlp.experts.lora_A.weight``. Reading tells them apart by
shape, which is unambiguous (gate/up maps ``H -> 2I``, down ``I -> H``).
"""

from __future__ import annotations

import re

import torch

from coserve.model.linear_modules import EXPERT_MODULES

# "...layers.<i>.mlp.experts[.base_layer].lora_<A|B>.weight"
EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(base_layer\.)?lora_([AB])\.weight$")


def a_from_peft(a: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT's ``lora_A`` ``[E * r, in]`` as per-expert ``[E, r, in]``."""
    return a.reshape(num_experts, a.shape[0] // num_experts, a.shape[1]).contiguous()


def b_from_peft(b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT's ``lora_B`` ``[out, r * E]`` (column ``j * E + e``: expert e's j-th) as per-expert ``[E, out, r]``."""
    return b.reshape(b.shape[0], b.shape[1] // num_experts, num_experts).permute(2, 0, 1).contiguous()


def a_to_peft(a: torch.Tensor) -> torch.Tensor:
    """``a_from_peft``'s inverse."""
    return a.reshape(a.shape[0] * a.shape[1], a.shape[2])


def b_to_peft(b: torch.Tensor) -> torch.Tensor:
    """``b_from_peft``'s inverse."""
    return b.permute(1, 2, 0).reshape(b.shape[1], b.shape[2] * b.shape[0])


def peft_prefix(layer: int, module: str, modules: frozenset[str] | set[str]) -> str:
    """The PEFT name of ``module``'s wrapper at ``layer`` (its tensors add ``.lora_A.weight`` / ``.lora_B.weight``),
    ``modules`` being every expert parameter the adapter adapts."""
    inner = module == EXPERT_MODULES[0] and len(set(modules) & set(EXPERT_MODULES)) > 1
    return f"base_model.model.model.layers.{layer}.mlp.experts" + (".base_layer" if inner else "")
