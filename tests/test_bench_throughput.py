"""`heterorl bench throughput`: its rate helpers, a small real run of every in-process part, and the parts on
vLLM's engine (our vllm backend's rollouts, the weight switch) on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from heterorl.bench.throughput import add_arguments, report, resolve_defaults, steady_rate, swarm_window
from heterorl.bench.throughput_micro import real_lengths


def test_steady_rate_leaves_out_the_warmup():
    ends = [0.0, 5.0, 6.0, 7.0, 8.0]  # a slow first step, then one step per second
    assert steady_rate(ends, warmup=1) == pytest.approx(1.0)
    assert steady_rate(ends, warmup=1, per_step=128) == pytest.approx(128.0)
    with pytest.raises(ValueError, match="more than"):
        steady_rate(ends[:2], warmup=1)


def test_swarm_window_reads_wait_train_and_publishing_time():
    rows = [
        {
            "time": 100.0 + 2 * i,
            "wait_s": 0.5 * i,
            "train_s": 1.4 * i,
            "publish_blocked_s": 0.1 * i,  # the training thread's share: 5 %
            "publish_save_s": 0.2 * i,  # the publisher thread's own time
            "publish_build_s": 0.6 * i,
            "publish_announce_s": 0.02 * i,
            "published": i // 2,  # every other version published: the publisher skips
            "time/fwd_bwd_s": 1.2,
            "rows": 128,
            "staleness/mean": i % 3,
        }
        for i in range(10)
    ]
    w = swarm_window(rows, warmup=2)
    assert w["trajectories_per_s"] == pytest.approx(64.0)
    assert w["updates_per_s"] == pytest.approx(0.5)
    assert w["wait_frac"] == pytest.approx(0.25) and w["train_frac"] == pytest.approx(0.7)
    assert w["publish_frac"] == pytest.approx(0.05)
    assert (w["save_frac"], w["build_frac"], w["announce_frac"]) == pytest.approx((0.1, 0.3, 0.01))
    assert w["published_frac"] == pytest.approx(3 / 7)  # published 1 -> 4 over updates 3..9
    assert w["fwd_bwd_s_per_update"] == pytest.approx(1.2)
    assert w["overhead_s_per_update"] == pytest.approx(2.0 - 0.5 - 1.2)  # wall - wait - fwd/bwd
    with pytest.raises(ValueError):
        swarm_window(rows[:3], warmup=2)


def test_real_lengths_count_up_to_the_first_eos():
    eos = 2
    c = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    assert real_lengths(c, eos).tolist() == [3, 5, 1]


def test_a_real_model_gets_its_own_defaults_and_set_flags_win():
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    tiny, real = ap.parse_args([]), ap.parse_args(["--steps", "9", "--parts", "rl"])
    resolve_defaults(tiny, real=False)
    resolve_defaults(real, real=True)
    assert tiny.parts == ["rollout", "switch", "learner", "rl", "swarm"] and tiny.steps == 40
    assert real.parts == ["rl"] and real.steps == 9 and real.max_new_tokens == 32 and real.repeats == 3
    assert "--micro-batch-tokens" in ap.format_help() and "--no-vllm" in ap.format_help()
    assert "--device {auto,cpu,cuda}" in ap.format_help() and tiny.device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: --device cuda would use it")
def test_device_cuda_without_a_gpu_is_refused_before_any_work(tmp_path):
    cmd = [sys.executable, "-m", "heterorl.cli", "bench", "throughput", "--device", "cuda"]
    cmd += ["--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--device cuda asked for, but torch sees no CUDA GPU" in done.stderr
    assert not (tmp_path / "results.json").exists()


def test_report_marks_sides_not_measured():
    import argparse

    args = argparse.Namespace(prompts=2, group_size=2, max_new_tokens=4, samplers=[])
    rates = {f"{s}_tokens_per_s": 10.0 for s in ("hf_backend", "plain_generate", "trl_generate")}
    lengths = {f"{s}_mean_length": 3.0 for s in ("hf_backend", "plain_generate", "trl_generate")}
    res = {
        "model": "m",
        "parameters": 1,
        "prompts": "plain (BOS + text)",
        "threads": 1,
        "rollout": {
            **rates,
            **lengths,
            "ratio_hf_vs_plain": 1.0,
            "ratio_hf_vs_trl": 1.0,
            "vllm_skipped": "why",
        },
        "switch": {"skipped": "why"},
        "rl": {"ours_grpo_steps_per_s": 2.0, "trl_grpo_steps_per_s": 1.0, "ratio_ours_grpo_vs_trl": 2.0},
    }
    text = report(res, args)
    assert "vllm backend: not measured (why)" in text and "weight switch: not measured (why)" in text
    assert "—" in text and "2.00×" in text


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
    cmd += ["--repeats", "2", "--out", str(out), "--profile", "--no-vllm", "--threads", "1"]
    cmd += ["--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["device"] == "cpu" and res["args"]["device"] == "cpu"
    for part, key in (
        ("rl", "ratio_ours_grpo_vs_trl"),
        ("rl", "ratio_ours_gepo_vs_trl"),
        ("rollout", "ratio_hf_vs_plain"),
        ("rollout", "ratio_hf_vs_trl"),
        ("learner", "ratio_learner_vs_plain_ce"),
    ):
        assert res[part][key] > 0, (part, key, res[part])
    assert res["rl"]["trl_mean_length"] > 0 and res["rl"]["ours_grpo_mean_length"] > 0
    for side in ("hf_backend", "plain_generate", "trl_generate"):  # the same prompts, comparable lengths
        assert 1 <= res["rollout"][f"{side}_mean_length"] <= 6, res["rollout"]
    assert res["rollout"]["vllm_skipped"] == "--no-vllm" and "ours_grpo_vllm_steps_per_s" not in res["rl"]
    assert "ratio vs TRL" in done.stdout and "profile: learner update" in done.stdout


def test_vllm_sides_run_in_a_child_and_report_rates_and_switch_times(tmp_path, tiny_model_dir):
    """Our vllm backend's rollouts and the weight switch (load_weights into the running engine vs a restart),
    each measured in a child process beside the in-process sides, with tiny budgets."""
    out = tmp_path / "tp"
    cmd = [sys.executable, "-m", "heterorl.cli", "bench", "throughput", "--parts", "rollout", "switch"]
    cmd += ["--model", str(tiny_model_dir), "--prompts", "2", "--group-size", "2", "--repeats", "1"]
    cmd += ["--threads", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    r, s = res["rollout"], res["switch"]
    assert r["vllm_backend_tokens_per_s"] > 0 and 1 <= r["vllm_backend_mean_length"] <= 6, r
    for ratio in ("ratio_vllm_vs_hf", "ratio_vllm_vs_plain", "ratio_vllm_vs_trl"):
        assert r[ratio] > 0, (ratio, r)
    assert s["load_weights_s"] > 0 and s["restart_s"] > 0 and s["ratio_restart_vs_load_weights"] > 0, s
    assert s["engine_start_s"] > 0 and s["weight_bytes"] > 0 and s["generates_after_switch"], s
    assert "vllm backend vs hf backend" in done.stdout and "weight switch" in done.stdout
