"""Whole-sequence finetuning with plain autograd: the oracle for token-level windows."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.finetune.token_windows import training_rows
from coserve.finetune.window_attention import window_attention
from coserve.model.decoder import Bypass, DecoderModel
from coserve.model.rope import sequence_rows


def whole_sequence_loss(model: DecoderModel, bypass: Bypass, token_ids: list[int], targets: list[int],
                        dropout_seed: int | None = 0) -> torch.Tensor:
    """Summed cross-entropy of one sequence, differentiable w.r.t. the bypass parameters
    (``dropout_seed`` None: no dropout, as for validation)."""
    logits = whole_sequence_logits(model, bypass, token_ids, dropout_seed)
    tgt = torch.tensor(targets, device=model.device)
    return F.cross_entropy(logits, tgt, ignore_index=IGNORE_INDEX, reduction="sum")


def whole_sequence_logits(model: DecoderModel, bypass: Bypass, token_ids: list[int],
                          dropout_seed: int | None = 0) -> torch.Tensor:
    """The sequence's logits ``[N, V]`` (float32) in one autograd forward."""
    ids = torch.tensor(token_ids, device=model.device)
    positions = sequence_rows(len(token_ids), model.long_rope_from, model.device)  # the rotary tables' rows
    def attend(q, k, v, i):
        return window_attention(q, k, v, model.attention[i])

    x = model.embed_tokens(ids)
    with training_rows(bypass, dropout_seed, positions) if dropout_seed is not None else contextlib.nullcontext():
        for layer in model.layers:
            x, _, _ = model.layer_forward(layer, x, positions, attend, bypass)
    return model.logits(model.final_norm(x))
