"""Guided decoding: which tokens may come next so that the output stays a prefix of JSON matching a
schema (or of a text matching a regular expression or a grammar), and an engine-wide registry of guides and
per-request cursors.

A ``Guide`` is one compiled schema (or pattern) over one vocabulary. Its allowed-token mask for a machine state is
a walk of the vocabulary trie that stops at the first byte the machine refuses; states recur (inside
a string, after every comma of an array), so byte steps and masks are cached. End-of-sequence is
allowed exactly where the text is a whole value, and then alone.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from coserve.guided.grammar import compile_grammar
from coserve.guided.machine import JsonMachine, State, initial_state
from coserve.guided.regex import compile_regex
from coserve.guided.schema import compile_choices, compile_schema
from coserve.guided.trie_walk import FlatTrie, StateTable, walk
from coserve.guided.vocab import build_trie

MASK_CACHE_BYTES = 64 << 20  # per guide: masks kept for recurring states
STEP_CACHE_ENTRIES = 200_000  # per guide: (state, byte) -> state


class Vocabulary:
    """The token bytes of one model's vocabulary, its trie and end-of-sequence ids, on one device.

    Tokens are also split for the inside of a JSON string: *plain* ones (whole UTF-8 characters, none of them a
    quote, a backslash or a control character) keep a string going whatever it holds, so a string state allows
    all of them up to its length limit without a walk (``plain_ids``, by character count); the rest (``trie``
    of them: ``other_trie``) are walked byte by byte.
    """

    def __init__(self, vocab: list[bytes | None], eos_ids: frozenset[int], device: torch.device) -> None:
        self.vocab = vocab
        self.size = len(vocab)
        self.eos_ids = sorted(i for i in eos_ids if 0 <= i < self.size)
        self.trie = build_trie(vocab)
        self.device = device
        plain = sorted((chars, i) for i, data in enumerate(vocab)
                       if data is not None and (chars := _plain_chars(data)) is not None)
        self.plain_ids = [i for _, i in plain]
        self.plain_chars = [c for c, _ in plain]
        plain_set = set(self.plain_ids)
        # as flat arrays, walked a level at a time (coserve/guided/trie_walk.py)
        self.flat_trie = FlatTrie(self.trie)
        self.flat_other_trie = FlatTrie(build_trie([None if i in plain_set else data for i, data in enumerate(vocab)]))


def _plain_chars(data: bytes) -> int | None:
    """How many characters ``data`` holds if it is plain JSON string content (see ``Vocabulary``), else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(c in '"\\' or c < " " for c in text):
        return None
    return len(text)


