"""Draft tokens for speculative decoding by n-gram lookup in a request's own tokens (vLLM's ``ngram`` method,
"prompt lookup decoding"): no draft model, just the text repeating itself.

The last ``n`` tokens (longest ``n`` first) are looked for earlier in the prompt and output; the tokens that
followed their latest earlier occurrence are proposed. The engine verifies the drafts in one forward pass and
keeps the ones the model itself would have produced (greedy), so outputs do not change; only how many
iterations they take.
"""

from __future__ import annotations

MAX_NGRAM, MIN_NGRAM = 4, 1


def propose_drafts(tokens: list[int], max_drafts: int) -> list[int]:
    """Up to ``max_drafts`` tokens that followed the latest earlier occurrence of ``tokens``' last n-gram."""
    if max_drafts <= 0:
        return []
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        tail, last = tokens[-n:], tokens[-1]
        for start in range(len(tokens) - n - 1, -1, -1):  # the latest occurrence before the tail itself
            if tokens[start + n - 1] == last and tokens[start:start + n] == tail:
                return tokens[start + n:start + n + max_drafts]
    return []
