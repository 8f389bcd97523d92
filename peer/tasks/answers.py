"""Final-answer extraction and normalisation (GSM8K ``####``, ``\\boxed{}``, last number), by hand.

Only for what math-verify does not cover: GSM8K's ``#### 42`` convention (the number after the mark, not the
last expression in the text), and the numeric tasks' rewards without a dependency. A LaTeX answer (fractions,
sets, intervals, expressions) is for the ``math_verify`` reward (:mod:`.math_reward`).
"""

from __future__ import annotations

import re

_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER_RE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?")
_BOXED = "\\boxed{"
MAX_SCAN = 4096  # characters from the end that last_number reads: a final answer is at the end


def normalize_answer(text: str) -> str:
    """Canonical answer text: strip spaces, ``,``, ``$`` and trailing ``.``; numbers to shortest form.

    ``"$1,000.50" -> "1000.5"``, ``"42.0" -> "42"``, ``"-0" -> "0"``; non-numbers are only stripped.
    Equal decimal numbers always normalise to the same string.
    """
    s = text.strip()
    candidate = s.replace(",", "").replace("$", "").strip().rstrip(".")
    m = _DECIMAL_RE.fullmatch(candidate)
    if m is None or not (m.group(2) or m.group(3)):
        return s.rstrip(".").strip()
    sign, whole, frac = m.group(1), m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    number = f"{whole}.{frac}" if frac else whole
    return number if number == "0" or sign != "-" else "-" + number


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}``, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED) : i - 1]
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_answer(text: str) -> str | None:
    """Normalised final answer of `text`, or None if it has none.

    Order: first ``#### answer`` (its first number if it has one), else the last ``\\boxed{...}``,
    else the last number anywhere.
    """
    m = _HASHES_RE.search(text)
    if m and m.group(1).strip():
        number = _NUMBER_RE.search(m.group(1))
        return normalize_answer(number.group(0) if number else m.group(1))
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return normalize_answer(boxed)
    numbers = _NUMBER_RE.findall(text)
    return normalize_answer(numbers[-1]) if numbers else None


def last_number(text: str) -> str | None:
    """The last number in ``text``, normalised (``"so 1,000."`` -> ``"1000"``), or None if it has none."""
    numbers = _NUMBER_RE.findall(text[-MAX_SCAN:])
    return normalize_answer(numbers[-1]) if numbers else None


def gsm8k(prompt: str, completion: str, reference: str) -> float:
    """1.0 iff the completion's extracted answer equals the (normalised) reference."""
    answer = extract_answer(completion)
    return 1.0 if answer is not None and answer == normalize_answer(reference) else 0.0
