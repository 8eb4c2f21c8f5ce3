"""GEMM tiles: batch-invariant matmuls where the BLAS library is not (cuBLAS).

cuBLAS picks its kernel (tile shape, split-K) by the problem's size, so a row's result depends on how many
rows share its call: measured on an H100 in float32, the ``small`` preset's weights rounded a row
differently in calls of 1, 2-10 and 11 or more rows, and a co-served finetuning window changed the
logprobs of 8 of 8 requests (tokens the same). Within one kernel a row's result depends only on its own
input, so a call's row count must depend on the inference rows alone (every weight of ``small`` and
``medium``, both dtypes, calls of 32 to 512 rows: bit-identical rows whatever the other rows held).

So, with tiles on, the inference rows of a forward run padded to a whole number of tiles (``padded_rows``),
in a call of their own: alone, the padding is zero rows; in a fused forward it is the finetuning window's
first rows, and the window's other rows run in a second call (``split_linear``). A fused forward makes at
most two calls per matmul, and inference alone one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_rows(rows: int, min_rows: int, tile_rows: int) -> int:
    """The row count of the call that ``rows`` inference rows run in: at least ``min_rows``, and a multiple of
    ``tile_rows`` when tiles are on (``tile_rows`` > 0)."""
    rows = max(rows, min_rows)
    return -(-rows // tile_rows) * tile_rows if tile_rows else rows


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, rows ``[:split]`` in a call of their own when ``0 < split < len(x)``."""
    if 0 < split < x.shape[0]:
        return torch.cat([F.linear(x[:split], weight, bias), F.linear(x[split:], weight, bias)])
    return F.linear(x, weight, bias)
