"""``coserve bench-generation``: coserve against HF transformers ``generate`` on the same model, same run."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from coserve.bench.hf_reference import load_hf_model
from coserve.bench.lora_adapters import ALL_LINEAR, make_lora_adapters
from coserve.bench.workload import sharegpt_prompts
from coserve.model.linear_modules import EXPERT_MODULES, ROUTER
from coserve.output_path import prepare_output


def add_arguments(p) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--sharegpt", default=None, help="ShareGPT trace JSON (default: ../shared/data)")
    p.add_argument("--skip-hf", action="store_true", help="measure coserve only")
    p.add_argument("--adapters", type=int, default=0,
                   help="serve this many random LoRA adapters (requests round-robin over them; HF: PEFT's mixed "
                        "adapter batch, adapter_names); 0 = the base model")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", default=",".join(ALL_LINEAR), help="comma-separated modules the adapters adapt")
    p.add_argument("--out", default=None, help="write the figures as JSON here")


def run(args) -> int:
    from coserve import LLM

    prepare_output("--out", args.out)
    if args.adapters < 0 or args.lora_rank < 1:
        raise ValueError("--adapters must be >= 0 and --lora-rank >= 1")
    targets = [t for t in args.lora_targets.split(",") if t]
    unknown = sorted(set(targets) - set(ALL_LINEAR) - set(EXPERT_MODULES) - {ROUTER})
    if unknown or not targets:
        raise ValueError(f"--lora-targets: {', '.join(unknown) or 'none given'}; expected some of "
                         f"{', '.join(ALL_LINEAR)} (a mixture's: {ROUTER}, {', '.join(EXPERT_MODULES)})")
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(args.num_requests, 1),
              max_loras=max(args.adapters, 1), max_lora_rank=args.lora_rank)
    prompts = sharegpt_prompts(llm.tokenizer, args.num_requests, args.max_prompt_len,
                               Path(args.sharegpt) if args.sharegpt else None)
    with tempfile.TemporaryDirectory(prefix="coserve-bench-adapters-") as root:
        adapters = make_lora_adapters(args.model, Path(root), args.adapters, args.lora_rank, targets)
        for i, path in enumerate(adapters):
            llm.load_adapter(f"a{i}", path)
        names = [f"a{i % args.adapters}" for i in range(len(prompts.prompts))] if adapters else None
        return _measure(args, llm, prompts, names, adapters, targets)


def _measure(args, llm, prompts, names: list[str] | None, adapters: list[Path], targets: list[str]) -> int:
    from coserve import SamplingParams

    prompt_tokens = sum(len(p) for p in prompts.prompts)
    out_tokens = args.num_requests * args.output_len
    full = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate(prompts.prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                 adapter=names[:4] if names else None)  # warm-up
    t_prefill = _timed(lambda: llm.generate(prompts.prompts, one, adapter=names))[0]
    t_full, outs = _timed(lambda: llm.generate(prompts.prompts, full, adapter=names))
    changed = None
    if names:  # the adapters must matter for the comparison to mean anything: outputs unlike the base model's
        base = llm.generate(prompts.prompts, full)
        changed = sum(o.token_ids != b.token_ids for o, b in zip(outs, base))
    figures = {
        "coserve": {"prefill_s": t_prefill, "total_s": t_full,
                    "prefill_tokens_per_s": prompt_tokens / t_prefill,
                    "output_tokens_per_s": out_tokens / t_full,
                    "preemptions": llm.engine.scheduler.num_preemptions},
    }
    if not args.skip_hf:
        hf, hf_tokens, padded = _run_hf(args, prompts.prompts, llm.engine.device, adapters, names)
        # HF computes every padded position; its per-position rate is reported too, for honesty.
        figures["hf"] = {**hf, "prefill_tokens_per_s": prompt_tokens / hf["prefill_s"],
                         "output_tokens_per_s": out_tokens / hf["total_s"], "padded_prompt_tokens": padded,
                         "padded_prefill_tokens_per_s": padded / hf["prefill_s"]}
        figures["ratio"] = {k: figures["coserve"][k] / figures["hf"][k]
                            for k in ("prefill_tokens_per_s", "output_tokens_per_s")}
        figures["identical_outputs"] = sum(o.token_ids == h for o, h in zip(outs, hf_tokens))
    report = {
        "model": args.model, "device": str(llm.engine.device), "dtype": args.dtype,
        "num_requests": args.num_requests, "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "adapters": args.adapters, "lora_rank": args.lora_rank if adapters else None,
        "outputs_changed_by_adapters": changed,
        "lora_targets": targets if adapters else None,
        "prompt_source": prompts.source, "max_prompt_len": args.max_prompt_len,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "device_name": torch.cuda.get_device_name(llm.engine.device) if llm.engine.device.type == "cuda" else "cpu",
        **figures,
    }
    for name in ("coserve", "hf"):  # the run less its prefill, per decode step (an estimate)
        if name in report:
            f = report[name]
            f["decode_ms_per_step"] = 1000 * (f["total_s"] - f["prefill_s"]) / max(1, args.output_len - 1)
    _print(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _timed(fn):
    """Seconds ``fn()`` takes, queued CUDA work included, and its value."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    value = fn()
    sync()
    return time.perf_counter() - start, value


