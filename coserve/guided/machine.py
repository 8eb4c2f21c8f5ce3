"""A byte-level pushdown machine for JSON that matches a compiled schema (``schema.py``).

A *stack* is a tuple of frames (tuples), the root frame first; a *state* is a frozenset of stacks
(``anyOf``, enums with shared prefixes and keys that may be declared or extra make the machine
nondeterministic). ``step(state, byte)`` is the state after one more byte (empty: the byte is not
allowed); ``accepting(state)`` says whether the text so far is a whole value. Everything is hashable,
so states cache (``Guide``) and repeat across positions.

The text it accepts is JSON as ``json.dumps`` writes it: no whitespace except one optional space after
``,`` and ``:`` (unbounded whitespace would let a model pad forever), numbers of at most
``MAX_INT_DIGITS`` integer, ``MAX_FRAC_DIGITS`` fraction and ``MAX_EXP_DIGITS`` exponent digits, and
strings of valid UTF-8 with JSON's escapes.
"""

from __future__ import annotations

from coserve.guided.regex import RegexMachine, compile_regex
from coserve.guided.schema import ANY_ARRAY, ANY_OBJECT, ANY_STRING, Node

MAX_INT_DIGITS, MAX_FRAC_DIGITS, MAX_EXP_DIGITS = 20, 24, 3  # room for any float's repr
QUOTE, BACKSLASH, COMMA, COLON, SPACE, MINUS, DOT = b'"\\,: -.'
LBRACE, RBRACE, LBRACK, RBRACK = b"{}[]"
HEX = frozenset(b"0123456789abcdefABCDEF")
SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
ESCAPED = {ord(k): ord(v) for k, v in zip('"\\/bfnrt', '"\\/\b\f\n\r\t')}  # what a simple escape stands for
ANY_LITERALS = (b"true", b"false", b"null")

# Frames. R: (R, node, done). V: (V, node, space_ok), a value not yet begun. O: (O, node, phase, seen keys, key).
# A: (A, node, phase, count). S: (S, node, escape, utf8 bytes owed, length, collected key bytes or None, pattern
# state or None, the \\u escape's value so far).
# N: (N, integer only, phase, digits in this part). L: (L, candidate texts, bytes matched).
# P: (P, node, pattern state), a number whose text a pattern bounds (minimum / maximum).
R, V, O, A, S, N, L, P = "RVOASNLP"
O_OPEN, O_COMMA, O_KEY, O_INKEY, O_COLON, O_VALUE, O_AFTER = range(7)
A_OPEN, A_VALUE, A_AFTER = range(3)
N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_E, N_ESIGN, N_EXP = range(8)
N_COMPLETE = frozenset({N_ZERO, N_INT, N_FRAC, N_EXP})

Stack = tuple
State = frozenset


def initial_state(root: int) -> State:
    return frozenset({((R, root, False), (V, root, False))})


