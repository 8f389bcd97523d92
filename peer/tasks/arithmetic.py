"""Procedural integer arithmetic: prompt ``"23+45="``, solution ``"68"``."""

from __future__ import annotations

import random
import re

from ._params import check_int, check_str
from .base import Example, RewardFn, Task

ALLOWED_OPS = "+-*"
_PROMPT_RE = re.compile(r"(\d{1,9})([+*-])(\d{1,9})=")


def arithmetic_exact(prompt: str, completion: str, reference: str) -> float:
    """1.0 iff the whitespace-stripped completion is exactly the reference integer text."""
    return 1.0 if completion.strip() == reference.strip() else 0.0


class ArithmeticTask(Task):
    """``a<op>b=`` with operands in [0, 10**digits); ``-`` orders operands so results are >= 0."""

    name = "arithmetic"

    def __init__(self, digits: int = 2, ops: str = "+", reward: RewardFn = arithmetic_exact) -> None:
        super().__init__(reward)
        self.digits = check_int(self.name, "digits", digits, 1, 9)
        check_str(self.name, "ops", ops)
        bad = sorted(set(ops) - set(ALLOWED_OPS))
        if bad:
            raise ValueError(f"{self.name}: ops must be a subset of {ALLOWED_OPS!r}, got {ops!r}")
        self.ops = "".join(dict.fromkeys(ops))

    def sample(self, rng: random.Random) -> Example:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = rng.choice(self.ops)
        if op == "-" and a < b:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Example(prompt=f"{a}{op}{b}=", reference=str(value), solution=str(value))

    def reference_for(self, prompt: str) -> str | None:
        m = _PROMPT_RE.fullmatch(prompt)
        if m is None or m.group(2) not in self.ops:
            return None
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if max(a, b) >= 10**self.digits or (op == "-" and a < b):
            return None
        return str(a + b if op == "+" else a - b if op == "-" else a * b)

    def alphabet(self) -> str:
        return "".join(sorted(set("0123456789=" + self.ops)))
