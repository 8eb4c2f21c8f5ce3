"""``coserve bench-finetune``: token-level finetuning against HF PEFT with a plain torch loop, same model.

Each measurement runs in its own subprocess so that peak RSS (and, on CUDA, peak GPU memory) is that
system's alone. Each system runs ``--warmup`` steps, then ``--steps`` timed steps of one sequence;
its rate is the tokens of one step over the median step time (the first steps after start-up run
slow while the allocator grows, and this shared machine has stray slow steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from coserve.bench.hf_reference import load_hf_model
from coserve.bench.lora_adapters import split_targets
from coserve.bench.workload import DEFAULT_SHAREGPT
from coserve.output_path import prepare_output

DEFAULT_ALPACA = DEFAULT_SHAREGPT.with_name("alpaca_en_demo.json")
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=str(DEFAULT_ALPACA), help="Alpaca JSON (default: ../shared/data)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps (one 1-sequence batch each)")
    p.add_argument("--warmup", type=int, default=4, help="untimed optimizer steps before them")
    p.add_argument("--targets", action="append", default=None,
                   help="comma-separated target modules, a mixture's experts among them by PEFT's target_parameters "
                        "names (experts.gate_up_proj, experts.down_proj); repeat (default: down_proj, and all linear "
                        "modules)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--use-dora", action="store_true", help="DoRA on both sides (PEFT's use_dora)")
    p.add_argument("--config", action="append", default=None, metavar="REMAT:WINDOW[:MEMORY_TARGET]",
                   help="coserve settings to measure, e.g. cheap:0 (0 = whole-sequence windows) or cheap:0:1.0 (the "
                        "plan's memory target, default the job's 0.5); default: cheap:0, all:0, cheap:64")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the base model's dtype for both systems (the adapter trains in float32)")
    p.add_argument("--device", default=None, help="cuda when available, else cpu (default)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every measurement, HF PEFT's run first in "
                   "one round and last in the next, so that a machine's drift falls on both systems; a coserve "
                   "row's ratios are against its own round's HF PEFT run, and are pooled as medians (default: 1)")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one measurement, as JSON


def packed_sequences(tokenizer, path: Path, seq_len: int, count: int) -> list[list[int]]:
    """``count`` sequences of exactly ``seq_len`` tokens, packed from Alpaca records (``alpaca_texts``), or from
    synthetic text where the default data set is absent (``../shared/data`` is not everywhere)."""
    if _synthetic(path):
        texts = [f"Example {i}: the scheduler packs tokens into iterations." for i in range(2000)]
    else:
        texts = alpaca_texts(path)
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, verbose=False)["input_ids"] + [tokenizer.eos_token_id])
        if len(stream) >= seq_len * count:
            break
    while len(stream) < seq_len * count:
        stream.extend(stream[: seq_len * count - len(stream)])
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def _synthetic(path: Path) -> bool:
    """Whether ``path`` is the default data set and it is absent (then synthetic text stands in; any other path
    must be a file)."""
    return path == DEFAULT_ALPACA and not path.is_file()


def alpaca_texts(path: Path) -> list[str]:
    """Each record of an Alpaca JSON array as ``instruction \\n input \\n output``; ValueError naming the file and the
    first record that is not one."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--data: {path} cannot be read as JSON ({e})") from e
    if not isinstance(records, list) or not records:
        raise ValueError(f"--data: {path} must be a JSON array of Alpaca records (instruction, input, output)")
    texts = []
    for i, r in enumerate(records):
        if not (isinstance(r, dict) and all(isinstance(r.get(k, ""), str) for k in ("instruction", "input", "output"))
                and "instruction" in r and "output" in r):
            raise ValueError(f"--data: {path}: record {i + 1} is not an Alpaca record with string instruction and "
                             "output")
        texts.append(f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}")
    return texts