class Guide:
    """One schema's (or pattern's) token masks over one vocabulary."""

    def __init__(self, schema: Any, vocab: Vocabulary, choices: list[str] | None = None,
                 regex: str | None = None, grammar: str | None = None) -> None:
        """``schema``: a JSON schema; or, with ``choices`` (vLLM's guided_choice), the output is one of them; or,
        with ``regex`` (vLLM's guided_regex) or ``grammar`` (guided_grammar, GBNF or Lark), the whole output matches it."""
        if regex is not None or grammar is not None:
            self.machine = compile_regex(regex) if regex is not None else compile_grammar(grammar)
            self.start = self.machine.start
        else:
            compiled = compile_choices(choices) if choices is not None else compile_schema(schema)
            self.machine = JsonMachine(compiled.nodes)
            self.start = initial_state(compiled.root)
        self.vocab = vocab
        self._steps: dict[tuple[State, int], State] = {}
        self._masks: OrderedDict[State, torch.Tensor] = OrderedDict()
        self._max_masks = max(16, MASK_CACHE_BYTES // max(1, vocab.size))
        self._table = StateTable(self.machine.step)  # the byte steps of the masks' walks

    def step(self, state: State, b: int) -> State:
        key = (state, b)
        nxt = self._steps.get(key)
        if nxt is None:
            if len(self._steps) >= STEP_CACHE_ENTRIES:
                self._steps.clear()
            nxt = self._steps[key] = self.machine.step(state, b)
        return nxt

    def advance(self, state: State, token_id: int) -> State:
        """The state after ``token_id`` (end-of-sequence leaves it as it is; a token with no text, or one
        the state does not allow, empties it)."""
        if token_id in self.vocab.eos_ids:
            return state
        data = self.vocab.vocab[token_id] if 0 <= token_id < self.vocab.size else None
        if data is None:
            return ()  # a dead state (every machine's dead state is empty)
        for b in data:
            state = self.step(state, b)
            if not state:
                break
        return state

    def allowed(self, state: State) -> torch.Tensor:
        """Bool ``[V]`` on the vocabulary's device: the tokens that may follow ``state``."""
        mask = self._masks.get(state)
        if mask is not None:
            self._masks.move_to_end(state)
            return mask
        ids = self.allowed_ids(state)
        # No token at all (a vocabulary without end-of-sequence, in a state no token fits): unguided.
        mask = torch.zeros(self.vocab.size, dtype=torch.bool) if ids else torch.ones(self.vocab.size, dtype=torch.bool)
        if ids:
            mask[torch.tensor(ids, dtype=torch.long)] = True
        mask = mask.to(self.vocab.device)
        self._masks[state] = mask
        if len(self._masks) > self._max_masks:
            self._masks.popitem(last=False)
        return mask

    def allowed_ids(self, state: State) -> list[int]:
        """The token ids that may follow ``state``: text tokens the machine takes whole, and end-of-sequence
        where the text is complete (or, should no token fit, so that the request can end)."""
        ids: list[int] = []
        trie = self.vocab.flat_trie
        room = self.machine.string_room(state)
        if room is not None:  # inside strings: every plain token that fits, then a walk of the others only
            count = len(self.vocab.plain_ids) if room < 0 else bisect.bisect_right(self.vocab.plain_chars, room)
            ids.extend(self.vocab.plain_ids[:count])
            trie = self.vocab.flat_other_trie
        if state:
            ids.extend(walk(trie, self._table, state).tolist())
        if not ids or self.machine.accepting(state):
            ids.extend(self.vocab.eos_ids)
        return ids


@dataclass(slots=True)
class Cursor:
    guide: Guide
    state: State
    consumed: int  # output tokens fed so far


class GuidedDecoding:
    """The engine's guides (one per distinct schema) and each guided request's position in its guide."""

    def __init__(self, vocab_factory, eos_ids: frozenset[int], device: torch.device, max_guides: int = 64) -> None:
        self._vocab_factory = vocab_factory  # () -> list[bytes | None], called once, on first use
        self._eos_ids = eos_ids
        self._device = device
        self._vocab: Vocabulary | None = None
        self._guides: OrderedDict[str, Guide] = OrderedDict()
        self._max_guides = max_guides
        self._cursors: dict[str, Cursor] = {}

    def guide(self, schema: Any, choices: list[str] | None = None, regex: str | None = None,
              grammar: str | None = None) -> Guide:
        key = json.dumps([schema, choices, regex, grammar], sort_keys=True)
        guide = self._guides.get(key)
        if guide is None:
            if self._vocab is None:
                self._vocab = Vocabulary(self._vocab_factory(), self._eos_ids, self._device)
            guide = self._guides[key] = Guide(schema, self._vocab, choices, regex, grammar)
            if len(self._guides) > self._max_guides:
                self._guides.popitem(last=False)
        self._guides.move_to_end(key)
        return guide

    def mask(self, request_id: str, schema: Any, output_ids: list[int], choices: list[str] | None = None,
             regex: str | None = None, grammar: str | None = None) -> torch.Tensor:
        """The tokens request ``request_id`` may sample next, its outputs so far being ``output_ids``."""
        cursor = self._cursors.get(request_id)
        if cursor is None or cursor.consumed > len(output_ids):
            guide = self.guide(schema, choices, regex, grammar)
            cursor = self._cursors[request_id] = Cursor(guide, guide.start, 0)
        for token in output_ids[cursor.consumed:]:
            cursor.state = cursor.guide.advance(cursor.state, token)
        cursor.consumed = len(output_ids)
        return cursor.guide.allowed(cursor.state)

    def release(self, request_id: str) -> None:
        self._cursors.pop(request_id, None)

    def release_all(self) -> None:
        """Forget every request's position (the engine starting over)."""
        self._cursors.clear()
