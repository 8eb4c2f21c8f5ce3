"""What sliding windows save in the KV cache: the same requests on the same KV memory, each way in one process,
alternated.

    python benchmarks/sliding_window_kv.py --model DIR [--requests 24] [--prompt-tokens 128] [--max-tokens 384]
        [--num-kv-blocks 256 | --kv-cache-memory-gb G] [--block-size 16] [--max-num-seqs 16]
        [--max-num-batched-tokens 512] [--repeats 2] [--way release|keep|pool|main] [--out FILE]

Where every layer of ``DIR`` slides (Mistral-7B-v0.1's layout: ``sliding_window`` in its config.json), a running
request gives up its blocks once they are wholly behind the window (``release``), against keeping every block to the
end (``keep``), on ``--num-kv-blocks`` blocks. Where sliding layers sit beside whole-context ones (Gemma 2 and 3),
the sliding layers keep their K/V in a pool of their own (``pool``), against keeping it in the main blocks
(``main``, ``disable_hybrid_kv_cache_manager``), on ``--kv-cache-memory-gb`` of KV memory (so that the pool's saving
shows as main blocks). ``--way`` runs one of them alone (``release`` with prompts longer than the whole cache, which
``keep`` cannot hold). Greedy requests of random prompt tokens (seed 0), all submitted at once; reported for each
way: the whole run's seconds, output tokens per second, preemptions, the main blocks and the most held at once. The
greedy tokens of the two ways must agree (checked).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from coserve import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, way: str) -> dict:
    scheduler = llm.engine.scheduler
    window = scheduler.blocks.window
    scheduler.blocks.window = None if way == "keep" else window
    before = scheduler.num_preemptions
    peak = [0]
    update = scheduler.update

    def watched(plan, result):
        events = update(plan, result)
        peak[0] = max(peak[0], scheduler.blocks.num_blocks - scheduler.blocks.num_free_blocks)
        return events

    scheduler.update = watched
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    scheduler.update = update
    scheduler.blocks.window = window
    tokens = sum(len(o.token_ids) for o in outs)
    return {"way": way, "seconds": round(seconds, 3), "output_tokens_per_s": round(tokens / seconds, 1),
            "preemptions": scheduler.num_preemptions - before, "main_blocks": scheduler.blocks.num_blocks,
            "window_storages": llm.engine.window_storages, "peak_blocks_held": peak[0],
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--kv-cache-memory-gb", type=float)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--way", choices=("release", "keep", "pool", "main"), help="run this way alone")
    ap.add_argument("--out")
    args = ap.parse_args()
    size = ({"kv_cache_memory_gb": args.kv_cache_memory_gb} if args.kv_cache_memory_gb
            else {"num_kv_blocks": args.num_kv_blocks})
    common = dict(dtype="float32", device=args.device, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, **size)
    llm = LLM(args.model, **common)
    cfg = llm.engine.model_config
    if cfg.kv_window is not None:
        engines, ways = {"release": llm, "keep": llm}, ("release", "keep")
    elif cfg.pooled_window is not None:
        engines = {"pool": llm, "main": LLM(args.model, disable_hybrid_kv_cache_manager=True, **common)}
        ways = ("pool", "main")
        if not llm.engine.window_storages:
            raise SystemExit("the sliding layers' pool would be no smaller than the main blocks here: give more "
                             "KV memory or a smaller --max-num-seqs / --max-num-batched-tokens")
    else:
        raise SystemExit(f"{args.model}: no layer slides (config.json's sliding_window); nothing to free")
    if args.way is not None:
        if args.way not in ways:
            raise SystemExit(f"--way: {args.way} is not one of this model's ({', '.join(ways)})")
        ways = (args.way,)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, cfg.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    need = args.requests * -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    print(f"window {cfg.kv_window or cfg.pooled_window} tokens; {args.requests} requests whose whole contexts need "
          f"{need} blocks; " + ", ".join(f"{w}: {engines[w].engine.scheduler.blocks.num_blocks} main blocks, "
                                         f"{engines[w].engine.window_storages} window storages" for w in ways))
    for e in {id(e): e for e in engines.values()}.values():
        e.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm up
    rows = []
    for r in range(args.repeats):
        for way in (ways if r % 2 == 0 else ways[::-1]):
            row = run(engines[way], prompts, params, way)
            rows.append({**row, "repeat": r})
            print(f"repeat {r} {way:>7}: {row['seconds']:7.2f} s, {row['output_tokens_per_s']:7.1f} output tok/s, "
                  f"{row['preemptions']} preemptions, at most {row['peak_blocks_held']} of "
                  f"{row['main_blocks']} blocks held")
    same = all(a["tokens"] == rows[0]["tokens"] for a in rows)
    print("greedy tokens identical across ways and repeats:", same)
    if not same:
        raise SystemExit("the two ways gave different greedy tokens")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "window": cfg.kv_window or cfg.pooled_window, "requests": args.requests,
                       "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, **size,
                       "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                       "max_num_batched_tokens": args.max_num_batched_tokens, "blocks_needed": need,
                       "runs": [{k: v for k, v in row.items() if k != "tokens"} for row in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
