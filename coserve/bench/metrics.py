"""Per-request records and the serving summary ``coserve bench`` reports (TTFT, TPOT,
SLO attainment, goodput, throughput), plus the GPU idle fraction.

All times are seconds on the benchmark's clock (0 = start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One inference request as the benchmark saw it.

    ``first_token_s`` / ``finish_s`` are None when the request never produced its first
    token / never finished (failed, or still running when the benchmark stopped).
    """

    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    failed: bool = False
    error: str | None = None
    engine_ttft_s: float | None = None  # the engine's part of the TTFT (submission to first token), where known
    server_ttft_s: float | None = None  # the server's (its arrival to the first token on its event loop), where known
    server_text_s: float | None = None  # the server's arrival to its first event of output text, where known

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"RequestRecord.num_prompt_tokens is negative ({self.num_prompt_tokens})")
        if self.num_output_tokens < 0:
            raise ValueError(f"RequestRecord.num_output_tokens is negative ({self.num_output_tokens})")
        if self.first_token_s is not None and self.first_token_s < self.arrival_s:
            raise ValueError(f"RequestRecord.first_token_s ({self.first_token_s}) is before arrival_s ({self.arrival_s})")
        if self.finish_s is not None and self.first_token_s is not None and self.finish_s < self.first_token_s:
            raise ValueError(f"RequestRecord.finish_s ({self.finish_s}) is before first_token_s ({self.first_token_s})")

    @property
    def completed(self) -> bool:
        """Finished with a first token and not failed."""
        return not self.failed and self.first_token_s is not None and self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: first_token_s - arrival_s (None without a first token)."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def outside_engine_s(self) -> float | None:
        """The part of the TTFT spent outside the engine (the client, HTTP, parsing, the chat template and
        tokenizing): ttft_s - engine_ttft_s, None unless both are known."""
        if self.ttft_s is None or self.engine_ttft_s is None:
            return None
        return self.ttft_s - self.engine_ttft_s

    @property
    def server_before_engine_s(self) -> float | None:
        """Of the time outside the engine, the server's before it (routing, validation, the chat template,
        tokenizing, submitting): server_ttft_s - engine_ttft_s, None unless both are known."""
        if self.server_ttft_s is None or self.engine_ttft_s is None:
            return None
        return self.server_ttft_s - self.engine_ttft_s

    @property
    def held_text_s(self) -> float | None:
        """Of the client's and the wire's part, the first text the server held back after the first token (an
        unfinished UTF-8 character, or what may begin a stop string): server_text_s - server_ttft_s, None unless
        both are known."""
        if self.server_text_s is None or self.server_ttft_s is None:
            return None
        return self.server_text_s - self.server_ttft_s

    @property
    def client_and_wire_s(self) -> float | None:
        """Of the time outside the engine, the rest: the client building and sending the request, TCP and the
        HTTP server before the server's middleware, and the first token's way back to the client (with any text
        held back, ``held_text_s``): ttft_s - server_ttft_s, None unless both are known."""
        if self.ttft_s is None or self.server_ttft_s is None:
            return None
        return self.ttft_s - self.server_ttft_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (finish - first_token) / (outputs - 1);
        0.0 with one output token; None unless both times are known."""
        if self.first_token_s is None or self.finish_s is None:
            return None
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


def percentile_stats(values: list[float]) -> dict[str, float | None]:
    """{mean, p50, p90, p99} (linear interpolation), all None for no values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    pct = np.percentile(arr, PERCENTILES)
    return {"mean": float(arr.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}}


def attains_slo(record: RequestRecord, slo_tpot_s: float, ttft_limit_s: float) -> bool:
    """Completed, with TPOT <= slo_tpot_s and TTFT <= ttft_limit_s."""
    return record.completed and record.tpot_s <= slo_tpot_s and record.ttft_s <= ttft_limit_s


def summarize(records: list[RequestRecord], duration_s: float, slo_tpot_s: float,
              ttft_limit_s: float) -> dict:
    """The summary of one benchmark run (JSON-ready: plain floats, ints, None).

    - ``slo_attainment``: SLO-attaining requests / all requests. Failed and unfinished
      requests count as missing the SLO. With no requests it is 1.0 (no request missed it).
    - ``ttft_s``, ``tpot_s``: {mean, p50, p90, p99} over completed requests (linear
      interpolation, numpy.percentile's default); all None when none completed.
    - ``goodput``: SLO-attaining requests per second of ``duration_s``.
    - ``inference_tokens_per_s``: prompt + output tokens of completed requests / duration_s;
      ``output_tokens_per_s``: output tokens of completed requests / duration_s.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s!r}")
    if not slo_tpot_s >= 0:
        raise ValueError(f"slo_tpot_s must be >= 0, got {slo_tpot_s!r}")
    if not ttft_limit_s >= 0:
        raise ValueError(f"ttft_limit_s must be >= 0 (math.inf for no limit), got {ttft_limit_s!r}")
    done = [r for r in records if r.completed]
    attained = sum(attains_slo(r, slo_tpot_s, ttft_limit_s) for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": sum(r.failed for r in records),
        "duration_s": float(duration_s),
        "slo_tpot_s": float(slo_tpot_s),
        "ttft_limit_s": float(ttft_limit_s),
        "slo_attainment": attained / len(records) if records else 1.0,
        "ttft_s": percentile_stats([r.ttft_s for r in done]),
        "tpot_s": percentile_stats([r.tpot_s for r in done]),
        "goodput": attained / duration_s,
        "inference_tokens_per_s": (prompt_tokens + output_tokens) / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
    }


def idle_fraction(busy_intervals: list[tuple[float, float]], duration_s: float) -> float:
    """Fraction of [0, duration_s) covered by no busy interval (intervals may overlap and
    are clipped to the window). Co-serving's finetuning throughput is compared against
    finetune-only throughput times this fraction."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive finite number, got {duration_s!r}")
    clipped = []
    for i, (start, end) in enumerate(busy_intervals):
        if end < start:
            raise ValueError(f"busy_intervals[{i}] ends ({end}) before it starts ({start})")
        start, end = max(0.0, start), min(duration_s, end)
        if end > start:
            clipped.append((start, end))
    clipped.sort()
    covered = 0.0
    cur_start = cur_end = None
    for start, end in clipped:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                covered += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        covered += cur_end - cur_start
    return max(0.0, 1.0 - covered / duration_s)
