"""Random walks through a guide's allowed tokens: the soundness check every guided-decoding test file uses."""

from __future__ import annotations


def ended_walks(guide, vocab, rng, walks: int, steps: int, end_chance: float, lean: bytes = b"",
                lean_chance: float = 0.0) -> list[bytes]:
    """The texts of the walks (of at most ``steps`` tokens each) that reached end-of-sequence. Each step takes
    end-of-sequence with ``end_chance`` where the guide allows it (1: always, without a draw), else a token drawn
    uniformly among the allowed ones, or, with ``lean_chance``, among those holding a byte of ``lean`` (the bytes
    that move a walk on). A state with no allowed token fails the check."""
    ended = []
    for _ in range(walks):
        state, data = guide.start, b""
        for _ in range(steps):
            allowed = guide.allowed_ids(state)
            assert allowed, f"no token may follow {data!r}"
            eos = [i for i in allowed if i in vocab.eos_ids]
            if eos and (end_chance >= 1 or rng.random() < end_chance):
                token = eos[0]
            else:
                leaning = [i for i in allowed if vocab.vocab[i] and any(c in vocab.vocab[i] for c in lean)]
                token = rng.choice(leaning if leaning and lean_chance and rng.random() < lean_chance else allowed)
            if token in vocab.eos_ids:  # drawn or taken: the walk ends
                ended.append(data)
                break
            state, data = guide.advance(state, token), data + vocab.vocab[token]
    return ended
