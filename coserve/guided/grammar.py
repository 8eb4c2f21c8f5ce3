"""A context-free grammar in GBNF (llama.cpp's format, which vLLM's ``guided_grammar`` takes), compiled into a
byte-level machine for guided decoding.

Syntax: rules ``name ::= alternatives`` (the output is the rule ``root``); alternatives separated by ``|``;
items are string literals ``"..."`` (escapes ``\\n \\t \\r \\\\ \\" \\xHH \\uHHHH``), character classes
``[a-z]`` / ``[^...]``, ``.`` (any character), rule names, groups ``( ... )``, each optionally followed by
``*``, ``+``, ``?`` or ``{m}``, ``{m,}``, ``{m,n}``; ``#`` starts a comment. A rule runs until the next
``name ::=``, so rules may span lines. A Lark grammar (``start: ...``) goes through ``lark.py`` into the same
rules (``compile_grammar`` tells the two apart). Immediate left recursion (``a ::= a "x" | "y"``) is rewritten
into repetition (``a ::= "y" "x"*``); left recursion through other rules (``a ::= b "x"``, ``b ::= a | "y"``)
is a ``GrammarError``: the machine expands rules top-down and would not end.

The machine is a nondeterministic top-down parser over code points: a state is a set of stacks (the symbols
still to match, the next one last), each expanded until a character is on top, plus the bytes of a UTF-8
character being read (alive while some completion of it can be taken, as in ``regex.py``). Repetition is
rewritten into right-recursive rules, so ``x*`` keeps stacks from growing; nesting grows them as it must.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from coserve.guided.regex import (MAX_CODE_POINT, CodePointMachine, Ranges, _without_surrogates, complement, contains,
                                  intersects, normalize, step_utf8)

MAX_SYMBOLS = 50_000  # a grammar compiling to more symbols is refused ({m,n} repeats copy their item)
MAX_STACKS = 4_096  # parses kept per state: beyond it an ambiguous grammar keeps the first found (every kept
#   one is a valid parse, so guided text stays valid; only some continuations may be missed)
MAX_CACHED_EXPANSIONS = 100_000
ANY_CHAR = complement(())


class GrammarError(ValueError):
    """A grammar this module cannot compile (or, while decoding, one too ambiguous to follow)."""


@dataclass(frozen=True, slots=True)
class Char:
    """A terminal: one code point in ``ranges``."""

    ranges: Ranges


Symbol = Char | int  # a character class, or a rule by its index


# ---- parsing -------------------------------------------------------------------------------------------------

Rules = list[list[tuple[Symbol, ...]]]  # rule index -> its alternatives, each a sequence of symbols


class RuleSet:
    """Rules under construction, shared by the grammar front ends (GBNF here, Lark in ``lark.py``): new rules,
    and repetition rewritten into right-recursive rules."""

    def __init__(self) -> None:
        self.rules: Rules = []
        self.symbols = 0

    def new_rule(self, alternatives: list[tuple[Symbol, ...]]) -> int:
        self.rules.append(alternatives)
        self.symbols += sum(len(a) for a in alternatives) + 1
        if self.symbols > MAX_SYMBOLS:
            raise GrammarError(f"grammar too large: more than {MAX_SYMBOLS} symbols once repeats are expanded")
        return len(self.rules) - 1

    def choice(self, alternatives: list[tuple[Symbol, ...]]) -> tuple[Symbol, ...]:
        """A group: the one sequence itself, or a new rule for several."""
        return (self.new_rule(alternatives),) if len(alternatives) > 1 else alternatives[0]

    def repeat(self, seq: tuple[Symbol, ...], lo: int, hi: int | None) -> tuple[Symbol, ...]:
        """``seq`` ``lo`` to ``hi`` times (None: any number more)."""
        if hi is None:  # tail: T ::= seq T | (empty)
            tail = self.new_rule([])
            self.rules[tail] = [seq + (tail,), ()]
            return seq * lo + (tail,)
        optional: tuple[Symbol, ...] = ()
        for _ in range(hi - lo):  # O ::= seq O' | (empty), nested so that at most hi - lo follow
            optional = (self.new_rule([seq + optional, ()]),)
        if lo * len(seq) > MAX_SYMBOLS:
            raise GrammarError(f"grammar too large: more than {MAX_SYMBOLS} symbols once repeats are expanded")
        return seq * lo + optional


class _Parser(RuleSet):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.t = text
        self.i = 0
        self.names: dict[str, int] = {}  # rule name -> index
        self.defined: set[str] = set()

    def error(self, message: str, at: int | None = None) -> GrammarError:
        at = self.i if at is None else at
        line = self.t.count("\n", 0, at) + 1
        return GrammarError(f"line {line}: {message}")

    def rule_id(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = len(self.rules)
            self.rules.append([])
        return self.names[name]

    def space(self) -> None:
        while self.i < len(self.t):
            c = self.t[self.i]
            if c == "#":
                while self.i < len(self.t) and self.t[self.i] != "\n":
                    self.i += 1
            elif c.isspace():
                self.i += 1
            else:
                return

    def name(self) -> str | None:
        j = self.i
        while j < len(self.t) and (self.t[j].isalnum() or self.t[j] in "-_"):
            j += 1
        if j == self.i:
            return None
        name, self.i = self.t[self.i:j], j
        return name

    def at_rule_start(self) -> bool:
        """Whether ``name ::=`` begins here (the end of the previous rule)."""
        save = self.i
        name = self.name()
        self.space()
        found = name is not None and self.t.startswith("::=", self.i)
        self.i = save
        return found

    def parse(self) -> tuple[Rules, int]:
        self.space()
        if self.i >= len(self.t):
            raise GrammarError("the grammar is empty")
        while self.i < len(self.t):
            start = self.i
            name = self.name()
            self.space()
            if name is None or not self.t.startswith("::=", self.i):
                raise self.error("expected a rule: name ::= ...", start)
            if name in self.defined:
                raise self.error(f"rule {name!r} is defined twice", start)
            self.defined.add(name)
            self.i += 3
            self.rules[self.rule_id(name)] = self.alternatives(top=True)
            self.space()
        undefined = sorted(set(self.names) - self.defined)
        if undefined:
            raise GrammarError(f"rule {undefined[0]!r} is used but never defined")
        if "root" not in self.names:
            raise GrammarError("no rule 'root' (the whole output)")
        return self.rules, self.names["root"]

    def alternatives(self, top: bool) -> list[tuple[Symbol, ...]]:
        options = [self.sequence(top)]
        while self.i < len(self.t) and self.t[self.i] == "|":
            self.i += 1
            options.append(self.sequence(top))
        return options

    def sequence(self, top: bool) -> tuple[Symbol, ...]:
        items: list[Symbol] = []
        while True:
            self.space()
            if self.i >= len(self.t) or self.t[self.i] in "|)" or (top and self.at_rule_start()):
                return tuple(items)
            items.extend(self.repeated(self.item()))

    def item(self) -> tuple[Symbol, ...]:
        c, at = self.t[self.i], self.i
        if c == '"':
            self.i += 1
            chars = []
            while True:
                if self.i >= len(self.t):
                    raise self.error("unterminated string literal", at)
                c = self.t[self.i]
                if c == '"':
                    self.i += 1
                    break
                cp = self.char()
                chars.append(Char(((cp, cp),)))
            return tuple(chars)
        if c == "[":
            return (Char(self.char_class()),)
        if c == ".":
            self.i += 1
            return (Char(ANY_CHAR),)
        if c == "(":
            self.i += 1
            alternatives = self.alternatives(top=False)
            self.space()
            if self.i >= len(self.t) or self.t[self.i] != ")":
                raise self.error("missing ')'", at)
            self.i += 1
            return self.choice(alternatives)
        name = self.name()
        if name is None:
            raise self.error(f"unexpected {c!r}")
        return (self.rule_id(name),)

    def repeated(self, seq: tuple[Symbol, ...]) -> tuple[Symbol, ...]:
        c = self.t[self.i] if self.i < len(self.t) else ""
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            end = self.t.find("}", self.i)
            body = self.t[self.i + 1:end] if end > 0 else ""
            parts = body.split(",")
            if end < 0 or len(parts) > 2 or not all(p.strip().isdigit() or (i == 1 and not p.strip())
                                                    for i, p in enumerate(parts)):
                raise self.error("bad repetition {m}, {m,} or {m,n}")
            lo = int(parts[0])
            hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1].strip() else None)
            if hi is not None and hi < lo:
                raise self.error(f"repetition {{{lo},{hi}}}: the maximum is below the minimum")
            self.i = end + 1
        else:
            return seq
        return self.repeat(seq, lo, hi)

    def char(self) -> int:
        c = self.t[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        if self.i >= len(self.t):
            raise self.error("a backslash at the end")
        e = self.t[self.i]
        self.i += 1
        simple = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}
        if e in simple:
            return ord(simple[e])
        if e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = self.t[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad escape \\{e}{digits}")
            self.i += width
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT or 0xD800 <= cp <= 0xDFFF:
                raise self.error(f"bad escape \\{e}{digits}: not an encodable character")
            return cp
        raise self.error(f"unknown escape \\{e}")

    def char_class(self) -> Ranges:
        at = self.i
        self.i += 1
        negate = self.i < len(self.t) and self.t[self.i] == "^"
        if negate:
            self.i += 1
        ranges = []
        while True:
            if self.i >= len(self.t):
                raise self.error("unterminated character class", at)
            if self.t[self.i] == "]":
                self.i += 1
                break
            lo = self.char()
            hi = lo
            if self.t.startswith("-", self.i) and not self.t.startswith("-]", self.i):
                self.i += 1
                hi = self.char()
                if hi < lo:
                    raise self.error(f"bad character range {chr(lo)}-{chr(hi)}")
            ranges.append((lo, hi))
        ranges = _without_surrogates(ranges)
        return complement(ranges) if negate else normalize(ranges)


# ---- the machine ---------------------------------------------------------------------------------------------

Stack = tuple  # symbols still to match, the next one last
State = tuple  # (frozenset of stacks, bytes of a UTF-8 character being read); () = dead


class GrammarMachine(CodePointMachine):
    """The byte-level transition function of one grammar (the interface of ``JsonMachine``)."""

    def __init__(self, rules: Rules, root: int) -> None:
        self.rules = rules
        _rewrite_immediate_left_recursion(rules)
        self._check_left_recursion()
        self._expanded: dict[Stack, frozenset[Stack]] = {}
        start = self._expand(frozenset({(root,)}))
        if not start:
            raise GrammarError("the grammar matches no text")
        self.start: State = (start, b"")

    def _check_left_recursion(self) -> None:
        """A rule that can reach itself without consuming a character would make top-down expansion endless."""
        nullable = [False] * len(self.rules)
        changed = True
        while changed:
            changed = False
            for r, alternatives in enumerate(self.rules):
                if not nullable[r] and any(all(isinstance(s, int) and nullable[s] for s in alt) for alt in alternatives):
                    nullable[r] = changed = True
        first: list[set[int]] = [set() for _ in self.rules]  # rules that can be leftmost in a rule's expansion
        for r, alternatives in enumerate(self.rules):
            for alt in alternatives:
                for s in alt:
                    if not isinstance(s, int):
                        break
                    first[r].add(s)
                    if not nullable[s]:
                        break
        for r in range(len(self.rules)):
            seen, todo = set(), list(first[r])
            while todo:
                x = todo.pop()
                if x == r:
                    raise GrammarError("left recursion: a rule can come back to itself before reading a character; "
                                       "write it with repetition (a ::= b c*) instead")
                if x not in seen:
                    seen.add(x)
                    todo.extend(first[x])

    def _expand(self, stacks) -> frozenset[Stack]:
        """Every stack with a character (or nothing: a whole match) on top, rules on top replaced by their
        alternatives."""
        out: set[Stack] = set()
        todo = list(stacks)
        seen: set[Stack] = set()
        while todo:
            stack = todo.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if not stack or isinstance(stack[-1], Char):
                out.add(stack)
                if len(out) >= MAX_STACKS:
                    break
                continue
            rest, rule = stack[:-1], stack[-1]
            for alt in self.rules[rule]:
                todo.append(rest + tuple(reversed(alt)))
        return frozenset(out)

    def step(self, state: State, b: int) -> State:
        return step_utf8(state, b, self._advance, self._may_take)

    @staticmethod
    def _may_take(stacks: frozenset[Stack], lo: int, hi: int) -> bool:
        return any(s and intersects(s[-1].ranges, lo, hi) for s in stacks)

    def _advance(self, stacks: frozenset[Stack], cp: int) -> State:
        out: set[Stack] = set()
        for s in stacks:
            if s and contains(s[-1].ranges, cp):
                out |= self._expand_one(s[:-1])
                if len(out) >= MAX_STACKS:
                    break
        return (frozenset(out), b"") if out else ()

    def _expand_one(self, stack: Stack) -> frozenset[Stack]:
        """``_expand`` of one stack, remembered (the same stacks come back at every repetition)."""
        done = self._expanded.get(stack)
        if done is None:
            if len(self._expanded) >= MAX_CACHED_EXPANSIONS:
                self._expanded.clear()
            done = self._expanded[stack] = self._expand((stack,))
        return done

    def accepting(self, state: State) -> bool:
        return bool(state) and not state[1] and () in state[0]



def _rewrite_immediate_left_recursion(rules: Rules) -> None:
    """``a ::= a x | a y | b | c`` becomes ``a ::= b t | c t``, ``t ::= x t | y t | (empty)``: the same texts, and
    no rule on top of a stack expands into itself (left recursion through other rules stays an error)."""
    for r in range(len(rules)):
        alternatives = rules[r]
        tails = [alt[1:] for alt in alternatives if alt and alt[0] == r]
        if not tails:
            continue
        bases = [alt for alt in alternatives if not (alt and alt[0] == r)]
        if not bases:
            continue  # only ever itself: no text; the left-recursion check says so
        tails = [t for t in tails if t]  # a ::= a adds nothing
        if not tails:
            rules[r] = bases
            continue
        tail = len(rules)
        rules.append([t + (tail,) for t in tails] + [()])
        rules[r] = [b + (tail,) for b in bases]


GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)


def is_gbnf(grammar: str) -> bool:
    """Whether ``grammar`` is GBNF (some line defines ``name ::= ...``) rather than Lark (``name: ...``), the
    test vLLM's ``guided_grammar`` makes too."""
    return GBNF_RULE.search(grammar) is not None


def parse_gbnf(grammar: str) -> tuple[Rules, int]:
    """A GBNF grammar's rules and the index of ``root``."""
    return _Parser(grammar).parse()


def compile_grammar(grammar: str) -> GrammarMachine:
    """The machine of a GBNF grammar, or of a Lark grammar (``coserve.guided.lark``), told apart by
    ``is_gbnf``; ``GrammarError`` names what is wrong and on which line. Machines are shared (a request's
    grammar is checked at the server, in ``SamplingParams`` and by the engine's guide)."""
    if not isinstance(grammar, str):
        raise GrammarError(f"grammar must be a string, got {type(grammar).__name__}")
    try:
        return _compiled(grammar)
    except RecursionError:  # the parsers recurse once per level of nesting
        raise GrammarError("grammar nests its groups too deeply to compile") from None


@lru_cache(maxsize=64)
def _compiled(grammar: str) -> GrammarMachine:
    if is_gbnf(grammar):
        return GrammarMachine(*parse_gbnf(grammar))
    from coserve.guided.lark import parse_lark  # the Lark front end builds on this module's rules
    return GrammarMachine(*parse_lark(grammar))
