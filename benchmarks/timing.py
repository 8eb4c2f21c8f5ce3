"""The benchmark scripts' timer: a callable's median wall time, the device synchronized around each run.

The scripts run as files from the repository root (``python benchmarks/NAME.py``), which puts this folder on
``sys.path``: they import it as ``from timing import median_seconds``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], sync: Callable[[], object], repeats: int = 15) -> float:
    """The median over ``repeats`` runs of ``fn()``'s wall time, after one untimed run (a warm-up), with ``sync()``
    (e.g. ``torch.cuda.synchronize``; a no-op on a CPU) before and after each, so that a device's queued work is
    inside the run that queued it."""
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
