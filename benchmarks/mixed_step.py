"""An eager (mixed) iteration's forward on a device: decode tokens of sequences with spread context lengths and a
prompt chunk, its attention laid out for one variable-length call (``forward_batch.CUDA_VARLEN``, CUDA's default)
against the per-length decode groups and per-chunk calls that CPU runs, side by side in one process: milliseconds
per forward (synchronized: on a GPU, host-bound forwards show their host time) and aten operators dispatched per
forward (each a kernel launch or more on a GPU).

    python benchmarks/mixed_step.py --model DIR [--device cuda] [--dtype bfloat16] [--decode 48] [--prompt 256]

From the repository root; where coserve is not installed (a lent GPU's image), with ``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coserve.model import forward_batch
from coserve.model.attention import PagedKVCache
from coserve.model.forward_batch import SequenceChunk, build_forward_batch
from coserve.model.loader import load_model

BLOCK = 16


class _CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _batch_parts(decode: int, prompt: int, lo: int, hi: int, seed: int):
    """Chunks (decode tokens with contexts drawn from [lo, hi], then one prompt chunk) on distinct blocks."""
    rng = random.Random(seed)
    chunks, tokens, next_block, row = [], [], 0, 0
    for context in [rng.randint(lo, hi) for _ in range(decode)] + ([prompt] if prompt else []):
        nb = -(-context // BLOCK)
        n = 1 if len(chunks) < decode else prompt
        chunks.append(SequenceChunk(row, row + n, context, list(range(next_block, next_block + nb))))
        tokens.append([rng.randrange(5, 200) for _ in range(n)])
        next_block += nb
        row += n
    return chunks, tokens, next_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decode", type=int, default=48, help="decode tokens in the batch")
    p.add_argument("--prompt", type=int, default=256, help="tokens of the prompt chunk (0: none)")
    p.add_argument("--context", default="64,1536", help="decode context lengths drawn from LO,HI")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    lo, hi = (int(x) for x in args.context.split(","))
    model = load_model(args.model, dtype, device)
    c = model.cfg
    chunks, tokens, blocks = _batch_parts(args.decode, args.prompt, lo, hi, seed=0)
    cache = PagedKVCache(c.num_layers, blocks, BLOCK, c.num_kv_heads, c.head_dim, device, dtype)
    rows = model.padded_rows(sum(len(t) for t in tokens))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def forward() -> None:
        batch = build_forward_batch(tokens, chunks, BLOCK, [ch.end - 1 for ch in chunks], device)
        model.forward(batch, cache, None, min_rows=rows)

    layouts = [True, False] if device.type == "cuda" else [False]
    print(f"{args.model} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{args.dtype}, {c.num_layers} layers: {args.decode} decode tokens (contexts {lo}-{hi}) and a "
          f"{args.prompt}-token prompt chunk, {rows} rows")
    times: dict[bool, list[float]] = {v: [] for v in layouts}
    for _ in range(3):  # warm-up: allocator, kernels
        for varlen in layouts:
            forward_batch.CUDA_VARLEN = varlen
            forward()
    for _ in range(args.repeats):  # the layouts alternate, so that drift hits both alike
        for varlen in layouts:
            forward_batch.CUDA_VARLEN = varlen
            sync()
            start = time.perf_counter()
            forward()
            sync()
            times[varlen].append(time.perf_counter() - start)
    for varlen in layouts:
        forward_batch.CUDA_VARLEN = varlen
        with _CountOps() as counted:
            forward()
        sync()
        label = "one variable-length call" if varlen else "per-length groups and chunks"
        print(f"  {label:<30} {statistics.median(times[varlen]) * 1e3:8.2f} ms a forward (median of "
              f"{args.repeats}), {sum(counted.count.values()):,} aten operators")
    forward_batch.CUDA_VARLEN = True


if __name__ == "__main__":
    main()
