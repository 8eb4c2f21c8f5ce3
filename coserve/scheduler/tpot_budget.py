"""The hybrid token scheduler's time budget: how long the next iteration may take so that every running request
keeps its time per output token (TPOT) within the SLO, less a margin that two controllers move: the misses of
finished requests (``observe_tpot``) and the inference load (``load_margin``).

Pure Python over the scheduler's requests; the scheduler asks it for ``budget_s`` before planning a finetuning
slice or cutting a prefill chunk, and feeds it what each iteration and each finished request measured.
"""

from __future__ import annotations

import math

from coserve.scheduler.config import SchedulerConfig
from coserve.scheduler.inference_load import InferenceLoad
from coserve.scheduler.request import Request

OVERHEAD_ALPHA = 0.05  # weight of each new iteration in the running mean of the time outside the model work
# The miss controller (``TpotBudget.observe_tpot``): up by MARGIN_UP at each finished request over the TPOT SLO,
# down by MARGIN_DOWN at each within it, so that it settles where about MARGIN_DOWN / MARGIN_UP (3%) miss.
MARGIN_UP = 0.05
MARGIN_DOWN = 0.0015
# The load-driven margin (``TpotBudget.load_margin``): with the inference load (``InferenceLoad``, the share of the
# last LOAD_TAU_S seconds that the inference work alone would take, each iteration's fixed cost counted as if the
# iteration were as long as the least margin lets it be) at LOAD_LOW or below, none beyond the least; rising
# linearly to ``slo_margin_max`` at LOAD_HIGH. It holds each request only until it has banked
# ``SchedulerConfig.load_reserve_s`` of slack (``TpotBudget.budget_s``).
LOAD_TAU_S = 5.0
LOAD_LOW, LOAD_HIGH = 0.2, 0.4


class TpotBudget:
    """The TPOT target (the SLO less the wider of the two margins), each running request's slack against it, the
    mean time an iteration spends outside the model work, and the idle iteration's length."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.margin = config.slo_margin  # the miss controller's fraction of the SLO kept free (observe_tpot)
        # widens the margin under load (the fixed cost of an iteration counted as if it were as long as the SLO lets
        # it be at the least margin); fed by the scheduler under the coserve policy with a latency model
        self.load = InferenceLoad(LOAD_TAU_S, config.slo_tpot_s * (1 - config.slo_margin))
        # Seconds each iteration costs beyond the model work the latency model predicts (scheduling, detokenizing,
        # handing tokens out, the thread that serves them): a running mean the engine feeds (``observe_overhead``).
        self.overhead_s = 0.0
        self._overhead_seen = False

    def budget_s(self, running: list[Request], now: float, idle: bool, bursting: bool) -> float:
        """The longest the next iteration's model work may take: the TPOT target (SLO minus margin), lowered to
        what keeps every running request's mean time per output token within it (negative when one is already
        behind: no finetuning until it catches up), less ``overhead_s``. ``idle`` (no request in the engine): the
        idle iteration length (``config.idle_iteration_s``) instead. ``bursting`` (finetuning waits for banked
        slack, ``config.finetune_burst_s``): up to the idle length, within each request's banked slack.

        The load margin's part of the target holds a request only until it has banked ``config.load_reserve_s``
        of slack against the target without it (the miss controller's): the slack a burst of arrivals takes from a
        request does not grow with the request's length, so a long one need not go at the load margin's shorter
        target for its whole output."""
        c = self.config
        target = c.slo_tpot_s * (1 - self.current_margin())
        if idle:  # no request to slow down: only a newcomer's wait is bounded
            return max(target, c.idle_iteration_s)
        base = c.slo_tpot_s * (1 - self.margin)  # the target without the load margin (>= target)
        reserve = c.load_reserve_s
        top = target if math.isinf(reserve) else base  # what a request that banked its reserve may go at
        # Bursting, with every running request past its first token and none waiting: up to the idle length,
        # within each one's banked slack. Otherwise at most the target (a prompt's first token is not held back;
        # with a finite reserve, the target without the load margin, each request bounding it below).
        budget = max(top, c.idle_iteration_s) if bursting else top
        for r in running:
            if r.first_token_time is not None:  # after the next token: (elapsed + t) / outputs-after-first
                n, elapsed = len(r.output_token_ids), now - r.first_token_time
                budget = min(budget, max(target * n, base * n - reserve) - elapsed)
        return budget - self.overhead_s  # what is left for the model work, which the latency model predicts

    def current_margin(self) -> float:
        """The margin the TPOT target keeps now: the miss controller's (``margin``) or the load's, the wider."""
        return max(self.margin, self.load_margin())

    def load_margin(self) -> float:
        """The margin the inference load asks for: ``slo_margin`` up to LOAD_LOW, ``load_margin_max`` (or
        ``slo_margin_max``) from LOAD_HIGH, linear between. Stretching decode to the target banks no slack for a
        burst of arrivals, and under load it trains no more than a wider margin (the engine is busy with inference
        either way)."""
        c = self.config
        ramp = min(max((self.load.share() - LOAD_LOW) / (LOAD_HIGH - LOAD_LOW), 0.0), 1.0)
        top = c.slo_margin_max if c.load_margin_max is None else c.load_margin_max
        return c.slo_margin + ramp * (top - c.slo_margin)

    def observe_tpot(self, request: Request, now: float) -> None:
        """``request`` finished at ``now``: move the margin (within ``[slo_margin, slo_margin_max]``) by whether
        its time per output token met the SLO. Stretching every iteration to the target lengthens requests, so
        more of them run at once and the engine idles less; under load that both misses the SLO (prefill chunks
        and mispredicted iterations land on requests with no slack left) and trains less than a shorter target,
        so misses raise the margin, and successes lower it back to ``slo_margin``."""
        c = self.config
        n = len(request.output_token_ids)
        if c.slo_margin_max == c.slo_margin or n < 2 or request.first_token_time is None:
            return
        tpot = (now - request.first_token_time) / (n - 1)
        step = MARGIN_UP if tpot > c.slo_tpot_s else -MARGIN_DOWN
        self.margin = min(c.slo_margin_max, max(c.slo_margin, self.margin + step))

    def observe_inference(self, now: float, inference_s: float, fixed_s: float = 0.0) -> None:
        """An iteration ended at ``now`` whose inference rows alone would take ``inference_s`` seconds by the latency
        model (0 for one without inference), ``fixed_s`` of it the cost any iteration pays: the load margin's feed
        (``InferenceLoad.observe``)."""
        self.load.observe(now, inference_s, fixed_s)

    def load_share(self) -> float:
        """The inference load the margin follows now (``InferenceLoad.share``)."""
        return self.load.share()

    def observe_overhead(self, seconds: float) -> None:
        """Fold one iteration's time outside the model work into ``overhead_s`` (clamped to [0, the TPOT SLO])."""
        seconds = min(max(seconds, 0.0), self.config.slo_tpot_s)
        if not self._overhead_seen:
            self.overhead_s, self._overhead_seen = seconds, True
        else:
            self.overhead_s += OVERHEAD_ALPHA * (seconds - self.overhead_s)
