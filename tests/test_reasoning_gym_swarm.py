"""A reasoning-gym mixture named in a run.toml trains on the swarm: ``heterorl local --run-config`` starts a
coordinator (which pins the library's version in the RunSpec), a learner and a sampler as processes on
127.0.0.1, with a tiny model built for the mixture's prompts (their newlines, their length); the sampler
scores its rows and the learner re-scores every row it trains on, both in their reward workers, and agree.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib

import pytest

pytest.importorskip("reasoning_gym")

MIXTURE = [
    {"name": "chain_sum", "weight": 2, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
    {"name": "leg_counting", "weight": 1, "config": {"min_animals": 1, "max_animals": 1, "max_instances": 1}},
]
STEPS = 4


def test_a_reasoning_gym_mixture_in_run_toml_trains_on_the_swarm(tmp_path):
    from heterorl.peer.model import build_tiny_model
    from heterorl.peer.tasks import get_task

    params = {"datasets": MIXTURE, "size": 400, "extract": "last_number"}
    model = build_tiny_model(tmp_path / "model", "reasoning_gym", params, steps=20, progress=False)
    config = json.loads((model / "config.json").read_text())
    task = get_task("reasoning_gym", **params)
    assert config["max_position_embeddings"] > 64  # room for the questions, longer than the built-in tasks'
    assert "\n" in json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    assert config["vocab_size"] >= len(set(task.alphabet()))

    run_toml = tmp_path / "run.toml"
    run_toml.write_text(
        '[task]\nname = "reasoning_gym"\n[task.params]\nsize = 400\nextract = "last_number"\n'
        + "".join(
            f'[[task.params.datasets]]\nname = "{d["name"]}"\nweight = {d["weight"]}\n'
            f"[task.params.datasets.config]\n" + "".join(f"{k} = {v}\n" for k, v in d["config"].items())
            for d in MIXTURE
        )
        + "[learner]\nprompts_per_update = 4\ngroup_size = 2\neval_every = 0\n"
        + "[sampler]\nprompts_per_batch = 2\n[sampling]\nmax_new_tokens = 8\n"
    )
    out = tmp_path / "local"
    cmd = [sys.executable, "-m", "heterorl.cli", "local", "--run-config", str(run_toml)]
    cmd += ["--model", str(model)]
    cmd += ["--samplers", "1", "--steps", str(STEPS), "--out", str(out), "--no-view", "--timeout", "600"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=700)
    assert done.returncode == 0, done.stderr[-4000:]

    written = tomllib.loads((out / "run.toml").read_text())
    assert written["task"]["name"] == "reasoning_gym" and written["task"]["params"]["datasets"] == MIXTURE
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["batches_rejected"] == 0, summary.get("rejections")
    assert summary["batches_applied"] >= STEPS * 2  # 2 batches of 2 prompts an update
    final = json.loads((out / "learner" / "final_stats.json").read_text())
    assert final["rewards"]["answers"] >= STEPS * 4 * 2  # every trained row re-scored in the reward worker
    assert final["rewards"]["crashes"] == final["rewards"]["timeouts"] == 0
    coordinator_log = (out / "coordinator.stderr.log").read_text()
    assert importlib.metadata.version("reasoning-gym") in coordinator_log  # the version the RunSpec pins
