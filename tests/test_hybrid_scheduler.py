"""The hybrid token scheduler on plain data: finetuning slices sized by the latency model, fed back
with hand-built results (no model, no tensors)."""

from __future__ import annotations

import math

import pytest

from coserve.kvcache import BlockManager
from coserve.scheduler import ExecutionResult, Request, SamplingParams, Scheduler, SchedulerConfig
from coserve.scheduler.finetune_work import BACKWARD, DONE, FORWARD, FinetuneProgress
from coserve.scheduler.inference_load import InferenceLoad
from coserve.scheduler.latency_model import FEATURE_NAMES, IterationShape, LatencyModel
from coserve.scheduler.scheduler import BURST_RESERVE
from coserve.scheduler.tpot_budget import LOAD_HIGH, LOAD_LOW, LOAD_TAU_S

# 1 ms per iteration, 0.1 ms per inference token, 0.2 ms per finetuning forward token, 0.05 ms per backward token-layer.
COEF = {"overhead": 1e-3, "decode_tokens": 1e-4, "prefill_tokens": 1e-4, "finetune_forward_tokens": 2e-4,
        "finetune_backward_token_layers": 5e-5}


def latency() -> LatencyModel:
    return LatencyModel({"model": "m", "device": "cpu", "dtype": "float32", "threads": "2", "fused": "true",
                         "gemms": "plain"},
                        [COEF.get(name, 0.0) for name in FEATURE_NAMES])


class Clock:
    """The scheduler's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(slo_ms=20.0, policy="coserve", budget=64, with_latency=True, clock=None, interval=64,
         idle_s=0.018, min_prefill=64, burst_s=0.0, margin_max=0.1, first_token_s=None,
         load_margin_max=None, load_reserve_s=math.inf) -> Scheduler:
    """A scheduler on the fake latency model; a fixed 10% margin unless ``margin_max`` lets misses or load move it."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64, max_model_len=512, max_loras=2,
                          policy=policy, slo_tpot_s=slo_ms / 1000, slo_margin=0.1, slo_margin_max=margin_max,
                          min_finetune_window=4,
                          temporal_interval=interval, idle_iteration_s=idle_s, min_prefill_chunk=min_prefill,
                          finetune_burst_s=burst_s, first_token_slice_s=first_token_s,
                          load_margin_max=load_margin_max, load_reserve_s=load_reserve_s)
    return Scheduler(cfg, BlockManager(256, 4), latency() if with_latency else None, clock=clock or Clock())


def job(jid="job", phase=FORWARD, pending=500, done=0, layers=0, tokens=500) -> FinetuneProgress:
    return FinetuneProgress(jid, phase, pending, done, layers, tokens, num_layers=4)


def req(rid, n_prompt, max_tokens=50):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   None, frozenset({0}), 0.0)


def step(s, progress=None):
    plan = s.schedule()
    result = ExecutionResult(sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                             finetune=progress(plan) if progress else [])
    s.update(plan, result)
    return plan


def test_idle_inference_gives_finetuning_the_whole_slo_budget():
    s = make()
    s.add_job(job())
    plan = step(s)
    (w,) = plan.finetune
    # 18 ms budget (20 ms SLO minus 10%): 1 ms overhead + 0.2 ms per token -> 85 tokens.
    assert (w.kind, w.num_tokens) == (FORWARD, 85)
    assert plan.predicted_s <= 0.018 + 1e-12 < latency().predict(IterationShape(finetune_forward_tokens=86))


def test_with_no_request_in_the_engine_iterations_may_run_to_the_idle_length():
    s = make(idle_s=0.05)
    s.add_job(job())
    assert s.iteration_budget_s() == 0.05
    assert step(s).finetune[0].num_tokens == int((0.05 - 1e-3) / 2e-4 + 1e-9)  # 245 tokens
    s.add_request(req("r", 4))
    assert abs(s.iteration_budget_s() - 0.018) < 1e-12  # a request arrived: the SLO's budget again


