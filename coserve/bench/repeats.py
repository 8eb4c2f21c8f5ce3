"""Repeated benchmark runs of one (policy, rate) as one row.

On a shared 2-core CPU two runs of the same code and workload moved by 10-30% in finetuning throughput
(docs/benchmark-history.md), so a ratio between two policies is read from several alternated runs of each:
``coserve bench --repeats N`` writes every run and reports their pooled rows; ``sweep_report --pool`` pools
rows from several files the same way.
"""

from __future__ import annotations


def policy_order(policies: list, repeat: int) -> list:
    """The order the policies run in at repeat ``repeat`` (from 0): rotated by one each repeat, so that no policy
    always runs first or right after another (a machine that drifts spreads its drift over all of them)."""
    k = repeat % len(policies) if policies else 0
    return policies[k:] + policies[:k]


def pool_rows(rows: list[dict]) -> list[dict]:
    """The rows with each (policy, rate) group of repeated runs pooled into one (``pool``), in the order each
    group first appears."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["policy"], row["rate"]), []).append(row)
    return [pool(group) for group in groups.values()]


def pool(runs: list[dict]) -> dict:
    """Repeated runs of one policy at one rate as one row: SLO attainment over all their requests, the means of
    the throughputs, the idle fraction and the TTFT/TPOT p50s (of the runs' medians), with ``runs`` (how many)
    and ``finetune_tokens_per_s_range`` (the lowest and highest run). The first run's other fields (its
    iterations, for the token-mix plot) stay. One run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    requests = [r.get("num_requests") or 0 for r in runs]
    attained = (sum(r["slo_attainment"] * n for r, n in zip(runs, requests)) / sum(requests) if all(requests)
                else _mean([r["slo_attainment"] for r in runs]))
    ft = [r["finetune_tokens_per_s"] for r in runs]
    trained = None not in ft  # None: a policy without finetuning (a run that trained nothing has 0)
    row = {**first, "runs": len(runs), "num_requests": sum(requests), "slo_attainment": attained,
           "idle_fraction": _mean([r["idle_fraction"] for r in runs]),
           "finetune_tokens_per_s": _mean(ft) if trained else None,
           "finetune_tokens_per_s_range": [min(ft), max(ft)] if trained else None}
    inference = [r.get("inference_tokens_per_s") for r in runs]
    if all(x is not None for x in inference):
        row["inference_tokens_per_s"] = _mean(inference)
    for key in ("ttft_s", "tpot_s"):
        p50s = [r[key]["p50"] for r in runs if isinstance(r.get(key), dict) and r[key].get("p50") is not None]
        if key in first:
            row[key] = {"p50": _mean(p50s) if p50s else None}
    return row


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
