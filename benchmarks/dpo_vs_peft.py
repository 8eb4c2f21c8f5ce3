"""Preference training speed: coserve's PreferenceJob (whole-sequence windows, as ``finetune-only`` runs it) against
HF PEFT in a plain torch loop as TRL's trainers compute the loss, the same model, pairs, LoRA and AdamW: DPO as
DPOTrainer runs a PEFT model without a reference model (the reference log-probabilities from the adapter disabled,
under no_grad, every step), or the reference-free SimPO (CPOTrainer) and ORPO (ORPOTrainer).

    python benchmarks/dpo_vs_peft.py --model models/coserve-small [--method dpo|simpo|orpo] [--pairs-per-step 4]
        [--steps 6] [--rounds 2]

Pairs come from ``../shared/data/alpaca_en_demo.json`` (TRL's text form: the Alpaca prompt, the record's output as
chosen, the next record's as rejected), each step on new pairs (no reference is reused). A rate is the step's
policy tokens (chosen and rejected sequences) over its median step time after one warm-up step; the systems
alternate in rounds, HF PEFT first in odd rounds, and each round's ratio is against its own HF PEFT run.
From the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from coserve.bench.finetune import DEFAULT_ALPACA
from coserve.finetune.config import FinetuneConfig
from coserve.finetune.dataset import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from coserve.finetune.preference import encode_preference_record
from coserve.finetune.preference_job import PreferenceJob
from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.model.loader import load_model
from coserve.model.tokenizer import load_tokenizer
from coserve.peft.config import LoraConfig
from coserve.peft.trainable import TrainableLora


def pairs_from_alpaca(tokenizer, path: Path, count: int, max_seq_len: int) -> list:
    records = json.loads(path.read_text())
    pairs = []
    for i, r in enumerate(records):
        prompt = (ALPACA_PROMPT.format(instruction=r["instruction"], input=r["input"]) if r.get("input", "").strip()
                  else ALPACA_PROMPT_NO_INPUT.format(instruction=r["instruction"]))
        other = records[(i + 1) % len(records)]["output"]
        if not r["output"].strip() or not other.strip():
            continue
        pairs.append(encode_preference_record({"prompt": prompt, "chosen": r["output"], "rejected": other},
                                              tokenizer, max_seq_len)[0])
        if len(pairs) == count:
            break
    return pairs


def coserve_steps(model, pairs, per_step: int, steps: int, targets: list[str], method: str) -> list[float]:
    bypass = TrainableLora(LoraConfig(r=16, lora_alpha=16, target_modules=targets), model.module_shapes(),
                           model.cfg.num_layers, model.device, torch.Generator().manual_seed(0))
    cfg = FinetuneConfig(output_dir=tempfile.mkdtemp(prefix="dpo-bench-"), method=method, batch_size=per_step,
                         max_steps=steps, shuffle=False, lr=1e-5, lr_scheduler="constant")
    job = PreferenceJob(model, bypass, pairs, cfg)
    times, start = [], time.perf_counter()
    while (kind := job.next_work()) is not None:
        step = job.step
        (job.forward if kind == "forward" else job.backward)(job.pending_tokens())
        if job.step > step:
            now = time.perf_counter()
            times.append(now - start)
            start = now
    return times


def peft_steps(model_dir, pairs, per_step: int, steps: int, targets: list[str], method: str) -> list[float]:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                           PeftLoraConfig(r=16, lora_alpha=16, target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    def logp(ex):
        logits = model(input_ids=torch.tensor([ex.token_ids])).logits[0]
        return -F.cross_entropy(logits, torch.tensor(ex.targets), ignore_index=IGNORE_INDEX, reduction="sum")

    times = []
    for step in range(steps):
        start = time.perf_counter()
        batch = pairs[step * per_step:(step + 1) * per_step]
        loss = 0
        if method == "orpo":  # the chosen completions' token-mean cross-entropy, from the same forwards below
            chosen_tokens = sum(sum(t != IGNORE_INDEX for t in pair.chosen.targets) for pair in batch)
        for pair in batch:
            chosen, rejected = logp(pair.chosen), logp(pair.rejected)
            if method == "dpo":
                with torch.no_grad(), model.disable_adapter():
                    refs = [logp(pair.chosen), logp(pair.rejected)]
                loss = loss - F.logsigmoid(0.1 * ((chosen - refs[0]) - (rejected - refs[1]))) / len(batch)
                continue
            means = [lp / sum(t != IGNORE_INDEX for t in ex.targets)
                     for lp, ex in ((chosen, pair.chosen), (rejected, pair.rejected))]
            if method == "simpo":
                loss = loss - F.logsigmoid(0.1 * (means[0] - means[1]) - 0.5) / len(batch)
            else:
                odds = (means[0] - means[1]) - (torch.log1p(-torch.exp(means[0])) - torch.log1p(-torch.exp(means[1])))
                loss = loss - chosen / chosen_tokens - 0.1 * F.logsigmoid(odds) / len(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=str(DEFAULT_ALPACA))
    p.add_argument("--pairs-per-step", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per run, the first a warm-up")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--targets", default="down_proj")
    p.add_argument("--method", default="dpo", choices=["dpo", "simpo", "orpo"])
    args = p.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model, torch.float32, torch.device("cpu"))
    tokenizer = load_tokenizer(args.model)
    pairs = pairs_from_alpaca(tokenizer, Path(args.data), args.pairs_per_step * args.steps, args.max_seq_len)
    targets = args.targets.split(",")
    tokens = [sum(len(x.chosen.token_ids) + len(x.rejected.token_ids)
                  for x in pairs[s * args.pairs_per_step:(s + 1) * args.pairs_per_step]) for s in range(args.steps)]
    print(f"{args.method}: {args.model}, LoRA r=16 on {args.targets}, {args.pairs_per_step} pairs a step, "
          f"{torch.get_num_threads()} threads; policy tokens a step: {statistics.median(tokens):.0f} (median)")
    ratios = []
    for r in range(args.rounds):
        order = ("hf", "coserve") if r % 2 == 0 else ("coserve", "hf")
        rates = {}
        for system in order:
            times = (peft_steps(args.model, pairs, args.pairs_per_step, args.steps, targets, args.method)
                     if system == "hf" else coserve_steps(model, pairs, args.pairs_per_step, args.steps, targets,
                                                          args.method))
            rates[system] = statistics.median(n / sec for n, sec in zip(tokens[1:], times[1:]))  # per step
        ratios.append(rates["coserve"] / rates["hf"])
        print(f"  round {r + 1}: HF PEFT {rates['hf']:,.0f} tokens/s, coserve {rates['coserve']:,.0f} tokens/s, "
              f"{ratios[-1]:.2f}x")
    print(f"coserve / HF PEFT, median of rounds: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
