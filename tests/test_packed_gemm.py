"""Frozen weights packed for MKL or oneDNN (coserve/model/packed_gemm.py): the same products as plain matmuls, rows
that do not depend on their neighbours, autograd left to plain matmuls, the backend a process picks, and a model that
uses them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from coserve.model.batch_invariance import invariance_violations
from coserve.model.loader import load_model
from coserve.model import packed_gemm
from coserve.model.packed_gemm import GEMM_BACKENDS, PackedWeights, gemm_backend, packing_available

needs_packing = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                   reason="this torch has no packed GEMM")
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not packed_gemm._BACKENDS[b].available(),
                                                     reason=f"this torch has no {b} packed GEMM"))
            for b in GEMM_BACKENDS]


def _weights():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(96, 40, generator=g).t().contiguous().t()  # column-major, as the model stores them
    return {"row-major": torch.randn(24, 40, generator=g), "column-major": fused, "chunk view": fused.chunk(2)[1]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["row-major", "column-major", "chunk view"])
def test_packed_products_equal_plain_ones(kind, backend):
    w = _weights()[kind]
    packed = PackedWeights(backend)
    packed.allow(w)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=g)
    for rows in (1, 8, 64, 300):
        x, dy = torch.randn(rows, w.shape[1], generator=g), torch.randn(rows, w.shape[0], generator=g)
        torch.testing.assert_close(packed.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.input_grad(dy, w), dy @ w, rtol=1e-5, atol=1e-5)
    assert packed.num_bytes() == 2 * w.numel() * 4  # a pack of w and one of w^T


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_row_does_not_depend_on_the_rows_beside_it(backend):
    w = _weights()["column-major"]
    packed = PackedWeights(backend)
    packed.allow(w)
    x = torch.randn(300, w.shape[1], generator=torch.Generator().manual_seed(2))
    alone = packed.linear(x[:8], w)
    for rows in (9, 17, 57, 177, 300):
        assert torch.equal(packed.linear(x[:rows], w)[:8], alone), rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_not_allowed_and_inputs_that_need_a_gradient_run_plain_matmuls(backend):
    w = _weights()["column-major"]
    packed = PackedWeights(backend)
    x = torch.randn(16, w.shape[1])
    assert torch.equal(packed.linear(x, w), F.linear(x, w)) and packed.num_bytes() == 0
    packed.allow(w)
    xg = x.clone().requires_grad_()
    y = packed.linear(xg, w)
    y.sum().backward()  # through F.linear's own backward
    torch.testing.assert_close(xg.grad, torch.ones(16, w.shape[0]) @ w)
    assert packed.num_bytes() == 0  # nothing was packed for it


@needs_packing
def test_the_process_picks_a_backend_once_and_the_environment_can_name_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("COSERVE_GEMMS", raising=False)
    chosen = gemm_backend(cpu, torch.float32)
    assert chosen in GEMM_BACKENDS and gemm_backend(cpu, torch.float32) == chosen  # timed once, then kept
    assert gemm_backend(cpu, torch.bfloat16) is None and gemm_backend(torch.device("meta"), torch.float32) is None
    monkeypatch.setenv("COSERVE_GEMMS", "plain")
    assert gemm_backend(cpu, torch.float32) is None
    for b in GEMM_BACKENDS:
        if packed_gemm._BACKENDS[b].available():
            monkeypatch.setenv("COSERVE_GEMMS", b.upper())
            assert gemm_backend(cpu, torch.float32) == b
    monkeypatch.setenv("COSERVE_GEMMS", "blas")
    with pytest.raises(ValueError, match="COSERVE_GEMMS"):
        gemm_backend(cpu, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        PackedWeights("blas")


@pytest.fixture
def fresh_choice(monkeypatch, tmp_path):
    """``_timed_choice`` with no answer yet in this process, keeping its answers in a file of this test's own."""
    if not all(b.available() for b in packed_gemm._BACKENDS.values()):
        pytest.skip("needs both packed GEMM backends")
    monkeypatch.setenv("COSERVE_GEMMS_FILE", str(tmp_path / "gemms.json"))
    packed_gemm._timed_choice.cache_clear()
    yield tmp_path / "gemms.json"
    packed_gemm._timed_choice.cache_clear()


def test_the_timed_choice_is_kept_for_the_machine_so_every_process_agrees(monkeypatch, fresh_choice):
    """The first process times the backends and keeps its answer; later ones (here: the cache cleared) read it even
    where their own timing would say otherwise. A different thread count is another machine key, timed anew; a
    corrupt file is timed over; a file that cannot be written leaves the timed answer standing."""
    timings = {"mkl": 2.0, "onednn": 1.0}
    monkeypatch.setattr(packed_gemm, "_timings", lambda backends: dict(timings))
    assert packed_gemm._timed_choice() == "onednn"
    kept = json.loads(fresh_choice.read_text())
    assert [entry["backend"] for entry in kept.values()] == ["onednn"]
    assert "threads=" in next(iter(kept)) and "MKL_CBWR=" in next(iter(kept))
    timings.update(mkl=1.0, onednn=2.0)  # a later process whose own timing favours MKL
    packed_gemm._timed_choice.cache_clear()
    assert packed_gemm._timed_choice() == "onednn"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        packed_gemm._timed_choice.cache_clear()
        assert packed_gemm._timed_choice() == "mkl"  # timed for this key, kept beside the other
    finally:
        torch.set_num_threads(threads)
    assert sorted(e["backend"] for e in json.loads(fresh_choice.read_text()).values()) == ["mkl", "onednn"]
    fresh_choice.write_text("{not json")
    packed_gemm._timed_choice.cache_clear()
    assert packed_gemm._timed_choice() == "mkl" and json.loads(fresh_choice.read_text())
    monkeypatch.setenv("COSERVE_GEMMS_FILE", str(fresh_choice.parent))  # a directory: cannot be written as a file
    packed_gemm._timed_choice.cache_clear()
    assert packed_gemm._timed_choice() == "mkl"


def test_the_faster_backend_wins_but_a_close_race_keeps_mkl():
    assert packed_gemm._pick({"mkl": 2.0, "onednn": 1.0}) == "onednn"
    assert packed_gemm._pick({"mkl": 1.0, "onednn": 2.0}) == "mkl"
    assert packed_gemm._pick({"mkl": 1.1, "onednn": 1.0}) == "mkl"  # a 10% lead is under SWITCH_SPEEDUP
    assert packed_gemm._pick({"onednn": 1.0}) == "onednn"


@needs_packing
def test_each_backend_is_timed_on_real_products():
    available = [b for b in packed_gemm._BACKENDS.values() if b.available()]
    seconds = packed_gemm._timings(available)
    assert set(seconds) == {b.name for b in available} and all(t > 0 for t in seconds.values())


@needs_packing
def test_the_model_runs_its_frozen_weights_packed_and_stays_batch_invariant(tiny_model):
    model = load_model(tiny_model, torch.float32, torch.device("cpu"))
    plain = load_model(tiny_model, torch.float32, torch.device("cpu"), pack_gemms=False)
    assert model.packed is not None and plain.packed is None
    assert invariance_violations(model) == []
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for w in model.layers[0].frozen_weights():
            x = torch.randn(12, w.shape[1], generator=g)
            torch.testing.assert_close(model.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        hidden = torch.randn(12, model.cfg.hidden_size, generator=g)
        torch.testing.assert_close(model.logits(hidden), plain.logits(hidden), rtol=1e-5, atol=1e-5)
    assert model.packed.num_bytes() > 0
