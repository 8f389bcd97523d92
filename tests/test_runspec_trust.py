"""A volunteer's peer trusts nothing a run asks of it (peer/daemon/consent.py, peer/daemon/weights.py,
coordinator/hosting.py): a RunSpec naming a custom reward the volunteer did not allow, a file on the peer's
disk, or a directory on the host's machine is refused with the reason and the flag that allows it; a model
directory with custom code or only pickled weights is never loaded.

Each refusal is checked at the function that checks a RunSpec (fast, no network), and through real
``heterorl peer`` processes joining a real coordinator (slow): the exit status and the reason as the last log
line. And the way a run gets its data set instead: a coordinator hosting a GSM8K-style jsonl file, a learner
and a sampler fetching it from the swarm by its id and training on it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from heterorl.coordinator.hosting import host_files
from heterorl.peer.daemon.consent import Consent, RunSpecRefused, check_runspec, model_kind
from heterorl.peer.daemon.weights import resolve_model
from heterorl.peer.model.loader import check_model_dir
from heterorl.peer.tasks import check_jsonl
from heterorl.protocol import decode, encode, load_or_create_identity
from heterorl.protocol.net.datasets import held_dataset
from heterorl.protocol.settings import Run, RunConfig, RunSettings, parse_run_config
from heterorl.protocol.settings.sections import ModelSettings, TaskSettings
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.dataset import MAX_DATASET_BYTES
from heterorl.testing.swarm import Swarm

KEY = "ab" * 32
DATASET = "0f" * 32  # a well-formed data set id
REWARD_MODULE = "volunteer_trust_reward"  # written by the tests below; importing it leaves a marker file
QUESTIONS = [(a, b) for a in range(1, 10) for b in range(0, 10)]


def _config(model: str = "tiny", task: str = "arithmetic", run_id: str = "trust", **params) -> RunConfig:
    return RunConfig(
        run_id=run_id,
        learner_keys=(KEY,),
        model=ModelSettings(path=model),
        task=TaskSettings(name=task, params=params),
    )


def _run(model: str = "tiny", task: str = "arithmetic", **params) -> Run:
    return _config(model, task, **params)


def _refused(run: Run, consent: Consent | None = None) -> str:
    with pytest.raises(RunSpecRefused) as e:
        check_runspec(run, consent or Consent(), "trust")
    return str(e.value)


# ---- the function that checks a RunSpec (fast) ----


@pytest.mark.fast
def test_a_custom_reward_is_refused_unless_the_volunteer_allowed_it():
    reward = f"{REWARD_MODULE}:exact"
    reason = _refused(_run(reward=reward))
    assert f"pass --allow-reward {reward}" in reason and "refused the RunSpec of run trust" in reason
    assert REWARD_MODULE not in sys.modules  # refused before anything was imported
    check_runspec(_run(reward=reward), Consent(rewards=(reward,)))  # the same reward, allowed
    assert "--allow-reward" in _refused(_run(reward=reward), Consent(rewards=(f"{REWARD_MODULE}:other",)))
    for builtin in ("gsm8k", "arithmetic_exact", "countdown"):
        check_runspec(_run(reward=builtin), Consent())  # built-ins need no flag
    assert "neither a built-in" in _refused(_run(reward="exactish"))
    assert "neither a built-in" in _refused(_run(reward=3))
    with pytest.raises(ValueError, match="--allow-reward takes 'package.module:function'"):
        Consent(rewards=("gsm8k",))


@pytest.mark.fast
@pytest.mark.parametrize(
    ("task", "params", "match"),
    [
        ("jsonl:/etc/hosts", {}, "would read a file on this machine"),
        ("jsonl:data/gsm8k.jsonl", {"dataset": DATASET}, "would read a file on this machine"),
        ("jsonl", {}, "names no data set"),
        ("jsonl", {"dataset": "/etc/hosts"}, "data set's id"),
        ("jsonl", {"dataset": DATASET[:-2]}, "data set's id"),
        ("arithmetic", {"dataset": DATASET}, "data set's id"),
        ("gsm8k", {}, "unknown task"),
    ],
)
def test_only_a_data_set_named_by_its_id_is_acceptable(task, params, match):
    assert match in _refused(_run(task=task, **params))


@pytest.mark.fast
def test_a_data_set_by_id_and_the_built_in_tasks_are_accepted():
    check_runspec(_run(task="jsonl", dataset=DATASET, answer_field="a", reward="gsm8k"), Consent())
    check_runspec(_run(task="countdown"), Consent())


@pytest.mark.fast
@pytest.mark.parametrize(
    ("model", "kind"),
    [
        ("tiny", "tiny"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "hub"),
        ("org/name", "hub"),
        ("/srv/models/llama", "path"),
        ("./model", "path"),
        ("../model", "path"),
        ("~/model", "path"),
        ("runs/models/smollm2", "path"),
        ("gpt2", "path"),  # a legacy id without an org: ambiguous with a directory, so a path
        ("org/..", "path"),
        ("org/na--me", "path"),
        ("C:\\models\\x", "path"),
    ],
)
def test_a_model_is_the_tiny_one_a_hub_id_or_a_path(model, kind):
    assert model_kind(model) == kind


@pytest.mark.fast
@pytest.mark.parametrize("model", ["/srv/models/llama", "./model", "../model", "~/model", "runs/models/x"])
def test_a_model_path_is_refused_without_model_dir(model, tmp_path):
    assert "pass --model-dir DIR" in _refused(_run(model=model))
    check_runspec(_run(model=model), Consent(model_dir=tmp_path))
    with pytest.raises(RunSpecRefused, match="pass --model-dir DIR"):
        resolve_model(model, tmp_path / "cache")


@pytest.mark.fast
def test_every_reason_is_given_at_once():
    reason = _refused(_run(model="/host/model", task="jsonl:/host/data.jsonl", reward=f"{REWARD_MODULE}:f"))
    assert all(flag in reason for flag in ("--model-dir", "--allow-reward", "would read a file"))


def _model_dir(path: Path, config: dict | None = None, weights: str = "model.safetensors") -> Path:
    """A directory that looks like a model to check_model_dir (it loads nothing)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (path / weights).write_bytes(b"\0" * 16)
    return path


