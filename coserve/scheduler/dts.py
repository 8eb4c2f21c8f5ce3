"""Temporal-sharing baselines (FlexLLM Appendix A): when to hand an iteration to finetuning. Plain Python.

Both controllers are called once per inference iteration with that iteration's
statistics; ``step`` returns True when the scheduler should switch to finetuning
after it (one finetuning iteration, then inference resumes and ``step`` counts again).
"""

from __future__ import annotations

import math
from statistics import fmean

MIN_INTERVAL = 64.0  # clamp bounds of COMPUTE_NEXT_INTERVAL, in inference steps
MAX_INTERVAL = 512.0
FLOOR = MIN_INTERVAL + 16  # line 41: the smoothed interval never drops below 80
RECOMPUTE_EVERY = 3  # decision delay: COMPUTE_NEXT_INTERVAL on every third switch


def pressure(queue_lens: list[int], arrivals: int, completions: int) -> float:
    """Lines 22-30: ``p_q + p_s + p_b`` from the queue lengths and request counts since the last switch.

    ``p_q = min(1, mean(Q)/20)``, ``p_s = min(0.5, max(Q)/25)`` and
    ``p_b = max(0, (lambda - mu)/8)`` where ``lambda`` and ``mu`` are the arrivals and
    completions per step. ``queue_lens`` must be non-empty.
    """
    if not queue_lens:
        raise ValueError("queue_lens must be non-empty")
    steps = len(queue_lens)
    p_q = min(1.0, fmean(queue_lens) / 20.0)
    p_s = min(0.5, max(queue_lens) / 25.0)
    p_b = max(0.0, (arrivals / steps - completions / steps) / 8.0)
    return p_q + p_s + p_b


def target_interval(p: float) -> float:
    """Lines 31-38: the raw interval ``f`` for pressure ``p`` (before hysteresis).

    ``p <= 0.8`` gives 64 and ``p >= 2`` gives 512; in between, ``64 + p_n * 0.6 * 448``
    with ``p_n = (p - 0.8) / 1.2``, times the 1.35 stabilisation. The stabilisation is read
    as part of the interpolation branch only (the endpoints stay the documented 64 and
    512, and the line-41 floor of 80 can only bind if ``f`` can be 64); so ``f`` jumps
    from 64 to 86.4 just above 0.8 and from 449.28 to 512 at 2.0.
    """
    if p <= 0.8:
        return MIN_INTERVAL
    if p >= 2.0:
        return MAX_INTERVAL
    p_n = (p - 0.8) / 1.2
    return (MIN_INTERVAL + p_n * 0.6 * (MAX_INTERVAL - MIN_INTERVAL)) * 1.35


class DynamicTemporalSharing:
    """Algorithm 3: inference runs ``s`` steps, then one finetuning switch; ``s`` adapts to load.

    Higher pressure gives a larger interval, i.e. finetuning runs *less* often while
    inference is under pressure. Choices where the pseudo-code is silent:

    * initial ``s`` = ``initial_interval`` (64) so the first switch comes after 64 steps,
      and initial ``f_p`` = ``initial_prev`` (64), the clamp minimum; ``d`` starts at 0.
    * ``s`` can be fractional (line 15 gives e.g. 70.4); a switch happens on the step that
      brings it to ``<= 0``, so an interval ``s`` lasts ``ceil(s)`` steps. ``remaining``
      counts those whole steps, rounded with a 1e-9 tolerance so that float noise
      (``1.1 * 100 = 110.00000000000001``) does not add a step; ``last_interval`` keeps ``s``.
    * line 15 (``s = min(512, 1.1 * f_p)``) runs only on switches that do not recompute
      (switches 1, 2, 4, 5, ...); on every third switch ``s`` is the recomputed interval,
      without the 1.1 factor.
    * ``f_p`` stores the smoothed interval before the line-41 floor (as written), and is
      left unchanged when COMPUTE_NEXT_INTERVAL returns early on an empty ``Q``.
    * RESET_STATS, on every switch, clears ``Q``, ``B``, ``r_a`` and ``r_c`` only; ``s``,
      ``f_p`` and ``d`` persist. So a recompute sees only the steps since the previous
      switch. ``B`` (batch sizes) is recorded but, as in the algorithm, unused.
    * the x1.35 stabilisation applies to the interpolated ``f`` only (see ``target_interval``).
    """

    def __init__(self, initial_interval: float = MIN_INTERVAL, initial_prev: float = MIN_INTERVAL) -> None:
        for name, value in (("initial_interval", initial_interval), ("initial_prev", initial_prev)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        self.queue_lens: list[int] = []  # Q
        self.batch_sizes: list[int] = []  # B
        self.arrivals = 0  # r_a
        self.completions = 0  # r_c
        self.remaining = _whole_steps(initial_interval)  # s: inference steps left before the next switch
        self.prev_interval = float(initial_prev)  # f_p: the last smoothed interval
        self.delay = 0  # d: switches since the last recompute
        self.num_steps = 0
        self.num_switches = 0
        self.last_interval: float | None = None  # the s set at the latest switch

    def step(self, queue_len: int, batch_size: int, arrivals: int, completions: int) -> bool:
        """Record one inference iteration; True when the scheduler should switch to finetuning now.

        ``queue_len``: requests waiting; ``batch_size``: requests in the batch; ``arrivals``
        and ``completions``: requests that arrived and finished during the iteration.
        """
        _check_counts(queue_len=queue_len, batch_size=batch_size, arrivals=arrivals, completions=completions)
        self.num_steps += 1
        self.arrivals += arrivals
        self.completions += completions
        self.queue_lens.append(queue_len)
        self.batch_sizes.append(batch_size)
        self.remaining -= 1
        if self.remaining > 0:
            return False
        self.delay += 1
        if self.delay >= RECOMPUTE_EVERY:
            interval = self.compute_next_interval()
            self.delay = 0
        else:
            interval = min(MAX_INTERVAL, self.prev_interval * 1.1)
        self.last_interval = interval
        self.remaining = _whole_steps(interval)
        self.num_switches += 1
        self._reset_stats()
        return True

    def compute_next_interval(self) -> float:
        """Lines 19-42: the next interval from the stats since the last switch; updates ``f_p``."""
        if not self.queue_lens:
            return MIN_INTERVAL
        f = target_interval(pressure(self.queue_lens, self.arrivals, self.completions))
        smoothed = (f + 2 * self.prev_interval) / 3  # hysteresis
        self.prev_interval = smoothed
        return min(MAX_INTERVAL, max(MIN_INTERVAL, smoothed, FLOOR))

    def _reset_stats(self) -> None:
        self.queue_lens.clear()
        self.batch_sizes.clear()
        self.arrivals = 0
        self.completions = 0


class TemporalSharing:
    """Fixed temporal sharing: a finetuning switch after every ``n`` inference iterations."""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        self.n = n
        self.num_steps = 0

    def step(self, queue_len: int = 0, batch_size: int = 0, arrivals: int = 0, completions: int = 0) -> bool:
        """Record one inference iteration (the statistics are ignored); True on every ``n``-th call."""
        _check_counts(queue_len=queue_len, batch_size=batch_size, arrivals=arrivals, completions=completions)
        self.num_steps += 1
        return self.num_steps % self.n == 0


def _whole_steps(interval: float) -> int:
    return max(1, math.ceil(interval - 1e-9))


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
