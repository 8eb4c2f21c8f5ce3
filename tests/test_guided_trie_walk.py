"""The level-at-a-time trie walk (``coserve/guided/trie_walk.py``) against the plain node-by-node walk, on the
states of random guided walks of JSON, pattern, format and grammar guides (``Guide.allowed_ids``, which walks this
way, is checked against every token one by one in tests/test_guided_json.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from coserve.guided.guide import Guide
from coserve.guided.trie_walk import DEAD, FlatTrie, StateTable, walk
from coserve.guided.vocab import TrieNode, build_trie
from guided_helpers import llama_vocab


@pytest.fixture(scope="module")
def vocab(model_factory):
    return llama_vocab(model_factory)


def _node_walk(guide: Guide, node: TrieNode, state) -> list[int]:
    """The oracle: every edge stepped by the machine, depth first (``Guide.step``: its steps memoized)."""
    ids, pending = [], [(node, state)]
    while pending:
        at, st = pending.pop()
        for b, child in at.children.items():
            nxt = guide.step(st, b)
            if nxt:
                ids.extend(child.ids)
                pending.append((child, nxt))
    return ids


GUIDES = {
    "array": dict(schema={"type": "array", "items": {"anyOf": [{"type": "number"}, {"enum": ["ab", True]}]},
                          "maxItems": 4}),
    "email": dict(schema={"type": "string", "format": "email"}),
    "pattern": dict(schema={"type": "string", "pattern": r"^[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?$"}),
    "regex": dict(schema=None, regex=r"(\d{3}-){2}\d{4}|[a-zé]+@[a-z]+\.(com|org)"),
    "grammar": dict(schema=None, grammar='root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+ | "\\"" [a-z]* "\\""'),
}


@pytest.mark.parametrize("name", list(GUIDES))
def test_the_flat_walk_allows_exactly_what_the_node_walk_does(vocab, name):
    guide = Guide(vocab=vocab, **GUIDES[name])
    flat, table = FlatTrie(vocab.trie), StateTable(guide.machine.step)
    rng = random.Random(name)
    checked = 0
    for _ in range(2):
        state = guide.start
        for _ in range(20):
            expected = sorted(_node_walk(guide, vocab.trie, state))
            got = walk(flat, table, state)
            assert got.dtype == np.int64 and sorted(got.tolist()) == expected
            checked += 1
            if not expected:
                break
            state = guide.advance(state, rng.choice(expected))
    assert checked >= 10


def test_a_dead_state_allows_nothing_and_a_small_trie_is_walked_by_level():
    trie = build_trie([b"ab", b"a", None, b"b", b"abc", b"ab"])  # ids 0 and 5 share a spelling
    flat = FlatTrie(trie)
    assert flat.num_nodes == 5 and flat.edge_count.tolist() == [2, 1, 0, 1, 0]  # root; a, b; ab; abc
    # a machine that takes the prefixes of "ab": a state is ("s", bytes so far...)
    table = StateTable(lambda state, b: (*state, b) if (*state[1:], b) in {(97,), (97, 98)} else ())
    assert table.intern(()) == DEAD and walk(flat, table, ()).size == 0
    assert sorted(walk(flat, table, ("s",)).tolist()) == [0, 1, 5]  # "a", "ab" twice; not "abc" nor "b"
    assert len(table) == 3  # ("s",), ("s", 97), ("s", 97, 98)
    table.max_states = 2  # over it: the next walk starts the table over, with the same result
    assert sorted(walk(flat, table, ("s",)).tolist()) == [0, 1, 5] and len(table) == 3
    assert table.table.shape == (64, 256)