def test_a_burst_cuts_the_finetuning_slice_within_one_iteration():
    s = make(budget=200)
    s.add_job(job())
    assert step(s).finetune[0].num_tokens == 85
    for i in range(4):  # a burst: 4 prompts of 42 tokens arrive
        s.add_request(req(f"r{i}", 42))
    plan = step(s)
    assert sum(len(c.token_ids) for c in plan.chunks) == 168
    assert plan.finetune == []  # 1 + 16.8 ms of prefill leaves room for 1 token, under the 4-token minimum
    plan = step(s)  # now four decodes: 1.4 ms, the slice grows back
    assert len(plan.chunks) == 4 and plan.finetune[0].num_tokens == 83
    assert plan.predicted_s <= 0.018 + 1e-12


@pytest.mark.parametrize("cap_ms", [None, 4.0])
def test_an_iteration_giving_a_first_token_carries_at_most_the_first_token_slice(cap_ms):
    s = make(first_token_s=None if cap_ms is None else cap_ms / 1000)
    s.add_job(job(pending=10**6, tokens=10**6))
    s.add_request(req("long", 100))
    plan = step(s)  # the prompt's first 64 tokens: no token sampled yet, so the whole budget
    assert [c.sample for c in plan.chunks] == [False] and plan.finetune[0].num_tokens == int((0.018 - 7.4e-3) / 2e-4 + 1e-9)
    plan = step(s)  # its last 36: the first token
    inference = latency().predict(IterationShape(prefill_tokens=36))
    n = plan.finetune[0].num_tokens
    if cap_ms is None:
        assert n == int((0.018 - inference) / 2e-4 + 1e-9)  # 72 tokens
    else:
        assert n == int(0.004 / 2e-4 + 1e-9) and plan.predicted_s <= inference + 0.004 + 1e-12  # 20 tokens
    plan = step(s)  # a decode: the whole budget again
    assert [c.sample for c in plan.chunks] == [True] and plan.finetune[0].num_tokens == int((0.018 - 1.1e-3) / 2e-4 + 1e-9)


def test_the_first_token_slice_must_be_none_or_non_negative():
    with pytest.raises(ValueError, match="first_token_slice_s"):
        SchedulerConfig(first_token_slice_s=-0.001)


def test_backward_slices_span_layers_and_several_jobs_share_an_iteration():
    s = make()
    s.add_job(job("a", BACKWARD, pending=30, done=500, layers=2, tokens=500))  # 30 + 500 token-layers left
    s.add_job(job("b", FORWARD, pending=20, done=0))
    plan = step(s)
    kinds = {w.job_id: (w.kind, w.num_tokens) for w in plan.finetune}
    assert kinds["b"] == (FORWARD, 20)  # finishes b's forward pass
    assert kinds["a"][0] == BACKWARD and kinds["a"][1] == int((0.018 - 1e-3 - 20 * 2e-4) / 5e-5 + 1e-9)
    assert plan.predicted_s <= 0.018 + 1e-12


def test_jobs_rotate_and_none_starves():
    s = make(slo_ms=5.0)  # room for one small slice only: 3.5 ms / 0.2 ms -> 17 tokens
    for jid in ("a", "b", "c"):
        s.add_job(job(jid))
    served = [step(s).finetune[0].job_id for _ in range(6)]
    assert sorted(set(served)) == ["a", "b", "c"] and all(served.count(j) == 2 for j in "abc")


def test_no_inference_request_starves_under_finetuning():
    s = make(budget=16)
    s.add_job(job(pending=10**6, tokens=10**6))
    s.add_request(req("r", 40, max_tokens=3))
    finished = False
    for _ in range(10):
        step(s)
        finished = finished or s.requests["r"].is_finished
    assert finished


def test_done_jobs_leave_and_policies():
    s = make()
    s.add_job(job())
    step(s, progress=lambda plan: [job(phase=DONE, pending=0)])
    assert not s.jobs and step(s).finetune == []
    only_inf = make(policy="inference-only")
    only_inf.add_job(job())
    assert step(only_inf).finetune == []
    only_ft = make(policy="finetune-only", with_latency=False)
    only_ft.add_job(job())
    only_ft.add_request(req("r", 10))
    plan = step(only_ft)
    assert plan.chunks == [] and plan.finetune[0].num_tokens == 64  # the whole token budget
    no_model = make(with_latency=False)
    no_model.add_job(job())
    no_model.add_request(req("r", 10))
    plan = step(no_model)
    assert plan.finetune[0].num_tokens == 64 - 10  # what inference left of the token budget


