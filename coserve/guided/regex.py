"""A regular expression, compiled into a byte-level machine that guided decoding walks (vLLM's ``guided_regex``).

The whole output must match the pattern (Python's ``re.fullmatch``). The syntax is Python's, less what
a finite automaton cannot decide: literals and escapes, ``.`` (anything but a newline), classes
``[a-z_]`` / ``[^...]``, ``\\d \\w \\s`` and their negations (ASCII meanings, as in JSON Schema and
``re.ASCII``), groups ``(...)``, ``(?:...)``, ``(?P<name>...)``, alternation ``|``, quantifiers ``* + ?
{m} {m,} {m,n} {,n}`` (lazy forms match the same whole texts), and ``^`` / ``$`` at the ends.
Backreferences, lookaround, possessive quantifiers, word boundaries, inline flags and ``\\p{...}`` are a
``RegexError`` naming the position, not silently ignored.

The pattern becomes a Thompson NFA over Unicode code points; a machine state is the set of NFA states
with the bytes of a UTF-8 character still being read (a partial character stays alive only while some
completion of it can be taken). States are hashable, so ``Guide`` caches steps and masks as it does for
JSON.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
MAX_STATES = 20_000  # an NFA larger than this is refused (``a{1000}{1000}`` would not end)
MAX_PATTERN_CHARS = 10_000

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges

DIGITS: Ranges = ((0x30, 0x39),)
WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20))
CLASS_ESCAPES = {"d": (DIGITS, False), "D": (DIGITS, True), "w": (WORD, False), "W": (WORD, True),
                 "s": (SPACE, False), "S": (SPACE, True)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
UNSUPPORTED_ESCAPES = {"b": "word boundaries (\\b)", "B": "word boundaries (\\B)", "A": "anchors (\\A)",
                       "Z": "anchors (\\Z)", "z": "anchors (\\z)", "p": "Unicode properties (\\p)",
                       "P": "Unicode properties (\\P)", "G": "\\G", "N": "named characters (\\N)"}
QUANTIFIER = re.compile(r"\{(\d*)(,(\d*))?\}")


class RegexError(ValueError):
    """A pattern this module cannot compile; the message says what and where (a 0-based character offset)."""


def normalize(ranges) -> Ranges:
    """Sorted, merged ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def complement(ranges: Ranges) -> Ranges:
    """Every encodable code point (surrogates excluded) not in ``ranges``."""
    out, start = [], 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return _without_surrogates(out)


def _without_surrogates(ranges) -> Ranges:
    lo_s, hi_s = SURROGATES
    out = []
    for lo, hi in ranges:
        if hi < lo_s or lo > hi_s:
            out.append((lo, hi))
            continue
        if lo < lo_s:
            out.append((lo, lo_s - 1))
        if hi > hi_s:
            out.append((hi_s + 1, hi))
    return normalize(out)


def contains(ranges: Ranges, cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in ranges)


def intersects(ranges: Ranges, lo: int, hi: int) -> bool:
    return any(a <= hi and lo <= b for a, b in ranges)


ANY_BUT_NEWLINE = complement(((0x0A, 0x0A),))


# ---- parsing -------------------------------------------------------------------------------------------------
# AST: ("set", ranges) | ("cat", [nodes]) | ("alt", [nodes]) | ("rep", node, min, max or None)

