"""Lark grammars (the EBNF of the Lark parsing toolkit, which vLLM's ``guided_grammar`` also takes and OpenAI's
grammar-constrained tools use) compiled into the rules the GBNF machine of ``grammar.py`` follows.

Syntax (Lark's): rules ``name: expansions`` (lower case, optionally ``?name`` / ``!name`` / ``name.2``) and
terminals ``NAME: expansions`` (upper case), one per line, alternatives ``|`` (a line that starts with ``|``
continues the definition above); items: ``"literal"`` (``"..."i`` for any case), ``/regex/flags`` (Python's
syntax as ``regex.py`` takes it; flags ``i`` and ``s``), ``"a".."z"``, names, ``( ... )``, ``[ ... ]``
(optional), each optionally followed by ``?``, ``*``, ``+``, ``~ n`` or ``~ n..m``; ``-> alias`` is allowed
(and has no effect on what matches); ``//`` starts a comment. Directives: ``%import common.NAME [-> ALIAS]``
and ``%import common (A, B)`` (Lark's ``common.lark`` terminals), ``%ignore`` (a terminal, literal or regex
that may come between any two tokens and around the whole text). The output is the rule ``start``.

What matches: a text matches when some split of it into tokens parses (Lark's Earley parser with
``lexer="dynamic_complete"``, the oracle of the tests). Lark's other lexers (``dynamic``, ``contextual``) do
not try every split and can reject texts this accepts; a guided output always parses with
``dynamic_complete``. Immediate left
recursion (``sum: sum "+" term | term``), common in Lark grammars, is rewritten by the machine; templates,
``%declare``, ``%override``, ``%extend`` and imports from files are a ``GrammarError`` naming the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from coserve.guided.grammar import Char, GrammarError, Rules, RuleSet, Symbol
from coserve.guided.regex import MAX_CODE_POINT, RegexError, _without_surrogates, normalize, parse_regex

# Lark's common.lark, less the lookbehind in ESCAPED_STRING (written here as the same language without it)
COMMON = r'''
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+"|"-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e"|"E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+"|"-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+"|"-"] NUMBER
ESCAPED_STRING: "\"" /([^"\\\n]|\\[^\n])*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_"|LETTER) ("_"|LETTER|DIGIT)*
WS_INLINE: (" "|/\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
SQL_COMMENT: /--[^\n]*/
'''
MAX_CASE_FOLD = 20_000  # code points a case-insensitive class is folded over (a wider one is left as written)
_TOKEN = re.compile(r'''
    (?P<space>[ \t\f\r]+|//[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?!/)(?:\\.|[^/\\\n])+/[a-z]*)
  | (?P<directive>%[a-z]+)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>-?\d+)
  | (?P<op>\.\.|->|[:|()\[\]*+?~.!,{}])
''', re.VERBOSE)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a", "b": "\b",
            "\\": "\\", '"': '"', "'": "'"}


@dataclass(slots=True)
class _Tok:
    kind: str
    text: str
    line: int


@dataclass(slots=True)
class _Definition:
    name: str
    body: tuple  # the expansions' tree: ("alt", [seq...]); seq = ("seq", [item...])
    line: int


@dataclass(slots=True)
class _Grammar:
    definitions: dict[str, _Definition] = field(default_factory=dict)
    ignores: list[tuple[tuple, int]] = field(default_factory=list)  # (item tree, line)
    imports: list[tuple[str, str, int]] = field(default_factory=list)  # (name in common, local name, line)


def _error(line: int, message: str) -> GrammarError:
    return GrammarError(f"line {line}: {message}")


def _tokens(text: str) -> list[list[_Tok]]:
    """The statements of a grammar, each a list of tokens (a line, with the ``|`` lines that continue it and
    anything inside brackets)."""
    statements: list[list[_Tok]] = [[]]
    line, i, depth = 1, 0, 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise _error(line, f"unexpected {text[i]!r}")
        kind, value = m.lastgroup, m.group()
        i = m.end()
        if kind == "newline":
            line += 1
            if depth == 0 and statements[-1]:
                statements.append([])
            continue
        if kind == "space":
            continue
        if kind == "op" and value in "([{":
            depth += 1
        elif kind == "op" and value in ")]}":
            depth = max(0, depth - 1)
        if kind == "op" and value == "|" and not statements[-1] and len(statements) > 1:
            statements.pop()  # a line starting with | continues the definition above
        statements[-1].append(_Tok(kind, value, line))
    return [s for s in statements if s]


class _StatementParser:
    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = toks
        self.i = 0

    def peek(self, kind: str | None = None, text: str | None = None) -> _Tok | None:
        if self.i >= len(self.toks):
            return None
        t = self.toks[self.i]
        if (kind is not None and t.kind != kind) or (text is not None and t.text != text):
            return None
        return t

    def take(self, kind: str | None = None, text: str | None = None, what: str = "") -> _Tok:
        t = self.peek(kind, text)
        if t is None:
            at = self.toks[min(self.i, len(self.toks) - 1)]
            found = repr(self.toks[self.i].text) if self.i < len(self.toks) else "the end of the line"
            raise _error(at.line, f"expected {what or text or kind}, found {found}")
        self.i += 1
        return t

    def done(self) -> bool:
        return self.i >= len(self.toks)

    def expansions(self) -> tuple:
        options = [self.alias()]
        while self.peek("op", "|"):
            self.i += 1
            options.append(self.alias())
        return ("alt", options)

    def alias(self) -> tuple:
        seq = self.expansion()
        if self.peek("op", "->"):
            self.i += 1
            self.take("name", what="an alias name after '->'")
        return seq

    def expansion(self) -> tuple:
        items = []
        while (t := self.peek()) is not None and not (t.kind == "op" and t.text in ("|", ")", "]", "->")):
            items.append(self.expr())
        return ("seq", items)

    def expr(self) -> tuple:
        atom = self.atom()
        t = self.peek("op")
        if t is not None and t.text in ("?", "*", "+"):
            self.i += 1
            lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[t.text]
            return ("rep", atom, lo, hi)
        if t is not None and t.text == "~":
            self.i += 1
            lo = int(self.take("number", what="a count after '~'").text)
            hi = lo
            if self.peek("op", ".."):
                self.i += 1
                hi = int(self.take("number", what="a count after '..'").text)
            if lo < 0 or hi < lo:
                raise _error(t.line, f"bad repetition ~ {lo}..{hi}")
            return ("rep", atom, lo, hi)
        return atom

    def atom(self) -> tuple:
        t = self.take(what="an item")
        if t.kind == "op" and t.text in "([":
            inner = self.expansions()
            close = ")" if t.text == "(" else "]"
            self.take("op", close, what=f"'{close}'")
            return inner if t.text == "(" else ("rep", inner, 0, 1)
        if t.kind == "string":
            text, icase = _string(t)
            if self.peek("op", ".."):
                self.i += 1
                end, _ = _string(self.take("string", what="a string after '..'"))
                if len(text) != 1 or len(end) != 1 or ord(end) < ord(text):
                    raise _error(t.line, f"bad range {t.text}..: both ends must be one character, in order")
                return ("range", ord(text), ord(end))
            return ("str", text, icase, t.line)
        if t.kind == "regex":
            return ("re", t.text, t.line)
        if t.kind == "name":
            if self.peek("op", "{"):
                raise _error(t.line, f"templates ({t.text}{{...}}) are not supported")
            return ("name", t.text, t.line)
        raise _error(t.line, f"unexpected {t.text!r}")


def _string(t: _Tok) -> tuple[str, bool]:
    """A string literal's text (Python's escapes) and whether it is case-insensitive."""
    body, icase = (t.text[1:-2], True) if t.text.endswith("i") else (t.text[1:-1], False)
    out, i = [], 0
    while i < len(body):
        c = body[i]
        i += 1
        if c != "\\":
            out.append(c)
            continue
        e = body[i]
        i += 1
        if e in _ESCAPES:
            out.append(_ESCAPES[e])
        elif e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = body[i:i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise _error(t.line, f"bad escape \\{e}{digits} in {t.text}")
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT or 0xD800 <= cp <= 0xDFFF:
                raise _error(t.line, f"bad escape \\{e}{digits} in {t.text}: not an encodable character")
            out.append(chr(cp))
            i += width
        else:  # as Python: an unknown escape keeps its backslash
            out += ["\\", e]
    if not out:
        raise _error(t.line, "empty string literals are not allowed (Lark refuses them too)")
    return "".join(out), icase


def _parse(text: str) -> _Grammar:
    g = _Grammar()
    for toks in _tokens(text):
        first = toks[0]
        p = _StatementParser(toks)
        if first.kind == "directive":
            _directive(p, g)
            continue
        if first.kind == "op" and first.text in "?!":
            p.i += 1
        name = p.take("name", what="a rule or terminal name")
        if p.peek("op", "."):  # a priority: it orders Lark's lexer, it changes no match here
            p.i += 1
            p.take("number", what="a priority after '.'")
        if p.peek("op", "{"):
            raise _error(name.line, f"templates ({name.text}{{...}}) are not supported")
        p.take("op", ":", what=f"':' after {name.text!r}")
        body = p.expansions()
        if not p.done():
            raise _error(p.toks[p.i].line, f"unexpected {p.toks[p.i].text!r}")
        if name.text in g.definitions:
            raise _error(name.line, f"{name.text!r} is defined twice")
        g.definitions[name.text] = _Definition(name.text, body, name.line)
    return g


def _directive(p: _StatementParser, g: _Grammar) -> None:
    d = p.take()
    if d.text == "%ignore":
        item = p.expansions()
        if not p.done():
            raise _error(d.line, f"unexpected {p.toks[p.i].text!r} after %ignore")
        g.ignores.append((item, d.line))
        return
    if d.text != "%import":
        raise _error(d.line, f"{d.text} is not supported (only %import common... and %ignore)")
    module = p.take("name", what="a module after %import").text
    if module != "common" or not p.peek("op", ".") and not p.peek("op", "("):
        raise _error(d.line, f"only %import common.NAME or %import common (A, B) is supported, not {module!r}")
    if p.peek("op", "("):
        p.i += 1
        while True:
            n = p.take("name", what="a terminal name").text
            g.imports.append((n, n, d.line))
            if p.peek("op", ")"):
                p.i += 1
                break
            p.take("op", ",", what="',' or ')'")
    else:
        p.i += 1
        n = p.take("name", what="a name after 'common.'").text
        local = n
        if p.peek("op", "->"):
            p.i += 1
            local = p.take("name", what="a name after '->'").text
        g.imports.append((n, local, d.line))
    if not p.done():
        raise _error(d.line, f"unexpected {p.toks[p.i].text!r} in %import")


_common: _Grammar | None = None


def _import(g: _Grammar) -> None:
    """Copy each imported common terminal in under its local name, and what it uses under ``common.NAME``."""
    global _common
    if _common is None:
        _common = _parse(COMMON)
    todo: list[tuple[str, str, int]] = list(g.imports)
    seen: set[str] = set()
    while todo:
        name, local, line = todo.pop()
        if local in seen:
            continue
        seen.add(local)
        source = _common.definitions.get(name)
        if source is None:
            raise _error(line, f"common has no terminal {name!r} (it has {', '.join(sorted(_common.definitions))})")
        if local in g.definitions and not local.startswith("common."):
            raise _error(line, f"{local!r} is imported and also defined")
        g.definitions[local] = _Definition(local, _renamed(source.body, todo, line), line)


def _renamed(tree: tuple, todo: list, line: int) -> tuple:
    """A common definition's tree with its names moved into ``common.`` (queued for import)."""
    kind = tree[0]
    if kind == "name":
        todo.append((tree[1], f"common.{tree[1]}", line))
        return ("name", f"common.{tree[1]}", line)
    if kind in ("alt", "seq"):
        return (kind, [_renamed(t, todo, line) for t in tree[1]])
    if kind == "rep":
        return ("rep", _renamed(tree[1], todo, line), tree[2], tree[3])
    return tree


