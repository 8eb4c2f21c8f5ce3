"""Driving a FinetuneJob's windows from a plain loop (the co-serving engine interleaves them instead)."""

from __future__ import annotations

import random
import time

from tqdm.auto import tqdm

from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import FinetuneJob


class WindowSizes:
    """Window sizes per ``FinetuneConfig``: whole passes, a fixed size, or random sizes (``random:SEED``)."""

    def __init__(self, cfg: FinetuneConfig) -> None:
        self.fixed = cfg.window_tokens
        self.rng = random.Random(int(cfg.window_schedule.split(":")[1])) if cfg.window_schedule else None

    def next(self, pending: int) -> int:
        """The next window's size given ``pending`` tokens left in the current pass or layer."""
        if self.rng is not None:
            return self.rng.choice([1, self.rng.randint(1, pending), pending])
        return min(self.fixed, pending) if self.fixed else pending


def run_job(job: FinetuneJob, progress: bool = True) -> None:
    """Run every window until the job is done, then save the adapter and optimizer state."""
    sizes = WindowSizes(job.cfg)
    bar = tqdm(total=job.total_steps, initial=job.step, disable=not progress, desc="finetune", unit="step")
    start, tokens_at_start = time.perf_counter(), job.tokens_done
    logged = len(job.log)
    while (kind := job.next_work()) is not None:
        n = sizes.next(job.pending_tokens())
        if kind == "forward":
            job.forward(n)
        else:
            job.backward(n)
        if len(job.log) > logged:
            logged = len(job.log)
            rate = (job.tokens_done - tokens_at_start) / max(1e-9, time.perf_counter() - start)
            bar.set_postfix(loss=f"{job.log[-1].loss:.4f}", tok_s=f"{rate:.0f}")
            bar.update(1)
    bar.close()
    job.save()
