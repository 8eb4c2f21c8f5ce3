"""Arrival processes (Poisson, gamma, the Azure trace) and length scaling for benchmarks."""

from __future__ import annotations

import numpy as np
import pytest

from coserve.bench.arrivals import (
    DEFAULT_AZURE,
    gamma_arrivals,
    load_azure_trace,
    poisson_arrivals,
    scale_lengths,
)


def _cv(arrivals: list[float]) -> float:
    gaps = np.diff(arrivals)
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("rate", [0.5, 4.0, 20.0])
def test_poisson_mean_rate(rate):
    duration = 4000.0 / rate  # ~4000 arrivals
    arrivals = poisson_arrivals(rate, duration, seed=1)
    assert len(arrivals) / duration == pytest.approx(rate, rel=0.05)
    assert _cv(arrivals) == pytest.approx(1.0, abs=0.06)  # exponential gaps


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0])
def test_gamma_mean_rate_and_cv(burstiness):
    rate, duration = 5.0, 1000.0
    arrivals = gamma_arrivals(rate, duration, burstiness, seed=2)
    assert len(arrivals) / duration == pytest.approx(rate, rel=0.06)
    assert _cv(arrivals) == pytest.approx(1 / burstiness ** 0.5, rel=0.1)


def test_gamma_bursty_has_larger_cv_than_poisson():
    poisson = poisson_arrivals(5.0, 1000.0, seed=3)
    bursty = gamma_arrivals(5.0, 1000.0, 0.3, seed=3)
    assert _cv(bursty) > 1.5 * _cv(poisson)


def test_gamma_burstiness_one_is_poisson():
    assert gamma_arrivals(3.0, 100.0, 1.0, seed=7) == poisson_arrivals(3.0, 100.0, seed=7)


def test_determinism_and_order():
    a = gamma_arrivals(10.0, 300.0, 0.5, seed=11)
    assert a == gamma_arrivals(10.0, 300.0, 0.5, seed=11)
    assert a != gamma_arrivals(10.0, 300.0, 0.5, seed=12)
    for arrivals in (a, poisson_arrivals(10.0, 300.0, seed=11)):
        assert arrivals == sorted(arrivals)
        assert all(0 < t < 300.0 for t in arrivals)
        assert all(isinstance(t, float) for t in arrivals)


def test_duration_cuts_a_prefix():
    # Same seed, shorter duration: the same process, cut earlier.
    long = poisson_arrivals(2.0, 500.0, seed=5)
    short = poisson_arrivals(2.0, 50.0, seed=5)
    assert short == [t for t in long if t < 50.0]
    assert poisson_arrivals(2.0, 0.0, seed=5) == []


@pytest.mark.parametrize("args", [(0.0, 10.0, 1.0), (-1.0, 10.0, 1.0), (1.0, -1.0, 1.0), (1.0, 10.0, 0.0),
                                  (float("nan"), 10.0, 1.0), (1.0, float("inf"), 1.0)])
def test_bad_arguments(args):
    rate, duration, burstiness = args
    with pytest.raises(ValueError):
        gamma_arrivals(rate, duration, burstiness, seed=0)


