"""Milliseconds per engine iteration as finetuning tokens join a decode batch (``IterationRig``, the profiler's rig):
what a co-served forward window or backward slice adds to an inference iteration on this device.

    python benchmarks/iteration_mix.py --model DIR [--decode 4] [--decode-ctx 256] [--backward-ctx 512] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from coserve.engine.profiler import IterationRig, ProfilePoint
from coserve.model.loader import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--decode", type=int, default=4, help="decode sequences in the iteration")
    p.add_argument("--decode-ctx", type=int, default=256)
    p.add_argument("--backward-ctx", type=int, default=512, help="length of the sequence a backward slice belongs to")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model, torch.float32, torch.device(args.device), max_positions=2048)
    rig = IterationRig(model, max(args.decode_ctx, args.backward_ctx) * 2)

    def ms(point: ProfilePoint) -> float:
        for _ in range(3):
            rig.once(point)
        return statistics.median(rig.once(point) for _ in range(args.repeats)) * 1e3

    d, ctx, bctx = args.decode, args.decode_ctx, args.backward_ctx
    base = ms(ProfilePoint(d, ctx, 0, 0, 0, 0))
    print(f"decode {d} at context {ctx}: {base:.2f} ms")
    for n in (1, 8, 64):
        print(f"  + finetuning forward window of {n:>2} tokens: {ms(ProfilePoint(d, ctx, 0, n, 0, 0)):.2f} ms")
    for n in (1, 8, 64):
        print(f"  + backward of {n:>2} token-layers (context {bctx}): {ms(ProfilePoint(d, ctx, 0, 0, n, bctx)):.2f} ms")
    print(f"forward window of 64 tokens alone: {ms(ProfilePoint(0, 0, 0, 64, 0, 0)):.2f} ms")
    print(f"backward of 64 token-layers alone (context {bctx}): {ms(ProfilePoint(0, 0, 0, 0, 64, bctx)):.2f} ms")


if __name__ == "__main__":
    main()