def _run_hf(args, prompts: list[list[int]], device: torch.device, adapters: list[Path] | None = None,
            names: list[str] | None = None) -> tuple[dict, list[list[int]], int]:
    """One static left-padded batch through ``model.generate`` (with ``adapters``, a PEFT model holding them all,
    each row through its own: PEFT's mixed adapter batch, where there are several); returns timings and its
    tokens."""
    from transformers import AutoTokenizer
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = load_hf_model(args.model, dtype)
    extra = {}
    if adapters:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="a0")
        for i, path in enumerate(adapters[1:], start=1):
            model.load_adapter(str(path), adapter_name=f"a{i}")
    model = model.to(device=device, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def gen(n: int, rows: slice = slice(None)):
        if names and len(adapters) > 1:  # one adapter: the active one (PEFT 0.21 mixes no adapters of experts)
            extra["adapter_names"] = names[rows]
        with torch.inference_mode():
            return model.generate(input_ids=ids[rows], attention_mask=mask[rows], max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=pad, **extra)

    gen(4, slice(0, 4))  # warm-up
    t_prefill = _timed(lambda: gen(1))[0]
    t_full, out = _timed(lambda: gen(args.output_len))
    tokens = [row[width:].tolist() for row in out]
    return {"prefill_s": t_prefill, "total_s": t_full}, tokens, width * len(prompts)


def _print(r: dict) -> None:
    print(f"model {r['model']} on {r['device']} {r['dtype']}, {r['threads']} threads; "
          f"{r['num_requests']} requests, {r['prompt_tokens']} prompt tokens ({r['prompt_source']}), "
          f"{r['output_tokens']} output tokens"
          + (f"; {r['adapters']} LoRA adapters of r={r['lora_rank']} on {','.join(r['lora_targets'])}, requests "
             "round-robin over them" if r.get("adapters") else ""))
    for name in ("coserve", "hf"):
        if name in r:
            f = r[name]
            print(f"  {name:8s} prefill {f['prefill_tokens_per_s']:9.1f} tok/s   "
                  f"output {f['output_tokens_per_s']:8.1f} tok/s   total {f['total_s']:.2f}s   "
                  f"decode step ~{f['decode_ms_per_step']:.1f} ms")
    if "hf" in r:
        print(f"  hf computes {r['hf']['padded_prompt_tokens']} padded prompt positions: "
              f"{r['hf']['padded_prefill_tokens_per_s']:.1f} positions/s")
    if "ratio" in r:
        print(f"  ratio    prefill {r['ratio']['prefill_tokens_per_s']:.2f}x   "
              f"output {r['ratio']['output_tokens_per_s']:.2f}x   "
              f"identical greedy outputs {r['identical_outputs']}/{r['num_requests']}")
    if r.get("outputs_changed_by_adapters") is not None:
        print(f"  the adapters changed {r['outputs_changed_by_adapters']}/{r['num_requests']} greedy outputs "
              "from the base model's")
