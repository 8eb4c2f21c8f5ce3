"""Milliseconds per ``LLMEngine.step`` for a batch of greedy requests (host work shows on small models), and the
median of the decode-only steps.

    python benchmarks/engine_step_time.py --model DIR [--requests 64] [--prompt-tokens 32] [--output-tokens 512]
        [--device cpu] [--texts OUT.json]

``--texts`` writes the final texts, to compare two versions of the code on the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.scheduler import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--texts")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device=args.device, max_num_seqs=args.requests,
                                    num_kv_blocks=args.requests * ((args.prompt_tokens + args.output_tokens) // 16 + 2)))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(5, 200) for _ in range(args.prompt_tokens)], params)
           for _ in range(args.requests)]
    texts: dict[str, str] = {}
    steps = 0
    start = time.perf_counter()
    decode: list[float] = []  # the steps whose chunks are all decode tokens
    while len(texts) < len(ids):
        begun = time.perf_counter()
        texts.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
        plan = engine.last_plan
        if plan is not None and plan.chunks and all(len(c.token_ids) == 1 for c in plan.chunks):
            decode.append(time.perf_counter() - begun)
        steps += 1
    elapsed = time.perf_counter() - start
    print(f"{steps} steps in {elapsed:.2f} s: {elapsed / steps * 1e3:.2f} ms per step, "
          f"{args.requests * args.output_tokens / elapsed:.0f} output tokens/s; {len(decode)} decode-only steps, "
          f"median {statistics.median(decode) * 1e3 if decode else float('nan'):.2f} ms")
    if args.texts:
        with open(args.texts, "w") as f:
            json.dump([texts[i] for i in ids], f)


if __name__ == "__main__":
    main()
