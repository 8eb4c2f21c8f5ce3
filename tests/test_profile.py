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
    point = profiler.ProfilePoint(4, 32, 0, 16, 0, 32)
    shape, seconds = rig.shape(point), rig.once(point)
    assert shape.finetune_forward_tokens == 16 and shape.decode_tokens == 4 and seconds > 0


def test_the_grid_is_timed_in_shuffled_passes_so_a_drifting_device_does_not_bias_one_kind_of_point(
        model_factory, monkeypatch):
    """A device that gets slower while it is profiled (seen on an H100): run in the grid's sorted order, the slow
    stretch lands on one kind of point; in shuffled passes every point sees the whole run, and each counts the
    median of its timed passes (the first pass is a warm-up)."""
    from coserve.engine import profiler
    from coserve.model.loader import load_model as load_decoder

    model = load_decoder(model_factory("llama"), torch.float32, torch.device("cpu"))
    runs: list[profiler.ProfilePoint] = []

    def once(self, point):  # a fixed cost, plus a slowdown during runs 14-28 of the whole run
        runs.append(point)
        return 0.015 if 14 <= len(runs) - 1 < 29 else 0.010

    monkeypatch.setattr(profiler.IterationRig, "once", once)
    calls = []
    key = {"model": "m", "device": "cpu", "dtype": "float32", "threads": "1", "fused": "true", "gemms": "plain"}
    _, samples = profiler.profile(model, key, num_points=12, repeats=3, max_ctx=64,
                                  progress=lambda done, total: calls.append((done, total)))
    points = profiler.grid(12, 64, 0, model.cfg.num_layers)
    assert len(runs) == 48 and calls[-1] == (48, 48)
    passes = [runs[i * 12:(i + 1) * 12] for i in range(4)]
    assert all(sorted(p, key=points.index) == points for p in passes)  # every point once per pass
    assert len({tuple(map(points.index, p)) for p in passes}) == 4 and passes[0] != points  # shuffled, each anew
    for i, (shape, seconds) in enumerate(samples):  # a point is slow only if two of its three timed runs were
        timed = [0.015 if 14 <= k < 29 else 0.010 for k, p in enumerate(runs) if k >= 12 and p == points[i]]
        assert seconds == sorted(timed)[1] and shape == profiler.IterationRig.shape(points[i])
    assert {s for _, s in samples} == {0.010, 0.015}


def test_an_output_that_cannot_be_written_is_refused_before_any_timing(model_factory, tmp_path, capsys,
                                                                        monkeypatch):
    """Its directory was made after the grid was timed (minutes on a CPU), and the error named no flag."""
    from coserve.engine import profile_command

    monkeypatch.setattr(profile_command, "profile", lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed")))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for flag in ("--out", "--samples"):
        extra = [flag, str(blocker / "x.json")] + (["--out", str(tmp_path / "ok.json")] if flag == "--samples" else [])
        assert main(["profile", "--model", str(model_factory("llama")), *extra]) == 2
        assert f"{flag}: cannot make the directory of {blocker / 'x.json'}" in capsys.readouterr().err
