"""Virtual Token Counter (FlexLLM Algorithm 4): fairness bounds on plain simulated workloads."""

import math
import random
import subprocess
import sys
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.scheduler.fairness import FairnessWeights, VirtualTokenCounter

L_INPUT, M = 64, 16  # longest prompt charged at once, most output/finetune tokens per pick


def serve(vtc: VirtualTokenCounter, queues: dict[str, deque], service: dict[str, float]) -> str | None:
    """One pick among the backlogged tenants: charge the head item of the winner, pop it."""
    tenant = vtc.pick(vtc.backlogged())
    if tenant is None:
        return None
    kind, tokens = queues[tenant].popleft()
    getattr(vtc, f"charge_{kind}")(tenant, tokens)
    service[tenant] += getattr(vtc.weights, kind) * tokens
    if not queues[tenant]:
        vtc.set_backlogged(tenant, False)
    return tenant


def random_item(rng: random.Random) -> tuple[str, int]:
    kind = rng.choice(["input", "output", "finetune"])
    return kind, rng.randint(1, L_INPUT if kind == "input" else M)


def gap(vtc: VirtualTokenCounter) -> float:
    values = [vtc.counter(t) for t in vtc.backlogged()]
    return max(values) - min(values) if values else 0.0


def test_heavy_tenant_gets_no_more_than_theorem1_bound_over_any_interval():
    rng = random.Random(0)
    weights = FairnessWeights(input=1.0, output=2.0, finetune=1.5)
    bound = 2 * weights.counter_gap_bound(L_INPUT, M)
    vtc = VirtualTokenCounter(weights)
    queues = {"A": deque(random_item(rng) for _ in range(2000)), "B": deque(random_item(rng) for _ in range(200))}
    service = {"A": 0.0, "B": 0.0}
    for tenant in queues:
        for _ in queues[tenant]:
            vtc.on_arrival(tenant)
    diffs = [0.0]  # W_A - W_B since the start; any interval's difference is a difference of two entries
    picks = {"A": 0, "B": 0}
    while vtc.is_backlogged("A") and vtc.is_backlogged("B"):
        picks[serve(vtc, queues, service)] += 1
        diffs.append(service["A"] - service["B"])
    assert max(diffs) - min(diffs) <= bound
    # B drained all its work while A, with 10x as much queued, got about the same weighted service
    assert not queues["B"] and picks["A"] < 400
    assert abs(service["A"] - service["B"]) <= bound / 2


def test_idle_tenant_rejoining_is_lifted_and_does_not_monopolise():
    vtc = VirtualTokenCounter()
    vtc.on_arrival("A")
    vtc.on_arrival("B")
    vtc.charge_input("B", 5)
    vtc.set_backlogged("B", False)  # B goes idle at counter 5
    for _ in range(100):
        assert vtc.pick(vtc.backlogged()) == "A"
        vtc.charge_input("A", 10)
    assert vtc.counter("A") == 1000
    vtc.on_arrival("B")  # rejoins while A is backlogged: lifted to min over backlogged = 1000
    assert vtc.counter("B") == 1000
    winners = []
    for _ in range(20):
        winner = vtc.pick(vtc.backlogged())
        vtc.charge_input(winner, 10)
        winners.append(winner)
    assert winners.count("B") == 10  # alternates, instead of 99 picks in a row without lifting


def test_rejoin_with_empty_queue_lifts_to_last_tenant_that_left_and_never_lowers():
    vtc = VirtualTokenCounter()
    for tenant in ("A", "B", "C"):
        vtc.on_arrival(tenant)
    vtc.charge_output("C", 400)  # C: 800
    vtc.set_backlogged("C", False)
    vtc.set_backlogged("B", False)
    vtc.charge_input("A", 500)
    vtc.set_backlogged("A", False)  # A leaves last, at 500; nobody is backlogged
    vtc.on_arrival("B")
    assert vtc.counter("B") == 500  # lifted to the last tenant that left, not to C's 800
    vtc.on_arrival("C")
    assert vtc.counter("C") == 800  # lifting only raises
    vtc.on_arrival("D")  # a brand-new tenant starts at the backlogged minimum, not 0
    assert vtc.counter("D") == 500
    vtc.on_arrival("D")  # already backlogged: no change
    assert vtc.counters() == {"A": 500, "B": 500, "C": 800, "D": 500}


def test_first_tenant_ever_starts_at_zero():
    vtc = VirtualTokenCounter()
    vtc.on_arrival("A")
    assert vtc.counters() == {"A": 0.0} and vtc.backlogged() == ["A"]


def test_work_conserving_single_backlogged_tenant_is_always_picked():
    vtc = VirtualTokenCounter()
    vtc.on_arrival("A")
    vtc.on_arrival("B")
    vtc.set_backlogged("B", False)  # idle at counter 0, far below A's
    for _ in range(50):
        assert vtc.pick(vtc.backlogged()) == "A"
        vtc.charge_output("A", M)
    assert vtc.pick([]) is None


