"""Dynamic Temporal Sharing (FlexLLM Algorithm 3) and the fixed temporal-sharing baseline."""

import math

import pytest

from coserve.scheduler.dts import DynamicTemporalSharing, TemporalSharing, pressure, target_interval

IDLE = (0, 0, 0, 0)  # queue_len, batch_size, arrivals, completions
HEAVY = (40, 32, 10, 0)  # p_q = 1, p_s = 0.5, p_b = 10/8: total 2.75 >= 2


def run(ctrl, stats, steps: int) -> list[int]:
    """Inference steps between consecutive finetuning switches over ``steps`` calls."""
    gaps, since = [], 0
    for _ in range(steps):
        since += 1
        if ctrl.step(*stats):
            gaps.append(since)
            since = 0
    return gaps


def run_switches(ctrl: DynamicTemporalSharing, stats, switches: int) -> list[float]:
    """The interval ``s`` set at each of the next ``switches`` switches."""
    out = []
    while len(out) < switches:
        if ctrl.step(*stats):
            out.append(ctrl.last_interval)
    return out


def test_idle_system_gives_the_shortest_intervals():
    # idle: p = 0 -> f = 64, so finetuning gets a switch as often as the algorithm allows.
    # The first interval is the initial s = 64; non-recompute switches give ceil(64 * 1.1) = 71
    # steps; every third switch recomputes (64 + 2 * 64) / 3 = 64, floored to 80.
    gaps = run(DynamicTemporalSharing(), IDLE, 2000)
    assert gaps[:7] == [64, 71, 71, 80, 71, 71, 80]
    assert all(64 <= g <= 80 for g in gaps)


def test_heavy_queue_pressure_lengthens_intervals_toward_512():
    # A higher pressure gives a larger f, and f (hence s) is the number of inference steps
    # between finetuning switches: under inference pressure finetuning runs *less* often.
    ctrl = DynamicTemporalSharing()
    recomputed = [s for i, s in enumerate(run_switches(ctrl, HEAVY, 60)) if i % 3 == 2]
    assert recomputed[0] == pytest.approx((512 + 2 * 64) / 3)  # hysteresis from f_p = 64
    assert all(a < b <= 512 for a, b in zip(recomputed, recomputed[1:]))
    assert recomputed[-1] > 511
    assert run(ctrl, HEAVY, 3000)[-3:] == [512, 512, 512]
    assert min(run(DynamicTemporalSharing(), HEAVY, 5000)[3:]) > max(run(DynamicTemporalSharing(), IDLE, 5000))


def test_pressure_terms_and_their_caps():
    assert pressure([0, 0], 0, 0) == 0
    assert pressure([100], 0, 0) == 1.5  # p_q capped at 1, p_s at 0.5
    assert pressure([10, 10], 16, 0) == pytest.approx(0.5 + 0.4 + 1.0)  # lambda = 8/step
    assert pressure([10, 10], 0, 16) == pytest.approx(0.9)  # completions outpacing arrivals: p_b = 0
    with pytest.raises(ValueError, match="queue_lens"):
        pressure([], 0, 0)


def test_target_interval_endpoints_interpolation_and_direction():
    assert target_interval(0.0) == target_interval(0.8) == 64
    assert target_interval(2.0) == target_interval(9.0) == 512
    assert target_interval(0.9) == pytest.approx((64 + 0.1 / 1.2 * 0.6 * 448) * 1.35)  # 116.64
    assert target_interval(1.999999) == pytest.approx(332.8 * 1.35)  # 449.28: the 1.35 applies in between only
    grid = [target_interval(i / 100) for i in range(0, 301)]
    assert all(a <= b for a, b in zip(grid, grid[1:]))  # more pressure, never a shorter interval


def test_hysteresis_moves_one_third_of_the_way_per_recompute():
    ctrl = DynamicTemporalSharing()
    run_switches(ctrl, HEAVY, 30)  # 10 recomputes: f_p close to 512
    f_p = ctrl.prev_interval
    assert f_p > 500
    # the load vanishes; the next recompute goes only a third of the way to f = 64
    after = run_switches(ctrl, IDLE, 3)
    assert after[2] == pytest.approx((64 + 2 * f_p) / 3)
    assert ctrl.prev_interval == pytest.approx((64 + 2 * f_p) / 3)
    lows = [s for i, s in enumerate(run_switches(ctrl, IDLE, 60)) if i % 3 == 2]
    assert all(a > b or a == b == 80 for a, b in zip(lows, lows[1:])) and lows[-1] == 80  # down to the floor


def test_decision_delay_recomputes_only_every_third_switch():
    ctrl = DynamicTemporalSharing()
    run_switches(ctrl, HEAVY, 30)
    assert ctrl.delay == 0
    f_p = ctrl.prev_interval
    # two switches under a changed (idle) load keep the old f_p: s = min(512, 1.1 * f_p)
    first_two = run_switches(ctrl, IDLE, 2)
    assert first_two == [min(512, 1.1 * f_p)] * 2
    assert ctrl.prev_interval == f_p and ctrl.delay == 2
    third = run_switches(ctrl, IDLE, 1)
    assert third[0] < first_two[0] and ctrl.delay == 0 and ctrl.prev_interval != f_p


def test_stats_reset_on_every_switch_so_a_recompute_sees_only_the_last_interval():
    ctrl = DynamicTemporalSharing()
    run_switches(ctrl, HEAVY, 2)  # heavy load during the first two intervals only
    assert ctrl.queue_lens == [] and ctrl.batch_sizes == [] and ctrl.arrivals == ctrl.completions == 0
    # the third interval is idle: the recompute sees p = 0, so s = max((64 + 2 * 64) / 3, 80)
    assert run_switches(ctrl, IDLE, 1) == [80]
    assert ctrl.prev_interval == 64


def test_float_interval_lasts_ceil_steps_and_initial_values_are_configurable():
    ctrl = DynamicTemporalSharing(initial_interval=10, initial_prev=100)
    assert run(ctrl, IDLE, 10 + 110 + 110) == [10, 110, 110]  # 1.1 * 100 is 110.00000000000001: still 110
    ctrl = DynamicTemporalSharing(initial_interval=1, initial_prev=70)
    assert run(ctrl, IDLE, 1 + 77) == [1, math.ceil(70 * 1.1)]


def test_bad_inputs_raise_naming_the_field():
    ctrl = DynamicTemporalSharing()
    for i, name in enumerate(("queue_len", "batch_size", "arrivals", "completions")):
        stats = [0, 0, 0, 0]
        stats[i] = -1
        with pytest.raises(ValueError, match=name):
            ctrl.step(*stats)
    with pytest.raises(ValueError, match="initial_interval"):
        DynamicTemporalSharing(initial_interval=0)
    with pytest.raises(ValueError, match="n must"):
        TemporalSharing(0)


def test_temporal_sharing_switches_every_nth_step():
    ts = TemporalSharing(4)
    assert [ts.step() for _ in range(12)] == [False, False, False, True] * 3
    assert run(TemporalSharing(7), HEAVY, 70) == [7] * 10  # statistics are ignored
    assert all(TemporalSharing(1).step() for _ in range(5))
