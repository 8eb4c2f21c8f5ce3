"""Milliseconds to sample one token for each row of a batch of logits: coserve's ``sample`` against HF
transformers' way (its temperature and top-p warpers, then softmax and ``torch.multinomial`` over the batch, as
``generate`` samples), side by side in one process on the same logits.

    python benchmarks/sampling_speed.py [--rows 8,32,128] [--vocab 8192,32000] [--top-p 1.0,0.9] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from coserve.model.sampling import SamplingRow, sample


def _median_ms(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32,128")
    p.add_argument("--vocab", default="8192,32000")
    p.add_argument("--top-p", default="1.0,0.9")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{device}, {torch.get_num_threads()} threads, temperature {args.temperature}; median of {args.repeats}")
    print("| rows | vocab | top-p | HF warpers + multinomial | coserve sample | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            for top_p in (float(x) for x in args.top_p.split(",")):
                logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
                warpers = [TemperatureLogitsWarper(args.temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
                generator = torch.Generator(device=device).manual_seed(0)

                def hf() -> None:
                    scores = logits
                    for warp in warpers:
                        scores = warp(None, scores)
                    torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1).tolist()

                settings = [SamplingRow(args.temperature, -1, top_p, None) for _ in range(rows)]
                ours = _median_ms(lambda: sample(logits, settings, generator), args.repeats, sync)
                theirs = _median_ms(hf, args.repeats, sync)
                print(f"| {rows} | {vocab:,} | {top_p:g} | {theirs:.2f} ms | {ours:.2f} ms | {theirs / ours:.1f}x |")


if __name__ == "__main__":
    main()
