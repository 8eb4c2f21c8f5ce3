"""Random HF PEFT LoRA adapters of a model, for the multi-adapter generation benchmark: written by PEFT itself
(``get_peft_model`` and ``save_pretrained``), with B drawn non-zero so that each adapter changes the outputs."""

from __future__ import annotations

from pathlib import Path

import torch

from coserve.bench.hf_reference import load_hf_model

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
B_STD = 0.05  # the spread of B's entries: enough that the adapters' outputs differ from the base model's


def make_lora_adapters(model_dir: str | Path, out_root: Path, count: int, rank: int, targets: list[str],
                       seed: int = 0) -> list[Path]:
    """``count`` PEFT LoRA adapter directories under ``out_root`` (``a0``, ``a1``, ...), adapter ``i`` drawn from
    ``seed + i``; returns their paths."""
    from peft import LoraConfig, get_peft_model

    paths = []
    base = load_hf_model(model_dir) if count else None
    for i in range(count):
        torch.manual_seed(seed + i)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, B_STD)
        path = out_root / f"a{i}"
        model.save_pretrained(str(path))
        paths.append(path)
        base = model.unload()  # the base model without this adapter's layers, for the next one
    return paths