def test_the_latency_model_learns_from_measured_iterations():
    s = make()
    s.add_job(job())
    plan = s.schedule()
    s.update(plan, ExecutionResult(elapsed_s=2 * plan.predicted_s))  # twice as slow as predicted
    assert s.latency.correction > 1.0
    assert step(s).finetune[0].num_tokens < 85


def test_has_work_only_when_the_policy_can_schedule_something():
    s = make(policy="inference-only")
    s.add_job(job())
    assert not s.has_work()  # a job inference-only never runs is no reason to iterate
    s.add_request(req("r", 5))
    assert s.has_work()
    co = make()
    co.add_job(job())
    assert co.has_work()


def test_a_request_behind_its_tpot_target_gets_short_iterations_until_it_catches_up():
    clock = Clock()
    s = make(clock=clock)
    s.add_job(job(pending=10**6, tokens=10**6))
    s.add_request(req("r", 4, max_tokens=100))
    step(s)  # prefill: the first token at t = 0
    assert s.requests["r"].first_token_time == 0.0
    clock.now = 0.010  # one output after the first so far would be on target at 18 ms: 8 ms of slack
    assert abs(s.iteration_budget_s() - 0.008) < 1e-12
    plan = step(s)
    assert plan.predicted_s <= 0.008 + 1e-12 and plan.finetune[0].num_tokens == int((0.008 - 1e-3 - 1e-4) / 2e-4)
    clock.now = 0.040  # 2 outputs after the first would need <= 36 ms: behind, finetuning waits
    assert s.iteration_budget_s() < 0
    plan = step(s)
    assert len(plan.chunks) == 1 and plan.finetune == []
    clock.now = 0.045  # 3 tokens' worth (54 ms) of target: 9 ms of slack again
    assert step(s).finetune != []


def test_bursting_banks_slack_in_decode_only_iterations_then_spends_it_on_one_long_slice():
    """finetune_burst_s: while requests decode, finetuning waits until every one has banked enough slack (each
    output under the 18 ms target adds the difference) for a slice of the burst length, up to the idle length."""
    clock = Clock()
    s = make(clock=clock, idle_s=0.1, burst_s=0.05)
    s.add_job(job(pending=10**6, tokens=10**6))
    s.add_request(req("a", 4, max_tokens=100))
    plan = step(s)  # a's prefill (no first token yet: no bursting, an 18 ms slice as without it)
    assert plan.finetune[0].num_tokens == int((0.018 - 1e-3 - 4e-4) / 2e-4 + 1e-9)
    outputs = 1
    while True:  # decode steps of 3 ms: 15 ms of slack banked each
        clock.now += 0.003
        budget = s.iteration_budget_s()
        plan = step(s)
        outputs += 1
        if budget >= 0.05:
            break
        assert plan.finetune == [] and len(plan.chunks) == 1  # decode alone while the slack is short
    assert abs(budget - (0.018 * (outputs - 1) - clock.now)) < 1e-12 and outputs == 5  # 4 x 15 ms + its own 18
    (w,) = plan.finetune  # the slice's prediction is kept BURST_RESERVE below the slack it spends
    kept = budget / (1 + BURST_RESERVE)
    assert w.num_tokens == int((kept - 1e-3 - 1e-4) / 2e-4 + 1e-9) and plan.predicted_s <= kept + 1e-12
    clock.now += plan.predicted_s * (1 + BURST_RESERVE)  # an overrun, within the slack: decode alone again
    assert step(s).finetune == []
    # a request waiting for admission or for its first token caps the iteration at the target, as without bursting
    s.add_request(req("b", 4, max_tokens=100))
    clock.now += 1.0  # a has fallen behind: nothing runs beside the inference
    assert s.iteration_budget_s() < 0.018
    lots = make(clock=Clock(), idle_s=0.1, burst_s=0.05)
    lots.add_job(job(pending=10**6, tokens=10**6))
    lots.add_request(req("a", 4, max_tokens=100))
    step(lots)
    lots.clock.now = -1.0  # a is far ahead of its target: the budget stops at the idle length
    assert abs(lots.iteration_budget_s() - 0.1) < 1e-12
    lots.add_request(req("b", 4, max_tokens=100))  # ... or at the target while b waits
    assert abs(lots.iteration_budget_s() - 0.018) < 1e-12


