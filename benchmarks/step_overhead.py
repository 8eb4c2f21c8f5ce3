"""The engine's host work per decode iteration, apart from the model: planning (``scheduler.schedule``), building
the flat batch, the iteration's other Python around the forward (sampling rows, results), ``scheduler.update`` and
the outputs, per running request. On a GPU a decode step replays a CUDA graph in a few milliseconds, so this work
is a large part of each iteration; a small model on the CPU shows it in isolation.

    python benchmarks/step_overhead.py --model DIR [--requests 32,128] [--prompt-len 200] [--steps 200]
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
    """Median microseconds per decode step of each part, with ``requests`` requests decoding (eager forward)."""
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", device=device, policy="inference-only",
                                    max_num_seqs=max(256, requests), cuda_graphs=False))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 50, temperature=0, ignore_eos=True)
    for _ in range(requests):
        engine.add_request([rng.randrange(5, 200) for _ in range(prompt_len)], params)
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # every prompt in, every request decoding
    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "eager": [], "batch": [], "step": []}

    def timed(name, fn):
        def run(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            parts[name].append(time.perf_counter() - start)
            return out
        return run

    ex = engine.executor
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    ex.execute = timed("execute", ex.execute)
    ex._eager_forward = timed("eager", ex._eager_forward)
    ex._forward_batch = timed("batch", ex._forward_batch)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        parts["step"].append(time.perf_counter() - start)
    assert len(engine.scheduler.running) == requests, "a request finished or was preempted during the timing"
    m = {k: statistics.median(v) * 1e6 for k, v in parts.items()}
    m["model"] = m["eager"] - m["batch"]  # the forward's own kernels
    m["execute-rest"] = m["execute"] - m["eager"]  # logits, sampling rows, results
    m["update+outputs"] = m["step"] - m["schedule"] - m["execute"]
    m["host"] = m["step"] - m["model"]
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", default="32,128", help="comma-separated numbers of decoding requests")
    p.add_argument("--prompt-len", type=int, default=200, help="tokens of each request's prompt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    print(f"{args.model} on {args.device}, prompts of {args.prompt_len} tokens: median microseconds per decode step")
    cols = ("step", "model", "host", "schedule", "batch", "execute-rest", "update+outputs")
    print(f"{'requests':>8} " + " ".join(f"{c:>14}" for c in cols) + f" {'host/request':>12}")
    for n in (int(x) for x in args.requests.split(",")):
        m = measure(args.model, n, args.steps, args.device, args.prompt_len)
        print(f"{n:>8} " + " ".join(f"{m[c]:>14.0f}" for c in cols) + f" {m['host'] / n:>12.1f}")


if __name__ == "__main__":
    main()