class _Parser:
    def __init__(self, pattern: str, dotall: bool = False) -> None:
        self.p = pattern
        self.i = 0
        self.dot = complement(()) if dotall else ANY_BUT_NEWLINE  # what '.' matches (re.DOTALL: anything)

    def error(self, message: str, at: int | None = None) -> RegexError:
        return RegexError(f"{message} at position {self.i if at is None else at}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        node = self.alternation()
        if self.i < len(self.p):  # only an unmatched ')' stops an alternation early
            raise self.error("unbalanced parenthesis ')'")
        return node

    def alternation(self):
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def sequence(self):
        items = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            start = self.i
            atom = self.atom()
            if atom is None:
                continue
            items.append(self.quantified(atom, start))
        return items[0] if len(items) == 1 else ("cat", items)

    def quantified(self, atom, start: int):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (m := QUANTIFIER.match(self.p, self.i)) and (m.group(1) or m.group(3)):
                self.i = m.end()
                lo = int(m.group(1) or 0)
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if hi is not None and hi < lo:
                    raise self.error(f"quantifier {{{lo},{hi}}}: the maximum is below the minimum", start)
            else:
                return atom
            if self.peek() == "?":  # lazy: the same whole texts match
                self.i += 1
            elif self.peek() == "+":  # possessive: gives nothing back, so a++a matches no text
                raise self.error("possessive quantifiers are not supported")
            if self.peek() in ("*", "+", "?") or (self.peek() == "{" and (m := QUANTIFIER.match(self.p, self.i))
                                                  and (m.group(1) or m.group(3))):
                raise self.error("multiple repeat")
            atom = ("rep", atom, lo, hi)

    def atom(self):
        c = self.p[self.i]
        at = self.i
        self.i += 1
        if c == "(":
            return self.group(at)
        if c == "[":
            return ("set", self.char_class(at))
        if c == ".":
            return ("set", self.dot)
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "*+?":
            raise self.error(f"nothing to repeat before {c!r}", at)
        if c == "{" and (m := QUANTIFIER.match(self.p, at)) and (m.group(1) or m.group(3)):
            raise self.error("nothing to repeat before '{'", at)
        if c == "^":
            if at == 0:
                return None
            raise self.error("'^' is supported only at the start of the pattern", at)
        if c == "$":
            if at == len(self.p) - 1:
                return None
            raise self.error("'$' is supported only at the end of the pattern", at)
        return ("set", ((ord(c), ord(c)),))

    def group(self, at: int):
        if self.p.startswith("?", self.i):
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i) or (self.p.startswith("?<", self.i)
                                                        and not self.p.startswith(("?<=", "?<!"), self.i)):
                end = self.p.find(">", self.i)
                name = self.p[self.p.index("<", self.i) + 1:end] if end > 0 else ""
                if end < 0 or not name.isidentifier():
                    raise self.error("bad group name", at)
                self.i = end + 1
            elif self.p.startswith(("?=", "?!", "?<=", "?<!"), self.i):
                raise self.error("lookaround assertions are not supported", at)
            elif self.p.startswith("?P=", self.i):
                raise self.error("backreferences are not supported", at)
            else:
                raise self.error("inline flags and other (?...) extensions are not supported", at)
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')', unterminated subpattern", at)
        self.i += 1
        return node

    def char_class(self, at: int) -> Ranges:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character set", at)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if isinstance(lo, tuple):  # \d and friends
                ranges.extend(lo)
                continue
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.class_item()
                if isinstance(hi, tuple):
                    raise self.error("bad character range: a class escape cannot end a range")
                if hi < lo:
                    raise self.error(f"bad character range {chr(lo)}-{chr(hi)}")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        ranges = _without_surrogates(ranges)
        return complement(ranges) if negate else ranges

    def class_item(self):
        """One member of a class: a code point, or (for ``\\d`` and the like) a tuple of ranges."""
        c = self.p[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        if self.peek() in CLASS_ESCAPES:
            return self.escape(in_class=True)
        return self.escape(in_class=True)[0][0]

    def escape(self, in_class: bool) -> Ranges:
        """The escape after a backslash: a class's ranges for ``\\d`` and the like, else one code point."""
        if self.i >= len(self.p):
            raise self.error("bad escape (end of pattern)")
        c = self.p[self.i]
        at = self.i - 1
        self.i += 1
        if c in CLASS_ESCAPES:
            ranges, negated = CLASS_ESCAPES[c]
            return complement(ranges) if negated else ranges
        if c in CHAR_ESCAPES:
            return _one(ord(CHAR_ESCAPES[c]))
        if c == "b" and in_class:
            return _one(8)
        if c in UNSUPPORTED_ESCAPES:
            raise self.error(f"{UNSUPPORTED_ESCAPES[c]} are not supported", at)
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad escape \\{c}{digits}", at)
            self.i += width
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT or SURROGATES[0] <= cp <= SURROGATES[1]:
                raise self.error(f"bad escape \\{c}{digits}: not an encodable character", at)
            return _one(cp)
        if c.isdigit():
            raise self.error("backreferences are not supported", at)
        if c.isascii() and c.isalpha():
            raise self.error(f"bad escape \\{c}", at)
        return _one(ord(c))


def parse_regex(pattern: str, dotall: bool = False):
    """A pattern's tree (``("set", ranges)``, ``("cat", items)``, ``("alt", options)``, ``("rep", item, lo, hi)``),
    for another front end to build on (Lark's regex terminals); ``RegexError`` names what is wrong."""
    return _Parser(pattern, dotall).parse()


def _one(cp: int) -> Ranges:
    return ((cp, cp),)


# ---- the automaton -------------------------------------------------------------------------------------------

@dataclass(slots=True)
class _State:
    eps: list[int] = field(default_factory=list)
    moves: list[tuple[Ranges, int]] = field(default_factory=list)


class _Builder:
    def __init__(self) -> None:
        self.states: list[_State] = []

    def new(self) -> int:
        if len(self.states) >= MAX_STATES:
            raise RegexError(f"pattern too large: more than {MAX_STATES} automaton states")
        self.states.append(_State())
        return len(self.states) - 1

    def build(self, node) -> tuple[int, int]:
        kind = node[0]
        if kind == "set":
            s, t = self.new(), self.new()
            if node[1]:
                self.states[s].moves.append((node[1], t))
            return s, t
        if kind == "cat":
            s = t = self.new()
            for item in node[1]:
                a, b = self.build(item)
                self.states[t].eps.append(a)
                t = b
            return s, t
        if kind == "alt":
            s, t = self.new(), self.new()
            for option in node[1]:
                a, b = self.build(option)
                self.states[s].eps.append(a)
                self.states[b].eps.append(t)
            return s, t
        _, inner, lo, hi = node  # rep
        s = t = self.new()
        for _ in range(lo):
            a, b = self.build(inner)
            self.states[t].eps.append(a)
            t = b
        if hi is None:  # then any number more
            a, b = self.build(inner)
            end = self.new()
            self.states[t].eps += [a, end]
            self.states[b].eps += [a, end]
            return s, end
        end = self.new()
        for _ in range(hi - lo):  # optional copies, each skippable to the end
            a, b = self.build(inner)
            self.states[t].eps += [a, end]
            t = b
        self.states[t].eps.append(end)
        return s, end


State = tuple  # (frozenset of NFA states, bytes of a UTF-8 character still being read); () = dead


class CodePointMachine:
    """What the machines over code points share (``RegexMachine``, ``grammar.GrammarMachine``): the interface of
    ``JsonMachine`` less its JSON-string fast path, and a whole-text check."""

    start: tuple

    def step(self, state: tuple, b: int) -> tuple:
        raise NotImplementedError

    def accepting(self, state: tuple) -> bool:
        raise NotImplementedError

    def string_room(self, state: tuple) -> None:
        return None  # no JSON string fast path: every token is walked

    def matches(self, text: str) -> bool:
        """Whether the whole of ``text`` matches (the machine run over its UTF-8 bytes)."""
        state = self.start
        for b in text.encode("utf-8"):
            state = self.step(state, b)
            if not state:
                return False
        return self.accepting(state)


class RegexMachine(CodePointMachine):
    """The byte-level transition function of one pattern (the interface of ``JsonMachine``)."""

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise RegexError(f"pattern must be a string, got {type(pattern).__name__}")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise RegexError(f"pattern too long: {len(pattern)} characters, at most {MAX_PATTERN_CHARS}")
        builder = _Builder()
        start, self.accept = builder.build(_Parser(pattern).parse())
        self.states = builder.states
        self.distance = self._distances()  # NFA state -> fewest characters to an accepting state (absent: none)
        self._closures: dict[int, frozenset[int]] = {}
        self.start: State = (self._closure([start]), b"")

    def _distances(self) -> dict[int, int]:
        """A 0-1 breadth-first search back from the accepting state (epsilon moves cost nothing)."""
        back: list[list[tuple[int, int]]] = [[] for _ in self.states]
        for s, st in enumerate(self.states):
            for e in st.eps:
                back[e].append((s, 0))
            for _, t in st.moves:
                back[t].append((s, 1))
        dist = {self.accept: 0}
        queue = deque([self.accept])
        while queue:
            t = queue.popleft()
            for s, cost in back[t]:
                d = dist[t] + cost
                if d < dist.get(s, d + 1):
                    dist[s] = d
                    (queue.appendleft if cost == 0 else queue.append)(s)
        return dist

    def chars_needed(self, state: State) -> int | None:
        """The fewest characters still to come before the text can match (a character being read counts as
        come); None when it never can."""
        if not state:
            return None
        nfa, partial = state
        if partial:
            return self.chars_after(state, *_completions(partial, _utf8_length(partial[0])))
        return min((self.distance[s] for s in nfa if s in self.distance), default=None)

    def chars_after(self, state: State, lo: int, hi: int) -> int | None:
        """The fewest characters to come after one (not yet taken) whose code point is in ``lo..hi``; None when
        no such character leads to a match."""
        if lo >= SURROGATES[0] and hi <= SURROGATES[1]:
            return None
        return min((self.distance[t] for s in state[0] for ranges, t in self.states[s].moves
                    if t in self.distance and intersects(ranges, lo, hi)), default=None)

    def _closure(self, seeds) -> frozenset[int]:
        seen: set[int] = set()
        stack = list(seeds)
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            stack.extend(self.states[s].eps)
        return frozenset(seen)

    def step(self, state: State, b: int) -> State:
        return step_utf8(state, b, self._advance, self._may_take)

    def _may_take(self, nfa: frozenset[int], lo: int, hi: int) -> bool:
        return any(intersects(ranges, lo, hi) for s in nfa for ranges, t in self.states[s].moves
                   if t in self.distance)

    def _advance(self, nfa: frozenset[int], cp: int) -> State:
        # only moves from which the accepting state can still be reached: a live state always has a way out
        targets = [t for s in nfa for ranges, t in self.states[s].moves if t in self.distance and contains(ranges, cp)]
        if not targets:
            return ()
        return (self._closure(targets), b"")

    def accepting(self, state: State) -> bool:
        return bool(state) and not state[1] and self.accept in state[0]



def step_utf8(state: tuple, b: int, advance, may_take) -> tuple:
    """One byte into a machine over code points whose state is ``(inner, bytes of a character being read)``
    (``()``: dead): a whole character goes to ``advance(inner, code point)``; a partial one stays alive while
    ``may_take(inner, lo, hi)`` says some code point it may still become can be taken."""
    if not state:
        return ()
    inner, partial = state
    if not partial:
        if b < 0x80:
            return advance(inner, b)
        if not (0xC2 <= b <= 0xF4):
            return ()
        partial = bytes([b])
    else:
        if not 0x80 <= b <= 0xBF:
            return ()
        partial += bytes([b])
    need = _utf8_length(partial[0])
    if len(partial) == need:
        try:
            cp = ord(partial.decode("utf-8"))
        except UnicodeDecodeError:
            return ()
        return advance(inner, cp)
    bounds = _completions(partial, need)
    if bounds is None or not may_take(inner, *bounds):
        return ()
    return (inner, partial)


def _utf8_length(lead: int) -> int:
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def _completions(partial: bytes, need: int) -> tuple[int, int] | None:
    """The code points a valid UTF-8 character starting with ``partial`` (shorter than ``need``) may be,
    or None when no valid character starts so."""
    if len(partial) >= 2:  # the second byte's narrower ranges (no overlongs, surrogates or > U+10FFFF)
        first, second = partial[0], partial[1]
        lo2, hi2 = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(
            first, (0x80, 0xBF))
        if not lo2 <= second <= hi2:
            return None
    lead_bits = {2: 0x1F, 3: 0x0F, 4: 0x07}[need]
    value = partial[0] & lead_bits
    for b in partial[1:]:
        value = (value << 6) | (b & 0x3F)
    rest = 6 * (need - len(partial))
    lo, hi = value << rest, (value << rest) | ((1 << rest) - 1)
    if need == 3 and partial[0] == 0xE0 and len(partial) == 1:
        lo = max(lo, 0x800)
    if need == 4 and len(partial) == 1:
        lo, hi = max(lo, 0x10000), min(hi, MAX_CODE_POINT)
    return lo, hi


def compile_regex(pattern: str) -> RegexMachine:
    """The machine of ``pattern``; ``RegexError`` names what is wrong and where. Machines are shared (a
    request's pattern is checked at the server, in ``SamplingParams`` and by the engine's guide)."""
    if not isinstance(pattern, str):
        raise RegexError(f"pattern must be a string, got {type(pattern).__name__}")
    try:
        return _compiled(pattern)
    except RecursionError:  # the parser and the automaton's builder recurse once per level of nesting
        raise RegexError("pattern nests its groups too deeply to compile") from None


@lru_cache(maxsize=256)
def _compiled(pattern: str) -> RegexMachine:
    return RegexMachine(pattern)


def search_pattern(pattern: str) -> str:
    """A pattern whose whole matches are the texts in which ``pattern`` is found (``re.search``, JSON Schema's
    ``pattern``): unanchored ends may hold anything. ``^a|b$`` (anchors on separate alternatives) is refused
    rather than read as ``^(a|b)$``."""
    if not isinstance(pattern, str):
        raise RegexError(f"pattern must be a string, got {type(pattern).__name__}")
    start = pattern.startswith("^")
    trailing_backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    end = pattern.endswith("$") and len(pattern) > start and trailing_backslashes % 2 == 0
    body = pattern[int(start):len(pattern) - int(end)]
    if (start or end) and _Parser(body).parse()[0] == "alt":
        raise RegexError("anchors with an alternation at the top level: group the alternatives, as in ^(a|b)$")
    anything = r"[\s\S]*"
    return f"{'' if start else anything}(?:{body}){'' if end else anything}"
