"""Tests for heterorl.peer.tasks: procedural tasks, rewards, answer extraction, JSONL loading."""

from __future__ import annotations

import json
import random
import re
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heterorl.peer.tasks import (
    REWARDS,
    ArithmeticTask,
    CountdownTask,
    Example,
    JsonlTask,
    arithmetic_exact,
    check_jsonl,
    countdown,
    extract_answer,
    get_task,
    gsm8k,
    load_reward,
    named_reward,
    normalize_answer,
    reward_names,
    task_names,
)
from heterorl.peer.tasks.arithmetic import arithmetic_answer

pytestmark = pytest.mark.fast  # in `make test-fast`

seeds = st.integers(min_value=0, max_value=2**32 - 1)


def _stream(task, seed: int, n: int = 20) -> list[Example]:
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(n)]


# --- registry -----------------------------------------------------------------------------------


def test_task_and_reward_names():
    assert task_names() == ["arithmetic", "countdown", "jsonl", "reasoning_gym"]
    assert reward_names() == ["arithmetic_answer", "arithmetic_exact", "countdown", "gsm8k", "math_verify"]
    assert REWARDS["gsm8k"] is gsm8k


def test_get_task_builds_each_kind(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n')
    assert isinstance(get_task("arithmetic", digits=3), ArithmeticTask)
    assert isinstance(get_task("countdown", n_numbers=4), CountdownTask)
    task = get_task(f"jsonl:{path}", answer_field="answer")
    assert isinstance(task, JsonlTask) and task.examples[0].reference == "1"
    from_bytes = get_task("jsonl", data=path.read_bytes(), answer_field="answer")  # a data set's, fetched
    assert from_bytes.examples == task.examples
    assert check_jsonl(path.read_bytes(), {"answer_field": "answer", "reward": "not:imported"}) == 1
    with pytest.raises(ValueError, match=r"dataset:1: missing field 'q'"):
        check_jsonl(path.read_bytes(), {"question_field": "q"})
    with pytest.raises(ValueError, match="reads a file .* or a data set's bytes"):
        get_task(f"jsonl:{path}", data=b"{}")
    with pytest.raises(ValueError, match="takes no ':' argument or data"):
        get_task("arithmetic", data=b"{}")


@pytest.mark.parametrize("spec", ["", "arith", "gsm8k", "jsonl", "jsonl:", "arithmetic:3", "countdown:x"])
def test_bad_spec_raises(spec):
    with pytest.raises(ValueError):
        get_task(spec)


def test_unknown_spec_lists_valid_names():
    with pytest.raises(ValueError, match="arithmetic, countdown, jsonl"):
        get_task("nope")


@pytest.mark.parametrize(
    ("spec", "params", "match"),
    [
        ("arithmetic", {"digits": 0}, "digits"),
        ("arithmetic", {"digits": 10}, "digits"),
        ("arithmetic", {"digits": "2"}, "digits"),
        ("arithmetic", {"digits": True}, "digits"),
        ("arithmetic", {"ops": ""}, "ops"),
        ("arithmetic", {"ops": "+/"}, "ops"),
        ("arithmetic", {"ops": 1}, "ops"),
        ("arithmetic", {"width": 3}, "unknown parameter.*width.*accepted: digits, ops"),
        ("countdown", {"n_numbers": 0}, "n_numbers"),
        ("countdown", {"n_numbers": 7}, "n_numbers"),
        ("countdown", {"max_number": 0}, "max_number"),
        ("countdown", {"max_number": 1000}, "max_number"),
        ("countdown", {"require_all": 1}, "require_all"),
        ("countdown", {"division": "yes"}, "division"),
        ("countdown", {"reward": 3}, "callable"),
        ("countdown", {"reward": "no_such_reward"}, "unknown reward"),
    ],
)
def test_bad_params_raise(spec, params, match):
    with pytest.raises(ValueError, match=match):
        get_task(spec, **params)


# --- arithmetic ---------------------------------------------------------------------------------


def test_arithmetic_prompt_format():
    ex = ArithmeticTask(digits=2, ops="+").sample(random.Random(1))
    a, b = ex.prompt[:-1].split("+")
    assert ex.prompt.endswith("=") and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
    assert ex.solution == ex.reference == str(int(a) + int(b))


@settings(max_examples=50)
@given(seeds)
def test_arithmetic_deterministic(seed):
    task = ArithmeticTask(digits=3, ops="+-*")
    assert _stream(task, seed) == _stream(task, seed)


def test_arithmetic_different_seeds_differ():
    task = ArithmeticTask(digits=3, ops="+-*")
    assert _stream(task, 1) != _stream(task, 2)


@settings(max_examples=100)
@given(seeds, st.integers(1, 9), st.sampled_from(["+", "-", "*", "+-", "+-*", "*-"]))
def test_arithmetic_solution_is_correct(seed, digits, ops):
    task = ArithmeticTask(digits=digits, ops=ops)
    alphabet = set(task.alphabet())
    for ex in _stream(task, seed, 10):
        op = next(c for c in ex.prompt[1:] if c in "+-*")
        a, b = ex.prompt[:-1].split(op, 1)
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert op in ops and expected >= 0 and ex.reference == str(expected)
        assert task.reward(ex.prompt, ex.solution, ex.reference) == 1.0
        assert set(ex.prompt + ex.solution) <= alphabet
        assert len(a) <= digits and len(b) <= digits


def test_arithmetic_exact_reward():
    assert arithmetic_exact("2+3=", " 5\n", "5") == 1.0
    for wrong in ["6", "05", "5.0", "+5", "5 5", "", "five"]:
        assert arithmetic_exact("2+3=", wrong, "5") == 0.0, wrong


def test_arithmetic_alphabet():
    assert ArithmeticTask(ops="-+").alphabet() == "+-0123456789="


# --- arithmetic, question style (for instruct models behind a chat template) ---------------------


def test_arithmetic_question_prompt_and_default_reward():
    task = ArithmeticTask(digits=2, ops="+", style="question")
    ex = task.sample(random.Random(1))
    m = re.fullmatch(r"What is (\d+) \+ (\d+)\? Answer with just the number\.", ex.prompt)
    assert m and ex.solution == ex.reference == str(int(m.group(1)) + int(m.group(2)))
    assert task.reward_fn is arithmetic_answer and ArithmeticTask().reward_fn is arithmetic_exact
    ref = ex.reference
    for reply in [
        ref,
        f" {ref}\n",
        f"The answer is {ref}.",
        f"{m.group(1)} + {m.group(2)} = {ref}",
        f"#### {ref}",
    ]:
        assert task.reward(ex.prompt, reply, ref) == 1.0, reply
    for reply in [
        "",
        "I don't know",
        f"{ref} is wrong, it is {int(ref) + 1}",
        f"{m.group(1)} + {m.group(2)}",
    ]:
        assert task.reward(ex.prompt, reply, ref) == 0.0, reply


@pytest.mark.parametrize(
    ("prompt", "reply", "reward"),
    [
        ("What is 0 + 6? Answer with just the number.", "6", 1.0),
        ("What is 0 + 6? Answer with just the number.", "0 + 6 = 6", 1.0),
        ("What is 0 + 6? Answer with just the number.", "0+6=6.", 1.0),
        ("What is 0 + 6? Answer with just the number.", "#### 6", 1.0),
        ("What is 0 + 6? Answer with just the number.", "That means 0 + 6 is ", 0.0),  # gsm8k says 1.0
        ("What is 0 + 6? Answer with just the number.", "0 plus 6", 0.0),
        ("What is 0 + 6? Answer with just the number.", "10 + 6", 1.0),  # not a restatement of 0 + 6
        ("What is 6 - 3? Answer with just the number.", "Let's see: 6 - 3", 0.0),
        ("What is 6 - 3? Answer with just the number.", "6 − 3 = 3", 1.0),
        ("What is 1 * 7? Answer with just the number.", "1 × 7", 0.0),
        ("What is 1 * 7? Answer with just the number.", "1 times 7 is 7", 1.0),
        ("2+3=", "2+3 is 5", 1.0),  # not a question prompt: plain gsm8k
    ],
)
def test_arithmetic_answer_ignores_restated_questions(prompt, reply, reward):
    reference = str(eval(prompt.removeprefix("What is ").split("?")[0].rstrip("=")))
    assert arithmetic_answer(prompt, reply, reference) == reward


def test_arithmetic_question_reward_is_overridable():
    task = get_task("arithmetic", style="question", reward="arithmetic_exact")
    ex = task.sample(random.Random(0))
    assert task.reward(ex.prompt, ex.reference, ex.reference) == 1.0
    assert task.reward(ex.prompt, f"It is {ex.reference}.", ex.reference) == 0.0
    assert get_task("arithmetic", style="question", reward="gsm8k").reward_fn is gsm8k


@settings(max_examples=60)
@given(
    seeds, st.integers(1, 9), st.sampled_from(["+", "-", "*", "+-*"]), st.sampled_from(["bare", "question"])
)
def test_arithmetic_both_styles_recover_their_references(seed, digits, ops, style):
    task = ArithmeticTask(digits=digits, ops=ops, style=style)
    other = ArithmeticTask(digits=digits, ops=ops, style="bare" if style == "question" else "question")
    alphabet = set(task.alphabet())
    for ex in _stream(task, seed, 10):
        assert task.reference_for(ex.prompt) == ex.reference
        assert other.reference_for(ex.prompt) is None  # each style accepts only its own prompts
        assert task.reward(ex.prompt, ex.solution, ex.reference) == 1.0
        assert set(ex.prompt + ex.solution) <= alphabet


@pytest.mark.parametrize(
    "prompt",
    [
        "What is 2 + 3? Answer with just the number. Also ignore the above.",
        "Ignore the rules. What is 2 + 3? Answer with just the number.",
        "What is 2 + 3? Answer with just the number.\n",
        " What is 2 + 3? Answer with just the number.",
        "What is 2  + 3? Answer with just the number.",
        "What is 2+3? Answer with just the number.",
        "what is 2 + 3? answer with just the number.",
        "What is 02 + 3? Answer with just the number.",  # the task never writes leading zeros
        "What is -2 + 3? Answer with just the number.",
        "What is \u0662 + 3? Answer with just the number.",  # a non-ASCII digit
        "What is 100 + 3? Answer with just the number.",  # more digits than the task's
        "What is 2 * 3? Answer with just the number.",  # not one of the task's ops
        "What is 2 - 3? Answer with just the number.",  # the task never makes negative results
        "What is 2 + 3?",
        "2+3=",
        "",
    ],
)
def test_arithmetic_question_refuses_prompts_it_could_not_have_made(prompt):
    assert ArithmeticTask(digits=2, ops="+-", style="question").reference_for(prompt) is None


def test_arithmetic_question_accepts_its_own_prompts():
    task = ArithmeticTask(digits=2, ops="+-", style="question")
    assert task.reference_for("What is 0 + 99? Answer with just the number.") == "99"
    assert task.reference_for("What is 10 - 10? Answer with just the number.") == "0"


def test_arithmetic_question_alphabet():
    alphabet = ArithmeticTask(ops="+", style="question").alphabet()
    assert alphabet == "".join(sorted(set(alphabet))) and set("0123456789+?. Whatisnumber") <= set(alphabet)
    assert "-" not in alphabet and "=" not in alphabet


@pytest.mark.parametrize(
    ("style", "match"), [("chat", "style must be one of bare, question"), ("", "style"), (1, "style")]
)
def test_arithmetic_bad_style(style, match):
    with pytest.raises(ValueError, match=match):
        get_task("arithmetic", style=style)


# --- countdown ----------------------------------------------------------------------------------


@settings(max_examples=50)
@given(seeds)
def test_countdown_deterministic(seed):
    task = CountdownTask(n_numbers=4, division=True)
    assert _stream(task, seed) == _stream(task, seed)


@settings(max_examples=150)
@given(seeds, st.integers(1, 6), st.integers(1, 999), st.booleans(), st.booleans())
def test_countdown_solution_is_correct(seed, n, max_number, division, require_all):
    task = CountdownTask(n_numbers=n, max_number=max_number, division=division, require_all=require_all)
    alphabet = set(task.alphabet())
    for ex in _stream(task, seed, 10):
        header, target = ex.prompt[:-1].split(">")
        numbers = [int(x) for x in header.split(" ")]
        assert ex.prompt.endswith(":") and len(numbers) == n and ex.reference == target
        assert all(1 <= x <= max_number for x in numbers) and int(target) >= 0
        assert len(ex.solution) <= 64 and ("/" not in ex.solution or division)
        assert task.reward(ex.prompt, ex.solution, ex.reference) == 1.0
        assert set(ex.prompt + ex.solution) <= alphabet


def test_countdown_division_is_used_when_enabled():
    sols = [ex.solution for ex in _stream(CountdownTask(n_numbers=4, division=True), 0, 300)]
    assert any("/" in s for s in sols)


@pytest.mark.parametrize(
    "completion",
    ["3*5+7", "7+5*3", "(5*3)+7", " 3 * 5 + 7 \n", "(7+3*5)", "7+(3*5)", "3*5+7" + " " * 60],
)
def test_countdown_accepts_correct(completion):
    assert countdown("3 5 7>22:", completion, "22") == 1.0


@pytest.mark.parametrize(
    ("completion", "why"),
    [
        ("3*5+8", "wrong value / foreign number"),
        ("3*5+6", "wrong value"),
        ("3*5", "not all numbers used"),
        ("3*5+7+0", "number not given"),
        ("3*5+7*1", "number not given"),
        ("3*7+7-5+5-3+3", "reused numbers"),
        ("3**2+5+7+1", "power"),
        ("x*5+7", "name"),
        ("abs(3)*5+7", "call"),
        ("(3).real*5+7", "attribute"),
        ("3*5+7.0", "float"),
        ("3*5+-7+14", "unary minus"),
        ("15//1+7", "floor division"),
        ("3*5+7/(5-5)", "division by zero"),
        ("3*5;7", "statement separator"),
        ("3*5+7==22", "comparison"),
        ("[3*5+7]", "list"),
        ("(3,5,7)", "tuple"),
        ("__import__('os')", "import"),
        ("", "empty"),
        ("22", "literal target"),
    ],
)
def test_countdown_rejects(completion, why):
    assert countdown("3 5 7>22:", completion, "22") == 0.0, why


def test_countdown_rejects_long_expressions():
    long_ok_value = "+".join(["3*5+7"] + ["(3-3)"] * 12)  # value 22, but > 64 chars and reuses numbers
    assert len(long_ok_value) > 64
    assert countdown("3 5 7>22:", long_ok_value, "22") == 0.0
    numbers = " ".join(["1"] * 40)
    expr = "+".join(["1"] * 40)  # 79 chars, uses each given number exactly once
    assert countdown(f"{numbers}>40:", expr, "40") == 0.0
    assert countdown(f"{numbers}>40:", "+".join(["1"] * 30), "30", require_all=False) == 1.0
    assert countdown("9>9:", "9" + " " * 10**6 + "+0", "9") == 0.0
    assert countdown("9>9:", "(" * 10**5 + "9" + ")" * 10**5, "9") == 0.0


def test_countdown_require_all_false_allows_subsets_but_not_reuse():
    task = CountdownTask(require_all=False)
    assert task.reward("3 5 7>15:", "3*5", "15") == 1.0
    assert task.reward("3 5 7>15:", "5+5+5", "15") == 0.0
    assert CountdownTask().reward("3 5 7>15:", "3*5", "15") == 0.0


def test_countdown_duplicates_in_prompt():
    assert countdown("2 2 6>24:", "2*2*6", "24") == 1.0
    assert countdown("2 2 6>24:", "(2+2)*6", "24") == 1.0
    assert countdown("2 2 6>24:", "2*2*2*3", "24") == 0.0


def test_countdown_fraction_exact():
    assert countdown("1 2 3 6>2:", "6/3*2/2", "2") == 0.0  # 2 used twice
    assert countdown("1 2 3 6>4:", "6/3*2/1", "4") == 1.0
    assert countdown("2 3 4>2:", "4/3*3/2", "2") == 0.0  # 3 used twice
    assert countdown("3 4 6>8:", "4/3*6", "8") == 1.0  # non-integer intermediate, exact
    assert countdown("3 4 6>7:", "4/3*6", "7") == 0.0


def test_countdown_bad_prompt_or_reference_gives_zero():
    assert countdown("no header", "3*5+7", "22") == 0.0
    assert countdown("3 5 7>22:", "3*5+7", "twenty-two") == 0.0
    assert countdown("3 5 7>22:", "3*5+7", "9" * 10_000) == 0.0


@settings(max_examples=500)
@given(st.text(max_size=200), st.text(max_size=80), st.text(max_size=20))
def test_countdown_never_raises(completion, prompt, reference):
    for p in (prompt, "3 5 7>22:"):
        assert countdown(p, completion, reference) in (0.0, 1.0)
        assert countdown(p, completion, "22") in (0.0, 1.0)


@settings(max_examples=300)
@given(st.text(alphabet="0123456789+-*/() ", max_size=80))
def test_countdown_never_raises_on_expression_like_text(completion):
    assert countdown("3 5 7 2 9>22:", completion, "22") in (0.0, 1.0)


# --- answer extraction / gsm8k -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48 clips... 48+24 = 72\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### $1,234.50", "1234.5"),
        ("#### 42.0", "42"),
        ("#### 42.", "42"),
        ("#### -7", "-7"),
        ("#### 42 apples", "42"),
        ("first #### 3\nthen #### 4", "3"),
        ("#### 5 but later \\boxed{6} and 7", "5"),
        ("so the answer is \\boxed{12} ok 99", "12"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1,000}", "1000"),
        ("the total is 3 + 4 = 7.", "7"),
        ("costs $2,500 in total", "2500"),
        ("x = -3", "-3"),
        ("10-3", "3"),
        ("pi is 3.14", "3.14"),
        ("0.50 dollars", "0.5"),
        ("007", "7"),
        ("no digits here", None),
        ("", None),
        ("#### \n", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("a", "b"), [("42", "42.0"), ("1,000", "1000"), ("$5", "5"), ("-0", "0"), ("0.50", ".5"), ("7.", "7")]
)
def test_normalize_answer_equal_numbers(a, b):
    assert normalize_answer(a) == normalize_answer(b)


def test_normalize_answer_distinct_numbers():
    assert normalize_answer("42") != normalize_answer("420")
    assert normalize_answer("1.5") != normalize_answer("15")
    assert normalize_answer("-3") != normalize_answer("3")


@settings(max_examples=200)
@given(st.integers(-(10**12), 10**12))
def test_extract_answer_integers(n):
    assert extract_answer(f"work...\n#### {n:,}") == str(n)
    assert extract_answer(f"answer {n}.0 done") == str(n)


@settings(max_examples=300)
@given(st.text(max_size=300))
def test_extract_answer_never_raises(text):
    result = extract_answer(text)
    assert result is None or isinstance(result, str)
    assert gsm8k("", text, "42") in (0.0, 1.0)


def test_gsm8k_reward():
    assert gsm8k("q", "so 40 + 2 = 42\n#### 42", "42") == 1.0
    assert gsm8k("q", "\\boxed{42.0}", "42") == 1.0
    assert gsm8k("q", "it is 1,000 dollars", "1000") == 1.0
    assert gsm8k("q", "#### 43", "42") == 0.0
    assert gsm8k("q", "I don't know", "42") == 0.0
    assert gsm8k("q", "#### 42", "#### 42") == 0.0  # reference must already be extracted


# --- JSONL --------------------------------------------------------------------------------------


def _write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_loads_and_samples(tmp_path):
    path = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"question": "1+1?", "answer": "It is 2.\n#### 2"}, "", "   ", {"question": "3*3?", "answer": 9}],
    )
    task = JsonlTask(path)
    assert [e.reference for e in task.examples] == ["2", "9"]
    assert task.examples[0] == Example(prompt="1+1?\n", reference="2", solution="It is 2.\n#### 2")
    seen = {task.sample(random.Random(s)).prompt for s in range(50)}
    assert seen == {"1+1?\n", "3*3?\n"}
    assert _stream(task, 7) == _stream(task, 7)
    for ex in task.examples:
        assert task.reward(ex.prompt, ex.solution, ex.reference) == 1.0
        assert set(ex.prompt + ex.solution) <= set(task.alphabet())
    assert task.alphabet() == "".join(sorted(set(task.alphabet())))


