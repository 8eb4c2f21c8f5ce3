"""``coserve bench``: serving SLO attainment and finetuning throughput per (policy, arrival rate).

Every (policy, rate) pair is one run in a fresh process (``serving_run``), on the same request
stream for a given rate, with the same finetuning job; ``--repeats N`` runs each pair N times (the
policies' order rotated each time) and pools them in the headline (``repeats.py``). Results go to
``--out`` as JSON (one row per run, with its per-iteration token mix) and, with ``--plot``, to PNGs
after FlexLLM's Figures 10-12.
"""

from __future__ import annotations

import argparse

import json
import os
import platform
import sys
from pathlib import Path

from coserve.bench.repeats import policy_order, pool_rows
from coserve.bench.serving_run import BENCH_POLICIES, FinetuneSpec, RunSpec, run_in_child
from coserve.bench.serving_workload import serving_workload
from coserve.engine.config import FUSE_CHOICES
from coserve.engine.slo_options import add_slo_arguments, slo_settings
from coserve.finetune.graph_pruning import DEFAULT_MEMORY_TARGET
from coserve.output_path import prepare_output


def add_arguments(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--policy", action="append", default=None, metavar="P",
                   help=f"repeatable; one of {', '.join(BENCH_POLICIES)}; temporal:N sets N inference "
                        f"iterations per finetuning iteration (default: coserve)")
    p.add_argument("--rate", action="append", type=float, default=None, metavar="R",
                   help="mean arrival rate in requests/s, repeatable (0 = no inference load; default 1)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=30.0, help="seconds after the last arrival for requests to finish")
    p.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson; < 1 burstier)")
    p.add_argument("--trace", default=None, help="Azure LLM trace CSV: rate x duration consecutive requests, "
                                                  "their timestamps scaled to the run")
    p.add_argument("--trace-start", type=int, default=0, help="the trace request the runs start from")
    p.add_argument("--prompts", default=None, help="ShareGPT-trace JSON: prompt texts and lengths")
    p.add_argument("--finetune-data", default=None, help="dataset for the finetuning job (none: inference only)")
    p.add_argument("--finetune-seq-len", type=int, default=1024)
    p.add_argument("--finetune-memory-target", type=float, default=DEFAULT_MEMORY_TARGET,
                   help="the job's --memory-target, in every policy (more kept between a sequence's passes, less "
                        "recomputed: faster, more memory)")
    add_slo_arguments(p, prefix="coserve: ")
    p.add_argument("--cut-for-arrivals", action=argparse.BooleanOptionalAction, default=True,
                   help="a request arriving during an iteration cuts its finetuning slice short, as in the "
                        "server and the Python API (--no-cut-for-arrivals: as the sweeps before commit 52f6613 ran)")
    p.add_argument("--ttft-limit-s", type=float, default=5.0)
    p.add_argument("--split", default="50:50", help="separate: percent of the cores for inference:finetuning")
    p.add_argument("--fuse-finetuning", default="auto", choices=FUSE_CHOICES,
                   help="coserve: forward windows in the inference rows' matmul calls (auto: where batch-invariant)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode iterations")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share full KV blocks among requests with the same prefix (EngineConfig)")
    p.add_argument("--latency-model", default=None, help="coserve profile JSON (default: the profile path)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (policy, rate) this many times, the policies' order rotated each time; every "
                        "run is a row of --out, the headline and plots pool each pair's runs (their means)")
    p.add_argument("--out", default=None, help="write every run's row as JSON here")
    p.add_argument("--with-results", action="append", default=[], metavar="FILE.json",
                   help="rows of an earlier run (its --out file) for the headline only: e.g. the zero-load "
                        "finetune-only run that the harvest ratio needs (pooled with this run's rows of the same "
                        "policy and rate)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write the figures (PNG) here")
    p.add_argument("--no-progress", action="store_true")


def parse_policy(text: str, split: tuple[int, int]) -> dict:
    """``{"policy", "label", "temporal_interval", "split"}`` from ``coserve``, ``temporal:64``, ``separate``..."""
    name, _, arg = text.partition(":")
    if name not in BENCH_POLICIES:
        raise ValueError(f"--policy: {text!r} is not one of {', '.join(BENCH_POLICIES)} (temporal:N for an interval)")
    out = {"policy": name, "label": name, "temporal_interval": 64, "split": split}
    if name == "temporal":
        if arg and not (arg.isdigit() and int(arg) > 0):
            raise ValueError(f"--policy: {text!r}: the interval must be a positive integer")
        out["temporal_interval"] = int(arg or 64)
        out["label"] = f"temporal:{out['temporal_interval']}"
    elif arg:
        raise ValueError(f"--policy: {text!r}: only temporal takes an argument")
    if name == "separate":
        out["label"] = f"separate {split[0]}:{split[1]}"
    return out


