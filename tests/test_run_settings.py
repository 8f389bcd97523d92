"""The run's settings as one tree: every setting documented with a default, run.toml → RunSpec → peer round
trips of the whole tree, forward compatibility of the RunSpec's settings, and one parser behind run.toml keys,
setting flags and ``--set``, whose errors name the setting."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tomllib
import typing

import pytest

from heterorl.cli import build_parser
from heterorl.localswarm import options as local_options
from heterorl.protocol import Identity, decode, encode
from heterorl.protocol.settings import (
    EXAMPLE,
    SPEC_FORMAT,
    LearnerSettings,
    Run,
    RunConfig,
    RunSettings,
    add_flag,
    add_set_flag,
    default_of,
    dump_run_config,
    from_dict,
    from_overrides,
    help_of,
    load_run_config,
    overrides_of,
    parse_run_config,
    paths,
    setting,
    to_dict,
    toml_text,
)
from heterorl.protocol.settings.spec import TYPED
from heterorl.protocol.settings.tree import field_at

pytestmark = pytest.mark.fast

KEY = "ab" * 32
BASE = bytes(range(32))

# non-default values for the settings no rule below can vary (a string is only valid as some names)
NAMED = {
    "model.path": "org/some-model",
    "model.chat": "off",
    "task.name": "countdown",
    "objective.name": "cispo",
    "objective.advantage": "rloo",
    "learner.checkpoint_dtype": "bfloat16",
    "trust.min_reproduced": 0.9,
    "lineage.exchange": "dense",
    "lineage.k": 64,
}


def _other(path: str) -> typing.Any:
    """A valid value of setting ``path`` other than its default."""
    if path in NAMED:
        return NAMED[path]
    holder, name = field_at(Run, path)
    default, annotation = default_of(holder, name), typing.get_type_hints(holder)[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2
    if isinstance(default, tuple):
        return [*default, "o_proj"]
    if isinstance(default, dict):
        return {**default, "extra": 2}
    if default is None:
        return 3 if int in typing.get_args(annotation) else 2.5
    raise AssertionError(f"{path}: no other value for {default!r}; add one to NAMED")


def _everything_changed() -> dict[str, typing.Any]:
    return {p: _other(p) for p in paths(Run) if p != "adapter.base_hash"}  # the coordinator's


def test_every_setting_has_its_help_and_one_default():
    for path in paths(RunConfig):
        holder, name = field_at(RunConfig, path)
        assert help_of(holder, name).strip(), f"{path} has no help"
        default_of(holder, name)  # KeyError if it had none
    for section in dataclasses.fields(Run):
        assert section.metadata["help"].strip(), f"[{section.name}] has no help"
    assert from_overrides(Run, {}) == Run()  # the defaults are a valid run


def test_the_example_config_is_the_defaults():
    cfg = parse_run_config(tomllib.loads(EXAMPLE.replace("<64 hex chars>", KEY)))
    assert cfg == RunConfig(run_id="my-run", learner_keys=(KEY,))


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "adapter"])
def test_the_whole_tree_round_trips_through_a_signed_runspec(adapter):
    changed = _everything_changed()
    if not adapter:
        changed = {p: v for p, v in changed.items() if not p.startswith("adapter.")}
    cfg = from_overrides(RunConfig, changed, {"run_id": "r1", "learner_keys": [KEY]})
    for path in changed:  # every setting off its default, so a dropped one would show
        holder, name = field_at(Run, path)
        section = getattr(cfg, path.split(".")[0])
        assert getattr(section, name) != default_of(holder, name), path
    assert (cfg.adapter is not None) == adapter
    signer = Identity.generate()
    body = cfg.runspec_body(b"\1" * 32, 77, base_hash=BASE if adapter else None)
    _, wire, _ = decode(encode("RunSpec", body, signer), "RunSpec")
    settings = RunSettings.from_spec(wire)
    sent = cfg.as_run()
    if adapter:
        sent = dataclasses.replace(sent, adapter=dataclasses.replace(cfg.adapter, base_hash=BASE.hex()))
    assert settings.as_run() == sent
    assert (settings.run_id, settings.learner_keys) == ("r1", (bytes.fromhex(KEY),))
    assert (settings.vocab_size, settings.initial_checkpoint) == (77, b"\1" * 32)
    hp = json.loads(body["hyperparameters"])
    assert hp["format"] == SPEC_FORMAT and "sampling" not in hp and "path" not in hp["model"]


def _spec_with(hp_change) -> dict:
    body = parse_run_config({"learner_keys": [KEY]}).runspec_body(b"\1" * 32, 40)
    hp = json.loads(body["hyperparameters"])
    hp_change(hp)
    return {**body, "hyperparameters": json.dumps(hp)}


def test_settings_a_newer_coordinator_added_are_ignored_and_reported(caplog):
    def newer(hp):
        hp["learner"]["new_knob"] = 3
        hp["rollout"] = {"speculative": True}

    body = _spec_with(newer)
    settings, ignored = RunSettings.read_spec(body)
    assert sorted(ignored) == ["learner.new_knob", "rollout"]
    assert settings.as_run() == Run()
    with caplog.at_level(logging.WARNING):
        RunSettings.from_spec(body)
    assert "learner.new_knob" in caplog.text and "rollout" in caplog.text


@pytest.mark.parametrize("fmt", [None, 1, 3, "2"])
def test_a_runspec_in_another_format_is_refused_saying_which_this_peer_reads(fmt):
    def other(hp):
        if fmt is None:
            del hp["format"]
        else:
            hp["format"] = fmt

    with pytest.raises(ValueError, match=f"this peer reads format {SPEC_FORMAT}"):
        RunSettings.from_spec(_spec_with(other))


# ---- flags, --set and run.toml: one parser ----


def _train(*argv: str) -> Run:
    return from_overrides(Run, overrides_of(build_parser().parse_args(["train", "--local", *argv])))


def _local(*argv: str) -> Run:
    return local_options.run_of(build_parser().parse_args(["local", *argv]))


def _toml(text: str) -> Run:
    return parse_run_config({**tomllib.loads(text), "learner_keys": [KEY]}).as_run()


@pytest.mark.parametrize(
    "flag, assignment, toml",
    [
        (["--group-size", "4"], "learner.group_size=4", "[learner]\ngroup_size = 4"),
        (["--lr", "0.002"], "objective.lr=2e-3", "[objective]\nlr = 0.002"),
        (["--objective", "grpo"], "objective.name=grpo", '[objective]\nname = "grpo"'),
        (["--task-params", '{"digits": 2}'], "task.params={digits=2}", "[task]\nparams = { digits = 2 }"),
        (
            ["--micro-batch-tokens", "512"],
            "learner.micro_batch_tokens=512",
            "[learner]\nmicro_batch_tokens = 512",
        ),
        (["--model", "some/dir"], "model.path=some/dir", '[model]\npath = "some/dir"'),
        (
            ["--adapter", "rank=4,targets=q_proj"],
            "adapter.rank=4",
            '[adapter]\nrank = 4\ntarget_modules = ["q_proj"]',
        ),
    ],
)
def test_a_flag_a_set_and_a_run_toml_key_give_the_same_tree(flag, assignment, toml):
    from_toml = _toml(toml)
    assert from_toml != Run()
    assert _train(*flag) == from_toml
    assert _local(*flag) == from_toml
    if flag[0] != "--adapter":  # the flag names its targets; --set sets one setting
        assert _train("--set", assignment) == from_toml == _local("--set", assignment)


def test_switches_and_set_winning_over_a_flag():
    assert _train("--gradient-checkpointing", "--tis-cap", "2") == _toml(
        "[learner]\ngradient_checkpointing = true\ntis_cap = 2.0"
    )
    assert _local("--no-deltas") == _toml("[learner]\ndeltas = 0")
    assert _local("--no-deltas", "--set", "learner.deltas=2").learner.deltas == 2
    assert _train("--group-size", "4", "--set", "learner.group_size=2").learner.group_size == 2
    assert _train() == Run()  # no flag given: nothing set, every default the tree's


def test_flag_help_shows_the_trees_default():
    text = _help("train")
    assert f"completions per prompt (default: {default_of(LearnerSettings, 'group_size')})" in text
    assert "UNSET" not in text and "UNSET" not in _help("local")


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[command].format_help().split())


def test_local_real_preset_is_data_under_the_flags():
    real = _local("--real")
    assert real.model.path == local_options.REAL_MODEL_DIR and real.learner.checkpoint_dtype == "bfloat16"
    assert (real.trust.check_share, real.trust.probation_check_share) == (0.5, 0.4)  # SmolLM2's checks on CPU
    assert _local("--real", "--group-size", "2").learner.group_size == 2  # a flag given wins
    assert _local("--real", "--set", "objective.lr=1e-5").objective.lr == 1e-5


def test_local_run_config_is_read_under_the_flags_and_over_the_real_preset(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'run_id = "theirs"\nlearner_keys = ["' + KEY + '"]\n[task]\nname = "reasoning_gym"\n'
        '[task.params]\ndatasets = [{name = "chain_sum", weight = 2}, {name = "leg_counting"}]\n'
        "[learner]\ngroup_size = 3\n"
    )
    run = _local("--run-config", str(toml))
    assert run.task.name == "reasoning_gym"
    assert run.task.params["datasets"][0] == {"name": "chain_sum", "weight": 2}
    assert run.learner.group_size == 3 and run.learner.prompts_per_update == Run().learner.prompts_per_update
    assert _local("--run-config", str(toml), "--group-size", "5").learner.group_size == 5  # a flag wins
    real = _local("--real", "--run-config", str(toml))
    assert real.learner.group_size == 3 and real.task.name == "reasoning_gym"  # the file over the preset
    assert real.model.path == local_options.REAL_MODEL_DIR and "digits" not in real.task.params
    toml.write_text("[learner]\ngroup_sise = 3\n")
    with pytest.raises(ValueError, match="group_sise"):
        _local("--run-config", str(toml))
    with pytest.raises(ValueError, match="cannot read"):
        _local("--run-config", str(tmp_path / "none.toml"))


def test_coordinator_set_overrides_run_toml(tmp_path):
    from heterorl.coordinator.daemon import add_arguments

    path = tmp_path / "run.toml"
    path.write_text(f'learner_keys = ["{KEY}"]\nrun_id = "a"\n[learner]\ngroup_size = 4\n')
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--run-config", str(path), "--set", "learner.group_size=2", "--set", "run_id=b"])
    cfg = load_run_config(path, overrides_of(args))
    assert (cfg.learner.group_size, cfg.run_id) == (2, "b")


@pytest.mark.parametrize(
    "flag, assignment, toml, match",
    [
        (["--group-size", "0"], "learner.group_size=0", "[learner]\ngroup_size = 0", "learner.group_size"),
        (["--lr", "-1"], "objective.lr=-1", "[objective]\nlr = -1", "objective.lr must be a number > 0"),
        (["--top-p", "2"], "sampling.top_p=2", "[sampling]\ntop_p = 2", "sampling.top_p"),
        (["--task-params", "[1]"], "task.params=[1]", "[task]\nparams = [1]", "task.params must be a table"),
        (["--chat", "on"], "model.chat=maybe", '[model]\nchat = "maybe"', "model.chat"),
    ],
)
def test_a_bad_value_names_the_setting_whichever_way_it_came(flag, assignment, toml, match):
    if flag[0] != "--chat":  # argparse's choices refuse a bad --chat already
        with pytest.raises(ValueError, match=match):
            _train(*flag)
    with pytest.raises(ValueError, match=match):
        _train("--set", assignment)
    with pytest.raises(ValueError, match=match):
        _toml(toml)
    path = assignment.split("=")[0]
    section, name = path.split(".")
    value = tomllib.loads(toml)[section][name]
    body = _spec_with(lambda hp: hp.setdefault(section, {}).__setitem__(name, value))
    if path in TYPED:  # a typed field of the RunSpec: its value is there, not in the hyperparameters
        *where, last = TYPED[path]
        node = body
        for key in where:
            node[key] = dict(node[key])
            node = node[key]
        node[last] = value
    with pytest.raises(ValueError, match=match):
        RunSettings.from_spec(body)


def test_an_unknown_setting_on_the_command_line_is_refused_by_name(capsys):
    for argv in (["train", "--local", "--set", "learner.nope=1"], ["local", "--set", "nope=1"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "unknown setting" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--local", "--set", "learner.group_size"])
    assert "SECTION.KEY=VALUE" in capsys.readouterr().err


# ---- run.toml written from the tree ----


def test_local_writes_a_run_toml_that_reads_back_as_its_run():
    run = from_overrides(Run, _everything_changed())
    text = local_options.run_toml(run, [KEY], "local-1")
    cfg = parse_run_config(tomllib.loads(text))
    assert cfg.as_run() == run and (cfg.run_id, cfg.learner_keys) == ("local-1", (KEY,))
    assert "base_hash" not in text  # the coordinator's, refused in run.toml


def test_toml_text_writes_what_tomllib_reads_back():
    data = {
        "name": 'a "quoted" \\ path\twith\nlines, ünïcode, \x7f and \x01',
        "n": -3,
        "x": 1e-7,
        "flags": [True, False],
        "section": {"table": {"weird key": "v", "nested": {"k": 1.5}}, "empty": {}, "none": None},
    }
    text = toml_text.dumps(data)
    back = tomllib.loads(text)
    del data["section"]["none"]  # absent
    assert back == data
    with pytest.raises(ValueError, match="no TOML form"):
        toml_text.dumps({"s": {"t": [None]}})


def test_run_toml_of_the_defaults_leaves_out_what_is_absent():
    cfg = RunConfig(run_id="x", learner_keys=(KEY,))
    data = tomllib.loads(dump_run_config(cfg))
    absent = {k for k, v in to_dict(cfg.learner).items() if v is None}
    assert absent == {"micro_batch_tokens", "tis_cap"} and not absent & set(data["learner"])
    assert "adapter" not in data and "advantage" not in data["objective"]
    assert parse_run_config(data) == cfg


# ---- a new setting is one field ----


@dataclasses.dataclass(frozen=True)
class _NewerLearner(LearnerSettings):
    warmup_updates: int = setting(0, "updates at a ramped-up lr")


@dataclasses.dataclass(frozen=True)
class _NewerConfig(RunConfig):
    learner: _NewerLearner = setting(None, "[learner]", factory=_NewerLearner)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NewerSettings(RunSettings):
    learner: _NewerLearner = setting(None, "[learner]", factory=_NewerLearner)


def test_a_new_setting_is_one_field_from_flag_to_peer_and_older_peers_ignore_it():
    """A newer version's [learner] field, with nothing else added: its flag, --set, run.toml and the
    RunSpec carry it to a peer of that version; a peer of this one ignores it, naming it."""
    ap = argparse.ArgumentParser()
    add_flag(ap, _NewerConfig, "learner.warmup_updates")
    add_set_flag(ap, _NewerConfig)
    assert "updates at a ramped-up lr (default: 0)" in " ".join(ap.format_help().split())
    identity = {"run_id": "r", "learner_keys": [KEY]}
    for argv in (["--warmup-updates", "5"], ["--set", "learner.warmup_updates=5"]):
        cfg = from_overrides(_NewerConfig, overrides_of(ap.parse_args(argv)), identity)
        assert cfg == from_dict(_NewerConfig, {**identity, "learner": {"warmup_updates": 5}})[0]
    body = cfg.runspec_body(b"\1" * 32, 40)
    assert _NewerSettings.from_spec(body).learner.warmup_updates == 5
    older, ignored = RunSettings.read_spec(body)
    assert ignored == ["learner.warmup_updates"] and older.learner == LearnerSettings()
