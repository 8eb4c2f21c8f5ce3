"""What a guided state's first mask costs: the level-at-a-time trie walk (``coserve/guided/trie_walk.py``) against
the node-by-node walk coserve used before it (kept here as the baseline), on the very same states.

    python benchmarks/guided_masks.py --model DIR [--extra-tokens N] [--walks 8] [--peer xgrammar] [--out FILE]

For each mode of ``benchmarks/guided_decoding.py`` (and an email-format string), random guided walks collect the
states a request passes through; a fresh guide then builds each state's allowed tokens once with each walk, so every
mask is a first one, as for a schema's first requests (each walk timed twice, alternated; the second kept).
``--extra-tokens N`` adds N tokens (two of the model's ASCII tokens joined) to the vocabulary, to see how each walk
scales towards the 32k-150k vocabularies of real models.

``--peer xgrammar`` (``pip install xgrammar``; vLLM's default guided-decoding backend) also times, in the same
process, what a request's masks cost each system from a fresh compile: random walks of ``--walks`` requests of up
to ``--steps`` tokens, each system through its own states (xgrammar's JSON allows whitespace that coserve's does not,
so the walks differ), the mean time of a token's mask (coserve's ``Guide.allowed``, the boolean mask the engine
applies; xgrammar's ``fill_next_token_bitmask``, the bitmask vLLM applies) and the compile time. Not with
``--extra-tokens`` (xgrammar reads the model's own tokenizer).
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from coserve.guided.guide import Guide, Vocabulary
from coserve.guided.vocab import build_trie, token_bytes
from coserve.model.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from guided_decoding import GRAMMARS, REGEXES, SCHEMAS  # noqa: E402


def node_walk_ids(guide: Guide, vocab: Vocabulary, other_trie, state) -> list[int]:
    """The baseline: ``Guide.allowed_ids`` as it was, the trie walked node by node (steps memoized by the guide)."""
    ids: list[int] = []
    trie = vocab.trie
    room = guide.machine.string_room(state)
    if room is not None:
        count = len(vocab.plain_ids) if room < 0 else bisect.bisect_right(vocab.plain_chars, room)
        ids.extend(vocab.plain_ids[:count])
        trie = other_trie
    pending = [(trie, state)] if state else []
    while pending:
        node, st = pending.pop()
        for b, child in node.children.items():
            nxt = guide.step(st, b)
            if nxt:
                ids.extend(child.ids)
                if child.children:
                    pending.append((child, nxt))
    if not ids or guide.machine.accepting(state):
        ids.extend(vocab.eos_ids)
    return ids


def walk_states(guide: Guide, vocab: Vocabulary, walks: int, steps: int, seed: int) -> list:
    """The distinct states of random guided walks, in the order they were first met."""
    rng, states = random.Random(seed), []
    for _ in range(walks):
        state = guide.start
        for _ in range(steps):
            states.append(state)
            token = rng.choice(guide.allowed_ids(state))
            if token in vocab.eos_ids:
                break
            state = guide.advance(state, token)
    return list(dict.fromkeys(states))


def coserve_walks(vocab: Vocabulary, spec: dict, walks: int, steps: int) -> dict:
    """A fresh guide's compile time, and its mean mask time per token over random guided walks."""
    from coserve.guided import grammar, regex
    grammar._compiled.cache_clear()  # compiled machines are kept per pattern and grammar: timed fresh here
    regex._compiled.cache_clear()
    start = time.perf_counter()
    guide = Guide(vocab=vocab, **spec)
    compile_s = time.perf_counter() - start
    rng, spent, masks = random.Random(0), 0.0, 0
    for _ in range(walks):
        state = guide.start
        for _ in range(steps):
            start = time.perf_counter()
            mask = guide.allowed(state)
            spent += time.perf_counter() - start
            masks += 1
            token = rng.choice(mask.nonzero().flatten().tolist())
            if token in vocab.eos_ids:
                break
            state = guide.advance(state, token)
    return {"compile_ms": compile_s * 1000, "mask_ms": spent / masks * 1000, "masks": masks}


def xgrammar_walks(compiler, spec: dict, vocab_size: int, walks: int, steps: int) -> dict:
    """The same for xgrammar: a fresh compile, then ``fill_next_token_bitmask`` at each token of random walks."""
    import xgrammar as xgr
    start = time.perf_counter()
    if spec.get("regex") is not None:
        compiled = compiler.compile_regex(spec["regex"])
    elif spec.get("grammar") is not None:
        compiled = compiler.compile_grammar(spec["grammar"])
    elif spec["schema"] == {"type": "object"}:
        compiled = compiler.compile_builtin_json_grammar()  # JSON mode, as vLLM compiles json_object
    else:
        compiled = compiler.compile_json_schema(json.dumps(spec["schema"]))
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    rng, spent, masks = random.Random(0), 0.0, 0
    for _ in range(walks):
        matcher = xgr.GrammarMatcher(compiled)
        for _ in range(steps):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            spent += time.perf_counter() - start
            masks += 1
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
            allowed = np.flatnonzero(bits).tolist()
            token = rng.choice(allowed)
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token} it allowed")
            if matcher.is_terminated():
                break
    return {"compile_ms": compile_s * 1000, "mask_ms": spent / masks * 1000, "masks": masks}