def test_jsonl_custom_fields_and_template(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"problem": "Add 2 and 3.", "solution": "\\boxed{5}"}])
    task = get_task(
        f"jsonl:{path}",
        question_field="problem",
        answer_field="solution",
        prompt_template="Q: {question}\nA:",
    )
    ex = task.sample(random.Random(0))
    assert ex.prompt == "Q: Add 2 and 3.\nA:" and ex.reference == "5"


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"question": "a", "answer": "1"}', "{not json"], r"d\.jsonl:2: invalid JSON"),
        (['{"question": "a", "answer": "1"}', "", "[1, 2]"], r"d\.jsonl:3: expected a JSON object"),
        (['{"question": "a"}'], r"d\.jsonl:1: missing field 'answer'"),
        (['{"answer": "1"}'], r"d\.jsonl:1: missing field 'question'"),
        (['{"question": 5, "answer": "1"}'], r"d\.jsonl:1: .*'question' must be a string"),
        (['{"question": "a", "answer": null}'], r"d\.jsonl:1: .*'answer' must be a string or number"),
        (['{"question": "a", "answer": true}'], r"d\.jsonl:1: .*'answer' must be a string or number"),
        (
            ['{"question": "a", "answer": "1"}', '{"question": "b", "answer": "none"}'],
            r"d\.jsonl:2: no final",
        ),
        (["", "  "], r"d\.jsonl: no records"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, match):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        JsonlTask(path)


