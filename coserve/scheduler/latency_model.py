"""Iteration latency model: predict one engine iteration's wall time from its token mix.

The hybrid token scheduler (FlexLLM §6.2) picks the finetuning window ``s = argmax f(c, s) <= SLO``
where ``f`` is a latency estimate profiled offline. This module is that ``f``: a linear cost model
over a few physically motivated features, fitted by non-negative least squares to measured
iterations, stored as JSON per (model, device, dtype, threads), and corrected online by an
exponentially weighted measured/predicted ratio. Pure Python plus numpy; no torch.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

FEATURE_NAMES: tuple[str, ...] = (
    "overhead",                        # 1.0: launches, Python, sampling, weight streaming of a decode step
    "decode_tokens",                   # matmul work of decode tokens (one per sequence)
    "decode_context",                  # attention work: keys read by decode tokens
    "prefill_tokens",                  # matmul work of prompt chunks
    "prefill_context",                 # attention work of prompt chunks (quadratic part of prefill)
    "finetune_forward_tokens",         # matmul work of finetuning forward tokens (plus loss head)
    "finetune_forward_context",        # their attention work
    "finetune_backward_token_layers",  # backward matmul work, per token per layer
    "finetune_backward_context",       # backward attention work
    "finetune_forward_active",         # 1 if any finetuning forward token: loss/LoRA-activation setup
    "finetune_backward_windows",       # backward windows (one per layer touched): per-window launches, recompute
)
KEY_FIELDS = ("model", "device", "dtype", "threads", "fused", "gemms")
CORRECTION_ALPHA = 0.1          # weight of each new observation in the online correction
CORRECTION_RANGE = (0.5, 2.0)   # the correction is clamped to this range
_CONTEXT_OF = {"decode_tokens": "decode_context", "prefill_tokens": "prefill_context",
               "finetune_forward_tokens": "finetune_forward_context",
               "finetune_backward_token_layers": "finetune_backward_context"}
_FORMAT_VERSION = 4  # 2: per-window backward cost; 3: keys say whether windows are fused; 4: and packed GEMMs
STALE_VERSIONS = (1, 2, 3)  # files of these versions hold no usable fit: as if none existed (re-profile)


@dataclass(slots=True, frozen=True)
class IterationShape:
    """Plain counts describing one iteration, known to the scheduler before it runs."""

    decode_tokens: int = 0  # inference sequences with one new token
    decode_context: int = 0  # sum over those sequences of their context length (keys attended)
    prefill_tokens: int = 0  # new inference prompt tokens (chunked prefill)
    prefill_context: int = 0  # sum over prefill tokens of the keys each attends
    finetune_forward_tokens: int = 0  # finetuning tokens in the forward window
    finetune_forward_context: int = 0  # keys attended summed over those tokens
    finetune_backward_token_layers: int = 0  # tokens x layers of backward windows
    finetune_backward_context: int = 0  # keys attended summed over backward token-layers
    finetune_backward_windows: int = 0  # per-layer backward windows those token-layers take (>= 1 if any)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_count(f.name, getattr(self, f.name))


def features(shape: IterationShape) -> list[float]:
    """Feature vector of ``shape``, in the order of ``FEATURE_NAMES``.

    A constant (per-iteration overhead), one linear term per token count (matmul work scales with
    tokens), one per context sum (attention work scales with keys attended), a 0/1 indicator for
    the fixed cost of a finetuning forward window, and the number of backward windows (each layer's
    backward has a fixed cost; at least one when there is backward work). Every feature is non-decreasing
    in every count, so non-negative coefficients make predictions monotone.
    """
    return [1.0, float(shape.decode_tokens), float(shape.decode_context),
            float(shape.prefill_tokens), float(shape.prefill_context),
            float(shape.finetune_forward_tokens), float(shape.finetune_forward_context),
            float(shape.finetune_backward_token_layers), float(shape.finetune_backward_context),
            1.0 if shape.finetune_forward_tokens > 0 else 0.0,
            float(max(shape.finetune_backward_windows, 1 if shape.finetune_backward_token_layers > 0 else 0))]


def iteration_kind(shape: IterationShape) -> str:
    """``forward`` (a finetuning forward window rides along), ``backward`` (one backward window, no forward
    window), ``backward-layers`` (backward windows over several layers) or ``inference`` (no finetuning work):
    iterations whose prediction errors differ. (Measured in co-served runs at 3 req/s, 2-core AMD EPYC: backward
    slices of 128-384 token-layers ran at 0.97-1.04x their prediction, those of 512-768, most over two or more
    layers of the short training sequences, at 1.15-1.35x.)"""
    if shape.finetune_forward_tokens:
        return "forward"
    if shape.finetune_backward_token_layers:
        return "backward-layers" if shape.finetune_backward_windows > 1 else "backward"
    return "inference"


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _check_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number of seconds, got {value!r}")
    return float(value)


@dataclass(slots=True)
class LatencyModel:
    """Fitted coefficients for one (model, device, dtype, threads), plus an online correction."""

    key: dict[str, str]  # model, device, dtype, threads: what the fit is valid for
    coefficients: list[float]  # seconds per unit of each feature, non-negative
    heldout_median_abs_pct_error: float | None = None  # percent, on held-out samples at fit time
    correction: float = 1.0  # online multiplicative correction, within CORRECTION_RANGE
    kind_corrections: dict[str, float] = field(default_factory=dict)  # per iteration kind (``iteration_kind``),
    #   learned online and not saved: a fit's errors differ by kind (e.g. backward windows over several layers)

    def __post_init__(self) -> None:
        if not isinstance(self.key, dict) or any(k not in self.key for k in KEY_FIELDS) \
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in self.key.items()):
            raise ValueError(f"key must map each of {KEY_FIELDS} to a string, got {self.key!r}")
        coefs = [float(c) for c in self.coefficients]
        if len(coefs) != len(FEATURE_NAMES) or not all(math.isfinite(c) and c >= 0 for c in coefs):
            raise ValueError(f"coefficients must be {len(FEATURE_NAMES)} finite non-negative numbers, "
                             f"got {self.coefficients!r}")
        self.coefficients = coefs
        lo, hi = CORRECTION_RANGE
        if not (isinstance(self.correction, (int, float)) and lo <= self.correction <= hi):
            raise ValueError(f"correction must lie in [{lo}, {hi}], got {self.correction!r}")

    def _raw(self, shape: IterationShape) -> float:
        return max(0.0, sum(c * x for c, x in zip(self.coefficients, features(shape))))

    def predict(self, shape: IterationShape) -> float:
        """Predicted iteration time in seconds (never negative), including the online correction of
        the shape's kind (the overall one until that kind has been observed)."""
        return self._raw(shape) * self.kind_corrections.get(iteration_kind(shape), self.correction)

    def fixed_s(self, shape: IterationShape) -> float:
        """The part of ``predict(shape)`` any iteration of its kind pays, whatever it carries (``overhead``)."""
        return self.coefficients[0] * self.kind_corrections.get(iteration_kind(shape), self.correction)

    def observe(self, shape: IterationShape, measured_s: float) -> None:
        """Fold one measured iteration into the correction.

        ``correction <- (1 - alpha) * correction + alpha * measured / uncorrected_prediction`` with
        ``alpha = CORRECTION_ALPHA`` (0.1: about the last 10 iterations matter), then clamped to
        ``CORRECTION_RANGE``. Shapes whose uncorrected prediction is 0 carry no ratio and are ignored.
        """
        measured = _check_seconds("measured_s", measured_s)
        raw = self._raw(shape)
        if raw <= 0:
            return
        lo, hi = CORRECTION_RANGE
        ratio = measured / raw
        mixed = (1 - CORRECTION_ALPHA) * self.correction + CORRECTION_ALPHA * ratio
        self.correction = min(hi, max(lo, mixed))
        kind = iteration_kind(shape)
        mixed = (1 - CORRECTION_ALPHA) * self.kind_corrections.get(kind, self.correction) + CORRECTION_ALPHA * ratio
        self.kind_corrections[kind] = min(hi, max(lo, mixed))

    def max_tokens_within(self, base: IterationShape, budget_s: float, field: str,
                          per_token_context: int = 0, *, max_n: int = 1 << 20,
                          windows_of: Callable[[int], int] | None = None) -> int:
        """Largest ``n <= max_n`` whose shape fits ``budget_s``; 0 if even ``n = 0`` exceeds it.

        The shape is ``base`` with ``field`` (a token-count field) increased by ``n`` and its context
        field by ``n * per_token_context`` (and ``finetune_backward_windows`` by ``windows_of(n)``, a
        non-decreasing function). Exponential then binary search; exact because predictions are
        monotone in every count. ``max_n`` bounds the answer when the field costs nothing.
        """
        if field not in _CONTEXT_OF:
            raise ValueError(f"field must be one of {sorted(_CONTEXT_OF)}, got {field!r}")
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not math.isfinite(budget_s):
            raise ValueError(f"budget_s must be a finite number of seconds, got {budget_s!r}")
        _check_count("per_token_context", per_token_context)
        _check_count("max_n", max_n)
        ctx = _CONTEXT_OF[field]

        def fits(n: int) -> bool:
            grown = replace(base, **{field: getattr(base, field) + n,
                                     ctx: getattr(base, ctx) + n * per_token_context})
            if windows_of is not None:
                grown = replace(grown, finetune_backward_windows=grown.finetune_backward_windows + windows_of(n))
            return self.predict(grown) <= budget_s

        if not fits(0):
            return 0
        lo, hi = 0, 1
        while hi <= max_n and fits(hi):  # invariant: fits(lo)
            lo, hi = hi, hi * 2
        hi = min(hi, max_n + 1)  # invariant: hi is past max_n or does not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def to_json(self) -> dict:
        """A JSON-ready dict; ``from_json`` inverts it."""
        d = asdict(self)
        del d["kind_corrections"]
        d["feature_names"] = list(FEATURE_NAMES)
        return d

    @classmethod
    def from_json(cls, d: dict) -> LatencyModel:
        """Rebuild a model from ``to_json`` output, checking the feature layout matches this code."""
        if list(d.get("feature_names", [])) != list(FEATURE_NAMES):
            raise ValueError(f"feature_names {d.get('feature_names')!r} do not match {list(FEATURE_NAMES)}")
        return cls(key=dict(d["key"]), coefficients=list(d["coefficients"]),
                   heldout_median_abs_pct_error=d.get("heldout_median_abs_pct_error"),
                   correction=float(d.get("correction", 1.0)))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Lawson-Hanson active-set solution of ``min ||a x - b||`` subject to ``x >= 0``."""
    m, n = a.shape
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, float(np.abs(a).sum(axis=0).max()))
    for _ in range(3 * n + 10):  # Lawson-Hanson needs at most a few passes per column
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        for _ in range(3 * n + 10):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            bad = passive & (z <= tol)
            step = np.min(x[bad] / np.maximum(x[bad] - z[bad], np.finfo(float).tiny))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return np.maximum(x, 0.0)


def _solve(shapes: list[IterationShape], times: np.ndarray) -> np.ndarray:
    """NNLS minimizing relative error: rows weighted by 1/time, columns scaled to unit norm."""
    a = np.array([features(s) for s in shapes]) / times[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return _nnls(a / scale, np.ones(len(times))) / scale


def fit(samples: list[tuple[IterationShape, float]], key: dict[str, str],
        holdout_every: int = 5) -> LatencyModel:
    """Fit coefficients by non-negative least squares on relative error.

    Every ``holdout_every``-th sample (indices k-1, 2k-1, ...) is held out to measure the median
    absolute percentage error, then the model is refit on all samples. ``holdout_every=0``
    skips the hold-out (error ``None``); so does a sample list too short to hold one out.
    """
    if not samples:
        raise ValueError("samples must be a non-empty list of (IterationShape, measured_s)")
    if isinstance(holdout_every, bool) or not isinstance(holdout_every, int) \
            or holdout_every < 0 or holdout_every == 1:
        raise ValueError(f"holdout_every must be 0 or an integer >= 2, got {holdout_every!r}")
    shapes: list[IterationShape] = []
    for i, (shape, measured) in enumerate(samples):
        if not isinstance(shape, IterationShape):
            raise ValueError(f"samples[{i}] shape must be an IterationShape, got {type(shape).__name__}")
        _check_seconds(f"samples[{i}] measured_s", measured)
        shapes.append(shape)
    times = np.array([float(t) for _, t in samples])
    error = None
    held = [i for i in range(len(samples)) if holdout_every and i % holdout_every == holdout_every - 1]
    if held:
        train = sorted(set(range(len(samples))) - set(held))
        trial = LatencyModel(dict(key), _solve([shapes[i] for i in train], times[train]).tolist())
        pct = [abs(trial.predict(shapes[i]) - times[i]) / times[i] * 100 for i in held]
        error = float(np.median(pct))
    return LatencyModel(dict(key), _solve(shapes, times).tolist(), heldout_median_abs_pct_error=error)


def save_models(path: str | os.PathLike, models: list[LatencyModel]) -> None:
    """Write ``models`` to one JSON file atomically (temp file in the same folder, then os.replace)."""
    keys = [tuple(sorted(m.key.items())) for m in models]
    if len(set(keys)) != len(keys):
        raise ValueError("models must have distinct keys")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"version": _FORMAT_VERSION, "models": [m.to_json() for m in models]}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # only still there if something failed


def load_model(path: str | os.PathLike, key: dict[str, str]) -> LatencyModel | None:
    """The model in ``path`` whose key equals ``key`` exactly; None if none does or no file exists."""
    try:
        payload = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    if payload.get("version") in STALE_VERSIONS:  # an older coserve's fits: as if none fitted
        return None
    if payload.get("version") != _FORMAT_VERSION:
        raise ValueError(f"version must be {_FORMAT_VERSION}, got {payload.get('version')!r} in {path}")
    for entry in payload.get("models", []):
        if entry.get("key") == key:
            return LatencyModel.from_json(entry)
    return None