def test_mixed_inference_and_finetuning_tokens_are_charged_with_their_weights():
    weights = FairnessWeights(input=1.0, output=2.0, finetune=0.5)
    vtc = VirtualTokenCounter(weights)
    vtc.on_arrival("A")
    vtc.charge_input("A", 10)
    vtc.charge_output("A", 3)
    vtc.charge_finetune("A", 8)
    assert vtc.counter("A") == 10 + 2 * 3 + 0.5 * 8
    # an inference tenant (output tokens, w_q=2) against a finetuning tenant (w_r=0.5), 4 tokens a pick:
    # equal weighted service means the finetuning tenant processes 4x the raw tokens
    vtc = VirtualTokenCounter(weights)
    vtc.on_arrival("inf")
    vtc.on_arrival("ft")
    raw = {"inf": 0, "ft": 0}
    for _ in range(1000):
        tenant = vtc.pick(["inf", "ft"])
        (vtc.charge_output if tenant == "inf" else vtc.charge_finetune)(tenant, 4)
        raw[tenant] += 4
    assert raw["ft"] == 4 * raw["inf"]
    assert abs(vtc.counter("inf") - vtc.counter("ft")) <= weights.counter_gap_bound(L_INPUT, 4)


def test_ties_go_to_earliest_arrival_then_deterministically():
    vtc = VirtualTokenCounter()
    for tenant in ("zeta", "alpha", "mid"):
        vtc.on_arrival(tenant)
    assert vtc.pick(["alpha", "mid", "zeta"]) == "zeta"  # arrival order beats the name
    assert vtc.pick(["mid", "alpha"]) == "alpha"
    order = []
    for _ in range(6):
        tenant = vtc.pick(["mid", "alpha", "zeta"])
        vtc.charge_input(tenant, 1)
        order.append(tenant)
    assert order == ["zeta", "alpha", "mid"] * 2


@pytest.mark.parametrize("field, value", [("input", 0), ("output", -1.0), ("finetune", math.nan),
                                          ("input", math.inf), ("output", True), ("finetune", "1")])
def test_bad_weights_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FairnessWeights(**{field: value})


def test_bad_calls_raise_naming_what_is_wrong():
    vtc = VirtualTokenCounter()
    with pytest.raises(ValueError, match="tenant 'x'"):
        vtc.pick(["x"])
    with pytest.raises(ValueError, match="tenant 'x'"):
        vtc.charge_input("x", 1)
    vtc.on_arrival("x")
    with pytest.raises(ValueError, match="tokens"):
        vtc.charge_output("x", -1)
    with pytest.raises(ValueError, match="max_tokens"):
        FairnessWeights().counter_gap_bound(8, -1)


def test_modules_do_not_import_torch():
    code = ("import sys, coserve.scheduler.fairness, coserve.scheduler.dts; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


arrival_seqs = st.lists(st.tuples(st.integers(0, 30),  # arrival tick
                                  st.sampled_from("abcd"),  # tenant
                                  st.sampled_from(["input", "output", "finetune"]),
                                  st.integers(0, L_INPUT)),  # tokens (capped at M unless input)
                        min_size=1, max_size=60)
weight = st.floats(0.1, 5.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(arrivals=arrival_seqs, w_p=weight, w_q=weight, w_r=weight, per_tick=st.integers(1, 3))
def test_lemma1_counter_gap_and_theorem1_service_gap_stay_bounded(arrivals, w_p, w_q, w_r, per_tick):
    weights = FairnessWeights(w_p, w_q, w_r)
    bound = weights.counter_gap_bound(L_INPUT, M)
    eps = 1e-9 * max(1.0, bound)
    vtc = VirtualTokenCounter(weights)
    queues = {t: deque() for t in "abcd"}
    service = dict.fromkeys("abcd", 0.0)
    spans: dict[tuple[str, str], tuple[float, float]] = {}  # pair both backlogged since -> (min, max) of W_f - W_g

    def check() -> None:
        assert gap(vtc) <= bound + eps  # Lemma 1
        live = vtc.backlogged()
        for pair in list(spans):
            if pair[0] not in live or pair[1] not in live:
                del spans[pair]
        for f in live:
            for g in live:
                if f < g:
                    d = service[f] - service[g]
                    lo, hi = spans.get((f, g), (d, d))
                    spans[(f, g)] = (min(lo, d), max(hi, d))
                    assert max(hi, d) - min(lo, d) <= 2 * bound + eps  # Theorem 1

    tick = 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or vtc.backlogged():
        while pending and pending[0][0] <= tick:
            _, tenant, kind, tokens = pending.pop(0)
            queues[tenant].append((kind, tokens if kind == "input" else min(tokens, M)))
            vtc.on_arrival(tenant)
            check()
        for _ in range(per_tick):
            if serve(vtc, queues, service) is not None:
                check()
        tick += 1
    assert all(not q for q in queues.values())
