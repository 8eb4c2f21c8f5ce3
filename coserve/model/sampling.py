"""Token sampling from float32 logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coserve.model.logit_adjust import LogitAdjustments, adjust_logits


@dataclass(slots=True)
class SamplingRow:
    """How to sample one row of logits (plain numbers; no dependency on the scheduler)."""

    temperature: float  # 0 = greedy
    top_k: int  # -1 or 0 = off
    top_p: float  # 1.0 = off
    generator: torch.Generator | None  # the request's own RNG when it has a seed
    adjust: LogitAdjustments | None = None  # penalties and biases, if the request has any
    allowed: torch.Tensor | None = None  # bool [V]: the only tokens it may sample (guided decoding), or None
    min_p: float = 0.0  # 0 = off


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           default_generator: torch.Generator | None = None) -> list[int]:
    """One token per row of ``logits`` ``[N, V]``; greedy rows in one argmax, the rest row by row. ``logits`` is
    left as it was (penalised and guided rows are copies)."""
    if any(row.adjust is not None or row.allowed is not None for row in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if row.adjust is not None:
                logits[i] = adjust_logits(logits[i], row.adjust)
            if row.allowed is not None:
                logits[i].masked_fill_(~row.allowed, float("-inf"))
    tokens = logits.argmax(dim=-1).tolist()
    for i, row in enumerate(rows):
        if row.temperature == 0 or row.top_k == 1:
            continue
        probs = _filtered_probs(logits[i], row)
        generator = row.generator if row.generator is not None else default_generator
        tokens[i] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens


def _filtered_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Probabilities ``[V]`` after temperature, min-p (vLLM's order), top-k and top-p."""
    scaled = logits / row.temperature
    if row.min_p > 0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < row.min_p * probs.max(), float("-inf"))
    if row.top_k > 0 and row.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, row.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if row.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= row.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled.softmax(-1)


def top_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]
                 ) -> list[tuple[float, dict[int, float]]]:
    """The sampled tokens' log-probabilities under the raw logits, and each row's top-N."""
    logp = logits.log_softmax(-1)  # [N, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    out = []
    for i, n in enumerate(num_top):
        top: dict[int, float] = {}
        if n > 0:
            values, ids = logp[i].topk(n)
            top = dict(zip(ids.tolist(), values.tolist()))
        out.append((chosen[i], top))
    return out