def run(args) -> int:
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    from coserve.model.loader import resolve_device
    device = str(resolve_device(args.device))
    targets = args.targets or ["down_proj", ALL_LINEAR]
    configs = [_parse_config(c) for c in (args.config or ["cheap:0", "all:0", "cheap:64"])]
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    prepare_output("--out", args.out)
    if not _synthetic(Path(args.data)):
        alpaca_texts(Path(args.data))  # a bad file named here, not in a worker's traceback
    rows = []
    for t in targets:
        spec = {"model": args.model, "data": args.data, "seq_len": args.seq_len, "steps": args.steps,
                "warmup": args.warmup, "targets": t, "r": args.lora_r, "use_dora": args.use_dora,
                "dtype": args.dtype, "device": device}
        for repeat in range(args.repeats):
            rows += _round(spec, configs, repeat)
    report = {"model": args.model, "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
              "use_dora": args.use_dora, "repeats": args.repeats,
              "threads": torch.get_num_threads(),
              "device": device, "device_name": _device_name(device), "dtype": args.dtype,
              "torch": torch.__version__, "rows": rows, "pooled": pooled_ratios(rows)}
    for r in rows:
        extra = (f" | x{r['ratio_tokens_per_s']:.2f} tok/s, kept/autograd {r['ratio_kept_to_autograd']:.3f}, "
                 f"rss x{r['ratio_peak_rss']:.2f}") if r["system"] == "coserve" else ""
        if "peak_gpu_bytes" in r:
            extra += f" | peak GPU {r['peak_gpu_bytes'] / 2**20:.1f} MiB" + (
                f" (x{r['ratio_peak_gpu']:.2f})" if "ratio_peak_gpu" in r else "")
        setting = setting_label(r) if r["system"] == "coserve" else "-"
        targets = "all linear" if r["targets"] == ALL_LINEAR else r["targets"]
        print(f"{r['system']:8s} {targets:20.20s} {setting:>8s}: "
              f"{r['tokens_per_s']:7.1f} tok/s, kept {r['kept_bytes_per_token']:8.0f} B/token, "
              f"peak RSS {r['peak_rss_bytes'] / 2**20:7.1f} MiB{extra}")
    if args.repeats > 1:
        for p in report["pooled"]:
            targets = "all linear" if p["targets"] == ALL_LINEAR else p["targets"]
            print(f"pooled   {targets:20.20s} {p['setting']:>8s}: x{p['ratio_tokens_per_s_median']:.2f} tok/s "
                  f"(median of {p['rounds']} rounds, x{p['ratio_tokens_per_s_min']:.2f}-"
                  f"x{p['ratio_tokens_per_s_max']:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


Config = tuple[str, int, float | None]  # rematerialize, window tokens (0: whole sequence), memory target (None: default)


def setting_label(row: dict) -> str:
    """A coserve row's ``REMAT:WINDOW[:MEMORY_TARGET]``, as ``--config`` gave it."""
    label = f"{row['rematerialize']}:{row['window_tokens']}"
    return label if row.get("memory_target") is None else f"{label}:{row['memory_target']:g}"


def measurement_order(configs: list[Config], repeat: int) -> list[Config | None]:
    """One round's measurements, None standing for HF PEFT's: first in even rounds, last (the coserve settings
    reversed) in odd ones, so that over two rounds each system runs as often early as late."""
    order: list[Config | None] = [None, *configs]
    return order if repeat % 2 == 0 else order[::-1]


def _round(spec: dict, configs: list[Config], repeat: int) -> list[dict]:
    """HF PEFT's row, then one row per coserve setting with its ratios to that HF PEFT run, all tagged ``repeat``."""
    results = {}
    for config in measurement_order(configs, repeat):
        if config is None:
            results[None] = _spawn({**spec, "system": "hf"})
        else:
            memory = {} if config[2] is None else {"memory_target": config[2]}
            results[config] = _spawn({**spec, "system": "coserve", "rematerialize": config[0],
                                      "window_tokens": config[1], **memory})
    hf = results[None]
    rows = [{**hf, "repeat": repeat}]
    for config in configs:
        co = {**results[config], "repeat": repeat}
        co["ratio_tokens_per_s"] = co["tokens_per_s"] / hf["tokens_per_s"]
        co["ratio_kept_to_autograd"] = co["kept_bytes_per_token"] / hf["autograd_bytes_per_token"]
        co["ratio_peak_rss"] = co["peak_rss_bytes"] / hf["peak_rss_bytes"]
        if "peak_gpu_bytes" in co and "peak_gpu_bytes" in hf:
            co["ratio_peak_gpu"] = co["peak_gpu_bytes"] / hf["peak_gpu_bytes"]
        rows.append(co)
    return rows


def pooled_ratios(rows: list[dict]) -> list[dict]:
    """Per target set and coserve setting, the median, least and greatest tokens/s ratio over the rounds."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r["system"] == "coserve":
            key = (r["targets"], setting_label(r))
            groups.setdefault(key, []).append(r["ratio_tokens_per_s"])
    return [{"targets": t, "setting": setting, "rounds": len(ratios),
             "ratio_tokens_per_s_median": statistics.median(ratios), "ratio_tokens_per_s_min": min(ratios),
             "ratio_tokens_per_s_max": max(ratios)} for (t, setting), ratios in groups.items()]


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def _parse_config(text: str) -> Config:
    remat, _, rest = text.partition(":")
    window, _, target = rest.partition(":")
    if remat not in ("cheap", "all") or not window.isdigit():
        raise ValueError(f"--config: expected cheap:N or all:N (optionally :MEMORY_TARGET), got {text!r}")
    if not target:
        return remat, int(window), None
    try:
        memory = float(target)
    except ValueError:
        memory = float("nan")
    if not 0 < memory <= 1:
        raise ValueError(f"--config: the memory target of {text!r} must be a number in (0, 1]")
    return remat, int(window), memory


def _spawn(spec: dict) -> dict:
    cmd = [sys.executable, "-m", "coserve.cli", "bench-finetune", "--model", spec["model"], "--worker",
           json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"bench worker {spec['system']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _worker(spec: dict) -> dict:
    from coserve.finetune.memory import peak_rss_bytes
    from coserve.model.tokenizer import load_tokenizer
    torch.manual_seed(0)
    tokenizer = load_tokenizer(spec["model"])
    warmup = spec.get("warmup", 1)
    seqs = packed_sequences(tokenizer, Path(spec["data"]), spec["seq_len"], warmup + spec["steps"])
    fn = _run_hf if spec["system"] == "hf" else _run_coserve
    device = torch.device(spec.get("device", "cpu"))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    step_seconds, kept = fn(spec, seqs[:warmup], seqs[warmup:], device, dtype)
    row = {**{k: spec[k] for k in ("system", "targets") if k in spec},
           **{k: spec[k] for k in ("rematerialize", "window_tokens", "memory_target") if k in spec},
           "tokens_per_s": spec["seq_len"] / statistics.median(step_seconds), "step_seconds": step_seconds,
           "peak_rss_bytes": peak_rss_bytes(), **kept}
    if device.type == "cuda":
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_hf(spec: dict, warmup: list[list[int]], seqs: list[list[int]], device: torch.device,
            dtype: torch.dtype) -> tuple[list[float], dict]:
    """HF PEFT: get_peft_model, plain loop of forward, loss.backward(), AdamW step."""
    from coserve.finetune.memory import saved_activation_bytes
    from peft import LoraConfig, get_peft_model
    base = load_hf_model(spec["model"], dtype).to(device)
    modules, experts = split_targets(spec["targets"].split(","))
    model = get_peft_model(base, LoraConfig(r=spec["r"], lora_alpha=spec["r"], use_dora=spec.get("use_dora", False),
                                            target_modules=modules, target_parameters=experts or None))
    for p in model.parameters():  # the adapter trains in float32, as coserve's does
        if p.requires_grad:
            p.data = p.data.float()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def ids_tensor(ids):
        return torch.tensor([ids], device=device)

    saved = saved_activation_bytes(lambda: model(input_ids=ids_tensor(seqs[0]), labels=ids_tensor(seqs[0])).loss,
                                   weights)

    def step(ids):
        loss = model(input_ids=ids_tensor(ids), labels=ids_tensor(ids)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    for ids in warmup:
        step(ids)
    times = _timed(device, [lambda ids=ids: step(ids) for ids in seqs])
    per_token = saved / len(seqs[0])
    return times, {"autograd_bytes_per_token": per_token, "kept_bytes_per_token": per_token}


def _timed(device: torch.device, steps: list) -> list[float]:
    """Seconds each of ``steps`` (callables) takes, the device's queued work included."""
    times = []
    for run_step in steps:
        _sync(device)
        start = time.perf_counter()
        run_step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _run_coserve(spec: dict, warmup: list[list[int]], seqs: list[list[int]], device: torch.device,
                 dtype: torch.dtype) -> tuple[list[float], dict]:
    from coserve.finetune.config import FinetuneConfig
    from coserve.finetune.job import Example, FinetuneJob
    from coserve.model.loader import load_model
    from coserve.peft.config import LoraConfig
    from coserve.peft.trainable import TrainableLora
    model = load_model(spec["model"], dtype, device)
    dora = spec.get("use_dora", False)
    modules, experts = split_targets(spec["targets"].split(","))
    bypass = TrainableLora(LoraConfig(r=spec["r"], lora_alpha=spec["r"], target_modules=modules, use_dora=dora,
                                      target_parameters=experts),
                           model.module_shapes(), model.cfg.num_layers, model.device, torch.Generator().manual_seed(0),
                           base_weight=model.module_weight if dora else None, experts=model.expert_shapes())
    examples = [Example(ids, ids[1:] + [-100]) for ids in warmup + seqs]
    out = tempfile.mkdtemp(prefix="coserve-bench-ft-")
    memory = {"memory_target": spec["memory_target"]} if spec.get("memory_target") is not None else {}
    cfg = FinetuneConfig(output_dir=out, batch_size=1, lr=1e-4, max_steps=len(examples), shuffle=False,
                         max_grad_norm=0, lr_scheduler="constant", window_tokens=spec["window_tokens"],
                         rematerialize=spec["rematerialize"], **memory)
    job = FinetuneJob(model, bypass, examples, cfg)

    def step() -> None:
        done = job.step
        while job.step == done:
            kind = job.next_work()
            (job.forward if kind == "forward" else job.backward)(cfg.window_tokens or job.pending_tokens())

    for _ in warmup:
        step()
    return _timed(device, [step] * len(seqs)), {"kept_bytes_per_token": job.kept_bytes_per_token}
