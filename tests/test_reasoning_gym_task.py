"""The ``reasoning_gym`` task (peer/tasks/reasoning_gym.py): prompts from reasoning-gym's data sets, one or a
weighted mixture, the same in every process; the learner's way back from a prompt to its entry; the data set's
own scorer; the held-out split; the library's version pinned by the host (coordinator/hosting.py) and checked
by a volunteer's peer (peer/daemon/consent.py) and by the task itself; run.toml and the CLI carrying it.

Tests that build a task import reasoning-gym (and sympy), so they are not in the fast tier; the version and
consent checks read installed metadata only and are.
"""

from __future__ import annotations

import collections
import importlib.metadata
import json
import os
import random
import subprocess
import sys
import textwrap
import tomllib

import pytest

from heterorl.coordinator.hosting import host_files
from heterorl.peer.daemon.consent import Consent, RunSpecRefused, check_runspec
from heterorl.peer.tasks import ReasoningGymTask, check_jsonl, get_task
from heterorl.peer.tasks import reasoning_gym as rg_task
from heterorl.peer.tasks.base import HELD_OUT_MAX, in_held_out_split
from heterorl.protocol.settings import RunConfig, RunSettings, dump_run_config, parse_run_config
from heterorl.protocol.settings.run import OWN_DATASET_PARAM as settings_own
from heterorl.protocol.settings.sections import TaskSettings
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.dataset import OWN_DATASET_PARAM as wire_own

KEY = "ab" * 32
INSTALLED = importlib.metadata.version("reasoning-gym")
MIXTURE = [{"name": "basic_arithmetic", "weight": 1}, {"name": "leg_counting", "weight": 2}]


@pytest.fixture(scope="module")
def arithmetic() -> ReasoningGymTask:
    return get_task("reasoning_gym", dataset="basic_arithmetic", size=400)


@pytest.fixture(scope="module")
def mixture() -> ReasoningGymTask:
    return get_task("reasoning_gym", datasets=MIXTURE, size=600, seed=3)