class _Builder(RuleSet):
    """The grammar's trees into rules; in rules (not terminals) every token is followed by the ignored text."""

    def __init__(self, g: _Grammar) -> None:
        super().__init__()
        self.g = g
        self.index = {name: self.new_rule([]) for name in g.definitions}
        self.ignore: int | None = None
        if g.ignores:  # I ::= (ignored) I | (empty)
            self.ignore = self.new_rule([])
            ignored = [alt for tree, _ in g.ignores for alt in self._alternatives(tree, in_rule=False)]
            self.rules[self.ignore] = [self.choice(ignored) + (self.ignore,), ()]
        for name, d in g.definitions.items():
            self.rules[self.index[name]] = self._alternatives(d.body, in_rule=_is_rule(name))

    def _alternatives(self, tree: tuple, in_rule: bool) -> list[tuple[Symbol, ...]]:
        if tree[0] == "alt":
            return [self._symbols(seq, in_rule) for seq in tree[1]]
        return [self._symbols(tree, in_rule)]

    def _token(self, symbols: tuple[Symbol, ...], in_rule: bool) -> tuple[Symbol, ...]:
        return symbols + (self.ignore,) if in_rule and self.ignore is not None else symbols

    def _symbols(self, tree: tuple, in_rule: bool) -> tuple[Symbol, ...]:
        kind = tree[0]
        if kind == "seq":
            return tuple(s for item in tree[1] for s in self._symbols(item, in_rule))
        if kind == "alt":
            return self.choice(self._alternatives(tree, in_rule))
        if kind == "rep":
            return self.repeat(self._symbols(tree[1], in_rule), tree[2], tree[3])
        if kind == "str":
            _, text, icase, _ = tree
            return self._token(tuple(Char(_folded(((ord(c), ord(c)),)) if icase else ((ord(c), ord(c)),))
                                     for c in text), in_rule)
        if kind == "range":
            return self._token((Char(((tree[1], tree[2]),)),), in_rule)
        if kind == "re":
            return self._token(self._regex(tree[1], tree[2]), in_rule)
        _, name, line = tree
        if name not in self.index:
            raise _error(line, f"{name!r} is used but never defined")
        if not in_rule and _is_rule(name):
            raise _error(line, f"a terminal cannot use the rule {name!r} (terminals are made of terminals)")
        return self._token((self.index[name],), in_rule and not _is_rule(name))

    def _regex(self, literal: str, line: int) -> tuple[Symbol, ...]:
        end = literal.rindex("/")
        pattern, flags = literal[1:end], literal[end + 1:]
        unknown = set(flags) - set("is")
        if unknown:
            raise _error(line, f"regex {literal}: flags {''.join(sorted(unknown))!r} are not supported (only i, s)")
        try:
            node = parse_regex(pattern, dotall="s" in flags)
        except RegexError as e:
            raise _error(line, f"regex {literal}: {e}") from None
        return self._node(node, "i" in flags)

    def _node(self, node, icase: bool) -> tuple[Symbol, ...]:
        """A parsed regex (``regex.py``'s tree) as grammar symbols."""
        kind = node[0]
        if kind == "set":
            return (Char(_folded(node[1]) if icase else normalize(node[1])),)
        if kind == "cat":
            return tuple(s for item in node[1] for s in self._node(item, icase))
        if kind == "alt":
            return self.choice([self._node(option, icase) for option in node[1]])
        _, inner, lo, hi = node
        return self.repeat(self._node(inner, icase), lo, hi)


