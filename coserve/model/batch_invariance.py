"""Batch invariance: an inference row's result must not depend on which rows are computed beside it.

Co-serving runs a finetuning window's rows in the same matmul calls as the inference rows, so a GEMM whose
rounding depends on the number of rows would let a finetuning job change inference outputs (logprobs bit
for bit, and a token wherever two candidates are that close). Two measures keep it from happening:

- Inference batches run over at least ``BATCH_INVARIANT_ROWS`` rows (``coserve.model.decoder``): GEMMs
  round a row differently in calls of very few rows.
- On CPU, MKL is asked for its strict conditional-numerical-reproducibility mode (``MKL_CBWR=AUTO,STRICT``,
  set when ``coserve`` is imported, unless the environment sets it). By default it changes how it splits
  the work between threads with the number of rows: measured on a 2-core Intel Xeon, the ``small``
  preset's down_proj (1,408 inputs) rounded a row differently in calls of 2-16, 17-176 and 177 or more
  rows, and 24 of 24 co-served requests came out with other logprobs (same tokens) than alone. Under the
  strict mode every call of 2 rows or more agrees bit for bit; decode and 64-token windows ran within noise,
  whole-sequence finetuning steps about 5% slower, so processes that serve no inference give MKL its own mode
  back (``release_strict_cpu_gemms``).

MKL reads the setting at its first call, so a process that multiplied matrices before importing coserve
keeps the default mode; ``invariance_violations`` probes the model's own weights at engine start, and where
rows depend on their neighbours (cuBLAS makes no promise either) the engine warns and, by default
(``EngineConfig.fuse_finetuning="auto"``), runs finetuning windows in matmul calls of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from coserve.model.decoder import BATCH_INVARIANT_ROWS, DecoderModel

PROBE_ROWS = (16, 17, 57, 177, 300)  # call sizes compared with BATCH_INVARIANT_ROWS rows alone (regime edges seen)


def release_strict_cpu_gemms() -> None:
    """For a process that serves no inference (``coserve finetune``, ``coserve bench-finetune``, the training
    process of the ``separate`` baseline), and the processes it starts: MKL's mode as the environment had it
    before coserve. Strict mode buys them nothing and costs a whole-sequence finetuning step about 5%
    (measured here: LoRA on down_proj 1,430 -> 1,367 tokens/s, on every linear module 1,244 -> 1,157). Only
    effective before the process's first MKL call."""
    os.environ["COSERVE_STRICT_GEMMS"] = "0"
    original = os.environ.get("COSERVE_MKL_CBWR_ORIGINAL", "")
    if original:
        os.environ["MKL_CBWR"] = original
    else:
        os.environ.pop("MKL_CBWR", None)


def invariance_violations(model: DecoderModel, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                          = F.linear, rows: tuple[int, ...] = PROBE_ROWS) -> list[str]:
    """The model's weights (one layer's and the LM head) whose first ``BATCH_INVARIANT_ROWS`` output rows differ,
    bit for bit, between a call of those rows alone and calls of ``rows`` rows: empty when invariant."""
    layer = model.layers[0]
    weights = {"qkv": layer.qkv, "o_proj": layer.o, "gate_up": layer.gate_up, "down_proj": layer.down,
               "lm_head": model.lm_head}
    generator = torch.Generator(device=model.device).manual_seed(0)
    found = []
    with torch.inference_mode():
        for name, weight in weights.items():
            x = torch.randn(max(rows), weight.shape[1], generator=generator, device=model.device,
                            dtype=weight.dtype)
            alone = linear(x[:BATCH_INVARIANT_ROWS], weight)
            beside = [m for m in rows if not torch.equal(linear(x[:m], weight)[:BATCH_INVARIANT_ROWS], alone)]
            if beside:
                found.append(f"{name} ({weight.shape[1]} -> {weight.shape[0]}) in calls of {beside} rows")
    return found