def test_requests_that_miss_the_slo_raise_the_margin_and_requests_that_attain_it_lower_it():
    clock = Clock()
    s = make(clock=clock, margin_max=0.4)
    assert s.tpot.margin == 0.1

    def serve(rid, seconds_per_token):  # a request of 4 outputs, each step taking seconds_per_token
        s.add_request(req(rid, 4, max_tokens=4))
        for _ in range(4):
            step(s)
            clock.now += seconds_per_token

    serve("slow", 0.030)  # 30 ms per output token: over the 20 ms SLO
    assert abs(s.tpot.margin - 0.15) < 1e-12
    s.add_request(req("r", 4, max_tokens=100))
    step(s)
    assert abs(s.iteration_budget_s() - 0.020 * 0.85) < 1e-12  # the target follows the margin
    for i in range(10):
        serve(f"slow{i}", 0.030)
    assert s.tpot.margin == 0.4  # capped at slo_margin_max
    serve("fast", 0.010)
    assert abs(s.tpot.margin - (0.4 - 0.0015)) < 1e-12
    for i in range(300):
        serve(f"fast{i}", 0.010)
    assert s.tpot.margin == 0.1  # back to the configured floor
    fixed = make(clock=clock)  # slo_margin_max == slo_margin: a fixed margin, no controller
    fixed.add_request(req("slow", 4, max_tokens=4))
    for _ in range(4):
        step(fixed)
        clock.now += 0.030
    assert fixed.tpot.margin == 0.1


def test_inference_load_widens_the_margin_before_any_request_misses_and_idle_time_narrows_it_back():
    clock = Clock()
    s = make(clock=clock, margin_max=0.6)
    s.add_job(job(pending=10**6, tokens=10**6))
    for i in range(8):
        s.add_request(req(f"r{i}", 4, max_tokens=10**6))
    step(s)  # the prompts
    decode = s.latency.predict(IterationShape(decode_tokens=8))
    for _ in range(200):  # decode iterations back to back, each as long as its inference work
        plan = step(s)
        clock.now += decode
    # each 1.8 ms iteration of 8 rows: 0.8 ms of token work in full, and its 1 ms fixed cost as if spread over the
    # 18 ms the SLO (20 ms less the least margin, 10%) lets an iteration last: 0.1 ms (fewer rows once the KV
    # blocks run out and requests are preempted)
    assert LOAD_HIGH < s.tpot.load_share() <= 0.9 / 1.8 + 0.01
    assert s.tpot.margin == 0.1  # no request has finished, let alone missed
    assert abs(s.tpot.current_margin() - 0.6) < 1e-12
    budget = s.iteration_budget_s()
    assert budget <= 0.020 * 0.4 + 1e-12  # the target is the SLO less the 60% margin
    for _ in range(100):  # the same requests, an iteration every 40 ms: 1 ms of inference in 40, load 0.03 for long
        plan = step(s)
        clock.now += 0.040
    assert s.tpot.load_share() < 0.2 and s.tpot.current_margin() == 0.1
    assert plan.chunks and plan.finetune  # nothing kept finetuning out meanwhile
    # the share between LOAD_LOW and LOAD_HIGH moves the margin linearly
    s.tpot.load = InferenceLoad(LOAD_TAU_S)
    s.tpot.observe_inference(0.0, 0.0)
    s.tpot.observe_inference(1.0, (LOAD_LOW + LOAD_HIGH) / 2)
    assert abs(s.tpot.current_margin() - 0.35) < 1e-12


def test_load_margin_max_caps_what_the_load_alone_asks_and_misses_go_beyond_it():
    clock = Clock()
    s = make(clock=clock, margin_max=0.8, load_margin_max=0.5)
    s.tpot.observe_inference(0.0, 0.0)
    s.tpot.observe_inference(1.0, 1.0)  # fully loaded
    assert abs(s.tpot.current_margin() - 0.5) < 1e-12  # the load alone: up to load_margin_max
    for i in range(20):  # requests over the 20 ms SLO
        s.add_request(req(f"slow{i}", 4, max_tokens=4))
        for _ in range(4):
            step(s)
            clock.now += 0.030
    assert s.tpot.margin == 0.8 and s.tpot.current_margin() == 0.8  # misses: up to slo_margin_max
    unset = make(margin_max=0.8)  # load_margin_max None: the load alone goes to slo_margin_max
    unset.tpot.observe_inference(0.0, 0.0)
    unset.tpot.observe_inference(1.0, 1.0)
    assert abs(unset.tpot.current_margin() - 0.8) < 1e-12
    for bad in (0.05, 0.9, "0.5"):
        with pytest.raises(ValueError, match="load_margin_max"):
            make(margin_max=0.8, load_margin_max=bad)


