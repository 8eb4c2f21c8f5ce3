"""Causal attention of a window of tokens over its sequence's cached prefix (autograd-friendly)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_attention(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_own: torch.Tensor,
                     v_own: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of window queries over ``prefix + own`` keys, causal within the window.

    Args:
        q: ``[n, Hq, D]`` rotated queries of the window's tokens.
        k_prefix, v_prefix: ``[p, Hkv, D]`` the sequence's K/V before the window.
        k_own, v_own: ``[n, Hkv, D]`` the window's own K/V.

    Returns:
        ``[n, Hq * D]``.
    """
    n, p = q.shape[0], k_prefix.shape[0]
    k = torch.cat([k_prefix, k_own]) if p else k_own
    v = torch.cat([v_prefix, v_own]) if p else v_own
    mask = None
    if p:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + p
        mask = torch.arange(p + n, device=q.device).unsqueeze(0) <= rows  # [n, p + n]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=not p, scale=scale, enable_gqa=True)  # [1, Hq, n, D]
    return out[0].transpose(0, 1).reshape(n, -1)
