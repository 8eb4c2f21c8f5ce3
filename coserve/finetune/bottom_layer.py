"""What the bottom layer's backward costs against another layer's, for one job. The bottom layer's input is
the frozen embedding, so its backward stops at the lowest trainable module (for LoRA on down_proj: the gate
projection recomputed and the adapter's gradients); the co-serving scheduler prices that layer's token-layers
with the ratio, so that a sequence's last backward slice is not sized as if it were a whole layer's work.

A job starts from a timing on a scratch sequence (``measure_bottom_layer_cost``); on a CPU, where a window's
wall time is its work, the windows the job then runs refine it (``BottomLayerCost.record``): in the engine's
iterations the bottom layer measured a third of another layer's time per token-layer, against a fifth on the
warm scratch sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from coserve.finetune.token_windows import backward_window, forward_window

if TYPE_CHECKING:
    from coserve.finetune.job import FinetuneJob

MEASURE_TOKENS = 128  # a scratch sequence's length (shorter when the job's sequences are)
REPEATS = 2  # the fastest of this many timings of each layer counts
MIN_SHARE = 0.02
DECAY = 0.95  # per window: how much of the past a running estimate keeps


@dataclass(slots=True)
class BottomLayerCost:
    """The bottom layer's backward seconds per token-layer over the other layers', as windows are timed
    (running sums that forget the past at ``DECAY`` per window of each kind); ``share`` until both kinds
    have been timed."""

    share: float = 1.0
    bottom_s: float = 0.0
    bottom_tokens: float = 0.0
    other_s: float = 0.0
    other_tokens: float = 0.0

    def record(self, bottom: bool, token_layers: int, seconds: float) -> None:
        if token_layers <= 0:
            return
        if bottom:
            self.bottom_s = self.bottom_s * DECAY + seconds
            self.bottom_tokens = self.bottom_tokens * DECAY + token_layers
        else:
            self.other_s = self.other_s * DECAY + seconds
            self.other_tokens = self.other_tokens * DECAY + token_layers
        if self.bottom_tokens and self.other_tokens and self.other_s > 0:
            ratio = (self.bottom_s / self.bottom_tokens) / (self.other_s / self.other_tokens)
            self.share = min(1.0, max(MIN_SHARE, ratio))


def measure_bottom_layer_cost(job: "FinetuneJob", tokens: int = MEASURE_TOKENS, repeats: int = REPEATS) -> float:
    """The bottom layer's backward time over the top layer's, for one whole-sequence window of a scratch
    sequence (clamped to ``[MIN_SHARE, 1]``). The job is left as it was: its position, and its adapter's
    gradients (restored: the scratch backward adds to them)."""
    model, bypass = job.model, job.bypass
    n = max(2, min(tokens, job.longest_tokens))
    ids = [(7 * i + 5) % model.cfg.vocab_size for i in range(n)]
    params = bypass.parameters()
    saved = [p.grad for p in params]
    top, bottom = [], []
    try:
        for _ in range(repeats):
            for p in params:
                p.grad = None
            state = job.scratch_sequence(ids)
            forward_window(model, bypass, state, n, 1.0 / n)
            top.append(_timed(model.device, lambda: backward_window(model, bypass, state, n)))
            state.backward_layer, state.backward_end = 0, n  # straight to the bottom layer (only the time counts)
            bottom.append(_timed(model.device, lambda: backward_window(model, bypass, state, n)))
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return min(1.0, max(MIN_SHARE, min(bottom) / min(top)))


def _timed(device: torch.device, fn) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
