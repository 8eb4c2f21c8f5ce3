"""MKL-packed frozen weights (coserve/model/packed_gemm.py): the same products as plain matmuls, rows that do not
depend on their neighbours, autograd left to plain matmuls, and a model that uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coserve.model.batch_invariance import invariance_violations
from coserve.model.loader import load_model
from coserve.model.packed_gemm import PackedWeights, packing_available

needs_packing = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32),
                                   reason="this torch has no MKL packed GEMM")


def _weights():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(96, 40, generator=g).t().contiguous().t()  # column-major, as the model stores them
    return {"row-major": torch.randn(24, 40, generator=g), "column-major": fused, "chunk view": fused.chunk(2)[1]}


@needs_packing
@pytest.mark.parametrize("kind", ["row-major", "column-major", "chunk view"])
def test_packed_products_equal_plain_ones(kind):
    w = _weights()[kind]
    packed = PackedWeights()
    packed.allow(w)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(w.shape[0], generator=g)
    for rows in (1, 8, 64, 300):
        x, dy = torch.randn(rows, w.shape[1], generator=g), torch.randn(rows, w.shape[0], generator=g)
        torch.testing.assert_close(packed.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.input_grad(dy, w), dy @ w, rtol=1e-5, atol=1e-5)
    assert packed.num_bytes() == 2 * w.numel() * 4  # a pack of w and one of w^T


@needs_packing
def test_a_packed_row_does_not_depend_on_the_rows_beside_it():
    w = _weights()["column-major"]
    packed = PackedWeights()
    packed.allow(w)
    x = torch.randn(300, w.shape[1], generator=torch.Generator().manual_seed(2))
    alone = packed.linear(x[:8], w)
    for rows in (9, 17, 57, 177, 300):
        assert torch.equal(packed.linear(x[:rows], w)[:8], alone), rows


@needs_packing
def test_weights_not_allowed_and_inputs_that_need_a_gradient_run_plain_matmuls():
    w = _weights()["column-major"]
    packed = PackedWeights()
    x = torch.randn(16, w.shape[1])
    assert torch.equal(packed.linear(x, w), F.linear(x, w)) and packed.num_bytes() == 0
    packed.allow(w)
    xg = x.clone().requires_grad_()
    y = packed.linear(xg, w)
    y.sum().backward()  # through F.linear's own backward
    torch.testing.assert_close(xg.grad, torch.ones(16, w.shape[0]) @ w)
    assert packed.num_bytes() == 0  # nothing was packed for it


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
