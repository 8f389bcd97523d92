"""The local loop end to end on the tiny model: outputs, staleness bookkeeping, learning, CLI."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from heterorl.peer.learner.update import StepOptions
from heterorl.peer.train import OneProcessConfig, PolicyLag, run_one_process
from heterorl.protocol.settings import Run, RunConfig, RunSettings, from_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_policy_lag_serves_k_versions_old():
    policy = torch.nn.Linear(1, 1, bias=False)
    lag = PolicyLag(policy, torch.nn.Linear(1, 1, bias=False), delay=2)
    seen = []
    for step in range(5):
        model, version = lag.behaviour()
        seen.append((version, float(model.weight.detach())))
        with torch.no_grad():
            policy.weight.fill_(step + 1.0)
        lag.step()
    weights = [0.0] + [float(i) for i in range(1, 6)]
    assert [v for v, _ in seen] == [0, 0, 0, 1, 2]
    assert [w for _, w in seen][3:] == [weights[1], weights[2]]


def test_run_local_writes_outputs_and_tracks_staleness(tiny_model_dir, tmp_path):
    run = from_overrides(
        Run, {"model.path": str(tiny_model_dir), "learner.prompts_per_update": 4, "learner.group_size": 4}
    )
    cfg = OneProcessConfig(run, steps=5, delay=2)
    summary = run_one_process(cfg, tmp_path, progress=False)
    for key in ("objective", "delay", "steps", "reward_curve"):
        assert key in summary
    assert len(summary["reward_curve"]) == 5
    assert summary["eval_curve"] == []  # 5 updates, fewer than learner.eval_every: no evaluation
    assert summary["rewards"]["answers"] == 5 * 16 and summary["rewards"]["crashes"] == 0  # the reward worker
    assert json.loads((tmp_path / "summary.json").read_text())["delay"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2, 2]
    assert all(0 < r["is/ess"] <= 1 for r in rows)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint")


@pytest.fixture
def one_torch_thread():
    """torch on one CPU thread for the test: the same sums in the same order on any machine and any load (an
    intra-op pool sized by the machine can reorder float reductions, and so the sampled rollouts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_gepo_reward_rises(tiny_model_dir, tmp_path, one_torch_thread):
    """GEPO learns the tiny task: the mean reward of the last 40 of 160 updates beats the first 40's by 0.08.
    Seeds 0-19 (each another draw of the run, as another machine's float rounding is) give +0.12 to +0.19;
    the first and last 20 of 80 updates, against a 0.05 bar, gave +0.04 to +0.12 and failed 4 of 20."""
    cfg = OneProcessConfig(from_overrides(Run, {"model.path": str(tiny_model_dir)}), steps=160, seed=0)
    curve = run_one_process(cfg, tmp_path, progress=False)["reward_curve"]
    first, last = sum(curve[:40]) / 40, sum(curve[-40:]) / 40
    assert last > first + 0.08, f"reward {first:.3f} over the first 40 updates, {last:.3f} over the last 40"


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="unknown objective"):
        from_overrides(Run, {"objective.name": "nope"})
    with pytest.raises(ValueError, match="delay"):
        OneProcessConfig(delay=-1)
    with pytest.raises(ValueError, match="grad_clip"):  # checked as run.toml's [learner] is
        from_overrides(Run, {"learner.grad_clip": 0})
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        OneProcessConfig(device="auto")  # the CLI resolves auto; the loop takes a device
    with pytest.raises(ValueError, match="hf backend"):
        OneProcessConfig(from_overrides(Run, {"adapter.rank": 4}), backend="vllm")


def test_the_loop_defaults_to_a_runs_settings_and_updates_as_the_learner_does():
    run = RunConfig(run_id="r", learner_keys=("ab" * 32,))
    settings = RunSettings.from_spec(run.runspec_body(b"\x01" * 32, 40))
    cfg = OneProcessConfig()
    assert cfg.run == run.as_run() == settings.as_run()  # one tree, one set of defaults
    assert StepOptions.from_settings(cfg.run) == StepOptions.from_settings(settings)


def test_cli_help_and_errors(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "heterorl", "train", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--delay" in out.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "heterorl",
            "train",
            "--local",
            "--model",
            str(tmp_path),
            "--objective-params",
            "{not json",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "error" in bad.stderr


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "heterorl", "train", *args], capture_output=True, text=True, timeout=600
    )


def test_cli_train_takes_a_device_and_records_it(tmp_path, tiny_model_dir):
    assert "--device {auto,cpu,cuda}" in _train("--help").stdout
    out = tmp_path / "run"
    args = ["--local", "--device", "cpu", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "2"]
    done = _train(*args, "--prompts", "2", "--group-size", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["config"]["device"] == "cpu"
    assert "hf generate, float32, cpu" in done.stderr  # the rollouts ran there too


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: --device cuda would train on it")
def test_cli_train_on_cuda_without_a_gpu_says_so(tmp_path):
    done = _train("--local", "--device", "cuda", "--model", str(tmp_path), "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "--device cuda asked for, but torch sees no CUDA GPU" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_the_loop_trains_and_samples_on_cuda(tiny_model_dir, tmp_path):
    run = {"model.path": str(tiny_model_dir), "learner.prompts_per_update": 2, "learner.group_size": 4}
    cfg = OneProcessConfig(from_overrides(Run, run), steps=3, device="cuda")
    seen = []
    summary = run_one_process(
        cfg, tmp_path, progress=False, on_update=lambda _s, policy, _st: seen.append(policy.device.type)
    )
    assert summary["device"] == "cuda" and set(seen) == {"cuda"} and len(summary["reward_curve"]) == 3


def test_every_package_folder_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = cfg["package-dir"]
    listed = set(cfg["packages"])
    for top, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            assert ".".join((top, *rel)) in listed, f"{init.parent} is not in pyproject packages"


def test_cli_train_without_local_says_so():
    out = subprocess.run([sys.executable, "-m", "heterorl", "train"], capture_output=True, text=True)
    assert out.returncode == 2 and "only --local" in out.stderr
