"""The ``math_verify`` reward (peer/tasks/math_reward.py): LaTeX and plain answers compared as mathematics
by math-verify, with its SIGALRM time limits off (so it scores off the main thread too); a jsonl data set of
LaTeX answers scored with it; and what happens where math-verify is not installed.

The tests that score import math-verify (and sympy), so they are not in the fast tier; the rest are.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import random
import sys

import pytest

from heterorl.peer.daemon.consent import Consent, RunSpecRefused, check_runspec
from heterorl.peer.tasks import REWARDS, check_jsonl, get_task, math_verify_reward
from heterorl.peer.tasks.math_reward import gold_text, math_reference
from heterorl.protocol.settings import RunConfig
from heterorl.protocol.settings.sections import TaskSettings

RIGHT = [
    # (reference, a completion that earns 1)
    ("72", "Natalia sold 48 + 24 = 72 clips, so the answer is 72."),
    ("72", "The answer is $\\boxed{72}$."),
    ("72", "#### 72"),
    ("-3", "x = \\boxed{-3}"),
    ("3.5", "\\boxed{\\frac{7}{2}}"),
    ("\\frac{1}{2}", "The probability is $\\boxed{0.5}$."),
    ("$\\frac{1}{2}$", "\\boxed{\\frac{2}{4}}"),
    ("\\dfrac{3}{4}", "so $\\boxed{3/4}$"),
    ("\\{1, 2\\}", "The solutions form the set $\\boxed{\\{2, 1\\}}$."),
    ("[0, 1)", "$x \\in \\boxed{[0, 1)}$"),
    ("(0, 1]", "\\boxed{(0,1]}"),
    ("2\\sqrt{3}", "\\boxed{\\sqrt{12}}"),
    ("x^2 + 1", "\\boxed{1 + x \\cdot x}"),
    ("The answer is $\\boxed{12}$.", "\\boxed{12}"),
]
WRONG = [
    ("72", "The answer is 73."),
    ("72", "I do not know."),
    ("72", ""),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"),
    ("\\{1, 2\\}", "\\boxed{\\{1, 3\\}}"),
    ("[0, 1)", "\\boxed{[0, 1]}"),
    ("(0, 1]", "\\boxed{1}"),  # the bare reference, read as math-verify reads it bare, would be 1
    ("2\\sqrt{3}", "\\boxed{2}"),
    ("x^2 + 1", "\\boxed{x^2 - 1}"),
]


@pytest.mark.parametrize(("reference", "completion"), RIGHT)
def test_an_equal_answer_earns_1(reference, completion):
    assert math_verify_reward("", completion, reference) == 1.0


@pytest.mark.parametrize(("reference", "completion"), WRONG)
def test_a_different_or_missing_answer_earns_0(reference, completion):
    assert math_verify_reward("", completion, reference) == 0.0


def test_an_unparsable_reference_earns_nothing():
    assert math_verify_reward("", "\\boxed{1}", "") == 0.0
    assert math_verify_reward("", "\\boxed{1}", "}{") == 0.0


def test_it_scores_off_the_main_thread():
    """Its own timeouts (SIGALRM) would fail outside the main thread: they are off."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda rc: math_verify_reward("", rc[1], rc[0]), RIGHT[:6] + WRONG[:3]))
    assert scores == [1.0] * 6 + [0.0] * 3


@pytest.mark.fast
def test_a_reference_outside_math_mode_is_put_in_it():
    assert gold_text("72") == "$72$" and gold_text(" (0, 1] ") == "$(0, 1]$"
    for text in ("$72$", "\\boxed{72}", "so $x$", "\\(x\\)", "\\[x\\]"):
        assert gold_text(text) == text


@pytest.mark.fast
def test_the_reference_of_a_data_set_answer():
    assert math_reference("She sold 24 in May.\n#### 72") == "72"
    assert math_reference("  \\frac{1}{2} ") == "\\frac{1}{2}"
    assert math_reference("#### ") is None and math_reference("   ") is None


@pytest.mark.fast
def test_it_is_a_built_in_reward():
    assert REWARDS["math_verify"] is math_verify_reward


