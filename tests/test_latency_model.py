"""Latency model: fit, monotonicity, budget search, online correction, JSON storage, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.scheduler.latency_model import (
    CORRECTION_RANGE, FEATURE_NAMES, IterationShape, LatencyModel, _nnls, features, fit, iteration_kind,
    load_model, save_models,
)

KEY = {"model": "llama-tiny", "device": "cpu", "dtype": "float32", "threads": "2", "fused": "true", "gemms": "plain"}
# Seconds per unit of each feature, in FEATURE_NAMES order.
TRUE = [2e-3, 4e-5, 2e-8, 1e-4, 1.5e-8, 1.2e-4, 3e-8, 8e-6, 1e-8, 2e-3, 3e-3]
TOKEN_FIELDS = ["decode_tokens", "prefill_tokens", "finetune_forward_tokens",
                "finetune_backward_token_layers"]


def random_shape(rng: np.random.Generator) -> IterationShape:
    """Each part present with probability 1/2; contexts vary independently of token counts."""
    def part(hi: int, ctx_hi: int) -> tuple[int, int]:
        if rng.random() < 0.5:
            return 0, 0
        n = int(rng.integers(1, hi))
        return n, int(n * rng.integers(1, ctx_hi))
    d, dc = part(64, 2048)
    p, pc = part(512, 2048)
    f, fc = part(256, 1024)
    b, bc = part(2048, 512)
    return IterationShape(d, dc, p, pc, f, fc, b, bc)


def synthetic(n: int, noise: float, seed: int = 0) -> list[tuple[IterationShape, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shape = random_shape(rng)
        out.append((shape, float(np.dot(TRUE, features(shape))) * (1 + noise * rng.standard_normal())))
    return out


@pytest.fixture(scope="module")
def model() -> LatencyModel:
    return fit(synthetic(600, 0.03), KEY)


def test_features_layout():
    assert len(features(IterationShape())) == len(FEATURE_NAMES)
    assert features(IterationShape()) == [1.0] + [0.0] * (len(FEATURE_NAMES) - 1)
    assert features(IterationShape(finetune_backward_token_layers=3))[-2:] == [0.0, 1.0]


def test_fit_recovers_known_coefficients(model):
    assert model.heldout_median_abs_pct_error is not None
    assert model.heldout_median_abs_pct_error < 10.0
    assert all(c >= 0 for c in model.coefficients)
    for name, got, want in zip(FEATURE_NAMES, model.coefficients, TRUE):
        assert got == pytest.approx(want, rel=0.2), name
    fresh = synthetic(200, 0.0, seed=1)
    errors = [abs(model.predict(s) - t) / t for s, t in fresh]
    assert np.median(errors) < 0.02


def test_fit_exact_data_and_nonnegativity():
    exact = fit(synthetic(100, 0.0, seed=3), KEY)
    assert exact.coefficients == pytest.approx(TRUE, rel=1e-6)
    assert exact.heldout_median_abs_pct_error == pytest.approx(0.0, abs=1e-6)
    # Time that falls with decode tokens would need a negative slope: NNLS pins it at 0.
    falling = [(IterationShape(decode_tokens=n), 0.01 - 1e-5 * n) for n in range(1, 200)]
    m = fit(falling, KEY, holdout_every=0)
    assert m.heldout_median_abs_pct_error is None
    assert m.coefficients[FEATURE_NAMES.index("decode_tokens")] == 0.0
    assert all(c >= 0 for c in m.coefficients)


def test_nnls_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(20):
        a, b = rng.standard_normal((12, 4)), rng.standard_normal(12)
        best = None
        for mask in range(16):  # the optimum is the unconstrained fit on some support
            cols = [j for j in range(4) if mask >> j & 1]
            x = np.zeros(4)
            if cols:
                x[cols] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (x >= 0).all() and (best is None or np.linalg.norm(a @ x - b) < np.linalg.norm(a @ best - b)):
                best = x
        np.testing.assert_allclose(_nnls(a, b), best, atol=1e-9)


@pytest.mark.parametrize("field", [f.name for f in fields(IterationShape)])
def test_predict_monotone_in_every_count(model, field):
    rng = np.random.default_rng(11)
    for _ in range(50):
        shape = random_shape(rng)
        bigger = replace(shape, **{field: getattr(shape, field) + int(rng.integers(1, 100))})
        assert model.predict(bigger) >= model.predict(shape)


@pytest.mark.parametrize("field", TOKEN_FIELDS)
def test_max_tokens_within_is_exact_boundary(model, field):
    base = IterationShape(decode_tokens=32, decode_context=32 * 700, prefill_tokens=128,
                          prefill_context=128 * 300)
    budget = model.predict(base) + 0.02
    n = model.max_tokens_within(base, budget, field, per_token_context=256)
    ctx = {"decode_tokens": "decode_context", "prefill_tokens": "prefill_context",
           "finetune_forward_tokens": "finetune_forward_context",
           "finetune_backward_token_layers": "finetune_backward_context"}[field]

    def grown(k: int) -> IterationShape:
        return replace(base, **{field: getattr(base, field) + k, ctx: getattr(base, ctx) + 256 * k})
    assert n > 0
    assert model.predict(grown(n)) <= budget < model.predict(grown(n + 1))


def test_max_tokens_within_edges(model):
    base = IterationShape(prefill_tokens=512, prefill_context=512 * 1000)
    assert model.max_tokens_within(base, model.predict(base) * 0.99, "finetune_forward_tokens") == 0
    assert model.max_tokens_within(base, -1.0, "prefill_tokens") == 0
    # exactly at budget: n = 0 fits, n = 1 does not
    assert model.max_tokens_within(base, model.predict(base), "prefill_tokens") == 0
    free = LatencyModel(dict(KEY), [1e-3] + [0.0] * (len(FEATURE_NAMES) - 1))
    assert free.max_tokens_within(IterationShape(), 1.0, "decode_tokens", max_n=1000) == 1000
    assert free.max_tokens_within(IterationShape(), 1.0, "decode_tokens", max_n=0) == 0


def test_online_correction_converges_and_clamps(model):
    rng = np.random.default_rng(5)
    shapes = [random_shape(rng) for _ in range(80)]
    m = LatencyModel.from_json(model.to_json())  # a copy: the fixture is shared
    for s in shapes:
        m.observe(s, 1.3 * model.predict(s) * (1 + 0.02 * rng.standard_normal()))
    assert m.correction == pytest.approx(1.3, rel=0.03)
    s = shapes[0]
    assert m.predict(s) == pytest.approx(1.3 * model.predict(s), rel=0.03)
    for _ in range(100):
        m.observe(s, 10 * m.predict(s))
    assert m.correction == CORRECTION_RANGE[1]
    for _ in range(100):
        m.observe(s, 1e-6 * m.predict(s))
    assert m.correction == CORRECTION_RANGE[0]
    m.observe(IterationShape(), 1.0)  # only the overhead term: still a valid ratio
    assert CORRECTION_RANGE[0] <= m.correction <= CORRECTION_RANGE[1]


def test_each_iteration_kind_learns_its_own_correction(model):
    m = LatencyModel.from_json(model.to_json())
    fwd, bwd = IterationShape(decode_tokens=4, finetune_forward_tokens=50), IterationShape(
        decode_tokens=4, finetune_backward_token_layers=400)
    for _ in range(100):  # forward windows run faster than fitted, backward windows slower
        m.observe(fwd, 0.8 * model.predict(fwd))
        m.observe(bwd, 1.4 * model.predict(bwd))
    assert m.predict(fwd) == pytest.approx(0.8 * model.predict(fwd), rel=0.01)
    assert m.predict(bwd) == pytest.approx(1.4 * model.predict(bwd), rel=0.01)
    over_layers = replace(bwd, finetune_backward_windows=3)  # a slice over several layers: a kind of its own
    assert iteration_kind(bwd) == "backward" and iteration_kind(over_layers) == "backward-layers"
    for _ in range(100):
        m.observe(over_layers, 1.2 * model.predict(over_layers))
    assert m.predict(over_layers) == pytest.approx(1.2 * model.predict(over_layers), rel=0.01)
    assert m.predict(bwd) == pytest.approx(1.4 * model.predict(bwd), rel=0.02)  # the one-window kind kept its own
    assert "kind_corrections" not in m.to_json()  # learned per run, not saved
    # the fixed part of a prediction (the overhead term) carries the same correction as the whole
    assert m.fixed_s(fwd) == pytest.approx(0.8 * model.fixed_s(fwd), rel=0.01)
    assert model.fixed_s(IterationShape()) == pytest.approx(model.predict(IterationShape()))
    assert model.fixed_s(IterationShape()) > 0


def test_json_round_trip_and_keyed_load(tmp_path, model):
    again = LatencyModel.from_json(json.loads(json.dumps(model.to_json())))
    assert again == model
    other = LatencyModel({**KEY, "device": "cuda:0", "dtype": "bfloat16"}, list(TRUE), 4.2, 1.1)
    path = tmp_path / "sub" / "latency.json"
    save_models(path, [model, other])
    assert load_model(path, KEY) == model
    assert load_model(path, other.key) == other
    assert load_model(path, {**KEY, "threads": "8"}) is None
    assert load_model(tmp_path / "missing.json", KEY) is None
    save_models(path, [other])  # overwrite: the old model is gone, no temp files left
    assert load_model(path, KEY) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["latency.json"]


@pytest.mark.parametrize("call, field", [
    (lambda m: fit([], KEY), "samples"),
    (lambda m: fit([(IterationShape(decode_tokens=1), -0.01)], KEY), "measured_s"),
    (lambda m: fit([(IterationShape(decode_tokens=1), float("nan"))], KEY), "measured_s"),
    (lambda m: fit(synthetic(10, 0.0), KEY, holdout_every=1), "holdout_every"),
    (lambda m: m.observe(IterationShape(), -1.0), "measured_s"),
    (lambda m: m.max_tokens_within(IterationShape(), 1.0, "decode_context"), "field"),
    (lambda m: m.max_tokens_within(IterationShape(), 1.0, "lora_tokens"), "field"),
    (lambda m: m.max_tokens_within(IterationShape(), float("inf"), "decode_tokens"), "budget_s"),
    (lambda m: m.max_tokens_within(IterationShape(), 1.0, "decode_tokens", -1), "per_token_context"),
    (lambda m: IterationShape(prefill_tokens=-3), "prefill_tokens"),
    (lambda m: LatencyModel(KEY, [-1.0] * len(FEATURE_NAMES)), "coefficients"),
    (lambda m: LatencyModel({"model": "x"}, list(TRUE)), "key"),
    (lambda m: LatencyModel(KEY, list(TRUE), correction=3.0), "correction"),
    (lambda m: LatencyModel.from_json({**m.to_json(), "feature_names": ["overhead"]}), "feature_names"),
    (lambda m: save_models("/tmp/unused.json", [m, m]), "models"),
])
def test_bad_input_names_the_field(model, call, field):
    with pytest.raises(ValueError, match=field):
        call(model)


counts = st.integers(min_value=0, max_value=10**7)


@settings(max_examples=200, deadline=None)
@given(shape=st.builds(IterationShape, *([counts] * len(fields(IterationShape)))),
       coefs=st.lists(st.floats(0, 1e3, allow_nan=False), min_size=len(FEATURE_NAMES),
                      max_size=len(FEATURE_NAMES)),
       correction=st.floats(*CORRECTION_RANGE))
def test_predict_never_negative(shape, coefs, correction):
    m = LatencyModel(dict(KEY), coefs, correction=correction)
    assert m.predict(shape) >= 0.0


def test_module_does_not_import_torch():
    code = "import sys, coserve.scheduler.latency_model; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
