"""Where an engine step's time goes: the scheduler, the executor (model, sampling) and output processing, with
the torch profiler's top operators and Python's top functions over a few decode steps.

    python benchmarks/profile_engine_step.py --model DIR [--device cuda] [--requests 64] [--prompt-tokens 32]
        [--steps 20] [--top 25]

On a GPU the executor synchronizes at the end of each iteration, so "executor" is the device time plus any host
time the device waited for; the torch profiler's table shows which operators the host spent its time in.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.scheduler import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    output_tokens = 3 * args.steps + 8
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device=args.device,
                                    max_num_seqs=args.requests,
                                    num_kv_blocks=args.requests * ((args.prompt_tokens + output_tokens) // 16 + 2)))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(5, 200) for _ in range(args.prompt_tokens)], params)
    timings = {"execute": 0.0}
    execute = engine.executor.execute

    def timed_execute(plan):
        start = time.perf_counter()
        try:
            return execute(plan)
        finally:
            timings["execute"] += time.perf_counter() - start

    engine.executor.execute = timed_execute
    while (len(engine.scheduler.running) < args.requests
           or any(not r.output_token_ids for r in engine.scheduler.running)):
        engine.step()  # the prefills
    for _ in range(args.steps):
        engine.step()  # warm-up decode steps
    timings["execute"] = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    whole = time.perf_counter() - start
    print(f"decode steps of {args.requests} requests on {args.device}: {whole / args.steps * 1e3:.2f} ms per step, "
          f"executor {timings['execute'] / args.steps * 1e3:.2f} ms, "
          f"rest (scheduler, outputs) {(whole - timings['execute']) / args.steps * 1e3:.2f} ms")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