@pytest.mark.fast
def test_a_model_dir_with_custom_code_or_only_pickled_weights_is_refused(tmp_path):
    auto = _model_dir(tmp_path / "auto", {"model_type": "x", "auto_map": {"AutoModelForCausalLM": "m.M"}})
    pickled = _model_dir(tmp_path / "pickled", weights="pytorch_model.bin")
    tok_code = _model_dir(tmp_path / "tok")
    (tok_code / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["t.T", None]}})
    )
    none = _model_dir(tmp_path / "none", weights="README.md")
    cases = [
        (auto, "auto_map"),
        (pickled, "only pickled weights"),
        (tok_code, "auto_map"),
        (none, r"no \*\.safetensors"),
    ]
    for path, match in cases:
        with pytest.raises(ValueError, match=match):
            check_model_dir(path)
        with pytest.raises(RunSpecRefused, match=match):  # whatever the run names, even with --model-dir
            resolve_model("tiny", tmp_path / "cache", model_dir=path)
    with pytest.raises(ValueError, match="no config.json"):
        check_model_dir(tmp_path)
    good = _model_dir(tmp_path / "good")
    assert resolve_model("/host/model", tmp_path / "cache", model_dir=good) == str(good.resolve())


@pytest.mark.fast
def test_a_hub_id_is_loaded_from_the_local_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = tmp_path / "hf"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and were it to try the network, it could not
    with pytest.raises(ValueError, match="not in this machine's Hugging Face cache.*hf download org/model"):
        resolve_model("org/model", tmp_path / "models")
    repo = cache / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    snapshot = _model_dir(repo / "snapshots" / ("a" * 40))
    assert resolve_model("org/model", tmp_path / "models") == str(snapshot)
    (snapshot / "config.json").write_text(json.dumps({"auto_map": {}}))
    with pytest.raises(RunSpecRefused, match="auto_map"):
        resolve_model("org/model", tmp_path / "models")


