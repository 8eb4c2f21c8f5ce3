"""Milliseconds to sample one token for each row of a batch of logits: coserve's ``sample`` against HF
transformers' way (its temperature and top-p warpers, then softmax and ``torch.multinomial`` over the batch, as
``generate`` samples), side by side in one process on the same logits.

    python benchmarks/sampling_speed.py [--rows 8,32,128] [--vocab 8192,32000] [--top-p 1.0,0.9] [--zipf 0,1.5]
        [--device cpu]

``--zipf A``: each row's logits are ``-A log(rank)`` over a random order of the vocabulary (a language model's
long tail; at 1.5 top-p 0.9 keeps about 50 tokens); 0: normal logits x3 (a flat row: top-p 0.9 keeps most of the
vocabulary, the worst case for top-p).
"""

from __future__ import annotations

import argparse

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from coserve.model.sampling import SamplingRow, sample
from timing import median_seconds


def _logits(rows: int, vocab: int, zipf: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if not zipf:
        return torch.randn(rows, vocab, generator=g).mul_(3)
    ranked = -zipf * torch.log(torch.arange(1.0, vocab + 1))
    return torch.stack([ranked[torch.randperm(vocab, generator=g)] for _ in range(rows)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32,128")
    p.add_argument("--vocab", default="8192,32000")
    p.add_argument("--top-p", default="1.0,0.9")
    p.add_argument("--zipf", default="0,1.5", help="logit shapes: 0 = normal x3, A > 0 = -A log(rank)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{device}, {torch.get_num_threads()} threads, temperature {args.temperature}; median of {args.repeats}")
    print("| logits | rows | vocab | top-p | HF warpers + multinomial | coserve sample | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    grid = [(zipf, vocab, rows, top_p) for zipf in _numbers(args.zipf) for vocab in _numbers(args.vocab, int)
            for rows in _numbers(args.rows, int) for top_p in _numbers(args.top_p)]
    for zipf, vocab, rows, top_p in grid:
        logits = _logits(rows, vocab, zipf).to(device)
        warpers = [TemperatureLogitsWarper(args.temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        generator = torch.Generator(device=device).manual_seed(0)

        def hf() -> None:
            scores = logits
            for warp in warpers:
                scores = warp(None, scores)
            torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1).tolist()

        settings = [SamplingRow(args.temperature, -1, top_p, None) for _ in range(rows)]
        ours = median_seconds(lambda: sample(logits, settings, generator), sync, args.repeats) * 1e3
        theirs = median_seconds(hf, sync, args.repeats) * 1e3
        shape = f"zipf {zipf:g}" if zipf else "normal x3"
        print(f"| {shape} | {rows} | {vocab:,} | {top_p:g} | {theirs:.2f} ms | {ours:.2f} ms | {theirs / ours:.1f}x |")


def _numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",")]

if __name__ == "__main__":
    main()
