"""PNG plots of ``coserve bench`` results, after FlexLLM's Figures 10-12: SLO attainment
and throughput against arrival rate per policy, and the per-iteration token mix over time.

matplotlib is imported inside the functions (figures are drawn on the Agg canvas, without
pyplot's global state), so importing this module is cheap.
"""

from __future__ import annotations

import math
from pathlib import Path

SWEEP_FIELDS = ("policy", "rate", "slo_attainment", "inference_tokens_per_s", "finetune_tokens_per_s")
TOKEN_MIX_FIELDS = ("t_s", "inference_tokens", "finetune_forward_tokens", "finetune_backward_tokens")
SLO_TARGET = 0.9


def _figure(width: float = 6.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _check_fields(rows: list[dict], fields: tuple[str, ...], what: str) -> None:
    for i, row in enumerate(rows):
        for field in fields:
            if field not in row:
                raise ValueError(f"{what}[{i}] has no {field!r} field")


def _number(value) -> float:
    """A plotted value: None (not measured, e.g. finetuning throughput of inference-only) is a gap."""
    return math.nan if value is None else float(value)


def plot_sweep(results: list[dict], out_dir: Path) -> list[Path]:
    """Write ``slo_attainment.png``, ``inference_throughput.png`` and
    ``finetune_throughput.png`` to ``out_dir``: one line with markers per policy against
    the arrival rate (req/s); a dashed line marks 90% on the attainment plot. A None value
    leaves a gap. Returns the three paths in that order."""
    if not results:
        raise ValueError("plot_sweep: no results to plot")
    _check_fields(results, SWEEP_FIELDS, "results")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    policies: dict[str, list[dict]] = {}
    for row in results:
        policies.setdefault(str(row["policy"]), []).append(row)
    specs = (
        ("slo_attainment", "slo_attainment.png", "SLO attainment", "SLO attainment vs arrival rate"),
        ("inference_tokens_per_s", "inference_throughput.png", "inference throughput (tokens/s)",
         "Inference throughput vs arrival rate"),
        ("finetune_tokens_per_s", "finetune_throughput.png", "finetuning throughput (tokens/s)",
         "Finetuning throughput vs arrival rate"),
    )
    paths = []
    for key, filename, ylabel, title in specs:
        fig, ax = _figure()
        for policy, rows in policies.items():
            rows = sorted(rows, key=lambda r: float(r["rate"]))
            ax.plot([float(r["rate"]) for r in rows], [_number(r[key]) for r in rows], marker="o", label=policy)
        if key == "slo_attainment":
            ax.axhline(SLO_TARGET, color="gray", linestyle="--", linewidth=1, label=f"{SLO_TARGET:.0%} target")
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, format="png")
        paths.append(path)
    return paths


def plot_token_mix(iterations: list[dict], out_path: Path, title: str, bins: int = 100) -> Path:
    """A stacked area of tokens per iteration (inference, finetuning forward, finetuning
    backward) over time: iterations are binned by start time ``t_s`` into ``bins`` equal
    bins over [first, last start], each bin showing the mean per iteration that started
    in it; a bin where no iteration started shows 0. Returns ``out_path``."""
    if not iterations:
        raise ValueError("plot_token_mix: no iterations to plot")
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins!r}")
    _check_fields(iterations, TOKEN_MIX_FIELDS, "iterations")
    import numpy as np

    t = np.array([float(it["t_s"]) for it in iterations])
    lo, hi = float(t.min()), float(t.max())
    if hi <= lo:
        hi = lo + 1.0
    edges = np.linspace(lo, hi, bins + 1)
    index = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    counts = np.bincount(index, minlength=bins)
    series = []
    for field in TOKEN_MIX_FIELDS[1:]:
        values = np.array([float(it[field]) for it in iterations])
        sums = np.bincount(index, weights=values, minlength=bins)
        series.append(np.divide(sums, counts, out=np.zeros(bins), where=counts > 0))
    centers = (edges[:-1] + edges[1:]) / 2

    fig, ax = _figure(8.0, 4.0)
    ax.stackplot(centers, *series, labels=("inference", "finetuning forward", "finetuning backward"),
                 colors=("tab:blue", "tab:orange", "tab:green"), alpha=0.85)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens per iteration (mean per bin)")
    ax.set_title(title)
    ax.set_xlim(lo, hi)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path
