"""``coserve profile`` on tiny settings: real timed iterations in, a keyed latency model out."""

from __future__ import annotations

import json
from dataclasses import fields

import torch

from coserve.cli import main
from coserve.engine.profiler import grid, latency_key
from coserve.model.loader import resolve_device
from coserve.scheduler.latency_model import IterationShape, load_model


def test_grid_points_are_distinct_and_do_work():
    points = grid(30, 512, seed=1, model_layers=4)
    assert len(points) == len(set(points)) == 30
    assert all(p.decode_seqs or p.prefill or p.ft_forward or p.ft_backward for p in points)
    assert all(p.ft_context <= 512 and p.decode_ctx <= 512 and p.prefill <= 512 for p in points)
    # backward work over one layer's window, and over several layers (at most 3)
    assert all(p.ft_backward <= 3 * p.ft_context for p in points)
    assert any(0 < p.ft_backward <= p.ft_context for p in points) and any(p.ft_backward > p.ft_context for p in points)
    assert all(p.ft_context <= 128 and p.prefill <= 128 for p in grid(20, 128))


def test_profile_writes_a_model_keyed_by_model_device_dtype_threads_and_fusion(model_factory, tmp_path, capsys):
    model_dir = model_factory("llama")
    out = tmp_path / "latency.json"
    assert main(["profile", "--model", str(model_dir), "--out", str(out), "--points", "12", "--repeats", "1",
                 "--max-context", "256", "--samples", str(tmp_path / "samples.json"), "--fuse-finetuning", "always"]) == 0
    assert "held-out median absolute error" in capsys.readouterr().out
    samples = json.loads((tmp_path / "samples.json").read_text())["samples"]
    assert len(samples) == 12 and all(s["seconds"] > 0 and s["predicted_s"] >= 0 for s in samples)
    assert {tuple(sorted(s["shape"])) for s in samples} == {tuple(sorted(f.name for f in fields(IterationShape)))}
    key = latency_key(model_dir, resolve_device(None), torch.float32, fused=True)  # the device the command picks
    latency = load_model(out, key)
    assert latency is not None and latency.heldout_median_abs_pct_error is not None
    assert load_model(out, {**key, "threads": "999"}) is None
    assert load_model(out, {**key, "fused": "false"}) is None  # an unfused engine times its windows otherwise
    # profiling another dtype adds a model beside the first one
    assert main(["profile", "--model", str(model_dir), "--out", str(out), "--points", "12", "--repeats", "1",
                 "--max-context", "256", "--dtype", "bfloat16"]) == 0
    assert len(json.loads(out.read_text())["models"]) == 2
    assert load_model(out, key) is not None


def test_an_unfused_rig_times_forward_windows_in_calls_of_their_own(model_factory, monkeypatch):
    """Where the engine does not fuse (``fuse_finetuning``), the profile must time what it runs."""
    import pytest

    from coserve.engine import profiler
    from coserve.model.loader import load_model as load_decoder

    model = load_decoder(model_factory("llama"), torch.float32, torch.device("cpu"))
    monkeypatch.setattr(profiler, "mixed_forward", lambda *a, **k: pytest.fail("the window was fused"))
    rig = profiler.IterationRig(model, 64, fuse=False)
    shape, seconds = rig.time(profiler.ProfilePoint(4, 32, 0, 16, 0, 32), repeats=1)
    assert shape.finetune_forward_tokens == 16 and shape.decode_tokens == 4 and seconds > 0
