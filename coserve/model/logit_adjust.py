"""Penalties and biases applied to a row of logits before sampling (OpenAI's and vLLM's request options).

In this order: ``logit_bias`` added; ``repetition_penalty`` (HF's and vLLM's: the logit of every token in the
prompt or the output so far divided by it where positive, multiplied where negative); then OpenAI's
``frequency_penalty`` times how often a token has been generated and ``presence_penalty`` once if it has,
subtracted; then vLLM's masks: tokens outside ``allowed_token_ids``, the tokens that would complete one of
the ``bad_words``, and until ``min_tokens`` are out the end-of-sequence and stop tokens, set to -inf.
Temperature, min-p, top-k and top-p come after. Reported logprobs stay those of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# The largest logit an adjustment leaves: still above any model's, and finite after the smallest temperature
# (``MIN_TEMPERATURE``, 0.01) divides it.
MAX_LOGIT = 1e30


@dataclass(slots=True)
class LogitAdjustments:
    """One request's adjustments (plain numbers and token ids)."""

    output_ids: list[int]  # tokens generated so far
    prompt_ids: list[int]  # the prompt (the repetition penalty reads it too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    banned: list[int] = field(default_factory=list)  # tokens it may not sample now (min_tokens: end-of-sequence)
    allowed: list[int] | None = None  # the only tokens it may sample (allowed_token_ids), or None


def bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word as the tokenizer splits it at the start of a text, and
    again after a space where that splits it into as many tokens, the first of them another (a word inside a text
    is usually such a spaced token)."""
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences


def bad_word_bans(sequences: list[list[int]], output_ids: list[int]) -> list[int]:
    """The tokens ``sequences`` ban next: each one's last token where the output so far ends with the rest of it
    (a one-token word always), as HF's ``NoBadWordsLogitsProcessor`` over the output does."""
    banned = []
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(output_ids) >= head and output_ids[len(output_ids) - head:] == seq[:-1]):
            banned.append(seq[-1])
    return banned


def adjust_logits(logits: torch.Tensor, adj: LogitAdjustments) -> torch.Tensor:
    """A copy of one row of logits ``[V]`` with ``adj`` applied."""
    out = logits.clone()
    device = out.device
    if adj.logit_bias:
        ids = torch.tensor(list(adj.logit_bias), dtype=torch.long, device=device)
        out.index_add_(0, ids, torch.tensor(list(adj.logit_bias.values()), dtype=out.dtype, device=device))
    if adj.repetition_penalty != 1.0:
        seen = torch.tensor(adj.prompt_ids + adj.output_ids, dtype=torch.long, device=device).unique()
        values = out[seen]
        out[seen] = torch.where(values > 0, values / adj.repetition_penalty, values * adj.repetition_penalty)
        out.clamp_(max=MAX_LOGIT)  # a penalty near zero divides a logit to +inf: NaN probabilities after softmax
    if (adj.presence_penalty or adj.frequency_penalty) and adj.output_ids:
        counts = torch.bincount(torch.tensor(adj.output_ids, dtype=torch.long, device=device),
                                minlength=out.shape[0]).to(out.dtype)
        out -= adj.frequency_penalty * counts + adj.presence_penalty * (counts > 0).to(out.dtype)
    if adj.allowed is not None:
        keep = torch.zeros_like(out, dtype=torch.bool)
        keep[torch.tensor(adj.allowed, dtype=torch.long, device=device)] = True
        out.masked_fill_(~keep, float("-inf"))
    if adj.banned:
        out[torch.tensor(adj.banned, dtype=torch.long, device=device)] = float("-inf")
    return out
