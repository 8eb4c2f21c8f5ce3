"""Milliseconds of one finetuning sequence's forward pass and backward pass as the window size changes: what slicing a
sequence into co-serving's windows costs against whole-sequence passes (``FinetuneJob``, no inference).

    python benchmarks/finetune_windows.py --model DIR [--seq-len 1024] [--targets down_proj] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from coserve.bench.finetune import DEFAULT_ALPACA, packed_sequences
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import Example, FinetuneJob
from coserve.model.loader import load_model
from coserve.model.tokenizer import load_tokenizer
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=str(DEFAULT_ALPACA), help="Alpaca JSON")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--targets", default="down_proj", help="comma-separated LoRA target modules")
    p.add_argument("--windows", default="32,64,128,256", help="comma-separated window sizes to time")
    p.add_argument("--repeats", type=int, default=3, help="sequences timed per setting (the median is printed)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model, torch.float32, torch.device("cpu"))
    seqs = packed_sequences(load_tokenizer(args.model), Path(args.data), args.seq_len, 4)
    bypass = TrainableLora(LoraConfig(r=16, lora_alpha=16, target_modules=args.targets.split(",")),
                           model.module_shapes(), model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    sizes = [int(w) for w in args.windows.split(",")]
    settings = [(0, 0)] + [(w, 0) for w in sizes] + [(0, w) for w in sizes]
    examples = [Example(ids, ids[1:] + [-100]) for ids in seqs] * (2 + args.repeats * len(settings))
    cfg = FinetuneConfig(output_dir=tempfile.mkdtemp(prefix="coserve-windows-"), batch_size=1, lr=1e-4,
                         max_steps=len(examples), shuffle=False, max_grad_norm=0, lr_scheduler="constant",
                         rematerialize="cheap")
    job = FinetuneJob(model, bypass, examples, cfg)

    def sequence(forward_window: int, backward_window: int) -> tuple[float, float]:
        """One sequence's forward and backward seconds, in windows of these sizes (0: whole passes / layers)."""
        done, seconds = job.step, {"forward": 0.0, "backward": 0.0}
        while job.step == done:
            kind, pending = job.next_work(), job.pending_tokens()
            size = forward_window if kind == "forward" else backward_window
            start = time.perf_counter()
            (job.forward if kind == "forward" else job.backward)(min(size or pending, pending))
            seconds[kind] += time.perf_counter() - start
        return seconds["forward"], seconds["backward"]

    for _ in range(2):
        sequence(0, 0)  # warm-up
    print(f"{args.model}: LoRA on {args.targets}, sequences of {args.seq_len} tokens, "
          f"{model.cfg.num_layers} layers, {torch.get_num_threads()} threads")
    for fw, bw in settings:
        runs = [sequence(fw, bw) for _ in range(args.repeats)]
        forward = statistics.median(r[0] for r in runs) * 1e3
        backward = statistics.median(r[1] for r in runs) * 1e3
        label = (f"forward windows of {fw}" if fw else f"backward windows of {bw}" if bw else "whole passes")
        print(f"  {label:<28} forward {forward:7.1f} ms   backward {backward:7.1f} ms")


if __name__ == "__main__":
    main()
