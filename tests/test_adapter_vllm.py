"""vLLM serves an adapter run's LoRA adapters in its running engine (vLLM's CPU build here). The engine checks
run once in a child process (``heterorl.testing.vllm_adapter_check``), as in tests/test_vllm_backend.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checks(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "heterorl.testing.vllm_adapter_check", str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", **os.environ},
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
