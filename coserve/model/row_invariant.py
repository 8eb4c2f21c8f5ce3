"""Elementwise functions whose value for an element does not depend on the tensor around it.

A CPU kernel over a contiguous tensor runs its vector path over most elements and a scalar path over the last few,
and for transcendental functions the two paths' bits can differ (``torch.sigmoid`` did on this project's 2-core
Xeon). Which elements the scalar path takes depends on the tensor's size, so a row's result would depend on how
many rows share the call, and a co-served finetuning window, which changes that, would change an inference output.
Softmax runs each row of its last dimension on its own: a function of one element written as a softmax over a
two-element row is the same for that element whatever surrounds it.
"""

from __future__ import annotations

import torch


def elementwise_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)``, each element as the first entry of the softmax of ``[x, 0]``."""
    return torch.softmax(torch.stack([x, torch.zeros_like(x)], dim=-1), dim=-1)[..., 0]
