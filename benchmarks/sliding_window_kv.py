"""What freeing the KV blocks behind a sliding window buys: the same requests on the same KV cache, with a running
request giving up its blocks once they are wholly behind the window (coserve's default where every layer slides)
and with every block kept to the end (as before), in one process, alternated.

    python benchmarks/sliding_window_kv.py --model DIR [--requests 24] [--prompt-tokens 128] [--max-tokens 384]
        [--num-kv-blocks 256] [--block-size 16] [--repeats 2] [--out FILE]

``DIR`` must be a model whose every layer slides (Mistral-7B-v0.1's layout: ``sliding_window`` in its config.json;
``coserve create-model`` then set it). Greedy requests of random prompt tokens (seed 0), all submitted at once;
reported for each way: the whole run's seconds, output tokens per second, preemptions, and the most blocks held at
once. The greedy tokens of the two ways must agree (checked).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from coserve import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, release: bool) -> dict:
    scheduler = llm.engine.scheduler
    window = llm.engine.model_config.kv_window
    scheduler.config.kv_window = window if release else None
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
    scheduler.config.kv_window = window
    tokens = sum(len(o.token_ids) for o in outs)
    return {"way": "release" if release else "keep", "seconds": round(seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1), "preemptions": scheduler.num_preemptions - before,
            "peak_blocks_held": peak[0], "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", device=args.device, num_kv_blocks=args.num_kv_blocks,
              block_size=args.block_size)
    window = llm.engine.model_config.kv_window
    if window is None:
        raise SystemExit(f"{args.model}: not every layer slides (config.json's sliding_window); nothing to free")
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    need = args.requests * -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    print(f"window {window} tokens; {args.requests} requests whose whole contexts need {need} blocks; "
          f"the cache holds {args.num_kv_blocks}")
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm up
    rows = []
    for r in range(args.repeats):
        for release in ((True, False) if r % 2 == 0 else (False, True)):
            row = run(llm, prompts, params, release)
            rows.append({**row, "repeat": r})
            print(f"repeat {r} {row['way']:>7}: {row['seconds']:7.2f} s, {row['output_tokens_per_s']:7.1f} output "
                  f"tok/s, {row['preemptions']} preemptions, at most {row['peak_blocks_held']} blocks held")
    same = all(a["tokens"] == rows[0]["tokens"] for a in rows)
    print("greedy tokens identical across ways and repeats:", same)
    if not same:
        raise SystemExit("the two ways gave different greedy tokens")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "window": window, "requests": args.requests,
                       "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                       "num_kv_blocks": args.num_kv_blocks, "block_size": args.block_size, "blocks_needed": need,
                       "runs": [{k: v for k, v in row.items() if k != "tokens"} for row in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
