"""Optimizers and learning-rate schedules (the formulas of transformers' ``get_*_schedule_with_warmup``)."""

from __future__ import annotations

import math

import torch

from coserve.finetune.config import FinetuneConfig


def make_optimizer(params: list[torch.Tensor], cfg: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW (torch's betas and eps) or SGD over the adapter parameters."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_factor(step: int, cfg: FinetuneConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return step / max(1, cfg.warmup_steps)
    if cfg.lr_scheduler == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.lr_scheduler == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: FinetuneConfig, total_steps: int
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following ``lr_factor``; its state is saved with the optimizer's."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
