"""Random HF PEFT LoRA adapters of a model, for the multi-adapter generation benchmark: written by PEFT itself
(``get_peft_model`` and ``save_pretrained``), with B drawn non-zero so that each adapter changes the outputs."""

from __future__ import annotations

from pathlib import Path

import torch

from coserve.bench.hf_reference import load_hf_model
from coserve.model.linear_modules import EXPERT_MODULES

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
B_STD = 0.05  # the spread of B's entries: enough that the adapters' outputs differ from the base model's


def split_targets(names: list[str]) -> tuple[list[str], list[str]]:
    """A benchmark's target list as PEFT's ``target_modules`` and ``target_parameters`` (a mixture's experts:
    ``EXPERT_MODULES``' names)."""
    return [n for n in names if n not in EXPERT_MODULES], [n for n in names if n in EXPERT_MODULES]


def make_lora_adapters(model_dir: str | Path, out_root: Path, count: int, rank: int, targets: list[str],
                       seed: int = 0) -> list[Path]:
    """``count`` PEFT LoRA adapter directories under ``out_root`` (``a0``, ``a1``, ...), adapter ``i`` drawn from
    ``seed + i``; returns their paths."""
    from peft import LoraConfig, get_peft_model

    paths = []
    base = load_hf_model(model_dir) if count else None
    for i in range(count):
        torch.manual_seed(seed + i)
        modules, experts = split_targets(list(targets))
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=modules,
                                                target_parameters=experts or None))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, B_STD)
        path = out_root / f"a{i}"
        model.save_pretrained(str(path))
        paths.append(path)
        base = model.unload()  # the base model without this adapter's layers, for the next one
    return paths
