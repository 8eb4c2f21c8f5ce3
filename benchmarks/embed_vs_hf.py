"""Embedding throughput: ``LLM.embed`` (the engine's continuous batching and chunked prefill) against HF
transformers' ``AutoModel`` run as embedding libraries run a decoder (batches of similar lengths padded on the right,
the last real token's final hidden state, L2-normalized), the same model and texts; checks that the two agree. The
engine's prefix cache is off (the rounds embed the same texts again).

    python benchmarks/embed_vs_hf.py --model models/coserve-small [--texts 256] [--hf-batch 16] [--rounds 2]

Texts are Alpaca records (instruction, input and output) from ``../shared/data/alpaca_en_demo.json``, cut to
``--max-tokens``. The systems alternate in rounds (HF first in odd rounds); each round's ratio is against its own
HF run. From the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from coserve import LLM
from coserve.bench.finetune import DEFAULT_ALPACA


def texts_from_alpaca(path: Path, count: int) -> list[str]:
    records = json.loads(path.read_text())
    return [" ".join(x for x in (r["instruction"], r.get("input", ""), r["output"]) if x) for r in records][:count]


def hf_embed(model, ids: list[list[int]], batch: int, pad: int) -> list[torch.Tensor]:
    """Batches of similar lengths (sorted, as sentence-transformers batches them), in the texts' order."""
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out: list[torch.Tensor | None] = [None] * len(ids)
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            rows = order[start:start + batch]
            group = [ids[i] for i in rows]
            width = max(len(x) for x in group)
            input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in group])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in group])
            hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(group)), mask.sum(1) - 1]
            for i, v in zip(rows, torch.nn.functional.normalize(last.float(), dim=-1)):
                out[i] = v
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=str(DEFAULT_ALPACA))
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from transformers import AutoModel
    llm = LLM(args.model, dtype="float32", device="cpu", enable_prefix_caching=False)  # rounds repeat the texts
    hf = AutoModel.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = llm.tokenizer
    ids = [tokenizer(t)["input_ids"][:args.max_tokens] for t in texts_from_alpaca(Path(args.data), args.texts)]
    tokens = sum(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    llm.embed(ids[:8])  # warm-up: the latency profile, allocator, kernels
    hf_embed(hf, ids[:8], args.hf_batch, pad)
    print(f"{args.model}, {len(ids)} texts, {tokens:,} tokens (median {statistics.median(len(x) for x in ids):.0f}), "
          f"HF batches of {args.hf_batch}, {torch.get_num_threads()} threads")
    ratios, ours, theirs = [], None, None
    for r in range(args.rounds):
        seconds = {}
        for system in (("hf", "coserve") if r % 2 == 0 else ("coserve", "hf")):
            start = time.perf_counter()
            if system == "hf":
                theirs = hf_embed(hf, ids, args.hf_batch, pad)
            else:
                ours = [torch.tensor(o.outputs.embedding) for o in llm.embed(ids)]
            seconds[system] = time.perf_counter() - start
        ratios.append(seconds["hf"] / seconds["coserve"])
        print(f"  round {r + 1}: HF {tokens / seconds['hf']:,.0f} tokens/s, coserve "
              f"{tokens / seconds['coserve']:,.0f} tokens/s, {ratios[-1]:.2f}x")
    worst = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    print(f"coserve / HF, median of rounds: {statistics.median(ratios):.2f}x; largest difference of an embedding's "
          f"value: {worst:.2e}")


if __name__ == "__main__":
    main()
