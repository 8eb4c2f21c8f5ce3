"""Random walks through a guide's allowed tokens: the soundness check every guided-decoding test file uses."""

from __future__ import annotations


def ended_walks(guide, vocab, rng, walks: int, steps: int, end_chance: float, lean: bytes = b"",
                lean_chance: float = 0.0) -> list[bytes]:
    """The texts of the walks (of at most ``steps`` tokens each) that reached end-of-sequence. Each step takes
    end-of-sequence with ``end_chance`` where the guide allows it (1: always, without a draw), else a token drawn
    uniformly among the allowed ones, or, with ``lean_chance``, among those holding a byte of ``lean`` (the bytes
    that move a walk on). A state with no allowed token fails the check."""
    ended = []
    lean_ids = {i for i, data in enumerate(vocab.vocab) if data and any(c in data for c in lean)}  # once, not per step
    for _ in range(walks):
        state, data = guide.start, b""
        for _ in range(steps):
            allowed = guide.allowed_ids(state)
            assert allowed, f"no token may follow {data!r}"
            eos = [i for i in allowed if i in vocab.eos_ids]
            if eos and (end_chance >= 1 or rng.random() < end_chance):
                token = eos[0]
            else:
                leaning = [i for i in allowed if i in lean_ids]
                token = rng.choice(leaning if leaning and lean_chance and rng.random() < lean_chance else allowed)
            if token in vocab.eos_ids:  # drawn or taken: the walk ends
                ended.append(data)
                break
            state, data = guide.advance(state, token), data + vocab.vocab[token]
    return ended


def llama_vocab(model_factory):
    """The tiny Llama model's vocabulary as guided decoding sees it (end-of-sequence its only stop)."""
    import torch

    from coserve.guided.guide import Vocabulary
    from coserve.guided.vocab import token_bytes
    from coserve.model.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(model_factory("llama"))
    return Vocabulary(token_bytes(tokenizer, len(tokenizer)), frozenset({tokenizer.eos_token_id}), torch.device("cpu"))


def assert_grammar_refused(grammar: str, message: str) -> None:
    """The grammar is a ``GrammarError`` matching ``message``, and a 'guided_grammar: ' error where a request
    gives it."""
    import pytest

    from coserve import SamplingParams
    from coserve.guided.grammar import GrammarError, compile_grammar
    with pytest.raises(GrammarError, match=message):
        compile_grammar(grammar)
    with pytest.raises(ValueError, match="guided_grammar: "):
        SamplingParams(guided_grammar=grammar)
