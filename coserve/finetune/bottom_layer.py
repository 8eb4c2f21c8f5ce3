"""What the bottom layer's backward costs against another layer's, timed on a job's own model, adapter and
plan. The bottom layer's input is the frozen embedding, so its backward stops at the lowest trainable module
(for LoRA on down_proj: the gate projection recomputed and the adapter's gradients, about a fifth of a layer);
the co-serving scheduler prices that layer's token-layers with the ratio, so that a sequence's last backward
slice is not sized as if it were a whole layer's work.
"""

from __future__ import annotations

import time

import torch

from coserve.finetune.job import FinetuneJob
from coserve.finetune.token_windows import backward_window, forward_window

MEASURE_TOKENS = 128  # a scratch sequence's length (shorter when the job's sequences are)
REPEATS = 2  # the fastest of this many timings of each layer counts
MIN_SHARE = 0.02


def measure_bottom_layer_cost(job: FinetuneJob, tokens: int = MEASURE_TOKENS, repeats: int = REPEATS) -> float:
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
