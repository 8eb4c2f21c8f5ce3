"""The headline, the rows and the plots of a co-serving sweep assembled from several ``coserve bench --out`` files.

    python -m coserve.bench.sweep_report FILE.json[:POLICY,POLICY...] ... [--pool] [--plot DIR]

``FILE.json:coserve,dts`` takes only those policies' rows of a file (a sweep whose policies ran different code);
a later file's row replaces an earlier one of the same policy and rate. With ``--pool`` the rows of the same
policy and rate are repeated runs instead, and each (policy, rate) becomes one row of their means
(``coserve.bench.repeats.pool``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from coserve.bench.headline import headline, markdown
from coserve.bench.repeats import pool
from coserve.bench.serving import read_rows


def select(specs: list[str], pooled: bool = False) -> list[dict]:
    """The rows named by ``FILE[:POLICY,...]`` specs, later ones replacing earlier ones of the same (policy, rate);
    with ``pooled``, the runs of each (policy, rate) pooled into one row instead (``pool``)."""
    runs: dict[tuple[str, float], list[dict]] = {}
    for spec in specs:
        path, _, names = spec.partition(":")
        wanted = set(names.split(",")) if names else None
        for row in read_rows(Path(path)):
            if wanted is None or row["policy"] in wanted:
                key = (row["policy"], row["rate"])
                runs[key] = (runs.get(key, []) + [row]) if pooled else [row]
    rows = [pool(group) for group in runs.values()]
    return sorted(rows, key=lambda r: (r["rate"], r["policy"]))


def table(rows: list[dict]) -> str:
    """One Markdown row per run: attainment, TTFT and TPOT p50, finetuning tokens/s, the time no inference ran."""
    pooled = any(r.get("runs", 1) > 1 for r in rows)
    out = ["| policy | rate | SLO attainment | TTFT p50 (ms) | TPOT p50 (ms) | finetune tok/s "
           "| no inference running |" + (" runs | finetune tok/s, lowest-highest |" if pooled else ""),
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if pooled else "")]
    for r in rows:
        ttft, tpot, ft = r["ttft_s"]["p50"], r["tpot_s"]["p50"], r["finetune_tokens_per_s"]
        line = (f"| {r['policy']} | {r['rate']:g} | {r['slo_attainment']:.1%} | "
                f"{'-' if ttft is None else round(ttft * 1000)} | {'-' if tpot is None else round(tpot * 1000, 1)} | "
                f"{'-' if not ft else format(round(ft), ',')} | {r['idle_fraction']:.0%} |")
        if pooled:
            spread = r.get("finetune_tokens_per_s_range")
            line += f" {r.get('runs', 1)} | {'-' if not spread else '-'.join(format(round(x), ',') for x in spread)} |"
        out.append(line)
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", metavar="FILE.json[:POLICY,...]")
    p.add_argument("--pool", action="store_true",
                   help="rows of the same policy and rate are repeated runs: report their means (and each spread)")
    p.add_argument("--plot", default=None, metavar="DIR", help="FlexLLM's Figures 10-12 and coserve's token mix")
    args = p.parse_args()
    rows = select(args.results, pooled=args.pool)
    print(markdown(headline(rows)))
    print()
    print(table(rows))
    if args.plot:
        from coserve.bench.plots import plot_sweep, plot_token_mix
        out = Path(args.plot)
        paths = plot_sweep([r for r in rows if r["rate"] > 0], out)
        for r in rows:
            if r["policy"] == "coserve" and r["rate"] > 0 and r.get("iterations"):
                paths.append(plot_token_mix(r["iterations"], out / f"token_mix_coserve_{r['rate']:g}.png",
                                            f"coserve at {r['rate']:g} req/s: tokens per iteration"))
        print("plots: " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