def _latex_jsonl(path):
    records = [
        {"question": "What is half of one?", "answer": "\\frac{1}{2}"},
        {"question": "Which x satisfy x^2 = 1?", "answer": "\\{-1, 1\\}"},
        {"question": "Where is x if 0 <= x < 1?", "answer": "[0, 1)"},
        {"question": "What is pi to the power 1?", "answer": "\\pi"},  # no number in it at all
        {"question": "Natalia sold 48 clips, then half as many. How many?", "answer": "48 + 24\n#### 72"},
        {"question": "What is 4 + 8?", "answer": "So it is $\\boxed{12}$."},
        {"question": "How many legs has a spider?", "answer": 8},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_jsonl_task_of_latex_answers_scored_by_math_verify(tmp_path):
    path = _latex_jsonl(tmp_path / "math.jsonl")
    task = get_task(f"jsonl:{path}", reward="math_verify")
    assert [ex.reference for ex in task.examples] == [
        "\\frac{1}{2}",
        "\\{-1, 1\\}",
        "[0, 1)",
        "\\pi",
        "72",
        "So it is $\\boxed{12}$.",
        "8",
    ]
    right = [
        "\\boxed{0.5}",
        "$\\boxed{\\{1, -1\\}}$",
        "\\boxed{[0,1)}",
        "\\boxed{\\pi}",
        "72",
        "\\boxed{12}",
        "8",
    ]
    wrong = ["\\boxed{2}", "$\\boxed{\\{1\\}}$", "\\boxed{(0,1)}", "\\boxed{3.14}", "27", "\\boxed{13}", "9"]
    for ex, good, bad in zip(task.examples, right, wrong, strict=True):
        assert task.reference_for(ex.prompt) == ex.reference
        assert task.reward(ex.prompt, good, ex.reference) == 1.0, (ex.reference, good)
        assert task.reward(ex.prompt, bad, ex.reference) == 0.0, (ex.reference, bad)
    # the host's check of its data set takes the same references: "\pi" has no number, yet is an answer
    data = path.read_bytes()
    assert check_jsonl(data, {"reward": "math_verify"}) == 7
    with pytest.raises(ValueError, match="no final answer found"):
        check_jsonl(data, {"reward": "gsm8k"})  # the last-number extraction finds none in "\pi"
    with pytest.raises(ValueError, match="no final answer found"):
        check_jsonl(
            data, {"reward": "not.imported:here"}
        )  # a custom reward is left out: the default extraction
    assert "not" not in sys.modules


def test_gsm8k_answers_score_the_same_with_either_reward(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{a}+{a}", "answer": f"#### {2 * a}"}) + "\n" for a in range(5))
    )
    plain, latex = get_task(f"jsonl:{path}"), get_task(f"jsonl:{path}", reward="math_verify")
    rng = random.Random(0)
    for _ in range(5):
        ex = plain.draw(rng)
        for reply in (f"It is {ex.reference}.", f"#### {int(ex.reference) + 1}", "no idea"):
            assert plain.reward(ex.prompt, reply, ex.reference) == latex.reward(
                ex.prompt, reply, ex.reference
            )


# ---- without math-verify ----


def _without_math_verify(monkeypatch) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "math-verify":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.fast
def test_without_math_verify_the_task_is_refused_with_the_install_command(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q", "answer": "1"}\n')
    _without_math_verify(monkeypatch)
    with pytest.raises(ValueError, match=r"math-verify.*not installed here: pip install 'heterorl\[tasks\]'"):
        get_task(f"jsonl:{path}", reward="math_verify")
    get_task(f"jsonl:{path}", reward="gsm8k")  # other rewards do not need it
    monkeypatch.setitem(sys.modules, "math_verify", None)  # and the reward itself, called anyway
    with pytest.raises(ValueError, match=r"pip install 'heterorl\[tasks\]'"):
        math_verify_reward("", "1", "1")


@pytest.mark.fast
def test_a_peer_without_math_verify_refuses_a_run_that_names_it(monkeypatch):
    run = RunConfig(
        run_id="mv",
        learner_keys=("ab" * 32,),
        task=TaskSettings(name="arithmetic", params={"digits": 1, "reward": "math_verify"}),
    )
    check_runspec(run.as_run(), Consent())
    _without_math_verify(monkeypatch)
    with pytest.raises(
        RunSpecRefused, match=r"reward 'math_verify' needs the math-verify package.*heterorl\[tasks\]"
    ):
        check_runspec(run.as_run(), Consent(), "mv")
