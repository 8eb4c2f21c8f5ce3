"""A new trainable bypass from a PEFT config (shared by ``coserve finetune`` and ``LLM.finetune``)."""

from __future__ import annotations

import torch

from coserve.model.decoder import DecoderModel
from coserve.peft.config import IA3Config, LoraConfig
from coserve.peft.trainable import TrainableBypass, TrainableIA3, TrainableLora


def make_bypass(peft: LoraConfig | IA3Config, model: DecoderModel, seed: int) -> TrainableBypass:
    """LoRA (PEFT's initialisation, drawn from ``seed``) or IA3 (ones) over ``model``'s modules."""
    shapes, layers = model.module_shapes(), model.cfg.num_layers
    if isinstance(peft, IA3Config):
        return TrainableIA3(peft, shapes, layers, model.device)
    if isinstance(peft, LoraConfig):
        try:
            return TrainableLora(peft, shapes, layers, model.device, torch.Generator().manual_seed(seed),
                                 base_weight=model.module_weight if peft.use_dora else None)
        except (RuntimeError, TypeError, OverflowError) as e:
            if isinstance(e, RuntimeError) and not _allocation_failed(e):
                raise  # not the rank's size: a fault of its own, reported as it is
            params = layers * sum(peft.r * sum(shapes[m]) for m in peft.target_modules)
            raise ValueError(f"r: a rank-{peft.r} LoRA on {', '.join(peft.target_modules)} has {params:,} "
                             f"parameters, which cannot be allocated ({type(e).__name__})") from e
    raise ValueError(f"peft: expected a LoraConfig or IA3Config, got {type(peft).__name__}")


def _allocation_failed(error: RuntimeError) -> bool:
    """Whether torch could not make a tensor that large (out of memory, or a size past its arithmetic)."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "allocat" in text or "overflow" in text
