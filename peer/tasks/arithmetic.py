"""Procedural integer arithmetic: prompt ``"23+45="``, solution ``"68"``.

Two prompt styles: ``"bare"`` (``"23+45="``, for the tiny model, scored by exact match) and ``"question"``
(``"What is 23 + 45? Answer with just the number."``, for instruct models behind their chat template, scored
by default with the ``gsm8k`` answer extractor, so ``"23 + 45 = 68."`` earns the reward too, but a reply that
only restates the question does not: see ``arithmetic_answer``).
"""

from __future__ import annotations

import random
import re

from ._params import check_int, check_str
from .answers import gsm8k
from .base import ENUMERATE_MAX, Example, RewardFn, Task

ALLOWED_OPS = "+-*"
STYLES = ("bare", "question")
QUESTION_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
_PROMPT_RE = re.compile(r"(\d{1,9})([+*-])(\d{1,9})=")
_NUMBER = r"(0|[1-9][0-9]{0,8})"  # what str(int) makes: ASCII, no sign, no leading zeros
_QUESTION_RE = re.compile(
    re.escape(QUESTION_TEMPLATE)
    .replace(re.escape("{a}"), _NUMBER)
    .replace(re.escape("{op}"), r"([+*-])")
    .replace(re.escape("{b}"), _NUMBER)
)


_OP_WORDS = {
    "+": r"(?:\+|plus)",
    "-": r"(?:[-\u2212\u2013]|minus)",
    "*": r"(?:[*x\u00d7\u00b7]|times|multiplied by)",
}


def arithmetic_exact(prompt: str, completion: str, reference: str) -> float:
    """1.0 iff the whitespace-stripped completion is exactly the reference integer text."""
    return 1.0 if completion.strip() == reference.strip() else 0.0


def arithmetic_answer(prompt: str, completion: str, reference: str) -> float:
    """``gsm8k`` (``####``, ``\\boxed{}``, else the last number) of the reply, once restatements of the
    question's ``a op b`` are deleted from it: echoing "0 + 6" is not an answer to "What is 0 + 6?" though
    its last number is right; ``"0 + 6 = 6"`` still scores. Prompts not in the question style: ``gsm8k``.
    """
    m = _QUESTION_RE.fullmatch(prompt)
    if m is not None:
        a, op, b = m.groups()
        restated = rf"(?<![\d.]){a}\s*{_OP_WORDS[op]}\s*{b}(?![\d.])"
        completion = re.sub(restated, " ", completion, flags=re.IGNORECASE)
    return gsm8k(prompt, completion, reference)


class ArithmeticTask(Task):
    """``a<op>b=`` with operands in [0, 10**digits); ``-`` orders operands so results are >= 0.

    ``style="question"`` asks ``QUESTION_TEMPLATE`` instead; its default reward is ``arithmetic_answer``
    (``gsm8k``'s answer extraction, restatements of the question ignored), the bare style's is
    ``arithmetic_exact``.
    """

    name = "arithmetic"

    def __init__(
        self, digits: int = 2, ops: str = "+", style: str = "bare", reward: RewardFn | None = None
    ) -> None:
        check_str(self.name, "style", style)
        if style not in STYLES:
            raise ValueError(f"{self.name}: style must be one of {', '.join(STYLES)}, got {style!r}")
        self.style = style
        default = arithmetic_answer if style == "question" else arithmetic_exact
        super().__init__(reward if reward is not None else default)
        self.digits = check_int(self.name, "digits", digits, 1, 9)
        check_str(self.name, "ops", ops)
        bad = sorted(set(ops) - set(ALLOWED_OPS))
        if bad:
            raise ValueError(f"{self.name}: ops must be a subset of {ALLOWED_OPS!r}, got {ops!r}")
        self.ops = "".join(dict.fromkeys(ops))

    def draw(self, rng: random.Random) -> Example:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        op = rng.choice(self.ops)
        if op == "-" and a < b:
            a, b = b, a
        return self._example(a, op, b)

    def _example(self, a: int, op: str, b: int) -> Example:
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Example(prompt=self._prompt(a, op, b), reference=str(value), solution=str(value))

    def all_examples(self) -> list[Example] | None:
        n = 10**self.digits
        size = sum(n * (n + 1) // 2 if op == "-" else n * n for op in self.ops)
        if size > ENUMERATE_MAX:
            return None
        return [
            self._example(a, op, b)
            for op in self.ops
            for a in range(n)
            for b in range(n)
            if op != "-" or a >= b
        ]

    def rewarded_completions(self, example: Example, max_chars: int) -> list[str] | None:
        """With the exact-match reward: the answer with any spaces around it (what ``strip`` forgives)."""
        if self.reward_fn is not arithmetic_exact:
            return None
        room = max_chars - len(example.solution)
        return [
            " " * left + example.solution + " " * right
            for left in range(max(room, -1) + 1)
            for right in range(room - left + 1)
        ]

    def _prompt(self, a: int, op: str, b: int) -> str:
        if self.style == "question":
            return QUESTION_TEMPLATE.format(a=a, op=op, b=b)
        return f"{a}{op}{b}="

    def reference_for(self, prompt: str) -> str | None:
        m = (_QUESTION_RE if self.style == "question" else _PROMPT_RE).fullmatch(prompt)
        if m is None or m.group(2) not in self.ops:
            return None
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if max(a, b) >= 10**self.digits or (op == "-" and a < b):
            return None
        return str(a + b if op == "+" else a - b if op == "-" else a * b)

    def alphabet(self) -> str:
        literal = QUESTION_TEMPLATE.format(a="", op="", b="") if self.style == "question" else "="
        return "".join(sorted(set("0123456789" + literal + self.ops)))
