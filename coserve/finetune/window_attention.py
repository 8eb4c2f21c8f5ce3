"""Causal attention of a window of tokens over its sequence's keys so far (autograd-friendly)."""

from __future__ import annotations

import torch

from coserve.model.attention import sdpa


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the window's queries over the sequence's first ``p + n`` keys, causal within the window.

    Args:
        q: ``[n, Hq, D]`` rotated queries of the window's tokens (positions ``p .. p + n - 1``).
        k, v: ``[p + n, Hkv, D]`` the sequence's K/V up to the window's end: the prefix the
            window attends to in full, then the window's own (callers pass slices of the
            sequence's K/V cache, so no copy is made).

    Returns:
        ``[n, Hq * D]``.
    """
    n = q.shape[0]
    p = k.shape[0] - n
    if p < 0:
        raise ValueError(f"window_attention: {k.shape[0]} keys for {n} queries")
    mask = None
    if p:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + p
        mask = torch.arange(p + n, device=q.device).unsqueeze(0) <= rows  # [n, p + n]
    out = sdpa(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=not p, scale=scale, enable_gqa=True)  # [1, Hq, n, D]
    return out[0].transpose(0, 1).reshape(n, -1)
