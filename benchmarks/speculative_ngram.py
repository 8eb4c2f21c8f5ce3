"""What n-gram speculative decoding buys: the same greedy requests with and without drafts, in one process.

    python benchmarks/speculative_ngram.py --model DIR [--device cpu] [--drafts 4] [--max-tokens 128]
        [--batch 1 --batch 8] [--out FILE]

Prompts are Alpaca records from ``../shared/data/alpaca_en_demo.json`` (instruction, input and output: text that
repeats itself now and then, as the documents people summarise or edit do), or synthetic text without it. Each
batch size runs on a fresh engine per setting (prefix caching off, so both pay every prefill); the outputs are
checked to be token-identical. Reported: output tokens per second, the ratio, and how many drafts were accepted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from coserve import LLM, SamplingParams

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "alpaca_en_demo.json"


def prompts(n: int) -> list[str]:
    if DATA.is_file():
        rows = json.loads(DATA.read_text())
        return [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}\nAgain:\n{r['output'][:200]}"
                for r in rows[:n]]
    return [f"Item {i}: the scheduler packs tokens into iterations. Item {i}: the scheduler" for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, action="append", default=None)
    p.add_argument("--out")
    args = p.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for batch in args.batch or [1, 8]:
        texts = prompts(batch)
        outs = {}
        for drafts in (0, args.drafts):
            llm = LLM(args.model, dtype="float32", device=args.device, speculative_tokens=drafts,
                      enable_prefix_caching=False)
            llm.generate(["Warm up."], SamplingParams(max_tokens=4))
            start = time.perf_counter()
            out = llm.generate(texts, params)
            seconds = time.perf_counter() - start
            s = llm.engine.scheduler
            outs[drafts] = [o.outputs[0].token_ids for o in out]
            tokens = sum(len(t) for t in outs[drafts])
            rows.append({"batch": batch, "drafts": drafts, "seconds": seconds, "output_tokens": tokens,
                         "tokens_per_s": tokens / seconds, "drafts_proposed": s.num_draft_tokens,
                         "drafts_accepted": s.num_accepted_drafts})
        rows[-1]["identical"] = outs[0] == outs[args.drafts]
        rows[-1]["ratio"] = rows[-1]["tokens_per_s"] / rows[-2]["tokens_per_s"]
    print(f"{'batch':>5} {'drafts':>6} {'tok/s':>8} {'ratio':>6} {'proposed':>8} {'accepted':>8} identical")
    for r in rows:
        print(f"{r['batch']:>5} {r['drafts']:>6} {r['tokens_per_s']:>8.0f} {r.get('ratio', 1.0):>5.2f}x "
              f"{r['drafts_proposed']:>8} {r['drafts_accepted']:>8} {r.get('identical', '')}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
