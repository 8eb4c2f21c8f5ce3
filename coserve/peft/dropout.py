"""Dropout masks that depend only on (seed, layer, module, token position, feature).

Token-level finetuning runs a token's forward and its backward in different windows; a
counter-based hash (no RNG state) gives the same mask however the tokens are windowed.
"""

from __future__ import annotations

import torch

_M31 = (1 << 31) - 1  # products of two 31-bit numbers fit in int64


def mix_seed(*parts: int) -> int:
    """A 31-bit seed from integers (job seed, step, sequence, layer, module, ...)."""
    h = 0x2545F491
    for p in parts:
        h = ((h ^ (p & _M31)) * 0x5BD1E995 + 0x27D4EB2F) & _M31
        h ^= h >> 13
    return h


def keep_mask(seed: int, positions: torch.Tensor, width: int, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``[n, width]`` of 0 (dropped) or ``1 / (1 - p)`` (kept), for rows at ``positions`` ``[n]``."""
    feats = torch.arange(width, device=positions.device, dtype=torch.int64)
    h = (positions.to(torch.int64).unsqueeze(1) * 0x01000193 + feats.unsqueeze(0) * 0x3C6EF35F + seed) & _M31
    for mult in (0x45D9F3B, 0x119DE1F3, 0x2C1B3C6D):
        h = ((h ^ (h >> 15)) * mult) & _M31
    h = h ^ (h >> 16)
    uniform = h.to(torch.float64) / float(_M31 + 1)
    return (uniform >= p).to(dtype) / (1.0 - p)
