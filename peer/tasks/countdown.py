"""Countdown: combine the given numbers with ``+ - * (/)`` to hit a target.

Prompt format: the numbers separated by spaces, ``>``, the target, ``:`` -- e.g.
``"3 5 7>22:"``. Solution: an expression using every number once, e.g. ``"3*5+7"``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction
from functools import partial

from ._expr import MAX_EXPR_LEN, evaluate
from ._params import check_bool, check_int
from .base import Example, RewardFn, Task

_PROMPT_RE = re.compile(r"(\d+(?: \d+)*)>(\d+):")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def format_prompt(numbers: list[int], target: int) -> str:
    """``[3, 5, 7], 22 -> "3 5 7>22:"``."""
    return " ".join(map(str, numbers)) + f">{target}:"


def parse_prompt(prompt: str) -> list[int] | None:
    """The numbers of the last countdown header in `prompt`, or None if there is none."""
    matches = _PROMPT_RE.findall(prompt)
    if not matches:
        return None
    try:
        return [int(n) for n in matches[-1][0].split()]
    except ValueError:  # absurdly long digit strings
        return None


def countdown(prompt: str, completion: str, reference: str, *, require_all: bool = True) -> float:
    """1.0 iff `completion` is an allowed expression over the prompt's numbers equal to `reference`.

    Each number may be used at most as often as given (exactly as often if `require_all`).
    Returns 0.0 for anything unparsable or disallowed; never raises.
    """
    numbers = parse_prompt(prompt)
    try:
        target = Fraction(int(reference.strip()))
    except ValueError:
        return 0.0
    result = evaluate(completion) if numbers is not None else None
    if result is None:
        return 0.0
    value, used = result
    have, need = Counter(numbers), Counter(used)
    if any(count > have[n] for n, count in need.items()):
        return 0.0
    if require_all and need != have:
        return 0.0
    return 1.0 if value == target else 0.0


class CountdownTask(Task):
    """Numbers in [1, max_number]; target = a random expression over all of them (always solvable)."""

    name = "countdown"

    def __init__(
        self,
        n_numbers: int = 3,
        max_number: int = 9,
        division: bool = False,
        require_all: bool = True,
        reward: RewardFn | None = None,
    ) -> None:
        self.require_all = check_bool(self.name, "require_all", require_all)
        super().__init__(reward if reward is not None else partial(countdown, require_all=self.require_all))
        self.n_numbers = check_int(self.name, "n_numbers", n_numbers, 1, 6)
        self.max_number = check_int(self.name, "max_number", max_number, 1, 999)
        self.division = check_bool(self.name, "division", division)
        self.ops = "+-*/" if self.division else "+-*"

    def draw(self, rng: random.Random) -> Example:
        numbers = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
        value, text = self._random_expression(numbers, rng)
        assert len(text) <= MAX_EXPR_LEN, text  # guaranteed by the parameter bounds
        return Example(prompt=format_prompt(numbers, value), reference=str(value), solution=text)

    def _random_expression(self, numbers: list[int], rng: random.Random) -> tuple[int, str]:
        """Fold all numbers pairwise with random ops; values stay non-negative integers."""
        items = [(n, str(n), _ATOM) for n in numbers]
        while len(items) > 1:
            i, j = rng.sample(range(len(items)), 2)
            (a, ta, pa), (b, tb, pb) = items[i], items[j]
            op = rng.choice([o for o in self.ops if o != "/" or (b != 0 and a % b == 0)])
            if op == "-" and a < b:
                (a, ta, pa), (b, tb, pb) = (b, tb, pb), (a, ta, pa)
            prec = _PREC[op]
            left = f"({ta})" if pa < prec else ta
            right = f"({tb})" if pb < prec or (pb == prec and op in "-/") else tb
            value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
            items = [it for k, it in enumerate(items) if k not in (i, j)] + [(value, left + op + right, prec)]
        return items[0][0], items[0][1]

    def reference_for(self, prompt: str) -> str | None:
        m = _PROMPT_RE.fullmatch(prompt)
        numbers = parse_prompt(prompt) if m else None
        if numbers is None or len(numbers) != self.n_numbers:
            return None
        if not all(1 <= n <= self.max_number for n in numbers):
            return None
        return str(int(m.group(2)))

    def alphabet(self) -> str:
        return "".join(sorted(set("0123456789 >:()" + self.ops)))
