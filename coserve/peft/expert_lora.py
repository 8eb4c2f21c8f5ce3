"""LoRA of a mixture's experts in HF PEFT's layout (``LoraConfig(target_parameters=[...])``, PEFT's ``ParamWrapper``).

PEFT adapts an ``[E, out, in]`` expert parameter (transformers 5's ``mlp.experts.gate_up_proj`` and ``down_proj``)
with one ``lora_A`` ``[E * r, in]`` and one ``lora_B`` ``[out, r * E]``: expert ``e``'s delta is ``scaling * B_e A_e``
with ``A_e`` rows ``e * r .. e * r + r - 1`` of ``lora_A`` and ``B_e`` columns ``e, E + e, 2E + e, ...`` of ``lora_B``
(``get_delta_weight``'s reshapes). coserve keeps them per expert, ``A`` ``[E, r, in]`` and ``B`` ``[E, out, r]``.

gpt-oss's gate/up parameter is ``[E, in, out]`` (PEFT's delta then ``[E, in, out]``, the same ``B_e A_e`` transposed)
and interleaves gate's and up's outputs (gate's the even ones), which coserve holds as all of gate's then all of up's
(``DecoderLayer._fused_experts``): its ``B_e``'s rows are reordered so on reading and back on writing
(``interleaved``).

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


def b_from_peft(b: torch.Tensor, num_experts: int, interleaved: bool = False) -> torch.Tensor:
    """PEFT's ``lora_B`` ``[out, r * E]`` (column ``j * E + e``: expert e's j-th) as per-expert ``[E, out, r]``; an
    ``interleaved`` gate/up's rows (gpt-oss's) as gate's then up's."""
    b = b.reshape(b.shape[0], b.shape[1] // num_experts, num_experts).permute(2, 0, 1)
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1) if interleaved else b.contiguous()


def a_to_peft(a: torch.Tensor) -> torch.Tensor:
    """``a_from_peft``'s inverse."""
    return a.reshape(a.shape[0] * a.shape[1], a.shape[2])


def b_to_peft(b: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``b_from_peft``'s inverse."""
    if interleaved:  # gate's rows back to the even places, up's to the odd
        half = b.shape[1] // 2
        b = torch.stack([b[:, :half], b[:, half:]], dim=2).flatten(1, 2)
    return b.permute(1, 2, 0).reshape(b.shape[1], b.shape[2] * b.shape[0])


def peft_prefix(layer: int, module: str, modules: frozenset[str] | set[str]) -> str:
    """The PEFT name of ``module``'s wrapper at ``layer`` (its tensors add ``.lora_A.weight`` / ``.lora_B.weight``),
    ``modules`` being every expert parameter the adapter adapts."""
    inner = module == EXPERT_MODULES[0] and len(set(modules) & set(EXPERT_MODULES)) > 1
    return f"base_model.model.model.layers.{layer}.mlp.experts" + (".base_layer" if inner else "")


# transformers 4's layout: one LoRA per expert module, "...layers.<i>.<block_sparse_moe|mlp>.experts.<e>.<name>.lora_A"
V4_EXPERT_KEY = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.lora_([AB])\.weight$")


def from_v4(tensors: dict[tuple[str, int, str], torch.Tensor], names: tuple[str, str, str], num_experts: int,
            where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's experts' LoRAs in transformers 4's layout (``tensors``: by (module name, expert, "A" | "B");
    ``names``: the gate, up and down modules' names, Mixtral's w1, w3, w2) as transformers 5's expert parameters, as
    PEFT 0.21 converts them on loading: gate's and up's A stacked (``[2r, H]``) and their B's block-diagonal
    (``[2I, 2r]``), a rank twice the adapter's; down as it is. Returns ``{module: (A [E, r', in], B [E, out, r'])}``;
    ``where`` names the file and layer in errors."""
    gate, up, down = names
    present = {name for name, _, _ in tensors}
    unknown = sorted(present - set(names))
    if unknown:
        raise ValueError(f"{where}: experts' modules {unknown} are not this model's ({', '.join(names)})")

    def stacked(name: str, which: str) -> torch.Tensor:
        missing = [e for e in range(num_experts) if (name, e, which) not in tensors]
        if missing:
            raise ValueError(f"{where}: expert {missing[0]}'s {name} has no lora_{which}")
        return torch.stack([tensors[(name, e, which)].float() for e in range(num_experts)])

    out = {}
    parts = [n for n in (gate, up) if n in present]
    if parts:
        a = torch.cat([stacked(n, "A") for n in parts], dim=1)  # [E, r * parts, H]
        bs = [stacked(n, "B") for n in (gate, up)] if len(parts) == 2 else None
        if bs is None:  # one of the two: the other's rows of the fused output get no update
            b_one = stacked(parts[0], "B")
            zeros = torch.zeros_like(b_one)
            bs = [b_one, zeros] if parts[0] == gate else [zeros, b_one]
            out[EXPERT_MODULES[0]] = (a, torch.cat(bs, dim=1))
        else:
            out[EXPERT_MODULES[0]] = (a, torch.cat([torch.cat([bs[0], torch.zeros_like(bs[1])], dim=2),
                                                   torch.cat([torch.zeros_like(bs[0]), bs[1]], dim=2)], dim=1))
    if down in present:
        out[EXPERT_MODULES[1]] = (stacked(down, "A"), stacked(down, "B"))
    return out


def v4_to_peft(tensors: dict[str, torch.Tensor], names: tuple[str, str, str], num_experts: int, where: str
               ) -> dict[str, torch.Tensor]:
    """An adapter file's tensors with its experts' in transformers 4's layout (and Mixtral's ``block_sparse_moe``
    router) renamed and converted to transformers 5's PEFT layout (``from_v4``); others as they are."""
    out, per_layer = {}, {}
    for key, tensor in tensors.items():
        m = V4_EXPERT_KEY.search(key)
        if m is None:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        per_layer.setdefault(int(m.group(1)), {})[(m.group(3), int(m.group(2)), m.group(4))] = tensor
    for layer, found in per_layer.items():
        converted = from_v4(found, names, num_experts, f"{where}: layer {layer}")
        for module, (a, b) in converted.items():
            prefix = peft_prefix(layer, module, set(converted))
            out[f"{prefix}.lora_A.weight"], out[f"{prefix}.lora_B.weight"] = a_to_peft(a), b_to_peft(b)
    return out