@pytest.mark.fast
def test_run_toml_may_not_set_the_data_set_id():
    with pytest.raises(ValueError, match="params.dataset is the id the coordinator computes"):
        parse_run_config({"learner_keys": [KEY], "task": {"name": "jsonl", "params": {"dataset": DATASET}}})


def _gsm8k_style(path: Path, n: int = len(QUESTIONS)) -> Path:
    """Records the tiny model's character tokenizer can spell: one-line questions, GSM8K answers."""
    lines = [json.dumps({"question": f"{a}+{b}", "answer": f"#### {a + b}"}) for a, b in QUESTIONS]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines[:n]) + "\n")
    return path


@pytest.mark.fast
def test_the_host_names_its_jsonl_file_by_id_and_its_model_directory_by_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _gsm8k_style(tmp_path / "gsm.jsonl")
    _model_dir(tmp_path / "runs" / "tiny-model")  # relative in run.toml: looks like a hub id, is a directory
    params = {"prompt_template": "{question}=", "reward": "not.imported:here"}
    cfg = _config("runs/tiny-model", "jsonl:gsm.jsonl", **params)
    store = ChunkStore(tmp_path / "chunks", max_bytes=1 << 30)
    hosted = host_files(cfg, store, check_jsonl)
    assert (
        hosted.model.path == str(tmp_path / "runs" / "tiny-model") and model_kind(hosted.model.path) == "path"
    )
    assert hosted.task.name == "jsonl" and set(hosted.task.params) == {*params, "dataset"}
    dataset_id = bytes.fromhex(hosted.task.params["dataset"])
    assert held_dataset(store, dataset_id) == (tmp_path / "gsm.jsonl").read_bytes()
    # the RunSpec carries the id: small, and a peer that allows the reward accepts it
    body = hosted.runspec_body(b"\x01" * 32, 40)
    assert len(body["hyperparameters"]) < 4096 and "gsm.jsonl" not in json.dumps(body, default=str)
    settings = RunSettings.from_spec(body)
    check_runspec(settings, Consent(rewards=("not.imported:here",), model_dir=tmp_path))
    # what the host cannot host is refused with the file's name
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": 5}\n')
    for name, match in [("jsonl:bad.jsonl", "bad.jsonl.*dataset:2"), ("jsonl:missing.jsonl", "cannot read")]:
        with pytest.raises(ValueError, match=match):
            host_files(_config(task=name), store, check_jsonl)
    monkeypatch.setattr("heterorl.coordinator.hosting.MAX_DATASET_BYTES", 100)
    with pytest.raises(ValueError, match="over the 100-byte cap"):
        host_files(cfg, store, check_jsonl)
    assert MAX_DATASET_BYTES == 256 << 20  # the real cap, as documented


# ---- through real processes (slow) ----


def _reward_module(where: Path) -> Path:
    """A custom reward that leaves a marker (its importer's pid) when imported: proof of what ran where."""
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{REWARD_MODULE}.py").write_text(
        textwrap.dedent(
            """
            import os, pathlib
            with open(pathlib.Path(__file__).with_name("imported"), "a") as f:
                f.write(f"{os.getpid()}\\n")

            def exact(prompt, completion, reference):
                head = completion.strip().split()[0] if completion.strip() else ""
                return 1.0 if head == reference else 0.0
            """
        )
    )
    return where / "imported"


def _last_log_line(path: Path) -> str:
    return [line for line in path.read_text().splitlines() if line.strip()][-1]


