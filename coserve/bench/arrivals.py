"""Request arrival times for benchmarks: Poisson, gamma (bursty) and the Azure LLM trace.

Arrival times are seconds from 0, sorted, and strictly below the benchmark's duration.
"""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

DEFAULT_AZURE = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure_llm_2023_code.csv"

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# "2023-11-16 18:17:03.9799600": the trace has 7 fractional digits, more than
# datetime.fromisoformat accepts before Python 3.11, so the fraction is parsed here.
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")


def _check_rate(rate: float, duration_s: float) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate!r}")
    if not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"duration_s must be a finite number >= 0, got {duration_s!r}")


def gamma_arrivals(rate: float, duration_s: float, burstiness: float, seed: int) -> list[float]:
    """Arrivals whose inter-arrival gaps are gamma(shape=burstiness, mean=1/rate).

    As vLLM's benchmark_serving: burstiness 1 is a Poisson process; below 1 the gaps'
    coefficient of variation (1/sqrt(burstiness)) grows, so requests come in bursts;
    above 1 they are more regular. The first request arrives after one gap, not at 0.
    """
    _check_rate(rate, duration_s)
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a positive number, got {burstiness!r}")
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)  # mean = shape * scale = 1 / rate
    chunk = max(64, int(rate * duration_s * 1.1) + 16)
    out: list[float] = []
    t = 0.0
    while True:
        times = t + np.cumsum(rng.gamma(burstiness, scale, size=chunk))
        below = times[times < duration_s]
        out.extend(below.tolist())
        if len(below) < chunk:  # times are increasing: the first one past the end stops it
            return out
        t = float(times[-1])


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrivals of a Poisson process of ``rate`` requests/s (exponential gaps, mean 1/rate)."""
    return gamma_arrivals(rate, duration_s, 1.0, seed)


def _parse_timestamp(text: str) -> int | None:
    """Nanoseconds since the Unix epoch (the trace's clock, taken as UTC), or None if malformed."""
    m = _TIMESTAMP.fullmatch(text.strip())
    if m is None:
        return None
    try:
        whole = datetime.strptime(f"{m[1]} {m[2]}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    frac = (m[3] or "").ljust(9, "0")
    return calendar.timegm(whole.timetuple()) * 1_000_000_000 + int(frac or 0)


@dataclass(slots=True)
class AzureTrace:
    """An Azure LLM inference trace: per request, its arrival (seconds after the first
    request), its context (prompt) tokens and its generated tokens, sorted by arrival."""

    offsets_s: list[float]
    context_tokens: list[int]
    generated_tokens: list[int]
    source: str

    def __len__(self) -> int:
        return len(self.offsets_s)

    @property
    def span_s(self) -> float:
        """Seconds from the first request to the last."""
        return self.offsets_s[-1] - self.offsets_s[0] if self.offsets_s else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests/s: (N - 1) gaps over the span, i.e. one over the mean inter-arrival gap."""
        if len(self) < 2 or self.span_s <= 0:
            raise ValueError(f"{self.source}: a mean rate needs at least two requests at distinct times")
        return (len(self) - 1) / self.span_s

    def segment(self, rate: float, duration_s: float, start: int = 0) -> list[tuple[float, int, int]]:
        """``(arrival_s, context_tokens, generated_tokens)`` of ``round(rate * duration_s)`` consecutive
        requests from request ``start`` on (wrapping around the trace), their timestamps scaled so that
        they arrive over ``duration_s``: the run's mean rate is ``rate`` and the trace's bursts keep their
        shape. (``rescaled`` keeps the whole trace's mean instead, which a short run can miss by far:
        this trace's first minutes hold 63 requests and then nothing for two minutes.)
        """
        _check_rate(rate, duration_s)
        n = max(1, round(rate * duration_s))
        if not 0 <= start < len(self):
            raise ValueError(f"start must lie in [0, {len(self)}), got {start!r}")
        period = self.span_s + 1.0 / self.mean_rate  # one copy of the trace, then the next one's start
        times, rows = [], []
        for j in range(n + 1):  # n requests plus the one after them (it closes the span)
            copy, i = divmod(start + j, len(self))
            times.append(copy * period + self.offsets_s[i])
            rows.append((self.context_tokens[i], self.generated_tokens[i]))
        span = times[-1] - times[0]
        scale = duration_s / span if span > 0 else 0.0
        out = [((t - times[0]) * scale if scale else duration_s * j / n, c, g)
               for j, (t, (c, g)) in enumerate(zip(times[:-1], rows[:-1]))]
        return [row for row in out if row[0] < duration_s]

    def rescaled(self, rate: float, duration_s: float) -> list[tuple[float, int, int]]:
        """``(arrival_s, context_tokens, generated_tokens)`` with the trace's timestamps
        scaled by ``mean_rate / rate`` so that its mean rate is ``rate``, keeping the arrivals
        below ``duration_s``.

        A trace shorter than the duration repeats from its start: each copy begins one mean
        gap (1/rate) after the previous copy's last request, so the rate stays ``rate``.
        """
        _check_rate(rate, duration_s)
        factor = self.mean_rate / rate
        scaled = [t * factor for t in self.offsets_s]
        period = len(self) / rate  # = (span + one mean gap) * factor
        out: list[tuple[float, int, int]] = []
        copy = 0
        while copy * period < duration_s:
            base = copy * period
            for t, ctx, gen in zip(scaled, self.context_tokens, self.generated_tokens):
                if base + t >= duration_s:
                    return out
                out.append((base + t, ctx, gen))
            copy += 1
        return out


def load_azure_trace(path: Path | str = DEFAULT_AZURE) -> AzureTrace:
    """Read an Azure LLM trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Blank lines are skipped; rows are sorted by time (stably) and offsets measured from
    the earliest. A malformed line raises ValueError naming the file and line number.
    """
    path = Path(path)
    stamps: list[int] = []
    contexts: list[int] = []
    generated: list[int] = []
    with path.open(encoding="utf-8-sig") as f:
        header = f.readline()
        if tuple(c.strip() for c in header.split(",")) != AZURE_HEADER:
            raise ValueError(f"{path}:1: expected the header {','.join(AZURE_HEADER)!r}, got {header.strip()!r}")
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            fields = line.rstrip("\r\n").split(",")
            if len(fields) != 3:
                raise ValueError(f"{path}:{lineno}: expected 3 comma-separated fields, got {len(fields)}: {line.strip()!r}")
            stamp = _parse_timestamp(fields[0])
            if stamp is None:
                raise ValueError(f"{path}:{lineno}: TIMESTAMP {fields[0].strip()!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'")
            counts = []
            for name, text in zip(AZURE_HEADER[1:], fields[1:]):
                try:
                    value = int(text.strip())
                except ValueError:
                    value = -1
                if value < 0:
                    raise ValueError(f"{path}:{lineno}: {name} {text.strip()!r} is not a non-negative integer")
                counts.append(value)
            stamps.append(stamp)
            contexts.append(counts[0])
            generated.append(counts[1])
    if not stamps:
        raise ValueError(f"{path}: no requests after the header")
    order = sorted(range(len(stamps)), key=stamps.__getitem__)
    first = stamps[order[0]]
    return AzureTrace(
        offsets_s=[(stamps[i] - first) / 1e9 for i in order],
        context_tokens=[contexts[i] for i in order],
        generated_tokens=[generated[i] for i in order],
        source=str(path),
    )


def scale_lengths(lengths: list[int], max_len: int, source_max: int) -> list[int]:
    """Map token lengths from a source whose context is ``source_max`` (Azure's ~8k,
    ShareGPT's 4k) to a model whose context is ``max_len``, keeping the distribution's shape.

    Each length is multiplied by ``max_len / source_max``, rounded, and clipped to
    ``[1, max_len]``: ratios between lengths (and so the shape of the distribution) are
    kept, lengths above ``source_max`` are clipped, and nothing becomes empty.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len!r}")
    if source_max < 1:
        raise ValueError(f"source_max must be >= 1, got {source_max!r}")
    factor = max_len / source_max
    out = []
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"lengths[{i}] is negative ({n})")
        out.append(min(max_len, max(1, round(n * factor))))
    return out
