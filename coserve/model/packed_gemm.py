"""Frozen weights pre-packed for MKL's GEMM (CPU, float32): matmuls of few rows at up to 2.5x the speed.

An ordinary MKL ``sgemm`` call re-packs panels of the weight into its internal layout every time; with the 8
rows of a decode batch or the 64 of a finetuning window that packing costs about as much as the arithmetic.
MKL can pack a weight once (``cblas_sgemm_pack``, reached through ``torch.ops.mkl._mkl_reorder_linear_weight``)
and multiply any number of rows by the packed copy (``_mkl_linear``). Measured on the development machine
(2-core Intel Xeon, MKL's strict mode): the ``small`` preset's gate/up weight (512 -> 2,816) ran 8 rows at
102 -> 201 GFLOP/s, 64 rows at 273 -> 332, 1,024 rows at 335 -> 334; its down_proj (1,408 -> 512) 8 rows at
107 -> 276. A pack takes about as much memory as its weight.

Results are not bit-identical to ``F.linear``'s (a different kernel), but a row's result still does not
depend on the rows beside it (calls of 8 to 400 rows, MKL's strict mode: ``batch_invariance.py`` probes the
model's own path at engine start). The input gradient of a frozen weight (``dy @ W``) has packs of its own,
made on first use (only finetuning needs them). Autograd never sees a packed product: where the input needs a
gradient, ``F.linear`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# Input gradients of more rows than this run plain (only finetuning computes them, so no inference row's result
# depends on the choice): from about 512 rows a packed product was no faster here, and whole-sequence
# backward steps ran 2-3% slower with packs.
INPUT_GRAD_PACKED_ROWS = 256


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether frozen weights on ``device`` in ``dtype`` can be packed (a CPU torch built with MKL, float32)."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear") and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # the row count given here only sizes MKL's hint; the pack serves calls of any row count
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, 64)


class PackedWeights:
    """MKL packs of a model's frozen ``[out, in]`` weights, found by the weight tensor itself (each kept alive
    here, so no other live tensor can share its ``id``). A weight is allowed once and packed on its first use
    (an engine that never finetunes never packs the transposed weights); others run plain ``F.linear``."""

    def __init__(self) -> None:
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
            pack = self._forward[key] = _pack(weight)
        return torch.ops.mkl._mkl_linear(x.contiguous(), pack, weight, bias, x.shape[0])

    def input_grad(self, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``dy @ weight`` (dL/dx of ``x @ weight^T``) for ``dy`` ``[m, out]``, by a pack of ``weight^T`` where
        ``weight`` is allowed."""
        key = id(weight)
        if (key not in self._allowed or dy.dim() != 2 or dy.dtype != torch.float32 or _wants_grad(dy, None)
                or dy.shape[0] > INPUT_GRAD_PACKED_ROWS):
            return dy @ weight
        entry = self._transposed.get(key)
        if entry is None:
            wt = weight.t().contiguous()  # [in, out], the product's "weight" (a view where weight is column-major)
            entry = self._transposed[key] = (wt, _pack(wt))
        return torch.ops.mkl._mkl_linear(dy.contiguous(), entry[1], entry[0], None, dy.shape[0])

    def num_bytes(self) -> int:
        """Memory the packs hold, counted as their weights' size (what a pack measured as in RSS)."""
        w = self._allowed
        return (sum(w[k].numel() * w[k].element_size() for k in self._forward)
                + sum(w[k].numel() * w[k].element_size() for k in self._transposed))


def _wants_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
