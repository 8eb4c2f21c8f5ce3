"""HF transformers models as the benchmarks' and tests' reference: loaded with the attention that computes what the
checkpoint's architecture defines."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Architectures whose scores HF's fused SDPA path does not compute as defined: Gemma 2 caps them
# (``attn_logit_softcapping``); transformers 5.17 chose SDPA for it by default and left the cap out (its greedy
# tokens then differed from eager's at the 5th of 8 on the tiny model), later versions refuse SDPA for it.
EAGER_MODEL_TYPES = frozenset({"gemma2"})


def hf_load_kwargs(model_dir: str | Path) -> dict:
    """``from_pretrained``'s extra arguments for the model in ``model_dir``: eager attention where needed."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    return {"attn_implementation": "eager"} if model_type in EAGER_MODEL_TYPES else {}


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)``, eager attention where needed."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **{**hf_load_kwargs(model_dir), **kwargs})
