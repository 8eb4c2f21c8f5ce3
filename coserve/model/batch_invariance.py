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
keeps the default mode. ``invariance_violations`` probes the model's own weights at engine start; where rows
depend on their neighbours (cuBLAS on an H100, in float32: ``coserve/model/tiled_gemm.py``) ``plan_fusion``
turns on GEMM tiles if they make the forward invariant, and otherwise the engine warns and, by default
(``EngineConfig.fuse_finetuning="auto"``), runs finetuning windows in matmul calls of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from coserve.model.decoder import BATCH_INVARIANT_ROWS, DecoderModel
from coserve.model.packed_gemm import backend_available

FUSE_CHOICES = ("auto", "always", "never")  # EngineConfig.fuse_finetuning

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


def forward_linear(model: DecoderModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A frozen weight's matmul as the engine runs it when the first ``BATCH_INVARIANT_ROWS`` rows are inference
    rows and the rest (if any) a finetuning window: the inference rows padded (``model.padded_rows``) and, with
    GEMM tiles on, in a call of their own."""
    split = model.padded_rows(BATCH_INVARIANT_ROWS)

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = max(0, split - m)
        return model.linear(torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x, weight, split=split)[:m]
    return linear


def invariance_violations(model: DecoderModel, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                          | None = None, rows: tuple[int, ...] = PROBE_ROWS) -> list[str]:
    """The model's weights (one layer's and the LM head) whose first ``BATCH_INVARIANT_ROWS`` output rows differ,
    bit for bit, between a call of those rows alone and calls of ``rows`` rows: empty when invariant. ``linear``
    defaults to the model's own (``forward_linear``)."""
    linear = linear or forward_linear(model)
    layer = model.layers[0]
    weights = {"qkv": layer.qkv, "o_proj": layer.o, "lm_head": model.lm_head}
    dense = next((lay for lay in model.layers if lay.router is None), None)
    if dense is not None:  # a dense MLP (in a mixture, its dense layers')
        weights.update(gate_up=dense.gate_up, down_proj=dense.down)
    moe = next((lay for lay in model.layers if lay.router is not None), None)
    if moe is not None:  # a mixture: its router and an expert's matrices (each expert's the same shapes)
        weights.update(expert_gate_up=moe.expert_gate_up[0], expert_down=moe.expert_down[0], router=moe.router)
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


# GEMM tile sizes by device type (coserve/model/tiled_gemm.py), used where plain GEMMs are not batch-invariant.
# 128 rows on CUDA: measured on an H100, a call of 128 rows cost as much as one of 32 in bfloat16 and up to 1.5x
# in float32 (``medium``), while a decode batch and a window's first rows share one call. No tiles on CPU: MKL's
# strict mode is invariant, and padding costs CPU time row for row.
GEMM_TILE_ROWS = {"cuda": 128}
# The packed GEMM library tried where another's packs are not batch-invariant: MKL, whose strict mode is (above).
# Seen on a 16-core host (2026-11-28): oneDNN packs rounded the LM head's first 16 rows differently in calls of 16,
# 17, 57, 177 and 300 rows, so an engine that had timed oneDNN faster ran every finetuning window apart.
INVARIANT_PACKS = "mkl"


@dataclass(frozen=True, slots=True)
class Fusion:
    """How an engine runs finetuning forward windows beside inference (``plan_fusion``)."""

    fuse: bool  # windows share the inference rows' matmul calls
    batch_invariant: bool  # an inference row rounds as it would alone (plain GEMMs, or in GEMM tiles)
    violations: tuple[str, ...]  # what plain GEMMs got wrong (``invariance_violations``)
    tile_rows: int  # > 0: GEMM tiles are on
    repacked: str = ""  # the packed GEMM library the frozen weights were moved to because it is invariant ("": none)


def plan_fusion(model: DecoderModel, setting: str) -> Fusion:
    """Probe ``model``'s GEMMs and decide under ``fuse_finetuning=setting`` (auto | always | never). Where they are
    not batch-invariant and fusion is wanted: turns the model's GEMM tiles on (CUDA) if they are, or moves the frozen
    weights' packs to MKL (CPU, packed for oneDNN: its kernels can round a row by the call's size) if MKL's are."""
    if setting not in FUSE_CHOICES:
        raise ValueError(f"fuse_finetuning must be one of {FUSE_CHOICES}, got {setting!r}")
    model.gemm_tile_rows = 0
    violations = tuple(invariance_violations(model))
    tile = GEMM_TILE_ROWS.get(model.device.type, 0)
    if violations and setting != "never" and tile:
        model.gemm_tile_rows = tile
        if not invariance_violations(model):
            return Fusion(True, True, violations, tile)
        model.gemm_tile_rows = 0
    packed = model.packed.backend if model.packed is not None else None
    if violations and setting != "never" and packed not in (None, INVARIANT_PACKS) \
            and backend_available(INVARIANT_PACKS):
        model.pack_gemms(INVARIANT_PACKS)
        if not invariance_violations(model):
            return Fusion(True, True, violations, 0, INVARIANT_PACKS)
        model.pack_gemms(packed)
    invariant = not violations
    return Fusion({"auto": invariant, "always": True, "never": False}[setting], invariant, violations, 0)
