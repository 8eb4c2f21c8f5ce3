"""Where a finetuning sequence's time goes on a device: the job's whole-window passes (as ``finetune-only`` runs
them) against one plain autograd forward and backward of the same sequence, then the torch profiler's top
operators and the host calls that stall it (kernel launches, copies, synchronizations).

    python benchmarks/finetune_profile.py --model DIR [--device cuda] [--dtype bfloat16] [--seq-len 512]

From the repository root; where coserve is not installed (a lent GPU's image), with ``PYTHONPATH=.``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from coserve.bench.finetune import DEFAULT_ALPACA, packed_sequences
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.job import Example, FinetuneJob
from coserve.finetune.pruned_layer import executor_plan, planned_keeps
from coserve.finetune.reference import whole_sequence_loss
from coserve.model.loader import load_model
from coserve.model.tokenizer import load_tokenizer
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora

# Host-side calls worth counting: each launch costs microseconds, each synchronization waits for the device.
_HOST_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize",
               "cudaDeviceSynchronize", "cudaMemsetAsync", "aten::_local_scalar_dense", "aten::nonzero", "aten::item")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=str(DEFAULT_ALPACA), help="Alpaca JSON")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--targets", default="down_proj", help="comma-separated LoRA target modules")
    p.add_argument("--repeats", type=int, default=4, help="sequences timed per path (the median is printed)")
    p.add_argument("--top", type=int, default=25, help="operators listed from the profile")
    args = p.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = load_model(args.model, dtype, device)
    seqs = packed_sequences(load_tokenizer(args.model), Path(args.data), args.seq_len, 4)
    bypass = TrainableLora(LoraConfig(r=16, lora_alpha=16, target_modules=args.targets.split(",")),
                           model.module_shapes(), model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    examples = [Example(ids, ids[1:] + [-100]) for ids in seqs] * (4 + 2 * args.repeats)
    cfg = FinetuneConfig(output_dir=tempfile.mkdtemp(prefix="coserve-profile-"), batch_size=1, lr=1e-4,
                         max_steps=len(examples), shuffle=False, max_grad_norm=0, lr_scheduler="constant")
    job = FinetuneJob(model, bypass, examples, cfg)
    # the same job on the plan FLOPs alone would pick (no charge for the host's time per dispatched operation)
    flops_job = FinetuneJob(model, bypass, examples, cfg)
    flops_job.plan = executor_plan(model, bypass.config, cfg.rematerialize, cfg.memory_target, flops_job.longest_tokens,
                                   dispatch_flops=0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def job_sequence(job: FinetuneJob = job) -> tuple[float, float]:
        """One sequence through ``job`` in whole windows: (forward s, backward s)."""
        done, seconds = job.step, {"forward": 0.0, "backward": 0.0}
        while job.step == done:
            kind = job.next_work()
            sync()
            start = time.perf_counter()
            (job.forward if kind == "forward" else job.backward)(job.pending_tokens())
            sync()
            seconds[kind] += time.perf_counter() - start
        return seconds["forward"], seconds["backward"]

    def autograd_sequence() -> tuple[float, float]:
        """The same sequence in one plain autograd forward and backward: (forward s, backward s)."""
        ids = seqs[0]
        sync()
        start = time.perf_counter()
        loss = whole_sequence_loss(model, bypass, ids, ids[1:] + [-100], dropout_seed=None)
        sync()
        mid = time.perf_counter()
        loss.backward()
        sync()
        end = time.perf_counter()
        for t in bypass.parameters():
            t.grad = None
        return mid - start, end - mid

    for _ in range(2):  # warm-up: allocator, kernels, autotuning
        job_sequence()
        job_sequence(flops_job)
        autograd_sequence()
    print(f"{args.model} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{args.dtype}, LoRA r=16 on {args.targets}, sequences of {args.seq_len} tokens, "
          f"{model.cfg.num_layers} layers, {torch.get_num_threads()} threads")
    for j, label in ((job, "job"), (flops_job, "job, FLOPs-only plan")):
        print(f"  {label}: keeps {', '.join(sorted(planned_keeps(j.plan)))}")
    timed = (("job, whole windows", job_sequence), ("job, FLOPs-only plan", lambda: job_sequence(flops_job)),
             ("plain autograd", autograd_sequence))
    runs = {label: [] for label, _ in timed}
    for _ in range(args.repeats):  # the paths in turn, so that a machine whose speed drifts slows each alike
        for label, run in timed:
            runs[label].append(run())
    for label, _ in timed:
        fw, bw = (statistics.median(r[i] for r in runs[label]) * 1e3 for i in (0, 1))
        print(f"  {label:<22} forward {fw:8.2f} ms  backward {bw:8.2f} ms  "
              f"({args.seq_len / ((fw + bw) / 1e3):,.0f} tokens/s)")

    if device.type == "cuda":  # where the job waits for the device: the Python lines of its synchronizing calls
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            job_sequence()
        torch.cuda.set_sync_debug_mode("default")
        sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                    if "synchronizing" in str(w.message))
        print("\n== job, whole windows: synchronizing calls by line: "
              + (", ".join(f"{k} {v}" for k, v in sites.most_common()) or "none"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for label, run in (("job, whole windows", job_sequence), ("plain autograd", autograd_sequence)):
        with profile(activities=activities) as prof:
            run()
            sync()
        events = prof.key_averages()
        counts = collections.Counter({e.key: e.count for e in events if e.key in _HOST_CALLS})
        print(f"\n== {label}: one sequence; host calls: "
              + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none counted"))
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=48))
        if device.type == "cuda":
            print(events.table(sort_by=sort, row_limit=args.top // 2, max_name_column_width=48))


if __name__ == "__main__":
    main()
