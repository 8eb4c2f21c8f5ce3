"""What automatic prefix caching saves: time to first token with the cache and without, on two workloads built
from ``../shared/data/alpaca_en_demo.json`` (synthetic instructions without it), in one process.

    python benchmarks/prefix_caching.py --model DIR [--device cpu] [--requests 24] [--shots 12] [--out FILE]

``few-shot``: every request is one system prompt (``--shots`` instruction/answer examples) followed by a new
instruction, sent one at a time. ``multi-turn``: conversations of four turns, each turn's prompt holding the
turns before it (the model's replies included), the conversations interleaved turn by turn. Each runs on a
fresh engine with ``enable_prefix_caching`` off and on (greedy, 16 output tokens); reported: prompt tokens,
the share found cached, time to first token (median and mean) and the whole run's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from coserve.engine.config import EngineConfig
from coserve.engine.llm_engine import LLMEngine
from coserve.scheduler import SamplingParams

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "alpaca_en_demo.json"
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def examples(n: int) -> list[tuple[str, str]]:
    if DATA.is_file():
        rows = json.loads(DATA.read_text())
        return [((r["instruction"] + " " + r.get("input", "")).strip(), r["output"][:400]) for r in rows[:n]]
    return [(f"Explain topic number {i} in a few words.", f"Topic {i} is about item {i}. " * 8) for i in range(n)]


def first_token_seconds(engine: LLMEngine, prompt: str) -> tuple[float, str]:
    """Run one request to its end; seconds to its first token, and its text."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, PARAMS)
    first, text = None, ""
    while True:
        for out in engine.step():
            if out.request_id == rid:
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
                if out.finished:
                    return first, out.outputs[0].text


def chat(engine: LLMEngine, messages: list[dict]) -> str:
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def few_shot(engine: LLMEngine, data: list[tuple[str, str]], shots: int, requests: int) -> list[float]:
    system = "Answer as in these examples.\n" + "".join(f"Q: {q}\nA: {a}\n" for q, a in data[:shots])
    return [first_token_seconds(engine, chat(engine, [{"role": "system", "content": system},
                                                      {"role": "user", "content": q}]))[0]
            for q, _ in data[shots:shots + requests]]


def multi_turn(engine: LLMEngine, data: list[tuple[str, str]], requests: int, turns: int = 4) -> list[float]:
    conversations = [[{"role": "system", "content": "You are a helpful assistant."}]
                     for _ in range(max(1, requests // turns))]
    questions = iter(q for q, _ in data)
    ttft = []
    for _ in range(turns):
        for conv in conversations:
            conv.append({"role": "user", "content": next(questions)})
            seconds, reply = first_token_seconds(engine, chat(engine, conv))
            ttft.append(seconds)
            conv.append({"role": "assistant", "content": reply})
    return ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--shots", type=int, default=12)
    p.add_argument("--out")
    args = p.parse_args()
    data = examples(args.shots + 4 * args.requests)
    rows = []
    for scenario in ("few-shot", "multi-turn"):
        for caching in (False, True):
            engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", device=args.device,
                                            enable_prefix_caching=caching))
            first_token_seconds(engine, "Warm up.")
            s = engine.scheduler
            q0, h0 = s.prefix_cache_queries, s.prefix_cache_hits
            start = time.perf_counter()
            ttft = (few_shot(engine, data, args.shots, args.requests) if scenario == "few-shot"
                    else multi_turn(engine, data, args.requests))
            seconds = time.perf_counter() - start
            queries = s.prefix_cache_queries - q0
            rows.append({"scenario": scenario, "prefix_caching": caching, "requests": len(ttft),
                         "mean_prompt_tokens": queries / len(ttft) if caching else None,
                         "cached_share": (s.prefix_cache_hits - h0) / queries if caching and queries else 0.0,
                         "ttft_p50_s": statistics.median(ttft), "ttft_mean_s": statistics.fmean(ttft),
                         "seconds": seconds})
    print(f"{'scenario':<11} {'cache':<5} {'reqs':>4} {'prompt':>6} {'cached':>6} {'TTFT p50':>9} {'mean':>8} "
          f"{'total':>7}")
    for r in rows:
        off = next(x for x in rows if x["scenario"] == r["scenario"] and not x["prefix_caching"])
        r["ttft_p50_ratio_to_off"] = r["ttft_p50_s"] / off["ttft_p50_s"]
        prompt = f"{r['mean_prompt_tokens']:.0f}" if r["mean_prompt_tokens"] else "-"
        print(f"{r['scenario']:<11} {'on' if r['prefix_caching'] else 'off':<5} {r['requests']:>4} {prompt:>6} "
              f"{r['cached_share']:>6.0%} {r['ttft_p50_s'] * 1e3:>7.1f}ms {r['ttft_mean_s'] * 1e3:>6.1f}ms "
              f"{r['seconds']:>6.2f}s")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
