"""The learner's re-scoring of sampler batches: Task.reference_for and RewardCheck on real token ids."""

from __future__ import annotations

import json
import random

import pytest

from heterorl.peer.learner.intake import RewardCheck
from heterorl.peer.model import build_tokenizer, completion_text
from heterorl.peer.tasks import ArithmeticTask, CountdownTask, JsonlTask

pytestmark = pytest.mark.fast  # in `make test-fast`


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _jsonl(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"{a} plus {a}?", "answer": f"#### {2 * a}"} for a in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return JsonlTask(path)


@pytest.mark.parametrize(
    "make", [lambda p: ArithmeticTask(digits=2, ops="+-*"), lambda p: CountdownTask(), _jsonl]
)
def test_reference_for_recovers_every_sampled_reference(make, tmp_path):
    task = make(tmp_path)
    rng = random.Random(3)
    for _ in range(300):
        ex = task.sample(rng)
        assert task.reference_for(ex.prompt) == ex.reference, ex.prompt


@pytest.mark.parametrize(
    "prompt",
    ["", "12+34", "12+34==", "123+4=", "12/3=", "a+b=", "12+34=5", " 12+34="],
)
def test_arithmetic_refuses_prompts_it_could_not_have_made(prompt):
    assert ArithmeticTask(digits=2, ops="+-").reference_for(prompt) is None


def test_arithmetic_respects_its_own_ops_and_sign():
    task = ArithmeticTask(digits=2, ops="+-")
    assert task.reference_for("7*8=") is None  # '*' is not one of this task's ops
    assert task.reference_for("3-8=") is None  # the task never makes negative differences
    assert task.reference_for("8-3=") == "5"


def test_countdown_refuses_wrong_arity_and_range():
    task = CountdownTask(n_numbers=3, max_number=9)
    good = task.sample(random.Random(0)).prompt
    assert task.reference_for(good) is not None
    assert task.reference_for("garbage") is None
    assert task.reference_for(good + "x") is None


def test_jsonl_unknown_prompt(tmp_path):
    assert _jsonl(tmp_path).reference_for("not a question in the file\n") is None


def _body(task, tok, n: int, seed: int = 0, correct_frac: float = 0.5):
    """A batch body as a sampler would send it: BOS+prompt ids, completion ids ending in EOS, its reward."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        ex = task.sample(rng)
        text = ex.solution if rng.random() < correct_frac else ex.solution + "9"
        prompt_ids = [tok.bos_token_id] + tok.encode(ex.prompt, add_special_tokens=False)
        completion_ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]
        reward = task.reward(ex.prompt, text, ex.reference)
        rows.append(
            {
                "group": i // 2,
                "prompt_ids": prompt_ids,
                "completion_ids": completion_ids,
                "logprobs": [-1.0] * len(completion_ids),
                "reward": reward,
            }
        )
    return {"rows": rows}


def test_completion_text_stops_at_the_first_eos(tok):
    enc = tok.encode
    comp = enc("15", add_special_tokens=False) + [tok.eos_token_id] + enc("7", add_special_tokens=False)
    assert completion_text(tok, comp) == "15"  # stops at the first EOS


@pytest.mark.parametrize("task", [ArithmeticTask(digits=2, ops="+-*"), CountdownTask()])
def test_honest_batch_is_admitted_and_rescored_exactly(task, tok):
    body = _body(task, tok, 16)
    check = RewardCheck(task, tok)
    assert check.rescore(body) == [row["reward"] for row in body["rows"]]
    assert {r["reward"] for r in body["rows"]} == {0.0, 1.0}  # the batch has both outcomes
    assert check(body, b"a" * 32) is None
    assert check.rows_checked == 16 and check.rows_disagreeing == 0 and not check.by_author


def test_inflated_rewards_are_refused_and_counted_against_the_author(tok):
    task = ArithmeticTask(digits=2, ops="+")
    body = _body(task, tok, 8, correct_frac=0.0)
    for row in body["rows"][:3]:
        row["reward"] = 1.0  # wrong answers claimed as right
    check = RewardCheck(task, tok)
    reason = check(body, b"m" * 32)
    assert reason is not None and "3 of 8 rows" in reason
    assert check.rows_disagreeing == 3 and check.by_author[b"m" * 32] == 1


def test_prompts_from_another_task_are_refused(tok):
    body = _body(CountdownTask(), tok, 4)
    check = RewardCheck(ArithmeticTask(digits=2, ops="+"), tok)
    reason = check(body, b"x" * 32)
    assert reason is not None and "not from this run's task" in reason
    assert check.by_author[b"x" * 32] == 1


class _FailingScorer:
    """A reward worker whose call on row ``bad`` timed out: 0, with the incident named."""

    def __init__(self, task, bad: int):
        self.task, self.bad, self.calls, self.incident = task, bad, 0, None

    def __call__(self, prompt, completion, reference):
        self.incident = "timeout" if self.calls == self.bad else None
        self.calls += 1
        return 0.0 if self.incident else self.task.reward_fn(prompt, completion, reference)


def test_a_row_the_reward_worker_could_not_score_drops_the_batch_without_a_strike(tok):
    from heterorl.peer.learner.intake import Refusal

    task = ArithmeticTask(digits=1)
    body = _body(task, tok, 8)
    task.scorer = _FailingScorer(task, bad=2)
    check = RewardCheck(task, tok)
    outcome = check(body, b"a" * 32)
    assert isinstance(outcome, Refusal) and not outcome.strike and "row 2" in outcome.reason
    assert task.scorer.calls == 3  # the rest of the batch is not scored
    assert check.batches_unscored == 1 and not check.by_author