def _without_library(monkeypatch) -> None:
    """importlib.metadata as on a machine without reasoning-gym and math-verify."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name in ("reasoning-gym", "math-verify"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def _answer(task: ReasoningGymTask, reference: str) -> str:
    return str(task.dataset[int(reference)]["answer"])


# ---- prompts, references, rewards ----


def test_a_prompt_is_the_instruction_then_the_question(arithmetic):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    ex = arithmetic.draw(random.Random(0))
    entry = arithmetic.dataset[int(ex.reference)]
    assert ex.prompt == SYSTEM_PROMPTS["direct"] + "\n\n" + entry["question"]
    assert ex.solution == f"<answer>{entry['answer']}</answer>"
    other = get_task("reasoning_gym", dataset="basic_arithmetic", size=400, instructions="chain_of_draft")
    same = other.dataset[int(ex.reference)]["question"]
    assert same == entry["question"]  # the instruction changes, the entries do not
    assert other.reference_for(SYSTEM_PROMPTS["chain_of_draft"] + "\n\n" + same) is not None
    assert arithmetic.version == INSTALLED


def test_reference_for_finds_the_entry_a_prompt_came_from(arithmetic, mixture):
    for task in (arithmetic, mixture):
        rng = random.Random(1)
        for _ in range(30):
            ex = task.draw(rng)
            ref = task.reference_for(ex.prompt)
            # the first entry with that prompt: the same question (and answer) as the one drawn
            assert ref is not None and int(ref) <= int(ex.reference)
            assert task.dataset[int(ref)]["question"] == task.dataset[int(ex.reference)]["question"]
            assert task.reward(ex.prompt, ex.solution, ref) == 1.0
        assert task.reference_for(ex.prompt + " ") is None
        assert task.reference_for("Calculate 1 + 1.") is None  # no instruction in front
        assert task.reference_for(task.prefix + "What is the meaning of life?") is None


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "leg_counting", "chain_sum"])
def test_the_data_sets_own_scorer_pays_the_right_answer_only(dataset):
    task = get_task("reasoning_gym", dataset=dataset, size=300)
    rng = random.Random(2)
    for _ in range(5):
        ex = task.sample(rng)
        answer = _answer(task, ex.reference)
        assert task.reward(ex.prompt, f"Thinking... <answer>{answer}</answer>", ex.reference) == 1.0
        wrong = answer[:-1] + ("2" if answer.endswith("1") else "1")
        assert task.reward(ex.prompt, f"<answer>{wrong}</answer>", ex.reference) == 0.0
        assert task.reward(ex.prompt, f"<answer>x</answer> <answer>{answer}</answer>", ex.reference) == 1.0
        assert task.reward(ex.prompt, answer, ex.reference) == 0.0  # no <answer> tags: no answer
    # a reference that is not this prompt's entry, or not an index at all, pays nothing
    ex = task.draw(rng)
    other = next(str(i) for i in range(task.size) if task.prefix + task.dataset[i]["question"] != ex.prompt)
    for ref in (other, "-1", "0x1", " 1", "01", "\u0661", str(task.size), "", "1e3", "9" * 5000):
        assert task.reward(ex.prompt, ex.solution, ref) == 0.0, ref


def test_extract_last_number_scores_an_untagged_reply_on_its_last_number():
    task = get_task("reasoning_gym", dataset="chain_sum", size=300, extract="last_number")
    tags_only = get_task("reasoning_gym", dataset="chain_sum", size=300)
    ex = task.draw(random.Random(8))
    answer = _answer(task, ex.reference)
    wrong = str(int(answer) + 1)
    for reply, paid in [
        (f"The answer is {answer}.", 1.0),
        (f"{ex.prompt[-12:]} {answer}", 1.0),
        (f"It is {answer}, no wait, {wrong}", 0.0),  # the last number is the answer
        (f"<answer>{wrong}</answer> so {answer}", 0.0),  # tags win where there are some
        (f"<answer>{answer}</answer> not {wrong}", 1.0),
        ("no number here", 0.0),
    ]:
        assert task.reward(ex.prompt, reply, ex.reference) == paid, reply
    assert tags_only.reward(ex.prompt, f"The answer is {answer}.", ex.reference) == 0.0


def test_a_mixture_draws_each_data_set_at_its_weight(mixture):
    rng = random.Random(4)
    drawn = collections.Counter(
        mixture.dataset[int(mixture.draw(rng).reference)]["metadata"]["source_dataset"] for _ in range(600)
    )
    assert set(drawn) == {"basic_arithmetic", "leg_counting"}
    assert 0.58 < drawn["leg_counting"] / 600 < 0.75  # weight 2 of 3
    for name in drawn:  # and each is scored by its own scorer
        ex = next(e for e in (mixture.draw(rng) for _ in range(100)) if _source(mixture, e) == name)
        assert mixture.reward(ex.prompt, ex.solution, ex.reference) == 1.0
        assert mixture.reward(ex.prompt, "<answer>-0.5</answer>", ex.reference) == 0.0


def _source(task, ex) -> str:
    return task.dataset[int(ex.reference)]["metadata"]["source_dataset"]


def test_another_reward_gets_the_entrys_answer_as_its_reference():
    task = get_task("reasoning_gym", dataset="leg_counting", size=300, reward="gsm8k")
    ex = task.draw(random.Random(5))
    answer = _answer(task, ex.reference)
    assert task.reward(ex.prompt, f"so #### {answer}", ex.reference) == 1.0
    assert task.reward(ex.prompt, f"so #### {int(answer) + 1}", ex.reference) == 0.0
    assert task.reward(ex.prompt, f"so #### {answer}", "nope") == 0.0


def test_held_out_entries_are_listed_in_order_and_never_drawn_for_training(monkeypatch):
    task = get_task("reasoning_gym", dataset="leg_counting", size=2000)
    held = task.held_out()
    assert 15 <= len(held) <= 70  # about 2 % of 2000
    assert all(in_held_out_split(ex.prompt) and task.is_held_out(ex.prompt) for ex in held)
    assert [int(ex.reference) for ex in held] == sorted(int(ex.reference) for ex in held)
    assert (
        held == get_task("reasoning_gym", dataset="leg_counting", size=2000).held_out()
    )  # the same anywhere
    assert all(task.reward(ex.prompt, ex.solution, ex.reference) == 1.0 for ex in held)
    rng = random.Random(6)
    training = {task.sample(rng).prompt for _ in range(400)}
    assert not training & {ex.prompt for ex in held}
    monkeypatch.setattr(rg_task, "HELD_OUT_MAX", 5)
    fresh = get_task("reasoning_gym", dataset="leg_counting", size=2000)
    assert fresh.held_out() == held[:5] and HELD_OUT_MAX == 200


def test_a_small_task_is_listed_whole_and_holds_nothing_out():
    task = get_task("reasoning_gym", dataset="leg_counting", size=40)
    listed = task.all_examples()
    assert listed is not None and len(listed) == 40 and task.held_out() == listed
    assert not any(task.is_held_out(ex.prompt) for ex in listed)
    assert [ex.reference for ex in listed] == [str(i) for i in range(40)]


def test_a_small_prompt_space_in_many_entries_is_evaluated_whole_each_prompt_once():
    easiest = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = get_task("reasoning_gym", dataset="chain_sum", config=easiest, size=2000)
    listed = task.all_examples()
    assert listed is not None and len({ex.prompt for ex in listed}) == len(listed) == 200  # 10 x 10 x (+, -)
    assert task.held_out() == listed and not any(task.is_held_out(ex.prompt) for ex in listed)
    assert all(task.reference_for(ex.prompt) == ex.reference for ex in listed)  # each prompt's first entry
    rng = random.Random(9)
    drawn = [task.sample(rng) for _ in range(50)]
    assert all(task.reward(ex.prompt, ex.solution, ex.reference) == 1.0 for ex in drawn)
    large = get_task("reasoning_gym", dataset="leg_counting", size=2000)
    assert large.all_examples() is None  # a large space


def test_the_alphabet_holds_every_character_of_the_prompts_and_solutions(arithmetic):
    alphabet = arithmetic.alphabet()
    assert alphabet == "".join(sorted(set(alphabet)))
    rng = random.Random(7)
    for _ in range(50):
        ex = arithmetic.draw(rng)
        assert set(ex.prompt + ex.solution) <= set(alphabet)


# ---- parameters ----


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({}, "exactly one of dataset"),
        ({"dataset": "leg_counting", "datasets": MIXTURE}, "exactly one of dataset"),
        ({"dataset": "no_such_set"}, "dataset must name a reasoning-gym data set"),
        ({"dataset": "composite"}, "dataset must name"),
        ({"dataset": 7}, "dataset must name"),
        ({"dataset": "word_ladder"}, "differ from one process to another"),
        ({"dataset": "leg_counting", "config": {"seed": 1}}, "config.seed is not leg_counting's"),
        ({"dataset": "leg_counting", "config": {"min_animal": 1}}, "no parameter.*min_animal"),
        ({"dataset": "leg_counting", "config": {"min_animals": 0}}, "refused dataset 'leg_counting'"),
        ({"dataset": "leg_counting", "config": [1]}, "config must be a table"),
        ({"datasets": MIXTURE, "config": {}}, "config goes with dataset"),
        ({"datasets": []}, "datasets must be a non-empty list"),
        ({"datasets": "leg_counting"}, "datasets must be a non-empty list"),
        ({"datasets": [{"name": "leg_counting", "weight": 0}]}, r"datasets\[0\].weight must be a positive"),
        ({"datasets": [{"name": "leg_counting", "weight": True}]}, r"datasets\[0\].weight"),
        ({"datasets": [{"name": "leg_counting", "wieght": 1}]}, r"datasets\[0\] has unknown key.*wieght"),
        ({"datasets": [{"name": "leg_counting"}, {"name": "leg_counting"}]}, "in the mixture twice"),
        ({"datasets": [{"name": "sokoban"}]}, r"datasets\[0\].name 'sokoban' is refused"),
        ({"datasets": ["leg_counting"]}, r"datasets\[0\] must be a"),
        ({"dataset": "leg_counting", "size": 0}, "size must be in"),
        ({"dataset": "leg_counting", "size": rg_task.MAX_SIZE + 1}, "size must be in"),
        ({"dataset": "leg_counting", "seed": -1}, "seed must be in"),
        ({"dataset": "leg_counting", "instructions": "shout"}, "instructions must be one of"),
        ({"dataset": "leg_counting", "version": 25}, "version must be a non-empty string"),
        ({"dataset": "leg_counting", "colour": "red"}, "unknown parameter.*colour"),
        ({"dataset": "leg_counting", "extract": "first_word"}, "extract must be one of"),
        ({"dataset": "leg_counting", "extract": "last_number", "reward": "gsm8k"}, "extract is for the data"),
        # a config the generator accepts but cannot draw from is refused when the task is built
        ({"dataset": "simple_equations", "config": {"operators": ["+"]}}, "refused dataset 'simple_equat"),
    ],
)
def test_bad_parameters_are_refused_by_name(params, match):
    with pytest.raises(ValueError, match=match):
        get_task("reasoning_gym", **params)


@pytest.mark.fast
def test_the_version_pin_is_checked_before_the_library_is_imported(monkeypatch):
    with pytest.raises(ValueError) as e:
        ReasoningGymTask(dataset="leg_counting", version="0.0.1")
    assert f"pins reasoning-gym 0.0.1, this machine has {INSTALLED}" in str(e.value)
    assert "pip install 'reasoning-gym==0.0.1'" in str(e.value)
    _without_library(monkeypatch)
    for version in (None, "0.1.25"):
        with pytest.raises(ValueError, match=r"not installed here: pip install 'heterorl\[tasks\]'") as e:
            ReasoningGymTask(dataset="leg_counting", version=version)
        assert ("reasoning-gym==0.1.25" in str(e.value)) == (version is not None)


def test_the_pinned_version_builds_the_task():
    assert get_task("reasoning_gym", dataset="leg_counting", size=10, version=INSTALLED).version == INSTALLED


# ---- the swarm: host pins, peers check ----


def _config(**params) -> RunConfig:
    return RunConfig(
        run_id="gym", learner_keys=(KEY,), task=TaskSettings(name="reasoning_gym", params=params)
    )


def _refusal(cfg: RunConfig) -> str:
    with pytest.raises(RunSpecRefused) as e:
        check_runspec(cfg.as_run(), Consent(), "gym")
    return str(e.value)


@pytest.mark.fast
def test_the_host_pins_the_installed_version_where_run_toml_leaves_it_out(tmp_path, monkeypatch):
    store = ChunkStore(tmp_path / "chunks", max_bytes=1 << 20)
    hosted = host_files(_config(datasets=MIXTURE), store, check_jsonl)
    assert hosted.task.params == {"datasets": MIXTURE, "version": INSTALLED}
    assert host_files(_config(dataset="leg_counting", version="9.9"), store, check_jsonl).task.params == {
        "dataset": "leg_counting",
        "version": "9.9",  # the host's choice stands
    }
    check_runspec(RunSettings.from_spec(hosted.runspec_body(b"\1" * 32, 40)), Consent())  # peers like it
    _without_library(monkeypatch)
    with pytest.raises(
        ValueError, match=r"reasoning-gym is not installed here.*pip install 'heterorl\[tasks\]'"
    ):
        host_files(_config(dataset="leg_counting"), store, check_jsonl)
    assert host_files(_config(dataset="leg_counting", version="0.1.25"), store, check_jsonl).task.params == {
        "dataset": "leg_counting",
        "version": "0.1.25",
    }


@pytest.mark.fast
def test_a_peer_refuses_a_run_pinned_to_a_version_it_does_not_have(monkeypatch):
    check_runspec(_config(dataset="leg_counting", version=INSTALLED).as_run(), Consent())
    reason = _refusal(_config(dataset="leg_counting", version="0.0.1"))
    assert f"pins reasoning-gym 0.0.1, this machine has {INSTALLED}" in reason
    assert "pip install 'reasoning-gym==0.0.1'" in reason
    assert "pins no reasoning-gym version" in _refusal(_config(dataset="leg_counting"))
    _without_library(monkeypatch)
    reason = _refusal(_config(dataset="leg_counting", version=INSTALLED))
    assert "needs the reasoning-gym package" in reason and "pip install 'heterorl[tasks]'" in reason


@pytest.mark.fast
def test_importing_the_tasks_and_the_consent_check_imports_no_task_library():
    code = (
        "import sys, heterorl.peer.tasks, heterorl.peer.daemon.consent; "
        "print([m for m in ('reasoning_gym', 'math_verify', 'sympy') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


# ---- the same prompts in every process ----

_DIGEST = textwrap.dedent(
    """
    import hashlib, json, sys
    from heterorl.peer.tasks import get_task
    from heterorl.peer.tasks.reasoning_gym import _library
    rg = _library()
    out = {}
    for name, params in json.loads(sys.argv[1]):
        if params is None:  # a data set the task refuses: straight from the library
            ds = rg.create_dataset(name, seed=0, size=20)
            items = [(ds[i]["question"], str(ds[i]["answer"])) for i in range(20)]
        else:
            task = get_task("reasoning_gym", **params)
            items = [(e.prompt, e.solution, e.reference) for e in task.held_out()]
            items += [task.reference_for(prompt) for prompt, _, _ in items]
        out[name] = hashlib.sha256(json.dumps(items).encode()).hexdigest()
    print(json.dumps(out))
    """
)


def test_every_process_generates_the_same_prompts_whatever_its_hash_seed():
    cases = [
        ["basic_arithmetic", {"dataset": "basic_arithmetic", "size": 300}],
        ["leg_counting", {"dataset": "leg_counting", "size": 300}],
        ["chain_sum", {"dataset": "chain_sum", "size": 300}],
        ["gsm_symbolic", {"dataset": "gsm_symbolic", "size": 300}],
        ["mixture", {"datasets": MIXTURE + [{"name": "chain_sum", "weight": 0.5}], "size": 300, "seed": 9}],
        ["ransom_note", None],  # one the task refuses: the check does see it differ
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DIGEST, json.dumps(cases)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    digests = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    differ = {name for name in digests[0] if digests[0][name] != digests[1][name]}
    assert differ == {"ransom_note"}
    assert "ransom_note" in rg_task.NONDETERMINISTIC


# ---- run.toml and the CLI ----


def test_run_toml_carries_a_mixture_inline_or_as_tables_through_the_runspec():
    first = '{ name = "basic_arithmetic", weight = 1 }'
    inline = f"""
        learner_keys = ["{KEY}"]
        [task]
        name = "reasoning_gym"
        params = {{ datasets = [{first}, {{ name = "leg_counting", weight = 2 }}] }}
    """
    tables = f"""
        learner_keys = ["{KEY}"]
        [task]
        name = "reasoning_gym"
        [task.params]
        size = 500
        [[task.params.datasets]]
        name = "basic_arithmetic"
        weight = 1
        config = {{ max_terms = 3, operators = ["+", "-"] }}
        [[task.params.datasets]]
        name = "leg_counting"
        weight = 2
    """
    for text in (inline, tables):
        cfg = parse_run_config(tomllib.loads(textwrap.dedent(text)))
        assert cfg.task.params["datasets"][1] == {"name": "leg_counting", "weight": 2}
        assert parse_run_config(tomllib.loads(dump_run_config(cfg))) == cfg  # what `heterorl local` writes
        spec = RunSettings.from_spec(cfg.runspec_body(b"\1" * 32, 40))
        assert spec.task == cfg.task
        task = get_task(spec.task.name, **spec.task.params)
        assert [s.name for s in task.sources] == ["basic_arithmetic", "leg_counting"]
    # `dataset` is this task's own parameter; in a jsonl task it is still the coordinator's alone
    assert set(settings_own) == set(wire_own) == {ReasoningGymTask.name}
    parse_run_config({"learner_keys": [KEY], "task": {"name": "reasoning_gym", "params": {"dataset": "gcd"}}})
    with pytest.raises(ValueError, match="params.dataset is the id the coordinator computes"):
        parse_run_config(
            {"learner_keys": [KEY], "task": {"name": "jsonl:x.jsonl", "params": {"dataset": "x"}}}
        )


def test_train_local_flags_reach_the_task():
    from heterorl.cli import build_parser
    from heterorl.protocol.settings import Run, from_overrides, overrides_of

    argv = ["train", "--local", "--task", "reasoning_gym", "--task-params", '{"dataset": "basic_arithmetic"}']
    run = from_overrides(Run, overrides_of(build_parser().parse_args(argv)))
    assert run.task == TaskSettings(name="reasoning_gym", params={"dataset": "basic_arithmetic"})
    task = get_task(run.task.name, **run.task.params)
    assert task.sources[0].name == "basic_arithmetic" and task.size == rg_task.DEFAULT_SIZE
