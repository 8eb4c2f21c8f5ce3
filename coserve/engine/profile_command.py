"""``coserve profile --model DIR --out FILE``: measure iteration latencies and fit the latency model."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from coserve.engine.profiler import default_profile_path, latency_key, profile, save_latency_model
from coserve.model.batch_invariance import FUSE_CHOICES, plan_fusion
from coserve.model.config import ModelConfig
from coserve.model.loader import load_model, resolve_device, resolve_dtype
from coserve.output_path import prepare_output
from coserve.scheduler.latency_model import FEATURE_NAMES


def add_arguments(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=None, help=f"latency JSON (default: {default_profile_path()})")
    p.add_argument("--points", type=int, default=60, help="grid points to time")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median counts)")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--fuse-finetuning", default="auto", choices=FUSE_CHOICES,
                   help="time forward windows in the inference rows' calls as an engine with this setting runs them")
    p.add_argument("--samples", default=None, metavar="FILE.json",
                   help="also write every timed iteration (its shape and seconds), to study or refit the model")


def run(args) -> int:
    for name in ("points", "repeats", "max_context"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be positive")
    out = prepare_output("--out", args.out or default_profile_path())  # before minutes of timing, not after
    prepare_output("--samples", args.samples)
    cfg = ModelConfig.from_dir(args.model)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype, cfg)
    model = load_model(args.model, dtype, device, max_positions=max(cfg.max_position_embeddings, args.max_context))
    fuse = plan_fusion(model, args.fuse_finetuning).fuse  # GEMM tiles (or packs) as the engine's would be
    key = latency_key(args.model, device, dtype, fuse, model.gemms)
    bar = tqdm(total=args.points * (args.repeats + 1), desc="profile", unit="iteration")
    latency, samples = profile(model, key, args.points, args.repeats, args.seed, args.max_context,
                               progress=lambda done, total: bar.update(1), fuse=fuse)
    bar.close()
    save_latency_model(out, latency)
    err = latency.heldout_median_abs_pct_error
    print(f"{len(samples)} iterations timed; held-out median absolute error "
          f"{'n/a' if err is None else f'{err:.1f}%'}; saved to {out} under {key}")
    for name, coef in zip(FEATURE_NAMES, latency.coefficients):
        print(f"  {name:32s} {coef:.3e} s")
    if args.samples:
        rows = [{"shape": asdict(shape), "seconds": seconds, "predicted_s": latency.predict(shape)}
                for shape, seconds in samples]
        Path(args.samples).write_text(json.dumps({"key": key, "samples": rows}, indent=1))
        print(f"samples written to {args.samples}")
    return 0
