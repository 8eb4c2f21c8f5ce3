"""Frozen weights pre-packed for the CPU's GEMM library (float32): matmuls of few rows at up to 4x the speed.

An ordinary ``sgemm`` call re-packs panels of the weight into its internal layout every time; with the 8 rows of a
decode batch or the 64 of a finetuning window that packing costs about as much as the arithmetic. Both GEMM
libraries in a CPU build of torch can pack a weight once and multiply any number of rows by the packed copy:

- ``mkl``: MKL's ``cblas_sgemm_pack`` (``torch.ops.mkl._mkl_reorder_linear_weight``, then ``_mkl_linear``).
  Measured on a 2-core Intel Xeon (MKL's strict mode): the ``small`` preset's gate/up weight (512 -> 2,816) ran
  8 rows at 102 -> 201 GFLOP/s, 64 rows at 273 -> 332, 1,024 rows at 335 -> 334; its down_proj (1,408 -> 512)
  8 rows at 107 -> 276.
- ``onednn``: oneDNN's reordered weight (``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise``,
  as torch.compile's CPU backend runs linear layers). Measured on a 2-core AMD EPYC (Zen 4), where MKL takes a
  slower path: the gate/up weight at 4 rows 38 (MKL packed) -> 152 GFLOP/s, 64 rows 161 -> 223, 1,024 rows 180 ->
  221; the LM head (512 -> 8,192) at 64 rows 104 -> 209.

``gemm_backend`` picks one per machine by timing both on the matmul shapes of a small model, and keeps the answer
for later processes (``gemm_choice.py``; ``COSERVE_GEMMS``: ``mkl``, ``onednn`` or ``plain`` decides instead). A
pack takes about as much memory as its weight.

Results are not bit-identical to ``F.linear``'s (other kernels), but a row's result still does not depend on the
rows beside it in calls of 2 rows or more (MKL in its strict mode; oneDNN on the 2-core machines measured, not on a
16-core host's, whose engine then packs for MKL instead): ``batch_invariance.py`` probes the model's own path at
engine start. The input gradient of a frozen weight (``dy @ W``) has packs of its
own, made on first use (only finetuning needs them). Autograd never sees a packed product: where the input needs
a gradient, ``F.linear`` runs.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coserve.model import gemm_choice

GEMM_BACKENDS = ("mkl", "onednn")
# A backend is chosen over MKL's only when it is this much faster on the timed shapes (so that a machine where
# the two are close keeps one answer from process to process: the latency profile is keyed by it).
SWITCH_SPEEDUP = 1.15


@dataclass(frozen=True, slots=True)
class _Backend:
    name: str
    input_grad_rows: int  # input gradients of more rows than this run plain (only finetuning computes them, so no
    #   inference row's result depends on the choice)

    def available(self) -> bool:
        if self.name == "mkl":
            return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
                    and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        # the row count given here only sizes the library's hint; the pack serves calls of any row count
        if self.name == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(weight, 64)
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)

    def mm(self, x: torch.Tensor, pack: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.name == "mkl":
            return torch.ops.mkl._mkl_linear(x, pack, weight, bias, x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, pack, bias, "none", [], "")


# MKL (Intel Xeon): from about 512 rows a packed input gradient was no faster, and whole-sequence backward steps
# ran 2-3% slower with packs. oneDNN (AMD EPYC): packed products were faster at every row count timed (up to 1,024).
_BACKENDS = {"mkl": _Backend("mkl", 256), "onednn": _Backend("onednn", 1 << 30)}


def backend_available(name: str) -> bool:
    """Whether this torch has the packed GEMM of library ``name`` (``GEMM_BACKENDS``)."""
    return _BACKENDS[name].available()


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether frozen weights on ``device`` in ``dtype`` can be packed (a CPU torch built with MKL or oneDNN,
    float32)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and any(b.available() for b in _BACKENDS.values()))


def gemm_backend(device: torch.device, dtype: torch.dtype) -> str | None:
    """The GEMM library that frozen weights on ``device`` in ``dtype`` run packed in (``GEMM_BACKENDS``), or None
    (plain ``F.linear``): ``$COSERVE_GEMMS`` if set (``mkl``, ``onednn``, ``plain``; ``auto`` the default), else
    the faster of the two on this machine (timed by its first process and kept, ``gemm_choice.py``; MKL unless
    oneDNN wins by ``SWITCH_SPEEDUP``)."""
    if not packing_available(device, dtype):
        return None
    setting = (os.environ.get("COSERVE_GEMMS") or "auto").strip().lower()
    if setting == "plain":
        return None
    if setting in _BACKENDS:
        if not _BACKENDS[setting].available():
            raise ValueError(f"COSERVE_GEMMS: this torch has no {setting} packed GEMM")
        return setting
    if setting != "auto":
        raise ValueError(f"COSERVE_GEMMS: {setting!r} is not one of auto, plain, {', '.join(GEMM_BACKENDS)}")
    return _timed_choice()


@functools.cache
def _timed_choice() -> str:
    """The available backend ``_pick`` takes after ``_timings``: once per machine, kept on disk (``gemm_choice.py``),
    then once per process."""
    backends = [b for b in _BACKENDS.values() if b.available()]
    if len(backends) == 1:
        return backends[0].name
    saved = gemm_choice.saved_choice([b.name for b in backends])
    if saved is not None:
        return saved
    seconds = _timings(backends)
    choice = _pick(seconds)
    gemm_choice.save_choice(choice, seconds)
    return choice


def _pick(seconds: dict[str, float]) -> str:
    """The fastest backend by ``seconds``, except that MKL stays unless the fastest beats it by ``SWITCH_SPEEDUP``."""
    best = min(seconds, key=seconds.get)
    if "mkl" in seconds and best != "mkl" and seconds["mkl"] < SWITCH_SPEEDUP * seconds[best]:
        return "mkl"
    return best


def _timings(backends: list[_Backend]) -> dict[str, float]:
    """Seconds each backend takes for a small model's matmuls (a 512 -> 2,816 and a 1,408 -> 512 weight, 8 and
    64 rows; the median of 15 rounds)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(2816, 512, generator=g), torch.randn(512, 1408, generator=g)]
    inputs = [torch.randn(m, w.shape[1], generator=g) for w in weights for m in (8, 64)]
    seconds = {}
    for b in backends:
        packs = [b.pack(w) for w in weights]
        calls = [(x, packs[i // 2], weights[i // 2]) for i, x in enumerate(inputs)]

        def once() -> float:
            t = time.perf_counter()
            for x, pack, w in calls:
                b.mm(x, pack, w, None)
            return time.perf_counter() - t

        for _ in range(3):
            once()
        seconds[b.name] = statistics.median(once() for _ in range(15))
    return seconds


class PackedWeights:
    """Packs of a model's frozen ``[out, in]`` weights in one GEMM library (``GEMM_BACKENDS``), found by the weight
    tensor itself (each kept alive here, so no other live tensor can share its ``id``). A weight is allowed once
    and packed on its first use (an engine that never finetunes never packs the transposed weights); others run
    plain ``F.linear``."""

    def __init__(self, backend: str = "mkl") -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {', '.join(GEMM_BACKENDS)}")
        self.backend = backend
        self._lib = _BACKENDS[backend]
        self._allowed: dict[int, torch.Tensor] = {}  # id(weight) -> weight
        self._forward: dict[int, torch.Tensor] = {}  # id(weight) -> pack of weight
        self._transposed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight^T, its pack)

    def allow(self, *weights: torch.Tensor) -> None:
        for w in weights:
            self._allowed[id(w)] = w

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for ``x`` ``[m, in]``, by the pack where the weight is allowed and no
        gradient is wanted."""
        key = id(weight)
        if key not in self._allowed or x.dim() != 2 or x.dtype != torch.float32 or _wants_grad(x, bias):
            return F.linear(x, weight, bias)
        pack = self._forward.get(key)
        if pack is None:
            pack = self._forward[key] = self._lib.pack(weight)
        return self._lib.mm(x.contiguous(), pack, weight, bias)

    def input_grad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``dy @ weight`` (dL/dx of ``x @ weight^T``) for ``dy`` ``[m, out]``, by a pack of ``weight^T`` where
        ``weight`` is allowed."""
        key = id(weight)
        if (key not in self._allowed or dy.dim() != 2 or dy.dtype != torch.float32 or _wants_grad(dy, None)
                or dy.shape[0] > self._lib.input_grad_rows):
            return dy @ weight
        entry = self._transposed.get(key)
        if entry is None:
            wt = weight.t().contiguous()  # [in, out], the product's "weight" (a view where weight is column-major)
            entry = self._transposed[key] = (wt, self._lib.pack(wt))
        return self._lib.mm(dy.contiguous(), entry[1], entry[0], None)

    def num_bytes(self) -> int:
        """Memory the packs hold, counted as their weights' size (what a pack measured as in RSS)."""
        w = self._allowed
        return (sum(w[k].numel() * w[k].element_size() for k in self._forward)
                + sum(w[k].numel() * w[k].element_size() for k in self._transposed))


def _wants_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
