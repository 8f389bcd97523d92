"""The ``math_verify`` reward: a completion's final answer checked against the reference by math-verify, which
parses LaTeX and plain expressions to sympy and compares them mathematically (``\\frac{1}{2}`` = ``0.5``,
``\\{1, 2\\}`` = ``\\{2, 1\\}``, intervals with their open and closed ends, ``x \\cdot x`` = ``x^2``).

math-verify comes with the ``tasks`` extra (``pip install 'heterorl[tasks]'``) and is imported only when an
answer is scored. Its own time limits use SIGALRM, which only works on the main thread, so they are turned off
here: the time one answer may take is enforced by the reward worker that runs it (:mod:`.sandbox`).
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "math-verify"
INSTALL = "pip install 'heterorl[tasks]'"
_GSM8K_MARK = "####"
_MATH_MODE = ("$", "\\(", "\\[", "\\boxed")


def missing() -> str | None:
    """Why the ``math_verify`` reward cannot run here (math-verify is not installed), or None. Reads the
    installed distributions' metadata only: nothing is imported."""
    try:
        importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"reward 'math_verify' needs the math-verify package, which is not installed here: {INSTALL}"
    return None


def math_reference(answer: str) -> str | None:
    """The reference a data set's answer field gives the ``math_verify`` reward: the text after a GSM8K
    ``####`` if it has one, else the whole field (a LaTeX answer, or a solution with a ``\\boxed{}`` one);
    None when that is empty."""
    text = answer.rpartition(_GSM8K_MARK)[2].strip()  # the whole field when it has no mark
    return text or None


def gold_text(reference: str) -> str:
    """``reference`` as math-verify should read it: in ``$...$`` unless it is in math mode already or boxed.
    Bare, math-verify would take only part of some answers (``(0, 1]`` as 1, ``2\\sqrt{3}`` as 2)."""
    text = reference.strip()
    return text if any(m in text for m in _MATH_MODE) else f"${text}$"


def math_verify_reward(prompt: str, completion: str, reference: str) -> float:
    """1.0 iff math-verify finds the completion's answer equal to ``reference``; 0.0 otherwise, and for a
    completion or reference it cannot parse. ValueError (with the install command) without math-verify."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise ValueError(missing() or f"reward 'math_verify': cannot import math_verify: {e}") from e
    gold = parse(gold_text(reference), parsing_timeout=None)
    answer = parse(completion, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