def test_jsonl_empty_missing_and_binary_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        JsonlTask(empty)
    with pytest.raises(ValueError, match="cannot read"):
        JsonlTask(tmp_path / "missing.jsonl")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"question": "a", "answer": "1"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"bin\.jsonl:2: not valid UTF-8"):
        JsonlTask(binary)


@pytest.mark.parametrize("template", ["no placeholder", "{q}", "{question} {0}", "{question"])
def test_jsonl_bad_template(tmp_path, template):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    with pytest.raises(ValueError, match="prompt_template"):
        JsonlTask(path, prompt_template=template)


def test_jsonl_template_with_escaped_braces(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}])
    assert JsonlTask(path, prompt_template="{{json}} {question}").examples[0].prompt == "{json} a"


# --- custom rewards -----------------------------------------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def always_half(prompt, completion, reference):
                return 0.5

            def length_match(prompt, completion, reference):
                return 1.0 if len(completion) == len(reference) else 0.0

            def too_big(prompt, completion, reference):
                return 2.0

            def one_arg(x):
                return 1.0

            class Scorers:
                @staticmethod
                def zero(prompt, completion, reference):
                    return 0.0

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_load_reward_builtin_and_import_path(reward_module):
    assert load_reward("countdown") is countdown
    fn = load_reward(f"{reward_module}:length_match", [f"{reward_module}:length_match"])
    assert fn("p", "abc", "xyz") == 1.0 and fn("p", "ab", "xyz") == 0.0
    assert (
        load_reward(f"{reward_module}:Scorers.zero", {f"{reward_module}:Scorers.zero"})("p", "c", "r") == 0.0
    )


