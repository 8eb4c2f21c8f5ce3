"""A multi grader's ``calculate_output``: arithmetic over its graders' scores, parsed once and evaluated safely
(numbers, the graders' names, ``+ - * / ^`` (``^`` and ``**`` are powers), parentheses, and ``min``, ``max``,
``abs``, ``floor``, ``ceil``, ``exp``, ``sqrt``, ``log``); nothing else of Python is reachable."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping

FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil, "exp": math.exp,
    "sqrt": math.sqrt, "log": math.log,
}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class Formula:
    """``Formula(text, names)`` checks ``text`` (a ValueError says what is wrong); ``value(scores)`` computes it."""

    def __init__(self, text: str, names: set[str], where: str = "calculate_output") -> None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: expected a formula over the graders' names, e.g. '0.5 * a + 0.5 * b'")
        try:
            # ``^`` is a power, binding as tightly as ``**`` (Python's ``^``, exclusive or, binds more loosely than +)
            tree = ast.parse(text.strip().replace("^", "**"), mode="eval")
        except SyntaxError as e:
            raise ValueError(f"{where}: not a formula ({e.msg} at column {e.offset})") from None
        self.text, self.where = text, where
        self.names = self._check(tree.body, names)
        self._tree = tree.body

    def _check(self, node: ast.AST, names: set[str]) -> set[str]:
        """The graders' names ``node`` reads; ValueError for anything outside the formula language."""
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return set()
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise ValueError(f"{self.where}: {node.id!r} is not one of the graders "
                                 f"({', '.join(sorted(names)) or 'none'})")
            return {node.id}
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return self._check(node.left, names) | self._check(node.right, names)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._check(node.operand, names)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
            if node.func.id not in FUNCTIONS:
                raise ValueError(f"{self.where}: {node.func.id}() is not one of {', '.join(FUNCTIONS)}")
            if not node.args:
                raise ValueError(f"{self.where}: {node.func.id}() needs an argument")
            return set().union(*(self._check(a, names) for a in node.args))
        raise ValueError(f"{self.where}: {ast.unparse(node)!r} is not allowed in a formula (numbers, grader names, "
                         f"+ - * / ^, parentheses and {', '.join(FUNCTIONS)})")

    def value(self, scores: Mapping[str, float]) -> float:
        """The formula's value for the graders' ``scores``; ValueError if it is undefined (e.g. a division by 0)."""
        try:
            out = float(self._eval(self._tree, scores))
        except (ArithmeticError, ValueError, TypeError) as e:
            raise ValueError(f"{self.where}: {self.text!r} is undefined for {dict(scores)} ({e})") from None
        if not math.isfinite(out):
            raise ValueError(f"{self.where}: {self.text!r} is {out} for {dict(scores)}")
        return out

    def _eval(self, node: ast.AST, scores: Mapping[str, float]) -> float:
        if isinstance(node, ast.Constant):
            return float(node.value)  # floats throughout: a power of integers cannot grow without bound
        if isinstance(node, ast.Name):
            return float(scores[node.id])
        if isinstance(node, ast.BinOp):
            return _BINARY[type(node.op)](self._eval(node.left, scores), self._eval(node.right, scores))
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._eval(node.operand, scores))
        return FUNCTIONS[node.func.id](*(self._eval(a, scores) for a in node.args))
