"""The backward of RMSNorm, by hand (for the finetuning executors, which run without autograd)."""

from __future__ import annotations

import torch


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """dL/dx of ``weight * (x * rsqrt(mean(x^2) + eps))`` (computed in float32 like the forward)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dy.float() * weight.float()
    return (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