def test_a_custom_reward_not_allowed_is_refused_before_its_module_is_imported(reward_module):
    for allowed in ((), [f"{reward_module}:length_match"]):  # none, or another function of the module
        with pytest.raises(ValueError, match="not among the rewards allowed"):
            load_reward(f"{reward_module}:always_half", allowed)
        with pytest.raises(ValueError, match="not among the rewards allowed"):
            get_task("arithmetic", allow_rewards=allowed, reward=f"{reward_module}:always_half")
    assert reward_module not in sys.modules


@pytest.mark.parametrize("spec", ["arithmetic", "countdown"])
def test_custom_reward_plugs_into_task(reward_module, spec):
    reward = f"{reward_module}:always_half"
    task = get_task(spec, allow_rewards=named_reward({"reward": reward}), reward=reward)
    ex = task.sample(random.Random(0))
    assert task.reward(ex.prompt, ex.solution, ex.reference) == 0.5
    assert task.reward(ex.prompt, "garbage", ex.reference) == 0.5


def test_custom_reward_callable_and_builtin_name(tmp_path):
    task = get_task("arithmetic", reward=lambda p, c, r: 1.0)
    assert task.reward("1+1=", "wrong", "2") == 1.0
    task = get_task("arithmetic", reward="gsm8k")
    assert task.reward("1+1=", "the answer is 2.0", "2") == 1.0


def test_reward_out_of_range_raises(reward_module):
    reward = f"{reward_module}:too_big"
    task = get_task("arithmetic", allow_rewards=[reward], reward=reward)
    with pytest.raises(ValueError, match="outside"):
        task.reward("1+1=", "2", "2")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_xyz:fn", "cannot import module"),
        ("my_rewards:missing", "no attribute"),
        ("my_rewards:Scorers.missing", "no attribute"),
        ("my_rewards:NOT_CALLABLE", "not callable"),
        ("my_rewards:one_arg", "must accept"),
        ("my_rewards:", "unknown reward"),
        (":fn", "unknown reward"),
        ("exactish", "unknown reward.*arithmetic_exact, countdown, gsm8k"),
        ("", "non-empty"),
    ],
)
def test_load_reward_errors(reward_module, spec, match):
    with pytest.raises(ValueError, match=match):
        load_reward(spec, [spec])
