"""What the job watcher keeps of every job the engine co-serves, whatever its kind (supervised and preference jobs:
``jobs.Running``; reinforcement jobs: ``rft_jobs.RFTRunning``)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class FollowedJob:
    """A job the engine is co-serving, and how far the watcher has followed it."""

    job_id: str
    tenant: str
    name: str  # its fine_tuned_model, once it succeeds
    checkpoint_every: int  # optimizer steps between servable checkpoints
    _: KW_ONLY
    logged: int = 0  # records of its log already turned into events
    tokens: int = 0  # trained tokens already counted in the metrics
    saved: list[tuple[int, Path]] = field(default_factory=list)  # checkpoints written, not yet recorded
