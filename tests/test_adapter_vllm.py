"""vLLM serves an adapter run's LoRA adapters in its running engine (vLLM's CPU build here). The engine checks
run once in a child process (``heterorl.testing.vllm_adapter_check``), as in tests/test_vllm_backend.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from heterorl.testing.procs import run_json_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checks(tiny_model_dir):
    return run_json_check("heterorl.testing.vllm_adapter_check", str(tiny_model_dir))


def test_vllm_serves_the_adapter_as_lora_and_agrees_with_the_learners_peft_model(checks):
    assert checks["native"] and "served as LoRA" in checks["describe"]
    assert checks["max_abs_diff"] < 1e-4


def test_a_new_adapter_version_is_served_without_restarting_the_engine(checks):
    assert checks["v2_max_abs_diff"] < 1e-4  # the new adapter's log-probs, not the old one's
    assert checks["v2_vs_v1_max_abs_diff"] > 1e-2


def test_vllm_refuses_an_adapter_for_another_base_and_keeps_its_own(checks):
    assert "another base" in (checks["bad_adapter_error"] or "")
    assert checks["after_refusal_max_abs_diff"] < 1e-4


def test_a_dead_engine_comes_back_serving_the_adapter_it_held(checks):
    after = checks["after_engine_death"]
    assert after["restarts"] == 1 and after["backend"] == "vllm" and after["native"]
    assert after["max_abs_diff"] < 1e-4


def test_vllm_and_hf_samplers_train_one_adapter_run(tmp_path, tiny_model_dir):
    """A mixed adapter swarm: the vLLM sampler serves each version as a LoRA adapter in its running engine,
    the hf one merges; the learner takes both, and the vLLM rows agree with its peft model."""
    out = tmp_path / "mixed"
    steps = 60
    cmd = [sys.executable, "-m", "heterorl.cli", "local", "--samplers", "2", "--steps", str(steps)]
    cmd += ["--out", str(out), "--model", str(tiny_model_dir), "--no-view", "--lr", "2e-3"]
    cmd += ["--sampler-backends", "vllm", "hf", "--sampler-slowdown", "1", "3"]
    cmd += ["--adapter", "rank=8,alpha=16,targets=q_proj,v_proj"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["batches_rejected"] == 0
    assert "adapter r8 served as LoRA" in (out / "sampler-0" / "sampler.log").read_text()
    assert "adapter r8 merged into the weights" in (out / "sampler-1" / "sampler.log").read_text()
    versions = summary["samplers"]["sampler-0"]["versions_loaded"]
    assert len(versions) >= 3 and versions == sorted(set(versions)), versions
    assert len(list((out / "sampler-0" / "adapters").iterdir())) <= 2  # old adapter directories are removed
    rows = [json.loads(line) for line in (out / "learner" / "metrics.jsonl").read_text().splitlines()]
    engines: dict[str, int] = {}
    for r in rows:
        for k, n in r["engines"].items():
            engines[k] = engines.get(k, 0) + n
    assert engines.get("vllm/float32", 0) > 0 and engines.get("hf/float32", 0) > 0, engines
    fresh = [r for r in rows if r["mismatch/tokens"] > 0]
    assert fresh and max(r["mismatch/abs_max"] for r in fresh) < 1e-3