def _fully_loaded(s: Scheduler) -> None:
    s.tpot.load = InferenceLoad(LOAD_TAU_S)
    s.tpot.observe_inference(0.0, 0.0)
    s.tpot.observe_inference(1.0, 1.0)


@pytest.mark.parametrize("reserve_s", [math.inf, 0.05, 0.0])
def test_the_load_margin_holds_a_request_only_until_it_has_banked_the_load_reserve(reserve_s):
    """Under full load the target is 8 ms (20 ms SLO, 60% margin) against 18 ms without the load margin. A request
    banks 10 ms more per output at 8 ms; once it has banked ``load_reserve_s`` against 18 ms it may go at 18 ms, and
    it keeps that reserve: a request that spent its slack gets short iterations until it has the reserve again."""
    clock = Clock()
    s = make(clock=clock, margin_max=0.6, load_reserve_s=reserve_s)
    s.add_job(job(pending=10**6, tokens=10**6))
    s.add_request(req("r", 4, max_tokens=1000))
    step(s)  # the first token at t = 0
    budgets = {}
    for k in range(1, 12):  # decode steps of 3 ms
        clock.now = 0.003 * k
        step(s)
        _fully_loaded(s)
        assert s.tpot.margin == 0.1 and abs(s.tpot.current_margin() - 0.6) < 1e-12
        n, elapsed = k + 1, clock.now
        budgets[n] = s.iteration_budget_s()
        # the load margin's target, or the one without it less the reserve, whichever allows more; never above 18 ms
        # once the reserve is finite (8 ms with no cap)
        expect = min(0.008 if math.isinf(reserve_s) else 0.018, max(0.008 * n, 0.018 * n - reserve_s) - elapsed)
        assert abs(budgets[n] - expect) < 1e-12, n
    if math.isinf(reserve_s):
        assert all(abs(b - 0.008) < 1e-12 for b in budgets.values())  # the load margin for the whole output
    elif reserve_s == 0.0:  # no reserve: as if there were no load margin at all
        free = make(clock=clock, margin_max=0.1)
        free.running, free.requests = s.running, s.requests
        assert abs(budgets[12] - free.iteration_budget_s()) < 1e-12 and abs(budgets[12] - 0.018) < 1e-12
    else:  # 50 ms: at 8 ms an output banks 10 ms more against 18 ms, so from the fifth output on the request's
        # budget is what it has banked against 18 ms less 50 ms; before, what it has banked against 8 ms (2 outputs
        # in 3 ms: 13 ms)
        assert abs(budgets[2] - 0.013) < 1e-12 and abs(budgets[12] - 0.018) < 1e-12
        clock.now = 0.164  # 12 outputs in 164 ms: 216 ms at 18 ms each less the 50 ms reserve leaves 2 ms
        assert abs(s.iteration_budget_s() - 0.002) < 1e-12
    for bad in (-0.001, math.nan, "1"):
        with pytest.raises(ValueError, match="load_reserve_s"):
            make(load_reserve_s=bad)


def test_the_load_counts_the_fixed_cost_of_an_iteration_as_if_it_were_stretched_so_shorter_ones_raise_it_not():
    """The same token work per second in 45 ms iterations or in 20 ms ones (a wider margin) is the same load; counted
    in full, the fixed cost made the shorter iterations a higher load, which widened the margin further."""
    def share(iteration_s: float, stretch_s: float | None) -> float:
        load = InferenceLoad(tau_s=2.0, stretch_s=stretch_s)
        now = 0.0
        load.observe(now, 0.0)
        for _ in range(int(20 / iteration_s)):
            now += iteration_s
            load.observe(now, 0.001 + 0.2 * iteration_s, fixed_s=0.001)  # 1 ms fixed + a fifth of the time in tokens
        return load.share()
    assert share(0.045, 0.045) == pytest.approx(0.2 + 0.001 / 0.045)
    assert share(0.020, 0.045) == pytest.approx(share(0.045, 0.045))
    assert share(0.020, None) == pytest.approx(0.2 + 0.001 / 0.020)  # in full: 0.25 against 0.22
    long = InferenceLoad(tau_s=2.0, stretch_s=0.045)  # an iteration longer than the stretch counts it once
    long.observe(0.0, 0.0)
    long.observe(0.1, 0.011, fixed_s=0.001)
    assert long.share() == pytest.approx(0.11)
    with pytest.raises(ValueError, match="stretch_s"):
        InferenceLoad(1.0, stretch_s=0.0)


