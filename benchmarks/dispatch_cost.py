"""What one dispatched operation's host time is worth in FLOPs on a device: the pruning plan's ``DISPATCH_FLOPS``.

Times a chain of small elementwise operations on a tensor the size of a short window's activations (their host
time, the device having nothing to do), then a model's projection at a finetuning window's rows (the device's
FLOP rate there), and prints their product beside the value ``coserve.finetune.pruned_layer.DISPATCH_FLOPS`` holds
for the device. It is a lower bound: the executor's operations take more arguments than this chain's (on the
2-core Xeon the proxy of the history's twelfth session measured some 9 us an operation where this chain gives 5),
and on a CPU the executor's packed GEMMs run faster than ``F.linear`` here (300 against 130-170 GFLOP/s).

    python benchmarks/dispatch_cost.py [--device cuda] [--dtype bfloat16] [--hidden 1024] [--intermediate 2816]

From the repository root; where coserve is not installed (a lent GPU's image), with ``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse

import torch

from coserve.finetune.pruned_layer import DISPATCH_FLOPS
from timing import median_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hidden", type=int, default=512, help="the projection's input width (small: 512)")
    p.add_argument("--intermediate", type=int, default=1408, help="its output width (small's gate: 1,408)")
    p.add_argument("--rows", type=int, default=256, help="a window's tokens")
    p.add_argument("--ops", type=int, default=2000, help="small operations in the timed chain")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    g = torch.Generator(device=device).manual_seed(0)
    small = torch.randn(32, 64, device=device, dtype=dtype, generator=g)

    def chain() -> None:  # each operation depends on the last, as a window's recomputation does
        y = small
        for _ in range(args.ops):
            y = y * 1.0
        return y

    per_op = median_seconds(chain, sync) / args.ops
    x = torch.randn(args.rows, args.hidden, device=device, dtype=dtype, generator=g)
    w = torch.randn(args.intermediate, args.hidden, device=device, dtype=dtype, generator=g)
    matmuls = 20
    gemm = median_seconds(lambda: [torch.nn.functional.linear(x, w) for _ in range(matmuls)], sync) / matmuls
    rate = 2 * args.rows * args.hidden * args.intermediate / gemm
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"  one small operation's host time: {per_op * 1e6:.1f} us")
    print(f"  a {args.rows} x {args.hidden} -> {args.intermediate} projection: {gemm * 1e6:.1f} us, "
          f"{rate / 1e9:,.0f} GFLOP/s")
    print(f"  one operation is worth {per_op * rate:.3g} FLOPs; DISPATCH_FLOPS[{device.type!r}] = "
          f"{DISPATCH_FLOPS.get(device.type, 0.0):.3g}")


if __name__ == "__main__":
    main()
