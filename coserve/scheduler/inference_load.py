"""The inference load: the share of recent wall time that the inference work of the iterations would take alone.

Co-serving stretches decode iterations to the TPOT target with finetuning work, so the requests in flight bank no
slack; when a burst of arrivals then saturates the engine, every one of them misses the SLO. Under load, a wider
margin trains about as much (the engine is busy with inference anyway) and keeps slack for the next burst, so the
scheduler widens its margin with this load before the misses come (``TpotBudget.budget_s``).

The load must not rise because the margin did. Every iteration pays a fixed cost whatever it carries (the latency
model's ``overhead`` term: on a 2-core CPU about half of a small decode step), so a wider margin, which shortens
iterations, makes the same requests cost more of the wall time: counted in full, that cost held the margin at its
widest at 1 req/s on a slower CPU, where the decode rows then ran in small, costly batches (``docs/benchmark-
history.md``). So the fixed part is counted as if the iteration had been as long as ``stretch_s`` (the longest the
SLO lets a decode iteration be): the load the requests would put on an engine that batched them as widely as it
may. The cost of each token (matmuls, attention) counts in full.
"""

from __future__ import annotations

import math


class InferenceLoad:
    """Exponentially time-decayed sums of the predicted inference-alone seconds of each iteration and of the wall
    time they covered (idle gaps included): ``share()`` is their ratio, over about the last ``tau_s`` seconds."""

    def __init__(self, tau_s: float, stretch_s: float | None = None) -> None:
        if not tau_s > 0:
            raise ValueError(f"tau_s must be positive, got {tau_s!r}")
        if stretch_s is not None and not stretch_s > 0:
            raise ValueError(f"stretch_s must be positive, got {stretch_s!r}")
        self.tau_s = tau_s
        self.stretch_s = stretch_s  # None: the fixed cost counts in full
        self._busy = 0.0
        self._wall = 0.0
        self._last: float | None = None

    def observe(self, now: float, inference_s: float, fixed_s: float = 0.0) -> None:
        """An iteration ended at ``now`` whose inference rows alone would take ``inference_s`` seconds, of which
        ``fixed_s`` any iteration pays: that part counts in the ratio of the time since the last observation (the
        iteration) to ``stretch_s``, at most in full."""
        if self._last is None:
            self._last = now
            return
        dt = max(now - self._last, 0.0)
        self._last = now
        uncounted = 0.0  # of the fixed cost
        if self.stretch_s is not None:
            uncounted = min(max(fixed_s, 0.0), max(inference_s, 0.0)) * (1.0 - min(dt / self.stretch_s, 1.0))
        decay = math.exp(-dt / self.tau_s)
        self._busy = self._busy * decay + max(inference_s, 0.0) - uncounted
        self._wall = self._wall * decay + dt

    def share(self) -> float:
        """The decayed inference seconds over the decayed wall seconds, in [0, 1] (0 before two observations)."""
        return min(self._busy / self._wall, 1.0) if self._wall > 0 else 0.0