def test_inference_load_is_the_decayed_share_of_wall_time_and_checks_its_time_constant():
    load = InferenceLoad(tau_s=2.0)
    assert load.share() == 0.0
    load.observe(10.0, 0.5)  # the first observation only starts the clock
    assert load.share() == 0.0
    load.observe(11.0, 0.25)
    assert abs(load.share() - 0.25) < 1e-12
    load.observe(13.0, 2.0)  # decay e^-1 over the 2 s: (0.25 e^-1 + 2) / (1 e^-1 + 2)
    e = math.exp(-1)
    assert abs(load.share() - (0.25 * e + 2.0) / (e + 2.0)) < 1e-12
    load.observe(14.0, 5.0)  # more inference than wall time (a misprediction) still reads as at most 1
    assert load.share() == 1.0
    with pytest.raises(ValueError, match="tau_s"):
        InferenceLoad(0.0)


def test_a_long_prompt_beside_decoding_requests_is_cut_to_their_tpot_budget():
    clock = Clock()
    s = make(clock=clock, budget=512, min_prefill=16)
    s.add_request(req("d", 4, max_tokens=100))
    step(s)  # d decodes from now on
    s.add_request(req("long", 300))
    plan = step(s)
    prefill = [c for c in plan.chunks if c.request_id == "long"][0]
    # 18 ms of budget: 1 ms + 0.1 ms for d's decode token + 0.1 ms per prompt token -> 169 tokens
    assert len(prefill.token_ids) == 169 and plan.predicted_s == 0.0  # no room left for finetuning (no job)
    assert latency().predict(IterationShape(decode_tokens=1, prefill_tokens=169)) <= 0.018 + 1e-12
    plan = step(s)  # the rest of the prompt, its first token, and d's next decode
    assert len([c for c in plan.chunks if c.request_id == "long"][0].token_ids) == 131
    clock.now = 1.0  # d far behind its target: prompts still move, by the minimum chunk
    s.add_request(req("late", 100))
    plan = step(s)
    assert len([c for c in plan.chunks if c.request_id == "late"][0].token_ids) == 16
    baseline = make(clock=Clock(), budget=512, min_prefill=16, policy="inference-only")
    baseline.add_request(req("d", 4, max_tokens=100))
    step(baseline)
    baseline.add_request(req("long", 300))
    assert len([c for c in step(baseline).chunks if c.request_id == "long"][0].token_ids) == 300  # the whole chunk


def _whole_sequence_progress(plan):
    """Finetuning work reported done: after a temporal-sharing iteration the job starts its next sequence."""
    return [job(w.job_id, FORWARD, pending=500) for w in plan.finetune]


def test_temporal_sharing_gives_one_whole_sequence_after_every_n_inference_iterations():
    s = make(policy="temporal", interval=3, with_latency=False)
    s.add_job(job(pending=200, done=300, tokens=500))
    plan = step(s, _whole_sequence_progress)  # no request: finetuning runs, the whole rest of the sequence
    assert [(w.kind, w.num_tokens) for w in plan.finetune] == [(FORWARD, 200), (BACKWARD, 4 * 500)]
    s.add_request(req("r", 4, max_tokens=100))
    kinds = []
    for _ in range(8):
        plan = step(s, _whole_sequence_progress)
        kinds.append("ft" if plan.finetune else "inf")
        assert not (plan.finetune and plan.chunks)  # never both in one iteration
    assert kinds == ["inf", "inf", "inf", "ft", "inf", "inf", "inf", "ft"]
    back = make(policy="temporal", with_latency=False)
    back.add_job(job(phase=BACKWARD, pending=100, done=500, layers=2, tokens=500))
    assert [(w.kind, w.num_tokens) for w in step(back).finetune] == [(BACKWARD, 100 + 500)]


