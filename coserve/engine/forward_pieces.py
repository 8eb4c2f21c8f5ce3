"""How many tokens a forward piece covers: a forward window with no inference beside it, where arrivals are watched,
runs in pieces so that a new request waits one piece rather than the whole window.

Each piece is a whole pass through the model, so a piece costs a fixed part (launching every layer's kernels) and a
part per token. A piece may take FORWARD_PIECE_S, or twice the fixed part where that is longer: where most of a
piece is its fixed part (a GPU driven from Python, a small model), a shorter piece bounds a newcomer's wait by little
and costs a whole pass more. Measured on an H200 (``medium``, bfloat16, host-bound): a pass cost about 20 ms
whatever its size, so pieces sized by time per token (a 128-token piece's 22 ms read as 30 ms for 174 tokens)
ran most windows in two or three passes: the median window, 282 tokens, took 46 ms in ``finetune-only``, where a
plain loop ran a 512-token sequence's whole forward in 24 ms. On a 2-core CPU the per-token part dominates and
pieces stay at FORWARD_PIECE_TOKENS (``small`` on a Zen 4: 9.5 ms a pass and 0.36 ms a token).

``ForwardPieces`` fits ``seconds = fixed + per_token * tokens`` to the latest pieces (least squares); until their
sizes differ enough to separate the two parts it reads the latest piece of at least FORWARD_PIECE_TOKENS as all
per-token time.
"""

from __future__ import annotations

from collections import deque

FORWARD_PIECE_TOKENS = 128  # the least a piece covers (64- and 256-token windows of `small`: 16 and 53 ms, Zen 5)
FORWARD_PIECE_S = 0.03  # the time a piece may take (or twice its fixed part, where that is longer)
FIT_PIECES = 32  # the latest pieces the fit reads
FIT_MIN_PIECES = 4  # and the fewest it needs, their sizes ...
FIT_MIN_SPREAD = 2.0  # ... the largest at least this many times the smallest


def piece_tokens(fixed_s: float, per_token_s: float, floor: int, piece_s: float) -> int | None:
    """The tokens of a piece that takes at most ``piece_s`` or twice ``fixed_s``, the longer, and at least
    ``floor`` tokens; None (no limit: windows run whole) where tokens cost nothing."""
    if per_token_s <= 0:
        return None
    return max(floor, int((max(piece_s, 2 * fixed_s) - fixed_s) / per_token_s))


class ForwardPieces:
    """The timings of recent forward pieces, and the piece size they call for (module docstring)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=FIT_PIECES)  # (tokens, seconds)
        self.per_token_s: float | None = None  # the latest piece of at least FORWARD_PIECE_TOKENS, per token

    def record(self, tokens: int, seconds: float) -> None:
        """A piece of ``tokens`` tokens ran in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        self.samples.append((tokens, seconds))
        if tokens >= FORWARD_PIECE_TOKENS:  # shorter ones are mostly fixed cost: read alone they shrink the pieces
            self.per_token_s = seconds / tokens

    def fit(self) -> tuple[float, float] | None:
        """``(fixed_s, per_token_s)`` by least squares over the latest pieces, or None while their sizes are too
        alike to tell the two apart. The fixed part is at least 0; a per-token part at or below 0 is returned as 0."""
        if len(self.samples) < FIT_MIN_PIECES:
            return None
        sizes = [n for n, _ in self.samples]
        if max(sizes) < FIT_MIN_SPREAD * min(sizes):
            return None
        mean_n = sum(sizes) / len(sizes)
        mean_t = sum(t for _, t in self.samples) / len(sizes)
        var = sum((n - mean_n) ** 2 for n in sizes)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in self.samples) / var
        fixed = mean_t - slope * mean_n
        if fixed < 0:  # through the origin instead: all per-token time
            return 0.0, sum(t for _, t in self.samples) / sum(sizes)
        return fixed, max(slope, 0.0)

    def tokens(self) -> int | None:
        """The tokens the next piece may cover (None: no limit)."""
        fit = self.fit()
        if fit is not None:
            return piece_tokens(*fit, FORWARD_PIECE_TOKENS, FORWARD_PIECE_S)
        if self.per_token_s is None:
            return FORWARD_PIECE_TOKENS  # nothing measured yet
        return piece_tokens(0.0, self.per_token_s, FORWARD_PIECE_TOKENS, FORWARD_PIECE_S)
