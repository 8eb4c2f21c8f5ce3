"""GRPO steps side by side: coserve (rollouts through its engine, training as co-served windows) against TRL's
``GRPOTrainer`` (rollouts by transformers' ``generate``, training by PEFT and autograd), same model, prompts, reward,
LoRA and GRPO settings, each in a fresh process.

    pip install trl datasets accelerate    # the peer; not a coserve dependency
    python benchmarks/grpo_vs_trl.py --model DIR [--data ../shared/data/alpaca_en_demo.json] [--steps 3] \\
        [--num-generations 4] [--batch-size 16] [--max-completion-tokens 32] [--rounds 2] [--out FILE]

Reported per system and round: seconds per step (the first step, which pays for warm-up, left out; ``--steps`` of at
least 2), completion tokens per second of the whole step (rollouts and training together), the mean completion
length and reward. The completions differ between the systems (each samples its own), so this compares speed, not
outputs; tests/test_grpo.py holds coserve's steps to TRL's math on the very same completions.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

PROMPT_COUNT = 64


def reward_letters(prompts, completions, **kwargs):
    """The same reward for both: letters written, less ten per 'e' (any spread will do)."""
    return [float(sum(ch.isalpha() for ch in c) - 10 * c.count("e")) for c in completions]


def prompts_of(data: str) -> list[str]:
    records = json.loads(Path(data).read_text())
    return [r["instruction"] + ("\n" + r["input"] if r.get("input") else "") for r in records][:PROMPT_COUNT]


def run_coserve(spec: dict) -> dict:
    import torch
    torch.set_num_threads(spec["threads"])
    from coserve import LLM, FinetuneConfig, LoraConfig
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in spec["prompts"]))
        llm = LLM(spec["model"], dtype="float32", device="cpu")
        cfg = FinetuneConfig(output_dir=str(Path(tmp) / "out"), method="grpo", num_generations=spec["g"],
                             batch_size=spec["batch"], max_completion_tokens=spec["length"], max_steps=spec["steps"],
                             lr=spec["lr"], seed=spec["seed"], max_seq_len=spec["max_seq_len"])
        started = time.perf_counter()
        handle = llm.finetune(data, peft=LoraConfig(r=spec["r"], lora_alpha=2 * spec["r"],
                                                    target_modules=spec["targets"]),
                              config=cfg, reward_funcs=[reward_letters])
        marks = []
        while handle.status()["status"] == "running":
            handle.wait(0.01)
            while len(marks) < len(handle.log):
                marks.append(time.perf_counter())
        status = handle.status()
        if status["status"] != "succeeded":
            raise RuntimeError(f"coserve: {status['error']}")
        log = handle.log
    return _row("coserve", started, marks, [r["completions_mean_length"] for r in log],
                [r["reward"] for r in log], spec)


def run_trl(spec: dict) -> dict:
    import torch
    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from peft import LoraConfig as PeftLoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    marks: list[float] = []

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, use_cpu=True, bf16=False, per_device_train_batch_size=spec["batch"],
                          num_generations=spec["g"], max_completion_length=spec["length"], max_steps=spec["steps"],
                          learning_rate=spec["lr"], seed=spec["seed"], logging_steps=1, report_to=[],
                          save_strategy="no", temperature=1.0, dataloader_num_workers=0)
        tokenizer = AutoTokenizer.from_pretrained(spec["model"])
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward_letters], args=args, processing_class=tokenizer,
                              train_dataset=_dataset(Dataset, spec["prompts"]),
                              peft_config=PeftLoraConfig(r=spec["r"], lora_alpha=2 * spec["r"],
                                                         target_modules=spec["targets"]),
                              callbacks=[Marks()])
        started = time.perf_counter()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    return _row("trl", started, marks, [h["completions/mean_length"] for h in logs], [h["reward"] for h in logs],
                spec)


def _dataset(cls, prompts: list[str]):
    """The prompts as a ``datasets.Dataset``, its fingerprint given (hashing the table failed with the pyarrow and
    dill this was run with)."""
    import pyarrow as pa
    return cls(pa.Table.from_pylist([{"prompt": p} for p in prompts]), fingerprint="grpo-bench-prompts")


def _row(system: str, started: float, marks: list[float], lengths: list[float], rewards: list[float],
         spec: dict) -> dict:
    steps = [b - a for a, b in zip([started] + marks, marks)]
    timed = steps[1:] or steps  # the first step pays for warm-up
    tokens = [n * spec["batch"] for n in lengths[1:] or lengths]
    return {"system": system, "step_s": steps, "mean_step_s": sum(timed) / len(timed),
            "completion_tokens_per_s": sum(tokens) / sum(timed), "mean_completion_length": sum(lengths) / len(lengths),
            "mean_reward": sum(rewards) / len(rewards)}


def _spawned(fn, spec):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, (spec,))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/alpaca_en_demo.json"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="completions a step")
    p.add_argument("--max-completion-tokens", type=int, default=32)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--target-modules", default="q_proj,v_proj")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="each round runs both systems, the order alternating")
    p.add_argument("--out")
    args = p.parse_args()
    spec = {"model": args.model, "prompts": prompts_of(args.data), "steps": args.steps, "g": args.num_generations,
            "batch": args.batch_size, "length": args.max_completion_tokens, "r": args.lora_r,
            "targets": args.target_modules.split(","), "lr": args.lr, "seed": 0, "threads": args.threads,
            "max_seq_len": 1024}
    rows = []
    for round_ in range(args.rounds):
        order = [run_coserve, run_trl] if round_ % 2 == 0 else [run_trl, run_coserve]
        for fn in order:
            row = _spawned(fn, spec) | {"round": round_ + 1}
            rows.append(row)
            print(f"round {round_ + 1} {row['system']:8s} {row['mean_step_s']:7.2f} s/step  "
                  f"{row['completion_tokens_per_s']:8.1f} completion tokens/s  "
                  f"(completions {row['mean_completion_length']:.1f} tokens, reward {row['mean_reward']:.2f})",
                  flush=True)
    for round_ in range(args.rounds):
        ours, theirs = (next(r for r in rows if r["round"] == round_ + 1 and r["system"] == s)
                        for s in ("coserve", "trl"))
        print(f"round {round_ + 1}: coserve / TRL completion tokens per second "
              f"{ours['completion_tokens_per_s'] / theirs['completion_tokens_per_s']:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": {k: v for k, v in spec.items() if k != "prompts"},
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
