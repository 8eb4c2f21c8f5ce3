"""Scheduler limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    """Budgets that bound one iteration; validated on construction."""

    max_num_batched_tokens: int = 2048  # new tokens per iteration, all requests together
    max_num_seqs: int = 128  # requests running at once
    max_model_len: int = 2048  # prompt plus output tokens of one request
    max_loras: int = 4  # distinct adapters among the running requests

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_loras"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
