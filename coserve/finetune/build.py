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
        return TrainableLora(peft, shapes, layers, model.device, torch.Generator().manual_seed(seed),
                             base_weight=model.module_weight if peft.use_dora else None)
    raise ValueError(f"peft: expected a LoraConfig or IA3Config, got {type(peft).__name__}")
