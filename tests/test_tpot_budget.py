"""The TPOT budget on plain requests and a hand-moved clock: the target, each request's slack, the idle and bursting
lengths, the load reserve and the time outside the model work."""

from __future__ import annotations

import math

import pytest

from coserve.scheduler import Request, SamplingParams, SchedulerConfig
from coserve.scheduler.tpot_budget import TpotBudget


def budget(**kw) -> TpotBudget:
    cfg = dict(slo_tpot_s=0.020, slo_margin=0.1, slo_margin_max=0.6, idle_iteration_s=0.1)
    return TpotBudget(SchedulerConfig(**{**cfg, **kw}))


def decoding(outputs: int, first_token_time: float) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=100), None, frozenset(), 0.0)
    r.output_token_ids = list(range(outputs))
    r.first_token_time = first_token_time
    return r


def test_the_budget_is_the_target_lowered_to_the_slack_of_the_request_furthest_behind():
    b = budget()
    assert b.budget_s([], now=0.0, idle=True, bursting=False) == 0.1  # no request: the idle length
    on_time = decoding(5, first_token_time=0.0)  # 5 outputs: 4 intervals of 18 ms allowed, and the next one
    assert b.budget_s([on_time], now=0.072, idle=False, bursting=False) == pytest.approx(0.018)
    behind = decoding(5, first_token_time=-0.028)  # 100 ms for what 90 ms allowed: no time for finetuning
    assert b.budget_s([on_time, behind], now=0.072, idle=False, bursting=False) == pytest.approx(-0.01)
    ahead = decoding(5, first_token_time=0.0)  # 90 ms banked: up to the idle length only while bursting
    assert b.budget_s([ahead], now=0.0, idle=False, bursting=False) == pytest.approx(0.018)
    assert b.budget_s([ahead], now=0.0, idle=False, bursting=True) == pytest.approx(0.09)
    assert b.budget_s([decoding(0, None)], now=5.0, idle=False, bursting=False) == pytest.approx(0.018)  # prefill
    b.observe_overhead(0.004)  # what the iteration costs outside the model work comes off
    assert b.budget_s([on_time], now=0.072, idle=False, bursting=False) == pytest.approx(0.014)


@pytest.mark.parametrize("reserve_s", [math.inf, 0.05])
def test_under_full_load_a_request_goes_at_the_load_target_until_it_has_banked_the_reserve(reserve_s):
    b = budget(load_reserve_s=reserve_s)
    b.observe_inference(0.0, 0.0)
    b.observe_inference(1.0, 1.0)
    assert b.current_margin() == pytest.approx(0.6) and b.margin == 0.1  # the load's margin, not the misses'
    r = decoding(11, first_token_time=0.0)  # 10 intervals at 8 ms (the load target): 100 ms banked against 18 ms
    at_load_target = b.budget_s([r], now=0.080, idle=False, bursting=False)
    if math.isinf(reserve_s):
        assert at_load_target == pytest.approx(0.008)
    else:  # 11 x 18 ms less the 50 ms reserve, less the 80 ms elapsed: 68 ms, capped at the 18 ms target
        assert at_load_target == pytest.approx(0.018)


def test_misses_raise_the_margin_and_attained_requests_lower_it():
    b = budget()
    b.observe_tpot(decoding(5, first_token_time=0.0), now=0.2)  # 50 ms per output: a miss
    assert b.margin == pytest.approx(0.15)
    b.observe_tpot(decoding(5, first_token_time=0.0), now=0.04)  # 10 ms: within the SLO
    assert b.margin == pytest.approx(0.15 - 0.0015)
    b.observe_tpot(decoding(1, first_token_time=0.0), now=9.0)  # one output: no interval to judge
    assert b.margin == pytest.approx(0.15 - 0.0015)
