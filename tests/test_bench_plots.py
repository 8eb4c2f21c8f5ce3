"""PNG plots of sweeps and token mixes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coserve.bench.plots import plot_sweep, plot_token_mix

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_plot_sweep(tmp_path):
    results = []
    for policy in ("coserve", "separate", "inference-only"):
        for rate in (4.0, 1.0, 2.0):  # unsorted on purpose
            results.append({
                "policy": policy, "rate": rate,
                "slo_attainment": min(1.0, 1.5 / rate),
                "inference_tokens_per_s": 100.0 * rate,
                "finetune_tokens_per_s": None if policy == "inference-only" else 1000.0 / rate,
            })
    out = tmp_path / "plots"  # created
    paths = plot_sweep(results, out)
    assert [p.name for p in paths] == ["slo_attainment.png", "inference_throughput.png", "finetune_throughput.png"]
    assert all(p.parent == out and _is_png(p) for p in paths)


def test_plot_sweep_missing_field(tmp_path):
    rows = [{"policy": "a", "rate": 1.0, "slo_attainment": 1.0, "inference_tokens_per_s": 1.0,
             "finetune_tokens_per_s": 1.0}, {"policy": "a", "rate": 2.0}]
    with pytest.raises(ValueError, match=r"results\[1\] has no 'slo_attainment'"):
        plot_sweep(rows, tmp_path)
    with pytest.raises(ValueError, match="no results"):
        plot_sweep([], tmp_path)


def test_plot_token_mix(tmp_path):
    iterations = [
        {"t_s": 0.01 * i, "inference_tokens": 50 + (i % 7), "finetune_forward_tokens": 200 if i % 3 else 0,
         "finetune_backward_tokens": 100 if i % 3 == 0 else 0}
        for i in range(1000)
    ]
    path = plot_token_mix(iterations, tmp_path / "sub" / "mix.png", "co-serving, 2 req/s")
    assert path == tmp_path / "sub" / "mix.png"
    assert _is_png(path)
    single = plot_token_mix(iterations[:1], tmp_path / "one.png", "one iteration", bins=10)
    assert _is_png(single)
    with pytest.raises(ValueError, match=r"iterations\[0\] has no 'finetune_backward_tokens'"):
        plot_token_mix([{"t_s": 0.0, "inference_tokens": 1, "finetune_forward_tokens": 1}], tmp_path / "x.png", "x")
    with pytest.raises(ValueError, match="no iterations"):
        plot_token_mix([], tmp_path / "x.png", "x")


def test_import_is_cheap():
    code = "import sys, coserve.bench.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