def _write(tmp_path, lines: list[str], name: str = "trace.csv"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_azure_parse_seven_digit_fraction(tmp_path):
    path = _write(tmp_path, [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-16 18:17:03.9799600,4808,10",
        "2023-11-16 18:17:04.0319600,3180,8",
        "2023-11-16 18:17:05.1234567,17,1",
        "2023-11-16 18:18:00,100,0",          # no fraction
        "",                                   # blank lines are skipped
        "2023-11-16 18:18:00.5,200,3",        # one digit
    ])
    trace = load_azure_trace(path)
    assert len(trace) == 5
    assert trace.offsets_s[0] == 0.0
    assert trace.offsets_s[1] == pytest.approx(0.052, abs=1e-9)
    assert trace.offsets_s[2] == pytest.approx(1.1434967, abs=1e-9)
    assert trace.offsets_s[3] == pytest.approx(56.02004, abs=1e-9)
    assert trace.offsets_s[4] == pytest.approx(56.52004, abs=1e-9)
    assert trace.context_tokens == [4808, 3180, 17, 100, 200]
    assert trace.generated_tokens == [10, 8, 1, 0, 3]
    assert trace.source == str(path)


def test_azure_crosses_midnight_and_sorts(tmp_path):
    path = _write(tmp_path, [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-17 00:00:01.0000000,2,2",
        "2023-11-16 23:59:59.5000000,1,1",
    ])
    trace = load_azure_trace(path)
    assert trace.offsets_s == [0.0, pytest.approx(1.5)]
    assert trace.context_tokens == [1, 2]


@pytest.mark.parametrize("bad, fragment", [
    ("2023-11-16 18:17:04.0319600,3180", "3 comma-separated fields"),
    ("2023-11-16 18:17:04.0319600,abc,8", "ContextTokens"),
    ("2023-11-16 18:17:04.0319600,31,-2", "GeneratedTokens"),
    ("2023-11-16T18:17:61.0,31,2", "TIMESTAMP"),
    ("yesterday,31,2", "TIMESTAMP"),
    ("2023-13-16 18:17:04.0,31,2", "TIMESTAMP"),
])
def test_azure_bad_line_names_file_and_line(tmp_path, bad, fragment):
    path = _write(tmp_path, [
        "TIMESTAMP,ContextTokens,GeneratedTokens",
        "2023-11-16 18:17:03.9799600,4808,10",
        "2023-11-16 18:17:03.9899600,48,1",
        bad,
    ])
    with pytest.raises(ValueError, match=fragment) as err:
        load_azure_trace(path)
    assert f"{path}:4:" in str(err.value)


def test_azure_bad_header_and_empty(tmp_path):
    with pytest.raises(ValueError, match=r"trace\.csv:1:"):
        load_azure_trace(_write(tmp_path, ["2023-11-16 18:17:03.9799600,4808,10"]))
    with pytest.raises(ValueError, match="no requests"):
        load_azure_trace(_write(tmp_path, ["TIMESTAMP,ContextTokens,GeneratedTokens"], "empty.csv"))


def _even_trace(tmp_path, n: int = 11, gap_s: int = 2):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:{(i * gap_s) // 60:02d}:{(i * gap_s) % 60:02d}.0000000,{100 + i},{i}" for i in range(n)]
    return load_azure_trace(_write(tmp_path, lines))


def test_azure_rescale_hits_target_rate(tmp_path):
    trace = _even_trace(tmp_path)  # 11 requests every 2 s: 0.5 req/s
    assert trace.mean_rate == pytest.approx(0.5)
    rows = trace.rescaled(rate=2.0, duration_s=5.0)  # time compressed 4x: every 0.5 s
    assert [r[0] for r in rows] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    assert [r[1] for r in rows] == list(range(100, 110))
    assert [r[2] for r in rows] == list(range(10))
    slow = trace.rescaled(rate=0.25, duration_s=20.0)  # stretched 2x: every 4 s
    assert [r[0] for r in slow] == pytest.approx([0.0, 4.0, 8.0, 12.0, 16.0])


def test_azure_rescale_wraps_around(tmp_path):
    trace = _even_trace(tmp_path)
    rows = trace.rescaled(rate=2.0, duration_s=12.0)
    times = [r[0] for r in rows]
    # One copy lasts 11 gaps (5.5 s): the next starts one gap after the last request.
    assert times == pytest.approx([0.5 * i for i in range(24)])
    assert [r[1] for r in rows] == [100 + (i % 11) for i in range(24)]
    assert times == sorted(times) and times[-1] < 12.0
    assert len(rows) / 12.0 == pytest.approx(2.0)


def test_azure_segment_has_the_target_rate_over_the_run(tmp_path):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]  # a burst of 4 at 1 s apart, a 60 s gap, 4 more
    stamps = [0, 1, 2, 3, 63, 64, 65, 66]
    lines += [f"2023-11-16 18:{t // 60:02d}:{t % 60:02d}.0000000,{100 + i},{i}" for i, t in enumerate(stamps)]
    trace = load_azure_trace(_write(tmp_path, lines))
    rows = trace.segment(rate=1.0, duration_s=4.0)  # 4 requests, then the 5th closes the span: 63 s -> 4 s
    assert [r[1] for r in rows] == [100, 101, 102, 103]
    assert [r[0] for r in rows] == pytest.approx([0.0, 4 / 63, 8 / 63, 12 / 63])  # the burst keeps its shape
    later = trace.segment(rate=1.0, duration_s=6.0, start=3)  # from the 4th request on, wrapping around
    assert [r[1] for r in later] == [103, 104, 105, 106, 107, 100]
    assert all(0 <= r[0] < 6.0 for r in later) and len(later) == 6
    with pytest.raises(ValueError, match="start"):
        trace.segment(1.0, 4.0, start=8)


def test_azure_rescale_needs_a_rate(tmp_path):
    trace = _even_trace(tmp_path, n=1)
    with pytest.raises(ValueError, match="two requests"):
        trace.rescaled(1.0, 10.0)


def test_azure_real_trace():
    if not DEFAULT_AZURE.is_file():
        pytest.skip(f"{DEFAULT_AZURE} is absent")
    trace = load_azure_trace(DEFAULT_AZURE)
    assert len(trace) == 8819
    assert 50 * 60 < trace.span_s < 60 * 60
    assert trace.mean_rate == pytest.approx(2.6, abs=0.2)
    assert np.mean(trace.context_tokens) == pytest.approx(2048, rel=0.02)
    assert np.median(trace.generated_tokens) == pytest.approx(13, abs=1)
    assert trace.offsets_s == sorted(trace.offsets_s)
    rows = trace.rescaled(rate=10.0, duration_s=881.9)  # one whole copy lasts 8819 / 10 s
    assert len(rows) == 8819
    assert rows[-1][0] == pytest.approx(881.8)
    assert [r[1] for r in rows] == trace.context_tokens
    wrapped = trace.rescaled(rate=1.0, duration_s=3 * 8819.0)  # three whole copies exactly
    assert len(wrapped) == 3 * 8819


def test_scale_lengths():
    assert scale_lengths([0, 1, 100, 4096, 8192, 20000], max_len=512, source_max=8192) == [1, 1, 6, 256, 512, 512]
    assert scale_lengths([10, 20, 30], max_len=2048, source_max=1024) == [20, 40, 60]  # stretching too
    assert scale_lengths([], 10, 10) == []
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        scale_lengths([1, -1], 10, 10)
    with pytest.raises(ValueError, match="max_len"):
        scale_lengths([1], 0, 10)
    with pytest.raises(ValueError, match="source_max"):
        scale_lengths([1], 10, 0)
