"""The one ``coserve`` command."""

from __future__ import annotations

import argparse
import importlib
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_create_model(sub)
    _add_generate(sub)
    argv = sys.argv[1:] if argv is None else argv
    _add_module_commands(sub, argv[0] if argv else None)
    args = parser.parse_args(argv)
    if args.command in NO_INFERENCE:
        from coserve.model.batch_invariance import release_strict_cpu_gemms
        release_strict_cpu_gemms()
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad input: a clear message, no stack trace
        print(f"coserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from coserve.finetune.job import FinetuneError
        if not isinstance(e, FinetuneError):
            raise
        print(f"coserve {args.command}: stopped: {e}", file=sys.stderr)
        return 1


def _add_create_model(sub) -> None:
    p = sub.add_parser("create-model", help="write a randomly initialised HF model directory")
    p.add_argument("dir")
    from coserve.model.presets import ARCHS, PRESETS  # plain data: no torch
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--arch", default="llama", choices=list(ARCHS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-shard-size", default=None, help="e.g. 20MB: write sharded safetensors")
    p.add_argument("--head-dim", type=int, default=None,
                   help="each attention head's width, apart from hidden/heads (as Qwen3 and Llama-3.2 checkpoints)")
    p.set_defaults(func=_create_model)


def _create_model(args) -> int:
    from coserve.model.create import create_model
    out = create_model(args.dir, preset=args.preset, arch=args.arch, seed=args.seed, dtype=args.dtype,
                       max_shard_size=args.max_shard_size, head_dim=args.head_dim)
    print(f"wrote {args.preset} {args.arch} model to {out}")
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="load a PEFT LoRA or IA3 adapter; the prompts use it (or the one named by --use)")
    p.add_argument("--use", default=None, metavar="NAME", help="which loaded adapter the prompts use")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=1, help="sequences per prompt (the i-th drawn from seed + i)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    from coserve import LLM, SamplingParams
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    names = []
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter: expected NAME=PATH, got {spec!r}")
        llm.load_adapter(name, path)
        names.append(name)
    use = args.use or (names[-1] if names else None)
    if use is not None and use not in names:
        raise ValueError(f"--use: {use!r} is not one of the loaded adapters {names}")
    start = time.perf_counter()
    outs = llm.generate(args.prompt, params, adapter=use)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(f"--- prompt: {out.prompt!r}  (adapter: {use or 'none'})")
        for seq in out.outputs:
            if len(out.outputs) > 1:
                print(f"[sequence {seq.index}]")
            print(seq.text)
            print(f"[{len(seq.token_ids)} tokens, finish: {seq.finish_reason}]")
    total = sum(len(seq.token_ids) for o in outs for seq in o.outputs)
    engine = llm.engine
    print(f"{len(outs) * params.n} requests, {total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s) "
          f"on {engine.device} {str(engine.dtype).removeprefix('torch.')}")
    return 0


# Subcommands whose module provides ``add_arguments(parser)`` and ``run(args) -> int``.
NO_INFERENCE = {"finetune", "bench-finetune"}  # commands that never co-serve inference: no batch invariance needed
MODULE_COMMANDS = {
    "finetune": ("coserve.finetune.command", "train a LoRA or IA3 adapter with token-level windows"),
    "bench-generation": ("coserve.bench.generation", "generation throughput against HF transformers generate"),
    "bench-finetune": ("coserve.bench.finetune", "token-level finetuning against HF PEFT with a torch loop"),
    "bench": ("coserve.bench.serving", "co-serving benchmark: SLO attainment and finetuning throughput per policy and rate"),
    "profile": ("coserve.engine.profile_command", "time co-serving iterations and fit the latency model"),
    "bench-server": ("coserve.bench.server_load", "a load run through the HTTP server against the in-process engine"),
    "serve": ("coserve.server.serve_command", "the OpenAI-compatible server: inference and fine-tuning jobs"),
    "run-batch": ("coserve.server.run_batch_command", "run an OpenAI batch file offline (as vLLM's run-batch)"),
}


def _add_module_commands(sub, chosen: str | None) -> None:
    """Every module command, named with its help; only the ``chosen`` one's module is imported (for its arguments),
    so that ``coserve bench`` or ``profile`` never loads what another command needs (the server's web stack)."""
    for name, (module_name, help_text) in MODULE_COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(func=module.run)


if __name__ == "__main__":
    sys.exit(main())
