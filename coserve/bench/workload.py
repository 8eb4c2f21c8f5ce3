"""Prompt workloads for benchmarks: ShareGPT-trace lengths when the shared data is there, else synthetic."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SHAREGPT = Path(__file__).resolve().parents[3] / "shared" / "data" / "sharegpt_trace.json"


@dataclass(slots=True)
class PromptSet:
    """Token-id prompts and where their lengths came from."""

    prompts: list[list[int]]
    source: str  # the trace file, or "synthetic"


def sharegpt_prompts(tokenizer, num: int, max_len: int, path: Path | None = None, seed: int = 0) -> PromptSet:
    """``num`` prompts whose lengths follow the ShareGPT trace (clipped to ``max_len``).

    Each prompt is the trace's own prompt text, tokenized by the model's tokenizer and cut
    (or repeated) to the trace's length. Without the trace file, lengths are drawn from a
    log-normal fitted to ShareGPT's (median 40, mean ~260) and the text is synthetic.
    """
    path = path or DEFAULT_SHAREGPT
    rng = random.Random(seed)
    if path.is_file():
        entries = json.loads(path.read_text())["entries"][:num]
        texts = [e["prompt"] for e in entries]
        lengths = [min(int(e["prompt_length"]), max_len) for e in entries]
        source = str(path)
    else:
        lengths = [min(max(4, int(rng.lognormvariate(3.9, 1.4))), max_len) for _ in range(num)]
        texts = [f"Request {i}: explain the scheduler and its batches." for i in range(num)]
        source = "synthetic"
    while len(lengths) < num:  # a short trace: reuse it from the start
        lengths.append(lengths[len(lengths) % max(1, len(texts))])
        texts.append(texts[len(texts) % max(1, len(texts))])
    prompts = []
    for text, length in zip(texts, lengths):
        ids = tokenizer(text, truncation=True, max_length=max(length, 2))["input_ids"]
        ids = ids or [tokenizer.bos_token_id or 0]
        body = ids[1:] or ids
        while len(ids) < length:
            ids = ids + body
        prompts.append(ids[:max(1, length)])
    return PromptSet(prompts, source)
