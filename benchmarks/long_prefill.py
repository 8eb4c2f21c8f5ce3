"""One long prompt's prefill through the engine: the time from its submission to its first token.

    python benchmarks/long_prefill.py --model DIR [--tokens 2000] [--repeats 5] [--device cpu] [--dtype float32]

Each run is a fresh prompt of ``--tokens`` token ids (so no prefix is cached) in chunks as large as the prompt
(``max_num_batched_tokens``), generating one token; the median of ``--repeats`` runs after one warm-up is printed.
It times attention over a whole prompt, where a layer's scores grow with the square of the prompt's length when they
are written out (gpt-oss's sinks on a CUDA device, Gemma 2's capped scores) and are never held by the flash kernels.
"""

from __future__ import annotations

import argparse

import torch

from coserve import LLM, SamplingParams
from timing import median_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=args.tokens)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    runs = iter(range(1, 1_000_000))

    def prefill() -> None:
        shift = next(runs)
        llm.generate([[(10 + i * 7 + shift) % vocab for i in range(args.tokens)]], params)

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    seconds = median_seconds(prefill, sync, args.repeats)
    print(f"{args.model}: a {args.tokens}-token prefill in {seconds:.3f} s (median of {args.repeats}), "
          f"{args.tokens / seconds:.0f} tokens/s")


if __name__ == "__main__":
    main()
