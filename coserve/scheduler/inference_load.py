"""The inference load: the share of recent wall time that the inference work of the iterations would take alone.

Co-serving stretches decode iterations to the TPOT target with finetuning work, so the requests in flight bank no
slack; when a burst of arrivals then saturates the engine, every one of them misses the SLO. Under load, a wider
margin trains as much (the engine is busy with inference anyway) and keeps slack for the next burst, so the
scheduler widens its margin with this load before the misses come (``Scheduler.iteration_budget_s``).
"""

from __future__ import annotations

import math


class InferenceLoad:
    """Exponentially time-decayed sums of the predicted inference-alone seconds of each iteration and of the wall
    time they covered (idle gaps included): ``share()`` is their ratio, over about the last ``tau_s`` seconds."""

    def __init__(self, tau_s: float) -> None:
        if not tau_s > 0:
            raise ValueError(f"tau_s must be positive, got {tau_s!r}")
        self.tau_s = tau_s
        self._busy = 0.0
        self._wall = 0.0
        self._last: float | None = None

    def observe(self, now: float, inference_s: float) -> None:
        """An iteration ended at ``now`` whose inference rows alone would take ``inference_s`` seconds."""
        if self._last is None:
            self._last = now
            return
        dt = max(now - self._last, 0.0)
        self._last = now
        decay = math.exp(-dt / self.tau_s)
        self._busy = self._busy * decay + max(inference_s, 0.0)
        self._wall = self._wall * decay + dt

    def share(self) -> float:
        """The decayed inference seconds over the decayed wall seconds, in [0, 1] (0 before two observations)."""
        return min(self._busy / self._wall, 1.0) if self._wall > 0 else 0.0
