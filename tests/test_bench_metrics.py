"""Per-request metrics (TTFT, TPOT), the run summary and the idle fraction."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from coserve.bench.metrics import RequestRecord, idle_fraction, summarize


def rec(arrival, first, finish, prompt=10, output=5, failed=False, error=None):
    return RequestRecord(arrival, first, finish, prompt, output, failed, error)


def test_ttft_and_tpot():
    r = rec(1.0, 1.5, 3.5, output=5)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx(0.5)  # 2.0 s over 4 tokens after the first
    assert r.completed
    one = rec(0.0, 0.2, 0.2, output=1)
    assert one.tpot_s == 0.0 and one.ttft_s == pytest.approx(0.2)
    never = rec(2.0, None, None, output=0, failed=True, error="OOM")
    assert never.ttft_s is None and never.tpot_s is None and not never.completed
    running = rec(2.0, 2.5, None, output=3)  # still decoding when the benchmark stopped
    assert running.ttft_s == pytest.approx(0.5) and running.tpot_s is None and not running.completed


@pytest.mark.parametrize("kwargs, field", [
    (dict(arrival=1.0, first=0.5, finish=2.0), "first_token_s"),
    (dict(arrival=1.0, first=2.0, finish=1.5), "finish_s"),
    (dict(arrival=1.0, first=2.0, finish=3.0, prompt=-1), "num_prompt_tokens"),
    (dict(arrival=1.0, first=2.0, finish=3.0, output=-1), "num_output_tokens"),
])
def test_record_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        rec(**kwargs)


def _records():
    return [
        #   arrival first finish prompt output          ttft  tpot
        rec(0.0, 0.1, 1.0, 100, 10),                 # 0.1   0.1    attains
        rec(1.0, 1.2, 1.6, 50, 5),                   # 0.2   0.1    attains
        rec(2.0, 4.0, 4.9, 20, 10),                  # 2.0   0.1    TTFT too long
        rec(3.0, 3.1, 6.1, 30, 11),                  # 0.1   0.3    TPOT too long
        rec(4.0, 4.05, 4.05, 8, 1),                  # 0.05  0.0    attains
        rec(5.0, None, None, 40, 0, failed=True, error="prompt too long"),
        rec(6.0, 6.5, 7.0, 60, 3, failed=True, error="aborted"),  # timed, but failed
        rec(9.0, 9.1, None, 70, 2),                  # unfinished
    ]


def test_summarize_hand_computed():
    s = summarize(_records(), duration_s=10.0, slo_tpot_s=0.15, ttft_limit_s=1.0)
    assert s["num_requests"] == 8
    assert s["num_failed"] == 2
    assert s["num_completed"] == 5
    assert s["slo_attainment"] == pytest.approx(3 / 8)  # failed and unfinished count as missing
    assert s["goodput"] == pytest.approx(0.3)
    assert s["inference_tokens_per_s"] == pytest.approx((100 + 50 + 20 + 30 + 8 + 10 + 5 + 10 + 11 + 1) / 10)
    assert s["output_tokens_per_s"] == pytest.approx((10 + 5 + 10 + 11 + 1) / 10)
    ttfts = [0.1, 0.2, 2.0, 0.1, 0.05]
    tpots = [0.1, 0.1, 0.1, 0.3, 0.0]
    assert s["ttft_s"]["mean"] == pytest.approx(np.mean(ttfts))
    assert s["ttft_s"]["p50"] == pytest.approx(0.1)
    # Linear interpolation over the sorted values [0.05, 0.1, 0.1, 0.2, 2.0]: rank 0.9*4 = 3.6.
    assert s["ttft_s"]["p90"] == pytest.approx(0.2 + 0.6 * 1.8)
    assert s["ttft_s"]["p99"] == pytest.approx(0.2 + 0.96 * 1.8)
    for p in (50, 90, 99):
        assert s["tpot_s"][f"p{p}"] == pytest.approx(np.percentile(tpots, p))
        assert s["ttft_s"][f"p{p}"] == pytest.approx(np.percentile(ttfts, p))
    assert s["tpot_s"]["mean"] == pytest.approx(0.12)
    json.dumps(s)  # plain Python values


def test_summarize_limits_are_inclusive_and_inf_means_none():
    records = [rec(0.0, 1.0, 3.0, output=3)]  # ttft 1.0, tpot 1.0
    assert summarize(records, 5.0, slo_tpot_s=1.0, ttft_limit_s=1.0)["slo_attainment"] == 1.0
    assert summarize(records, 5.0, slo_tpot_s=0.99, ttft_limit_s=1.0)["slo_attainment"] == 0.0
    assert summarize(records, 5.0, slo_tpot_s=1.0, ttft_limit_s=0.99)["slo_attainment"] == 0.0
    assert summarize(records, 5.0, slo_tpot_s=1.0, ttft_limit_s=math.inf)["goodput"] == pytest.approx(0.2)


def test_summarize_no_requests_and_none_completed():
    empty = summarize([], 10.0, 0.1, 1.0)
    assert empty["slo_attainment"] == 1.0 and empty["goodput"] == 0.0 and empty["num_requests"] == 0
    assert empty["ttft_s"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    failed = summarize([rec(0.0, None, None, failed=True)], 10.0, 0.1, 1.0)
    assert failed["slo_attainment"] == 0.0
    assert failed["tpot_s"]["p99"] is None
    assert failed["inference_tokens_per_s"] == 0.0


@pytest.mark.parametrize("args", [(0.0, 0.1, 1.0), (-1.0, 0.1, 1.0), (10.0, -0.1, 1.0), (10.0, 0.1, float("nan"))])
def test_summarize_bad_arguments(args):
    with pytest.raises(ValueError):
        summarize(_records(), *args)


def test_idle_fraction():
    assert idle_fraction([], 10.0) == 1.0
    assert idle_fraction([(0.0, 10.0)], 10.0) == 0.0
    # [1, 4) and [3, 5) overlap: union [1, 5) = 4 s; [7, 8) adds 1 s; [8, 8) adds nothing.
    assert idle_fraction([(3.0, 5.0), (1.0, 4.0), (7.0, 8.0), (8.0, 8.0)], 10.0) == pytest.approx(0.5)
    # Nested and touching intervals: [0, 6) in all.
    assert idle_fraction([(0.0, 3.0), (3.0, 6.0), (1.0, 2.0)], 10.0) == pytest.approx(0.4)
    # Clipped to [0, duration).
    assert idle_fraction([(-5.0, 2.0), (9.0, 15.0), (20.0, 30.0)], 10.0) == pytest.approx(0.7)
    with pytest.raises(ValueError, match=r"busy_intervals\[1\]"):
        idle_fraction([(0.0, 1.0), (3.0, 2.0)], 10.0)
    with pytest.raises(ValueError, match="duration_s"):
        idle_fraction([], 0.0)