def _is_rule(name: str) -> bool:
    """Lower case names are rules, upper case ones terminals (``common.NAME``: an imported terminal's part)."""
    return name.rsplit(".", 1)[-1].lstrip("_")[:1].islower()


def _folded(ranges) -> tuple:
    """``ranges`` with each character's other case added (left as they are when wider than MAX_CASE_FOLD)."""
    ranges = normalize(ranges)
    if sum(hi - lo + 1 for lo, hi in ranges) > MAX_CASE_FOLD:
        return ranges
    extra = []
    for lo, hi in ranges:
        for cp in range(lo, hi + 1):
            for other in (chr(cp).lower(), chr(cp).upper()):
                if len(other) == 1:
                    extra.append((ord(other), ord(other)))
    return normalize(_without_surrogates(list(ranges) + extra))


def parse_lark(text: str) -> tuple[Rules, int]:
    """A Lark grammar's rules and the index of its root (``start``, after any ignored text)."""
    if not text.strip():
        raise GrammarError("the grammar is empty")
    g = _parse(text)
    _import(g)
    if "start" not in g.definitions:
        raise GrammarError("no rule 'start' (the whole output)")
    b = _Builder(g)
    start = b.index["start"]
    root = b.new_rule([(b.ignore, start)]) if b.ignore is not None else start
    return b.rules, root