class JsonMachine:
    """The transition function over one compiled node table."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.patterns: dict[int, RegexMachine] = {i: compile_regex(n.pattern) for i, n in enumerate(nodes)
                                                  if n.pattern is not None}

    def step(self, state: State, b: int) -> State:
        out: set[Stack] = set()
        for stack in state:
            out.update(self.feed(stack, b))
        return frozenset(out)

    def accepting(self, state: State) -> bool:
        return any(self._accepts(s) for s in state)

    def string_room(self, state: State) -> int | None:
        """Where every stack is inside a string, between characters: how many more characters the roomiest may
        take (-1: no limit); else None."""
        room = None
        for stack in state:
            top = stack[-1]
            if top[0] != S or top[2] or top[3] or top[6] is not None:  # not a string, in an escape or a
                return None  # UTF-8 character, or a string whose content a pattern constrains
            node = self.nodes[top[1]]
            left = -1 if node.max_length is None else node.max_length - top[4]
            room = left if room is None or left < 0 or (room >= 0 and left > room) else room
        return room

    # ---- one stack, one byte -------------------------------------------------------------------------------
    def feed(self, stack: Stack, b: int) -> tuple[Stack, ...]:
        top, rest = stack[-1], stack[:-1]
        kind = top[0]
        if kind == V:
            return self._start(top[1], top[2], rest, b)
        if kind == S:
            return self._string(top, rest, b)
        if kind == N:
            return self._number(top, rest, b)
        if kind == P:
            return self._bounded_number(top, rest, b)
        if kind == L:
            return self._literal(top, rest, b)
        if kind == O:
            return self._object(top, rest, b)
        if kind == A:
            return self._array(top, rest, b)
        return ()  # the root's value is complete: nothing may follow

    def _start(self, nid: int, space_ok: bool, rest: Stack, b: int) -> tuple[Stack, ...]:
        """The first byte of a value of node ``nid``."""
        if b == SPACE and space_ok:
            return (rest + ((V, nid, False),),)
        node = self.nodes[nid]
        kind = node.kind
        if kind == "union":
            return tuple(s for o in node.options for s in self._start(o, False, rest, b))
        if kind == "any":
            if b == LBRACE:
                kind, nid = "object", ANY_OBJECT
            elif b == LBRACK:
                kind, nid = "array", ANY_ARRAY
            elif b == QUOTE:
                kind, nid = "string", ANY_STRING
            elif b == MINUS or 0x30 <= b <= 0x39:
                kind = "number"
            else:
                return self._literal((L, ANY_LITERALS, 0), rest, b)
        if kind == "object":
            return (rest + ((O, nid, O_OPEN, frozenset(), None),),) if b == LBRACE else ()
        if kind == "array":
            return (rest + ((A, nid, A_OPEN, 0),),) if b == LBRACK else ()
        if kind == "string":
            return (rest + (self._open_string(nid, None),),) if b == QUOTE else ()
        if kind in ("number", "integer") and node.pattern is not None:
            rx = self.patterns[nid].step(self.patterns[nid].start, b)
            return (rest + ((P, nid, rx),),) if rx and self.patterns[nid].chars_needed(rx) is not None else ()
        if kind in ("number", "integer"):
            if b == MINUS:
                return (rest + ((N, kind == "integer", N_MINUS, 0),),)
            if b == 0x30:
                return (rest + ((N, kind == "integer", N_ZERO, 1),),)
            if 0x31 <= b <= 0x39:
                return (rest + ((N, kind == "integer", N_INT, 1),),)
            return ()
        return self._literal((L, node.texts, 0), rest, b)  # literal

    def _complete(self, rest: Stack, text: bytes | None) -> tuple[Stack, ...]:
        """The stacks once the value on top of ``rest`` has ended (``text``: a literal's or a collected key's)."""
        parent, up = rest[-1], rest[:-1]
        kind = parent[0]
        if kind == R:
            return (up + ((R, parent[1], True),),)
        if kind == A:
            return (up + ((A, parent[1], A_AFTER, parent[3] + 1),),)
        _, nid, phase, seen, key = parent
        node = self.nodes[nid]
        if phase == O_INKEY:
            if text is not None and node.property_node(text) is not None:
                return () if text in seen else (up + ((O, nid, O_COLON, seen, text),),)
            return () if node.additional is None else (up + ((O, nid, O_COLON, seen, None),),)
        return (up + ((O, nid, O_AFTER, seen if key is None else seen | {key}, None),),)

    def _object(self, top: tuple, rest: Stack, b: int) -> tuple[Stack, ...]:
        _, nid, phase, seen, key = top
        node = self.nodes[nid]
        if phase in (O_OPEN, O_COMMA, O_KEY):
            if b == SPACE and phase == O_COMMA:
                return (rest + ((O, nid, O_KEY, seen, None),),)
            if b == QUOTE:
                return self._key(nid, node, seen, rest)
            if b == RBRACE and phase == O_OPEN and node.required <= seen:
                return self._complete(rest, None)
            return ()
        if phase == O_COLON:
            if b != COLON:
                return ()
            value = node.additional if key is None else node.property_node(key)
            return (rest + ((O, nid, O_VALUE, seen, key), (V, value, True)),)
        # O_AFTER
        if b == COMMA and (node.additional is not None or node.next_keys(seen)):
            return (rest + ((O, nid, O_COMMA, seen, None),),)
        if b == RBRACE and node.required <= seen:
            return self._complete(rest, None)
        return ()

    def _key(self, nid: int, node: Node, seen: frozenset, rest: Stack) -> tuple[Stack, ...]:
        """A key has opened (its quote consumed): declared keys matched as literals when no other key
        may appear, else any string (collected when it may be a declared one)."""
        inkey = (O, nid, O_INKEY, seen, None)
        if node.additional is None:
            remaining = node.next_keys(seen)
            return (rest + (inkey, (L, remaining, 1)),) if remaining else ()
        return (rest + (inkey, self._open_string(ANY_STRING, b"" if node.properties else None)),)

    def _array(self, top: tuple, rest: Stack, b: int) -> tuple[Stack, ...]:
        _, nid, phase, count = top
        node = self.nodes[nid]
        if phase == A_OPEN:
            if b == RBRACK and node.min_items == 0:
                return self._complete(rest, None)
            if node.max_items == 0:
                return ()
            return self._start(node.items, False, rest + ((A, nid, A_VALUE, 0),), b)
        if b == COMMA and (node.max_items is None or count < node.max_items):
            return (rest + ((A, nid, A_VALUE, count), (V, node.items, True)),)
        if b == RBRACK and count >= node.min_items:
            return self._complete(rest, None)
        return ()

    def _open_string(self, nid: int, collected: bytes | None) -> tuple:
        machine = self.patterns.get(nid)
        return (S, nid, 0, 0, 0, collected, None if machine is None else machine.start, 0)

    def _string(self, top: tuple, rest: Stack, b: int) -> tuple[Stack, ...]:
        _, nid, esc, owed, length, collected, rx, code = top
        node = self.nodes[nid]
        counted = node.max_length is not None or node.min_length > 0

        def then(esc2: int, owed2: int, new_char: bool, fed: bytes = b"", code2: int = 0) -> tuple[Stack, ...]:
            n = length + 1 if counted and new_char else length
            if node.max_length is not None and n > node.max_length:
                return ()
            rx2 = rx
            if rx is not None:  # the content's characters (escapes decoded), as UTF-8, through the pattern
                machine = self.patterns[nid]
                for c in fed:
                    rx2 = machine.step(rx2, c)
                if not rx2:
                    return ()
                # the fewest characters after this one (or after the one being read) to a match: there must be
                # some, and with a length limit they must fit in it
                if esc2 == 1:  # after a backslash: any character of the Basic Multilingual Plane may come
                    needed = machine.chars_after(rx2, 0, 0xFFFF)
                elif esc2:  # inside \\u: the digits so far narrow the code point
                    free_bits = 4 * (6 - esc2)
                    needed = machine.chars_after(rx2, code2 << free_bits, (code2 << free_bits) | ((1 << free_bits) - 1))
                else:
                    needed = machine.chars_needed(rx2)
                if needed is None or (node.max_length is not None and n + needed > node.max_length):
                    return ()
            key = None if collected is None else collected + bytes((b,))
            return (rest + ((S, nid, esc2, owed2, n, key, rx2, code2),),)

        raw = bytes((b,))
        if owed:
            return then(0, owed - 1, False, raw) if 0x80 <= b <= 0xBF else ()
        if esc == 1:
            if b in SIMPLE_ESCAPES:
                return then(0, 0, False, bytes((ESCAPED[b],)))
            return then(2, 0, False) if b == 0x75 else ()  # \u
        if esc:
            if b not in HEX:
                return ()
            if rx is None:
                return then(esc + 1 if esc < 5 else 0, 0, False)
            value = code * 16 + int(chr(b), 16)
            if esc < 5:
                return then(esc + 1, 0, False, code2=value)
            if 0xD800 <= value <= 0xDFFF:  # a surrogate pair's half: not decoded under a pattern
                return ()
            return then(0, 0, False, chr(value).encode())
        if b == QUOTE:
            if length < node.min_length or (rx is not None and not self.patterns[nid].accepting(rx)):
                return ()
            return self._complete(rest, None if collected is None else b'"' + collected + b'"')
        if b == BACKSLASH:
            return then(1, 0, True)
        if b < 0x20:
            return ()
        if b < 0x80:
            return then(0, 0, True, raw)
        if 0xC2 <= b <= 0xDF:
            return then(0, 1, True, raw)
        if 0xE0 <= b <= 0xEF:
            return then(0, 2, True, raw)
        if 0xF0 <= b <= 0xF4:
            return then(0, 3, True, raw)
        return ()

    def _bounded_number(self, top: tuple, rest: Stack, b: int) -> tuple[Stack, ...]:
        _, nid, rx = top
        machine = self.patterns[nid]
        out: list[Stack] = []
        rx2 = machine.step(rx, b)
        if rx2 and machine.chars_needed(rx2) is not None:
            out.append(rest + ((P, nid, rx2),))
        if machine.accepting(rx):  # the number may end here: the enclosing value reads the byte
            out.extend(s for done in self._complete(rest, None) for s in self.feed(done, b))
        return tuple(out)

    def _number(self, top: tuple, rest: Stack, b: int) -> tuple[Stack, ...]:
        _, integer, phase, digits = top
        digit = 0x30 <= b <= 0x39
        nxt = None
        if phase == N_MINUS and digit:
            nxt = (N_ZERO, 1) if b == 0x30 else (N_INT, 1)
        elif phase == N_INT and digit:
            nxt = (N_INT, digits + 1) if digits < MAX_INT_DIGITS else None
        elif phase in (N_ZERO, N_INT) and b == DOT and not integer:
            nxt = (N_DOT, 0)
        elif phase in (N_ZERO, N_INT, N_FRAC) and b in b"eE" and not integer:
            nxt = (N_E, 0)
        elif phase in (N_DOT, N_FRAC) and digit:
            nxt = (N_FRAC, digits + 1) if digits < MAX_FRAC_DIGITS else None
        elif phase == N_E and b in b"+-":
            nxt = (N_ESIGN, 0)
        elif phase in (N_E, N_ESIGN, N_EXP) and digit:
            nxt = (N_EXP, digits + 1) if digits < MAX_EXP_DIGITS else None
        if nxt is not None:
            return (rest + ((N, integer, *nxt),),)
        if phase in N_COMPLETE:  # the byte ends the number: the enclosing value reads it
            return tuple(s for done in self._complete(rest, None) for s in self.feed(done, b))
        return ()

    def _literal(self, top: tuple, rest: Stack, b: int) -> tuple[Stack, ...]:
        _, texts, pos = top
        out: list[Stack] = []
        going = tuple(t for t in texts if len(t) > pos and t[pos] == b)
        if len(going) == 1 and len(going[0]) == pos + 1:
            out.extend(self._complete(rest, going[0]))  # the only candidate, now whole
        elif going:
            out.append(rest + ((L, going, pos + 1),))
        for t in texts:  # a shorter candidate already whole (enum [1, 12]): the byte may follow it
            if len(t) == pos:
                out.extend(s for done in self._complete(rest, t) for s in self.feed(done, b))
        return tuple(out)

    def _accepts(self, stack: Stack) -> bool:
        top = stack[-1]
        if top[0] == R:
            return top[2]
        if (top[0] == N and top[2] in N_COMPLETE) or (top[0] == P and self.patterns[top[1]].accepting(top[2])):
            return any(self._accepts(s) for s in self._complete(stack[:-1], None))
        if top[0] == L:
            return any(len(t) == top[2] and any(self._accepts(s) for s in self._complete(stack[:-1], t))
                       for t in top[1])
        return False
