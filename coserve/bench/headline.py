"""The co-serving headline from ``coserve bench`` rows: per arrival rate, finetuning throughput of
co-serving against the best baseline that still holds the SLO, and against the idle capacity
inference leaves. Plain Python on the result rows.
"""

from __future__ import annotations

from coserve.bench.repeats import pool_rows

SLO_TARGET = 0.9  # a policy "holds" a rate when at least this fraction of its requests attain the SLO


def _holds(row: dict) -> bool:
    return row["slo_attainment"] >= SLO_TARGET


def _best(rows: list[dict], prefixes: tuple[str, ...]) -> dict | None:
    """The row with the most finetuning throughput among policies starting with ``prefixes`` that hold the SLO."""
    ok = [r for r in rows if r["policy"].startswith(prefixes) and _holds(r) and r["finetune_tokens_per_s"]]
    return max(ok, key=lambda r: r["finetune_tokens_per_s"]) if ok else None


def headline(rows: list[dict]) -> list[dict]:
    """One dict per rate > 0 with a ``coserve`` row: attainments, finetuning tokens/s and the ratios.

    ``vs_separate`` / ``vs_temporal``: co-serving's finetuning throughput over the best ``separate`` /
    ``temporal``-or-``dts`` run that holds the SLO at that rate (None when none does).
    ``harvest``: co-serving's throughput over ``finetune-only``'s (its zero-load run) times the
    fraction of time ``inference-only`` left idle at that rate.

    Repeated runs of a (policy, rate) count as one row of their means (``repeats.pool_rows``): attainment over
    all their requests, the mean throughputs.
    """
    rows = pool_rows(rows)
    solo = [r for r in rows if r["policy"] == "finetune-only" and r["rate"] == 0 and r["finetune_tokens_per_s"]]
    solo_rate = solo[0]["finetune_tokens_per_s"] if solo else None
    out = []
    for rate in sorted({r["rate"] for r in rows if r["rate"] > 0}):
        at = [r for r in rows if r["rate"] == rate]
        co = next((r for r in at if r["policy"] == "coserve"), None)
        if co is None:
            continue
        inf = next((r for r in at if r["policy"] == "inference-only"), None)
        sep, tmp = _best(at, ("separate",)), _best(at, ("temporal", "dts"))
        ft = co["finetune_tokens_per_s"] or 0.0
        idle = inf["idle_fraction"] if inf is not None else None
        out.append({
            "rate": rate,
            "attainment": {r["policy"]: r["slo_attainment"] for r in at},
            "finetune_tokens_per_s": {r["policy"]: r["finetune_tokens_per_s"] for r in at},
            "coserve_runs": co.get("runs", 1), "coserve_range": co.get("finetune_tokens_per_s_range"),
            "coserve_holds": _holds(co), "inference_only_holds": inf is not None and _holds(inf),
            "best_separate": sep["policy"] if sep else None,
            "vs_separate": ft / sep["finetune_tokens_per_s"] if sep else None,
            "best_temporal": tmp["policy"] if tmp else None,
            "vs_temporal": ft / tmp["finetune_tokens_per_s"] if tmp else None,
            "inference_only_idle": idle,
            "harvest": (ft / (solo_rate * idle) if solo_rate and idle else None),
        })
    if solo_rate:
        zero = next((r for r in rows if r["policy"] == "coserve" and r["rate"] == 0), None)
        if zero is not None:
            out.insert(0, {"rate": 0.0, "finetune_tokens_per_s": {"finetune-only": solo_rate,
                                                                  "coserve": zero["finetune_tokens_per_s"]},
                           "vs_finetune_only": zero["finetune_tokens_per_s"] / solo_rate})
    return out


def markdown(lines: list[dict]) -> str:
    """The headline as a Markdown table."""
    def f(x, fmt="{:.2f}x"):
        return "-" if x is None else fmt.format(x)

    rows = ["| rate (req/s) | SLO: inference-only / coserve | coserve finetune tok/s | vs best separate "
            "| vs best temporal/dts | harvest (target >= 0.8) |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for h in lines:
        if h["rate"] == 0:
            rows.append(f"| 0 | - | {h['finetune_tokens_per_s']['coserve']:.0f} | finetune-only "
                        f"{h['finetune_tokens_per_s']['finetune-only']:.0f} tok/s: {h['vs_finetune_only']:.2f}x | - | - |")
            continue
        att = h["attainment"]
        flag = "" if h["coserve_holds"] else " (below 90%)"  # its ratios then compare a run that misses the SLO
        inf = att.get("inference-only")
        spread = h.get("coserve_range")  # repeated runs: how many, the lowest and the highest
        runs = f" ({h['coserve_runs']} runs: {spread[0]:.0f}-{spread[1]:.0f})" if spread else ""
        rows.append(f"| {h['rate']:g} | {'-' if inf is None else format(inf, '.0%')} / {att['coserve']:.0%}{flag} "
                    f"| {h['finetune_tokens_per_s']['coserve']:.0f}{runs} "
                    f"| {f(h['vs_separate'])} ({h['best_separate'] or 'none holds'}) "
                    f"| {f(h['vs_temporal'])} ({h['best_temporal'] or 'none holds'}) | {f(h['harvest'])} |")
    return "\n".join(rows)
