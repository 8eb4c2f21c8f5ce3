"""The engine's host work per decode iteration, apart from the model: planning (``scheduler.schedule``), the
iteration's own Python around the forward (batch building, sampling rows), ``scheduler.update`` and the outputs,
per running request. On a GPU a decode step replays a CUDA graph in a few milliseconds, so this work is a large
part of each iteration; a small model on the CPU shows it in isolation.

    python benchmarks/step_overhead.py --model DIR [--requests 32,128] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.scheduler.sampling_params import SamplingParams


def measure(model: str, requests: int, steps: int, device: str, prompt_len: int) -> dict[str, float]:
    """Median microseconds per decode step of each part, with ``requests`` requests decoding."""
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device=device, policy="inference-only",
                                    max_num_seqs=max(256, requests)))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 50, temperature=0, ignore_eos=True)
    for _ in range(requests):
        engine.add_request([rng.randrange(5, 200) for _ in range(prompt_len)], params)
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # every prompt in, every request decoding
    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "forward": [], "step": []}
    schedule, execute = engine.scheduler.schedule, engine.executor.execute
    forward = engine.executor._eager_forward if engine.executor.graphs is None else engine.executor.graphs.forward

    def timed(name, fn):
        def run(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            parts[name].append(time.perf_counter() - start)
            return out
        return run

    engine.scheduler.schedule = timed("schedule", schedule)
    engine.executor.execute = timed("execute", execute)
    if engine.executor.graphs is None:
        engine.executor._eager_forward = timed("forward", forward)
    else:
        engine.executor.graphs.forward = timed("forward", forward)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        parts["step"].append(time.perf_counter() - start)
    assert len(engine.scheduler.running) == requests, "a request finished or was preempted during the timing"
    med = {k: statistics.median(v) * 1e6 for k, v in parts.items() if v}
    med["update+outputs"] = med["step"] - med["schedule"] - med["execute"]  # the rest of the step
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", default="32,128", help="comma-separated numbers of decoding requests")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=200, help="tokens of each request's prompt")
    args = p.parse_args()
    print(f"{args.model} on {args.device}, prompts of {args.prompt_len} tokens: median microseconds per decode step")
    print(f"{'requests':>8} {'step':>8} {'forward':>8} {'host':>8} {'schedule':>9} {'execute-forward':>15} "
          f"{'update+outputs':>14} {'host/request':>12}")
    for n in (int(x) for x in args.requests.split(",")):
        m = measure(args.model, n, args.steps, args.device, args.prompt_len)
        host = m["step"] - m["forward"]
        print(f"{n:>8} {m['step']:>8.0f} {m['forward']:>8.0f} {host:>8.0f} {m['schedule']:>9.0f} "
              f"{m['execute'] - m['forward']:>15.0f} {m['update+outputs']:>14.0f} {host / n:>12.1f}")


if __name__ == "__main__":
    main()
