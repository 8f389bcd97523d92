"""The reward fuzz target (``heterorl bench fuzz --targets rewards``): a short run, through the CLI's entry
point, throws bombs, code and hostile text at every reward scorer through the sandbox; nothing gets out, every
answer returns a reward in [0, 1] within the sandbox's limit, honest answers score as in process. And the
oracle notices each kind of failure."""

import importlib.util
import json
import os
import socket
import time

import pytest

from heterorl.bench import fuzz
from heterorl.bench.fuzz import reward_target
from heterorl.bench.fuzz.reward_target import LIMIT_S, RG_DATASETS, SLACK_S, scorer_specs
from heterorl.peer.tasks import reward_names, task_names

INPUTS = 150


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-rewards") / "rewards.json"
    argv = [
        "--targets",
        "rewards",
        "--inputs",
        str(INPUTS),
        "--seed",
        "3",
        "--json",
        str(out),
        "--no-progress",
    ]
    t0 = time.monotonic()
    rc = fuzz.main(argv)
    return rc, json.loads(out.read_text()), time.monotonic() - t0


def _failures(t: dict) -> list:
    return t["crash_examples"] + t["hang_examples"] + t["violation_examples"] + t["harness_error_examples"]


def test_a_short_run_finds_nothing(run):
    rc, report, _ = run
    t = report["targets"]["rewards"]
    assert report["inputs"] == INPUTS == t["inputs"]
    assert t["escaped"] == 0 and not t["details"]["escaped_after_last_input"], _failures(t)
    assert t["crashes"] == t["hangs"] == t["violations"] == t["harness_errors"] == 0, _failures(t)
    assert report["ok"] and rc == 0


def test_the_short_run_sent_bombs_code_and_oversize_text_and_they_cost_one_limit_each(run):
    _, report, _ = run
    totals = report["targets"]["rewards"]["details"]["totals"]
    assert totals["timeouts"] > 0, totals  # bombs ran into the limit
    assert totals["blocked"] > 0, totals  # code reached the audit hook and was refused
    assert totals["errors"] > 0 and totals["oversize"] > 0, totals
    assert totals["max_s"] <= LIMIT_S + SLACK_S


def test_every_built_in_reward_and_task_scorer_is_fuzzed(run):
    _, report, _ = run
    details = report["targets"]["rewards"]["details"]
    scorers, skipped = details["scorers"], details["skipped"]
    fuzzed = {name for name, row in scorers.items() if row["inputs"] > 0}
    assert {"hostile:evaluates", "hostile:sympy_parses"} <= fuzzed
    known = ("arithmetic_exact", "arithmetic_answer", "countdown", "gsm8k", "math_verify")
    for reward in reward_names():
        name = reward if reward in known else f"reward:{reward}"
        assert name in fuzzed or (reward == "math_verify" and name in skipped), (name, skipped)
    if "reasoning_gym" in task_names() and importlib.util.find_spec("reasoning_gym"):
        assert {f"rg:{ds}" for ds in RG_DATASETS} | {"rg:chain_sum/last_number"} <= fuzzed, skipped
    assert set(scorers) | set(skipped) == {s.name for s in scorer_specs()}


@pytest.fixture
def one_scorer(monkeypatch):
    """The target with the eval-ing stand-in only (a fast start), and no fixed first inputs."""
    specs = [s for s in scorer_specs() if s.name == "hostile:evaluates"]
    monkeypatch.setattr(reward_target, "scorer_specs", lambda: specs)
    monkeypatch.setattr(reward_target, "PRELUDE", ())


def test_the_oracle_sees_a_file_a_connection_and_a_process(one_scorer):
    from heterorl.bench.fuzz.harness import _Harness

    target = reward_target.RewardTarget(_Harness(0))
    try:
        assert target._escaped("-") is None
        open(target.canary, "w").close()
        assert target._escaped("-")[:2] == ("escaped", "file(s)")
        assert not os.listdir(target.dir)  # removed: the next input is judged on its own
        with socket.create_connection(("127.0.0.1", target.port), timeout=1) as s:
            s.sendall(b"escaped")
            time.sleep(0.1)
            assert target._escaped("-")[:2] == ("escaped", "a")
        assert target._escaped("-") is None
    finally:
        target.close()
    assert not os.path.exists(target.dir)


def test_an_honest_answer_scored_otherwise_or_too_slowly_fails_the_run(one_scorer, monkeypatch):
    monkeypatch.setattr(reward_target.RewardTarget, "_expected", lambda self, *a: 0.5)
    report = fuzz.run_fuzz(40, seed=1, targets=["rewards"], progress=False, hypothesis_share=0)
    t = report.targets["rewards"]
    assert t.wrong_result > 0 and not report.ok
    assert any("honest answer scored otherwise" in e["signature"] for e in t.violation_examples)
    assert t.details["scorers"]["hostile:evaluates"]["rebuilds"] == reward_target.MAX_REBUILDS
    monkeypatch.undo()

    specs = [s for s in scorer_specs() if s.name == "hostile:evaluates"]
    monkeypatch.setattr(reward_target, "scorer_specs", lambda: specs)
    monkeypatch.setattr(reward_target, "SLACK_S", -LIMIT_S)  # any call is past the limit
    report = fuzz.run_fuzz(5, seed=1, targets=["rewards"], progress=False, hypothesis_share=0)
    assert report.targets["rewards"].hangs > 0 and not report.ok


def test_rewards_is_not_in_the_default_run():
    assert "rewards" in fuzz.ALL_TARGETS and "rewards" not in fuzz.DEFAULT_TARGETS
