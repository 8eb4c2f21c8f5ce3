"""Virtual Token Counter across tenants (FlexLLM Appendix C, Algorithm 4). Plain Python, no tensors.

Each tenant ``i`` has a counter ``c_i`` of the weighted service it has received:
``w_p`` per input (prompt) token, ``w_q`` per output token and ``w_r`` per finetuning
token. The scheduler serves the candidate with the smallest counter. A tenant that
(re)joins with no queued work has its counter lifted so that idleness earns no credit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class FairnessWeights:
    """Cost of one token of each kind; validated on construction, errors name the field."""

    input: float = 1.0  # w_p: per prompt token prefilled
    output: float = 2.0  # w_q: per output token generated
    finetune: float = 1.0  # w_r: per finetuning token processed

    def __post_init__(self) -> None:
        for name in ("input", "output", "finetune"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")

    def counter_gap_bound(self, max_input_len: int, max_tokens: int) -> float:
        """Lemma 1's bound ``U = max(w_p * L_input, max(w_q, w_r) * M)`` on the backlogged counter gap.

        ``max_input_len`` is the longest prompt charged at once (L_input) and ``max_tokens``
        the most output or finetuning tokens charged to one tenant at once (M). Theorem 1
        bounds the weighted-service difference of two backlogged tenants by ``2 * U``.
        """
        for name, value in (("max_input_len", max_input_len), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        return max(self.input * max_input_len, max(self.output, self.finetune) * max_tokens)


class VirtualTokenCounter:
    """Per-tenant virtual counters with Algorithm 4's lifting rule and argmin selection.

    The caller reports the queue, not the counter: ``on_arrival`` for every request that
    arrives (it lifts the tenant's counter if the tenant had no queued work and marks it
    backlogged, Algorithm 4 lines 5-12), and ``set_backlogged(tenant, False)`` when a
    tenant's queue empties (which records it as "the last tenant that left").
    ``set_backlogged(tenant, True)`` marks a known tenant backlogged *without* lifting,
    for work that returns to the queue (a preempted request); new work goes through
    ``on_arrival``. Counters never decrease.

    Ties in ``pick`` go to the tenant that arrived first (first ``on_arrival`` ever), then
    to the smaller name; since arrival order is unique per tenant, the name never decides
    in practice but keeps the order total. Unknown tenants (never passed to
    ``on_arrival``) are an error everywhere except ``on_arrival``.
    """

    def __init__(self, weights: FairnessWeights | None = None) -> None:
        self.weights = weights if weights is not None else FairnessWeights()
        self._counters: dict[str, float] = {}  # tenant -> c_i, in first-arrival order
        self._order: dict[str, int] = {}  # tenant -> first-arrival sequence number
        self._backlogged: dict[str, None] = {}  # Q's tenants (an ordered set)
        self._last_left: str | None = None  # the last tenant whose queue emptied

    # ---- the monitoring stream ----------------------------------------------
    def on_arrival(self, tenant: str) -> None:
        """A request from ``tenant`` arrived: lift its counter if it had no queued work, mark it backlogged.

        With no tenant backlogged the counter is lifted to the last tenant that left the
        queue (if any); otherwise to the smallest counter among backlogged tenants.
        """
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {tenant!r}")
        if tenant not in self._counters:
            self._counters[tenant] = 0.0
            self._order[tenant] = len(self._order)
        if tenant in self._backlogged:
            return
        if not self._backlogged:
            if self._last_left is not None:
                self._counters[tenant] = max(self._counters[tenant], self._counters[self._last_left])
        else:
            floor = min(self._counters[t] for t in self._backlogged)
            self._counters[tenant] = max(self._counters[tenant], floor)
        self._backlogged[tenant] = None

    def set_backlogged(self, tenant: str, backlogged: bool) -> None:
        """Record that ``tenant``'s queue became non-empty (True, no lifting) or empty (False)."""
        self._known(tenant)
        if backlogged:
            self._backlogged[tenant] = None
        elif tenant in self._backlogged:
            del self._backlogged[tenant]
            self._last_left = tenant

    def is_backlogged(self, tenant: str) -> bool:
        """Whether ``tenant`` currently has queued work (as last reported)."""
        return tenant in self._backlogged

    def backlogged(self) -> list[str]:
        """The backlogged tenants, in first-arrival order."""
        return sorted(self._backlogged, key=self._order.__getitem__)

    # ---- the execution stream -----------------------------------------------
    def pick(self, tenants: Iterable[str]) -> str | None:
        """The candidate with the smallest counter (ties: earliest arrival, then name); None if no candidates."""
        best: tuple[float, int, str] | None = None
        for tenant in tenants:
            self._known(tenant)
            key = (self._counters[tenant], self._order[tenant], tenant)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def charge_input(self, tenant: str, tokens: int) -> None:
        """Charge ``w_p * tokens`` for prompt tokens admitted for ``tenant``."""
        self._charge(tenant, tokens, self.weights.input)

    def charge_output(self, tenant: str, tokens: int) -> None:
        """Charge ``w_q * tokens`` for output tokens generated for ``tenant``."""
        self._charge(tenant, tokens, self.weights.output)

    def charge_finetune(self, tenant: str, tokens: int) -> None:
        """Charge ``w_r * tokens`` for finetuning tokens processed for ``tenant``."""
        self._charge(tenant, tokens, self.weights.finetune)

    # ---- reading ------------------------------------------------------------
    def counter(self, tenant: str) -> float:
        """``tenant``'s current counter ``c_i``."""
        self._known(tenant)
        return self._counters[tenant]

    def counters(self) -> dict[str, float]:
        """A copy of every known tenant's counter, in first-arrival order."""
        return dict(self._counters)

    # ---- internals ----------------------------------------------------------
    def _charge(self, tenant: str, tokens: int, weight: float) -> None:
        self._known(tenant)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a non-negative integer, got {tokens!r}")
        self._counters[tenant] += weight * tokens

    def _known(self, tenant: str) -> None:
        if tenant not in self._counters:
            raise ValueError(f"tenant {tenant!r} is unknown: call on_arrival for it first")
