"""RMSNorm's statistics and its backward, by hand (for the finetuning executors, which run without autograd)."""

from __future__ import annotations

import torch


def rms_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x in float32, rsqrt(mean(x^2) + eps))``: what the forward computes and the backward reads, so that a
    backward which has just recomputed the forward need not compute them again."""
    xf = x.float()
    return xf, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                      stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """dL/dx of ``weight * (x * rsqrt(mean(x^2) + eps))`` (computed in float32 like the forward); ``stats``:
    ``rms_norm_stats(x, eps)`` where already at hand. ``weight`` may be given in float32 already (no copy then)."""
    xf, rstd = stats if stats is not None else rms_norm_stats(x, eps)
    xhat = xf * rstd
    g = dy.float() * weight.float()
    return (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
