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
        entries = load_sharegpt(path)[:num]
        texts = [text for text, _, _ in entries]
        lengths = [min(p, max_len) for _, p, _ in entries]
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
        prompts.append(fit_length(ids or [tokenizer.bos_token_id or 0], length))
    return PromptSet(prompts, source)


def fit_length(ids: list[int], length: int) -> list[int]:
    """``ids`` cut or repeated (its body after the first token) to exactly ``length`` tokens (>= 1)."""
    if not ids:
        raise ValueError("fit_length: no tokens to fit")
    length = max(1, length)
    body = ids[1:] or ids
    out = list(ids)
    while len(out) < length:
        out.extend(body)
    return out[:length]


def load_sharegpt(path: Path) -> list[tuple[str, int, int]]:
    """``(prompt text, prompt_length, response_length)`` per entry of a ShareGPT-format trace file."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    entries = raw.get("entries") if isinstance(raw, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected {{\"entries\": [...]}} with at least one entry")
    out = []
    for i, e in enumerate(entries):
        try:
            text, p, r = e["prompt"], int(e["prompt_length"]), int(e["response_length"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: entries[{i}] needs prompt, prompt_length and response_length ({err})") from err
        if not isinstance(text, str) or p < 1 or r < 1:
            raise ValueError(f"{path}: entries[{i}] has an empty prompt or a length below 1")
        out.append((text, p, r))
    return out