def _refused_peer(swarm: Swarm, name: str, *flags: str, timeout: float = 90) -> str:
    """Start a sampler with ``flags`` (not the swarm's own model flag): its exit status and last log line."""
    boot = ["--bootstrap", *swarm.ready["maddrs"], "--run-key", swarm.ready["run_key"]]
    args = ["peer", "--state-dir", str(swarm.root / name), "--threads", "1", "--backend", "hf", *boot, *flags]
    done = subprocess.run(
        [sys.executable, "-m", "heterorl.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 1, done.stderr[-3000:]
    return _last_log_line(swarm.root / name / "sampler.log")


@pytest.mark.slow
def test_a_swarm_trains_on_a_data_set_the_coordinator_hosts_and_refuses_a_reward_not_allowed(
    tmp_path, tiny_model_dir
):
    """The host names a jsonl file on its disk and a custom reward; the learner and sampler fetch the data set
    from the swarm by its id and train, allowed to run the reward; a sampler not allowed is refused."""
    code = tmp_path / "code"
    marker = _reward_module(code)
    data = _gsm8k_style(tmp_path / "host-data" / "gsm.jsonl")
    reward = f"{REWARD_MODULE}:exact"
    params = f'{{ prompt_template = "{{question}}=", reward = "{reward}" }}'
    task = f'[task]\nname = "jsonl:{data}"\nparams = {params}\n'
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, prompts_per_update=4, group_size=4, extra_toml=task)
    try:
        swarm.start_coordinator()
        spec = swarm.root / "coordinator" / "runspec.msgpack"
        _, body, _ = decode(spec.read_bytes(), "RunSpec")
        assert body["task"] == "jsonl" and str(data) not in body["hyperparameters"]
        env = ["env", f"PYTHONPATH={code}"]
        swarm.start_learner("--allow-reward", reward, wrap=env)
        swarm.start_sampler("s0", "--allow-reward", reward, wrap=env)
        last = _refused_peer(swarm, "unwilling", "--model-dir", str(tiny_model_dir))
        assert f"pass --allow-reward {reward}" in last and "ERROR" in last, last
        swarm.wait_step(2, timeout=120)
        importers = set(marker.read_text().split())
        # the learner and the sampler ran the reward, each in its process and in its reward worker (which
        # builds the task there: peer/tasks/sandbox.py); the refused peer did not
        assert len(importers) == 4
        held = json.loads(body["hyperparameters"])["task"]["params"]["dataset"]
        for name in ("learner", "s0", "coordinator"):
            store = ChunkStore(swarm.root / name / "chunks", max_bytes=1 << 40, read_only=True)
            assert held_dataset(store, bytes.fromhex(held)) == data.read_bytes(), name
        assert "data set" in (swarm.root / "s0" / "sampler.log").read_text()
        rewards = [m["reward/mean"] for m in swarm.metrics()]
        assert len(rewards) >= 2 and all(0.0 <= r <= 1.0 for r in rewards)
    finally:
        swarm.close()


@pytest.mark.slow
def test_a_peer_refuses_a_runspec_naming_files_on_its_machine(tmp_path, tiny_model_dir):
    """An older or hostile coordinator signs a RunSpec that names a file on the volunteer's disk and a
    directory on the host's: the peer exits 1 with both reasons, and with --model-dir only the file's."""
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir)
    state = swarm.root / "coordinator"
    state.mkdir(parents=True)
    identity, _ = load_or_create_identity(state / "coordinator.key")
    cfg = dataclasses.replace(
        _config(swarm.model_dir, "jsonl:/etc/hosts", run_id="files"), learner_keys=(swarm.learner_key,)
    )
    (state / "runspec.msgpack").write_bytes(encode("RunSpec", cfg.runspec_body(b"\x01" * 32, 40), identity))
    try:
        swarm.start_coordinator()  # resumes with the stored RunSpec
        started = time.monotonic()
        last = _refused_peer(swarm, "volunteer")
        assert "would read a file on this machine" in last and "pass --model-dir DIR" in last, last
        last = _refused_peer(swarm, "volunteer", "--model-dir", str(tiny_model_dir))
        assert "would read a file on this machine" in last and "--model-dir" not in last, last
        assert time.monotonic() - started < 90
        auto = shutil.copytree(tiny_model_dir, tmp_path / "custom-code")
        config = json.loads((auto / "config.json").read_text())
        (auto / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling.M"}}))
        argv = ["peer", "--state-dir", str(tmp_path / "x"), "--bootstrap", *swarm.ready["maddrs"]]
        argv += ["--model-dir", str(auto)]
        done = subprocess.run(
            [sys.executable, "-m", "heterorl.cli", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2 and "auto_map" in done.stderr, done.stderr[-2000:]
    finally:
        swarm.close()