def test_dynamic_temporal_sharing_switches_when_its_controller_says_so():
    s = make(policy="dts", with_latency=False)
    s.add_job(job(pending=10**6, tokens=10**6))
    s.add_request(req("r", 4, max_tokens=500))
    kinds = ["ft" if step(s, _whole_sequence_progress).finetune else "inf" for _ in range(66)]
    assert kinds.index("ft") == 64  # Algorithm 3's first interval: 64 inference iterations


def test_backward_slices_pay_each_layer_window_they_touch():
    from coserve.scheduler.slice_policy import backward_windows
    windows = backward_windows(job("a", BACKWARD, pending=30, done=500, layers=3, tokens=500))
    assert [windows(n) for n in (0, 1, 30, 31, 530, 531, 1030)] == [0, 1, 1, 2, 2, 3, 3]
    per_window = [0.0] * len(FEATURE_NAMES)
    per_window[FEATURE_NAMES.index("finetune_backward_windows")] = 1e-3  # 1 ms per layer window, nothing else
    lat = LatencyModel(latency().key, per_window)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, slo_tpot_s=0.0025 / 0.9,
                                  min_finetune_window=4, idle_iteration_s=0.0025), BlockManager(64, 4), lat, clock=Clock())
    s.add_job(job("a", BACKWARD, pending=30, done=500, layers=3, tokens=500))
    (w,) = step(s).finetune  # 2.5 ms: two windows, the rest of this layer and the whole next one
    assert (w.kind, w.num_tokens) == (BACKWARD, 530)


def treq(rid, tenant, n_prompt=8, max_tokens=4):
    r = req(rid, n_prompt, max_tokens)
    r.tenant = tenant
    return r


def test_a_light_tenant_is_admitted_ahead_of_a_heavy_tenants_backlog():
    s = make(budget=16, with_latency=False)
    s.config.max_num_seqs = 2
    for i in range(6):
        s.add_request(treq(f"a{i}", "heavy"))
    step(s)  # heavy's first two requests run and are charged
    s.add_request(treq("b0", "light"))
    assert s.vtc.counter("light") == s.vtc.counter("heavy") > 0  # lifted on arrival: no credit for idleness
    admitted = []
    for _ in range(30):
        plan = step(s)
        admitted += [c.request_id for c in plan.chunks if c.start == 0]
    assert admitted.index("b0") == 0  # the next free seat goes to the tenant with the smaller counter


def test_finetuning_jobs_are_served_in_counter_order():
    s = make(slo_ms=5.0)  # room for one small slice only
    s.add_job(job("ja"), tenant="a")
    s.add_job(job("jb"), tenant="b")
    served = [step(s).finetune[0].job_id for _ in range(10)]
    assert served.count("ja") == served.count("jb") == 5  # equal work, equal counters: they alternate
    s.add_request(treq("r", "a", n_prompt=40, max_tokens=2))  # tenant a also uses inference
    step(s)
    served = [step(s).finetune[0].job_id for _ in range(4)]
    assert served[0] == "jb"  # a's counter rose with its prompt: b's job first
    s.remove_job("jb")
    assert not s.vtc.is_backlogged("b")  # b has nothing left: its counter waits, lifted on return


def test_time_outside_the_model_work_comes_off_the_budget():
    """The latency model predicts the model work; what each iteration costs beyond it (scheduling, detokenizing,
    serving the tokens) is measured by the engine and kept out of the finetuning slice's budget."""
    s = make()
    s.add_request(req("r", 4))
    s.tpot.observe_overhead(0.004)  # the first observation is taken as it is
    assert abs(s.iteration_budget_s() - 0.014) < 1e-12
    s.tpot.observe_overhead(0.0)  # then a running mean
    assert 0 < s.tpot.overhead_s < 0.004
    s.tpot.observe_overhead(5.0)  # a stall is clamped to the SLO, not taken whole
    assert s.tpot.overhead_s <= 0.02


def test_the_engine_measures_its_overhead(tiny_model):
    from coserve import LLM, SamplingParams
    llm = LLM(tiny_model, dtype="float32", device="cpu", policy="inference-only")
    llm.generate(["a", "b"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert 0 < llm.engine.scheduler.tpot.overhead_s < 0.05