def peer_rows(model: str, vocab: Vocabulary, modes: dict, walks: int, steps: int) -> list[dict]:
    try:
        import xgrammar as xgr
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SystemExit(f"--peer xgrammar: {e} (pip install xgrammar)")
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model), vocab_size=vocab.size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    rows = []
    for name, spec in modes.items():
        ours = coserve_walks(vocab, spec, walks, steps)
        try:
            theirs = xgrammar_walks(compiler, spec, vocab.size, walks, steps)
        except Exception as e:  # a mode xgrammar does not take (Lark's syntax): reported, not fatal
            theirs = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
        rows.append({"mode": name, "coserve": ours, "xgrammar": theirs})
        peer = ("xgrammar: " + theirs["error"] if "error" in theirs else
                f"xgrammar compile {theirs['compile_ms']:7.1f} ms, mask {theirs['mask_ms']:6.3f} ms/token "
                f"({theirs['masks']} masks); coserve/xgrammar {ours['mask_ms'] / theirs['mask_ms']:5.1f}x")
        print(f"{name:12s} coserve compile {ours['compile_ms']:6.1f} ms, mask {ours['mask_ms']:6.3f} ms/token "
              f"({ours['masks']} masks)   {peer}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--extra-tokens", type=int, default=0)
    p.add_argument("--walks", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--peer", choices=["xgrammar"])
    p.add_argument("--out")
    args = p.parse_args()
    if args.peer and args.extra_tokens:
        raise SystemExit("--peer xgrammar: not with --extra-tokens (xgrammar reads the model's own tokenizer)")
    tokenizer = load_tokenizer(Path(args.model))
    tokens = token_bytes(tokenizer, len(tokenizer))
    rng = random.Random(5)
    ascii_tokens = [t for t in tokens if t and t.isascii()]
    tokens = tokens + [rng.choice(ascii_tokens) + rng.choice(ascii_tokens) for _ in range(args.extra_tokens)]
    vocab = Vocabulary(tokens, frozenset({tokenizer.eos_token_id}), torch.device("cpu"))
    plain = set(vocab.plain_ids)
    other_trie = build_trie([None if i in plain else data for i, data in enumerate(vocab.vocab)])
    modes = {**{k: {"schema": s} for k, s in SCHEMAS.items()},
             "email": {"schema": {"type": "string", "format": "email"}},
             **{k: {"schema": None, "regex": r} for k, r in REGEXES.items()},
             **{k: {"schema": None, "grammar": g} for k, g in GRAMMARS.items()}}
    rows = []
    print(f"vocabulary: {vocab.size} tokens")
    for name, spec in modes.items():
        # the walks also warm what compiled machines keep between guides (regex and grammar compilation caches)
        states = walk_states(Guide(vocab=vocab, **spec), vocab, args.walks, args.steps, seed=0)
        ms = {}
        for how in ("flat_walk", "node_walk") * 2:  # each twice, alternated: the second of each is kept
            guide = Guide(vocab=vocab, **spec)  # nothing cached: every mask a first one
            start = time.perf_counter()
            for state in states:
                got = node_walk_ids(guide, vocab, other_trie, state) if how == "node_walk" else guide.allowed_ids(state)
                assert got, name
            ms[how] = (time.perf_counter() - start) / len(states) * 1000
        check = Guide(vocab=vocab, **spec)
        same = all(sorted(node_walk_ids(check, vocab, other_trie, s)) == sorted(check.allowed_ids(s)) for s in states)
        rows.append({"mode": name, "states": len(states), "node_walk_ms": ms["node_walk"],
                     "flat_walk_ms": ms["flat_walk"], "speedup": ms["node_walk"] / ms["flat_walk"],
                     "same_masks": same})
        print(f"{name:12s} {len(states):4d} states  node walk {ms['node_walk']:7.2f} ms/state  flat walk "
              f"{ms['flat_walk']:7.2f} ms/state  {ms['node_walk'] / ms['flat_walk']:4.1f}x  same masks: {same}",
              flush=True)
    peers = None
    if args.peer:
        print(f"each system's own random walks ({args.walks} of up to {args.steps} tokens), from a fresh compile:")
        peers = peer_rows(args.model, vocab, modes, args.walks, args.steps)
    if args.out:
        Path(args.out).write_text(json.dumps({"vocab_size": vocab.size, "model": args.model, "rows": rows,
                                              "peer": peers}, indent=1))


if __name__ == "__main__":
    main()
