"""Safe evaluation of ``+ - * /`` expressions over int literals, via `ast` (never eval)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

MAX_EXPR_LEN = 64
_ALLOWED_CHARS = frozenset("0123456789+-*/() ")
_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class _Rejected(Exception):
    pass


def evaluate(text: str, max_len: int = MAX_EXPR_LEN) -> tuple[Fraction, list[int]] | None:
    """Exact value and the int literals used, or None if the text is not allowed.

    Allowed: non-negative int literals, binary ``+ - * /`` and parentheses, at most
    `max_len` characters after stripping. Anything else (``**``, ``//``, unary minus,
    names, calls, floats, ...) and division by zero give None. Never raises.
    """
    text = text.strip()
    if not text or len(text) > max_len or not set(text) <= _ALLOWED_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        raise _Rejected

    try:
        value = walk(tree.body)
    except (_Rejected, ZeroDivisionError, RecursionError):
        return None
    return value, literals
