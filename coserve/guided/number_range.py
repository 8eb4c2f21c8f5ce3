"""Regular expressions for JSON numbers within bounds, for JSON Schema's ``minimum`` / ``maximum`` (and
``exclusiveMinimum`` / ``exclusiveMaximum`` on integers), matched by ``regex.py``'s machine.

Integers: exactly the JSON integers (no leading zeros, no ``-0``) in the range. Numbers with integer bounds:
an integer part and an optional fraction (no exponent), exactly those whose value is in the range (at a bound
itself, only zeros may follow the point). Numbers are capped at ``MAX_INT_DIGITS`` integer digits, as the JSON
machine caps them.
"""

from __future__ import annotations

MAX_INT_DIGITS = 20
UNBOUNDED = 10 ** MAX_INT_DIGITS - 1  # the largest magnitude written


def _fixed(lo: str, hi: str) -> str:
    """Digit strings of one length from ``lo`` to ``hi`` (leading zeros as they come)."""
    n = len(lo)
    if lo == hi:
        return lo
    if n == 1:
        return f"[{lo}-{hi}]"
    if lo[1:] == "0" * (n - 1) and hi[1:] == "9" * (n - 1):
        return f"[{lo[0]}-{hi[0]}]" + (rf"\d{{{n - 1}}}")
    if lo[0] == hi[0]:
        return lo[0] + _fixed(lo[1:], hi[1:])
    parts = [lo[0] + _fixed(lo[1:], "9" * (n - 1))]
    if int(lo[0]) + 1 <= int(hi[0]) - 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + rf"\d{{{n - 1}}}")
    parts.append(hi[0] + _fixed("0" * (n - 1), hi[1:]))
    return "(?:" + "|".join(parts) + ")"


def natural_range(lo: int, hi: int) -> str | None:
    """Non-negative integers ``lo..hi`` as JSON writes them; None when the range is empty."""
    lo, hi = max(lo, 0), min(hi, UNBOUNDED)
    if lo > hi:
        return None
    parts = []
    for length in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (length - 1) if length > 1 else 0)
        b = min(hi, 10 ** length - 1)
        if a <= b:
            parts.append(_fixed(str(a), str(b)))
    return "(?:" + "|".join(parts) + ")"


def integer_range(lo: int | None, hi: int | None) -> str | None:
    """JSON integers in ``lo..hi`` (None: unbounded on that side); None when there are none."""
    lo = -UNBOUNDED if lo is None else lo
    hi = UNBOUNDED if hi is None else hi
    parts = []
    if hi >= 0:
        parts.append(natural_range(max(lo, 0), hi))
    if lo < 0:
        parts.append(None if min(hi, -1) < lo else "-" + natural_range(max(-hi, 1), -lo))
    parts = [p for p in parts if p]
    return "(?:" + "|".join(parts) + ")" if parts else None


def number_range(lo: int | None, hi: int | None) -> str | None:
    """JSON numbers (integer part, optional fraction) whose value is in ``lo..hi`` (integer bounds)."""
    lo = -UNBOUNDED if lo is None else lo
    hi = UNBOUNDED if hi is None else hi
    if lo > hi:
        return None
    frac, zeros = r"(?:\.\d{1,24})?", r"(?:\.0{1,24})?"
    parts = []
    if hi >= 0:  # value >= 0: integer part n, value in [n, n + 1)
        whole = natural_range(max(lo, 0), hi - 1)  # any fraction
        if whole:
            parts.append(whole + frac)
        if hi >= max(lo, 0):
            parts.append(str(hi) + zeros)  # at the upper bound: nothing but zeros after the point
    if lo < 0:  # value < 0: "-m.f" with m + f in (0, -lo]
        top = -lo
        whole = natural_range(max(-hi, 0), top - 1)
        if whole:
            parts.append("-" + whole + frac)  # includes -0.x; -0 itself equals 0, in range as hi >= ... checked below
        parts.append("-" + str(top) + zeros)
    return "(?:" + "|".join(parts) + ")" if parts else None
