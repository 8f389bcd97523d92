"""`heterorl bench throughput`: its rate helpers, and a small real run of every in-process part."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from heterorl.bench.throughput import _real_lengths, steady_rate, swarm_window


def test_steady_rate_leaves_out_the_warmup():
    ends = [0.0, 5.0, 6.0, 7.0, 8.0]  # a slow first step, then one step per second
    assert steady_rate(ends, warmup=1) == pytest.approx(1.0)
    assert steady_rate(ends, warmup=1, per_step=128) == pytest.approx(128.0)
    with pytest.raises(ValueError, match="more than"):
        steady_rate(ends[:2], warmup=1)


def test_swarm_window_reads_wait_and_train_time():
    rows = [
        {"time": 100.0 + 2 * i, "wait_s": 0.5 * i, "train_s": 1.5 * i, "rows": 128, "staleness/mean": i % 3}
        for i in range(10)
    ]
    w = swarm_window(rows, warmup=2)
    assert w["trajectories_per_s"] == pytest.approx(64.0)
    assert w["updates_per_s"] == pytest.approx(0.5)
    assert w["wait_frac"] == pytest.approx(0.25) and w["train_frac"] == pytest.approx(0.75)
    with pytest.raises(ValueError):
        swarm_window(rows[:3], warmup=2)


def test_real_lengths_count_up_to_the_first_eos():
    eos = 2
    c = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    assert _real_lengths(c, eos).tolist() == [3, 5, 1]


def test_in_process_parts_run_and_report_ratios(tmp_path, tiny_model_dir):
    out = tmp_path / "tp"
    cmd = [sys.executable, "-m", "heterorl.cli", "bench", "throughput", "--parts", "rl", "rollout", "learner"]
    cmd += [
        "--model",
        str(tiny_model_dir),
        "--prompts",
        "2",
        "--group-size",
        "4",
        "--steps",
        "5",
        "--warmup",
        "1",
    ]
    cmd += ["--repeats", "2", "--out", str(out), "--profile"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    for part, key in (
        ("rl", "ratio_ours_grpo_vs_trl"),
        ("rl", "ratio_ours_gepo_vs_trl"),
        ("rollout", "ratio_hf_vs_plain"),
        ("learner", "ratio_learner_vs_plain_ce"),
    ):
        assert res[part][key] > 0, (part, key, res[part])
    assert res["rl"]["trl_mean_length"] > 0 and res["rl"]["ours_grpo_mean_length"] > 0
    assert "ratio vs TRL" in done.stdout and "profile: learner update" in done.stdout