def parse_split(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    if not sep or not a.isdigit() or not b.isdigit() or int(a) <= 0 or int(b) <= 0:
        raise ValueError(f"--split: expected two positive percentages like 50:50, got {text!r}")
    return int(a), int(b)


def read_rows(path: Path) -> list[dict]:
    """The result rows of a ``coserve bench --out`` file; errors name the file."""
    try:
        rows = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--with-results: {path} is not a coserve bench --out file ({e})") from e
    needed = {"policy", "rate", "slo_attainment", "finetune_tokens_per_s", "idle_fraction"}
    if not isinstance(rows, list) or not all(isinstance(r, dict) and needed <= set(r) for r in rows):
        raise ValueError(f"--with-results: {path}: every result row needs {sorted(needed)}")
    return rows


def run(args) -> int:
    from coserve.model.config import ModelConfig
    from coserve.model.tokenizer import load_tokenizer

    if args.duration <= 0 or args.drain < 0:
        raise ValueError("--duration must be positive and --drain non-negative")
    split = parse_split(args.split)
    policies = [parse_policy(p, split) for p in (args.policy or ["coserve"])]
    rates = args.rate or [1.0]
    for r in rates:
        if r < 0:
            raise ValueError(f"--rate: {r} is negative")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    prepare_output("--out", args.out)
    for name in ("trace", "prompts", "finetune_data", "latency_model"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"--{name.replace('_', '-')}: {value} is not a file")
    earlier = [row for path in args.with_results for row in read_rows(Path(path))]
    cfg = ModelConfig.from_dir(args.model)
    max_len = args.max_model_len or cfg.max_position_embeddings
    tokenizer = load_tokenizer(Path(args.model))
    if not 0 < args.finetune_memory_target <= 1:
        raise ValueError(f"--finetune-memory-target: must be in (0, 1], got {args.finetune_memory_target}")
    if args.finetune_data:  # a bad file named here, before any run, not in a child's traceback
        from coserve.finetune.dataset import DatasetError, load_dataset
        try:
            load_dataset(args.finetune_data, tokenizer, args.finetune_seq_len)
        except DatasetError as e:
            raise ValueError(f"--finetune-data: {e}") from e
    finetune = (FinetuneSpec(args.finetune_data, args.finetune_seq_len, seed=args.seed,
                             memory_target=args.finetune_memory_target) if args.finetune_data else None)
    workloads = {rate: serving_workload(tokenizer, max_len, rate, args.duration,
                                        burstiness=args.burstiness if args.arrival == "gamma" else 1.0,
                                        trace=Path(args.trace) if args.trace else None,
                                        prompts=Path(args.prompts) if args.prompts else None, seed=args.seed,
                                        trace_start=args.trace_start)
                 for rate in rates}  # every repeat of a rate serves the same request stream
    rows = []
    for repeat in range(args.repeats):
        for rate in rates:
            workload = workloads[rate]
            for pol in policy_order(policies, repeat):
                spec = RunSpec(model=args.model, policy=pol["policy"], label=pol["label"], rate=rate,
                               duration_s=args.duration, requests=workload.requests, finetune=finetune,
                               **slo_settings(args), ttft_limit_s=args.ttft_limit_s,
                               drain_s=args.drain,
                               temporal_interval=pol["temporal_interval"], split=pol["split"], dtype=args.dtype,
                               device=args.device, max_model_len=args.max_model_len,
                               latency_model=args.latency_model, seed=args.seed, progress=not args.no_progress,
                               fuse_finetuning=args.fuse_finetuning, cuda_graphs=not args.enforce_eager,
                               prefix_caching=args.enable_prefix_caching, cut_for_arrivals=args.cut_for_arrivals,
                               extra={"arrivals": workload.arrivals, "lengths": workload.lengths})
                row = {**run_in_child(spec), "repeat": repeat + 1}
                rows.append(row)
                print(format_row(row), flush=True)
                if args.out:  # after every run: a long sweep keeps what it measured
                    write_report(Path(args.out), args, rows)
    if any(r["policy"] == "coserve" for r in rows):
        from coserve.bench.headline import headline, markdown
        print(markdown(headline(earlier + rows)))
    if args.plot:
        from coserve.bench.plots import plot_sweep, plot_token_mix
        paths = plot_sweep(pool_rows(rows), Path(args.plot))
        for row in rows:
            if row["iterations"] and row["policy"] == "coserve" and row["repeat"] == 1:  # each rate's first run
                name = f"token_mix_{row['policy']}_{row['rate']:g}.png".replace(" ", "_").replace(":", "-")
                paths.append(plot_token_mix(row["iterations"], Path(args.plot) / name,
                                            f"{row['policy']} at {row['rate']:g} req/s: tokens per iteration"))
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def format_row(r: dict) -> str:
    ft = r["finetune_tokens_per_s"]
    tpot, ttft = r["tpot_s"]["p50"], r["ttft_s"]["p50"]
    again = f" #{r['repeat']}" if r.get("repeat", 1) > 1 else ""
    return (f"{r['policy'] + again:>16s} {r['rate']:6.2f} req/s  requests {r['num_requests']:4d}  "
            f"failed {r['num_failed']}  unfinished {r['num_unfinished']}  SLO {r['slo_attainment']:6.1%}  "
            f"TTFT p50 {'-' if ttft is None else f'{ttft * 1000:.0f} ms'}  "
            f"TPOT p50 {'-' if tpot is None else f'{tpot * 1000:.1f} ms'}  "
            f"inference {r['inference_tokens_per_s']:7.1f} tok/s  "
            f"finetune {'-' if ft is None else f'{ft:7.1f}'} tok/s  idle {r['idle_fraction']:.0%}")


def write_report(path: Path, args, rows: list[dict]) -> None:
    """The report so far, written atomically into the directory ``run`` prepared before the first run."""
    import torch
    report = {"model": args.model, "duration_s": args.duration, **slo_settings(args),
              "cut_for_arrivals": args.cut_for_arrivals, "ttft_limit_s": args.ttft_limit_s,
              "finetune_data": args.finetune_data,
              "command": " ".join(["coserve", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else None,
              "torch": torch.__version__, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
              "results": rows}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)
