"""Forward pieces: the size that keeps a piece within its time, read from the timings of earlier pieces."""

from __future__ import annotations

import pytest

from coserve.engine.forward_pieces import FORWARD_PIECE_S, FORWARD_PIECE_TOKENS, ForwardPieces, piece_tokens


def _timed(fixed_s: float, per_token_s: float, sizes: list[int]) -> ForwardPieces:
    pieces = ForwardPieces()
    for n in sizes:
        pieces.record(n, fixed_s + per_token_s * n)
    return pieces


def test_the_piece_size_rule():
    assert piece_tokens(0.0, FORWARD_PIECE_S / 512, 128, FORWARD_PIECE_S) == 512  # all per-token: what fits the time
    assert piece_tokens(0.0, FORWARD_PIECE_S / 16, 128, FORWARD_PIECE_S) == 128  # slow: never under the floor
    # most of a piece is its fixed part: up to twice that part, here 20 ms of tokens at 10 us each
    assert piece_tokens(0.02, 1e-5, 128, 0.03) == pytest.approx(2000, abs=1)
    assert piece_tokens(0.02, 0.0, 128, 0.03) is None  # tokens cost nothing: windows run whole


def test_nothing_measured_gives_the_floor_and_one_timed_piece_reads_as_per_token_time():
    pieces = ForwardPieces()
    assert pieces.tokens() == FORWARD_PIECE_TOKENS
    pieces.record(FORWARD_PIECE_TOKENS // 2, 1.0)  # a short piece alone says little about the per-token cost
    assert pieces.per_token_s is None and pieces.tokens() == FORWARD_PIECE_TOKENS
    pieces.record(FORWARD_PIECE_TOKENS, FORWARD_PIECE_S / 4)  # a full piece in a quarter of the time
    assert pieces.fit() is None and pieces.tokens() == 4 * FORWARD_PIECE_TOKENS


def test_a_host_bound_device_runs_long_pieces_and_a_compute_bound_one_short_pieces():
    host_bound = _timed(0.02, 1e-5, [128, 40, 200, 90, 128])  # a GPU driven from Python: 20 ms a pass
    fixed, per_token = host_bound.fit()
    assert fixed == pytest.approx(0.02) and per_token == pytest.approx(1e-5)
    assert host_bound.tokens() == pytest.approx(2000, abs=1)  # a piece may take twice its fixed part
    compute_bound = _timed(0.002, 5e-4, [128, 40, 200, 90])  # a CPU: 0.5 ms a token
    assert compute_bound.tokens() == FORWARD_PIECE_TOKENS  # 30 ms holds 56 tokens: the floor
    flat = _timed(0.02, 0.0, [128, 40, 200, 90])
    assert flat.fit() == pytest.approx((0.02, 0.0)) and flat.tokens() is None  # whole windows


def test_the_fit_waits_for_sizes_that_differ_and_never_returns_a_negative_part():
    alike = _timed(0.02, 1e-5, [128, 130, 150, 200])  # under twice the smallest: the parts cannot be told apart
    assert alike.fit() is None and alike.tokens() == int(FORWARD_PIECE_S / ((0.02 + 1e-5 * 200) / 200))
    pieces = ForwardPieces()
    for n, t in [(40, 0.001), (200, 0.05), (100, 0.02), (150, 0.035)]:  # a line that crosses below zero
        pieces.record(n, t)
    fixed, per_token = pieces.fit()
    assert fixed == 0.0 and per_token == pytest.approx(0.106 / 490)  # through the origin instead
    slowing = _timed(0.05, 0.0, [40, 200, 100, 150])
    slowing.record(300, 0.04)  # a longer piece ran faster: no negative per-token cost
    assert slowing.fit()[1] == 0.0


def test_only_the_latest_pieces_count():
    pieces = _timed(0.0, 1e-3, [128, 40, 200, 90] * 10)  # a slow device once ...
    for n in [128, 40, 200, 90] * 10:  # ... then a fast one
        pieces.record(n, 0.02 + 1e-5 * n)
    assert pieces.fit() == pytest.approx((0.02, 1e-5))
