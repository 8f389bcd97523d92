"""The vllm rollout backend on a real engine (vLLM's CPU build here, its CUDA build on a GPU machine).

The engine checks run once, in a child process (``heterorl.testing.vllm_check``): vLLM's in-process engine
changes process-wide torch settings that other tests must not inherit. No test here is skipped: the project's
install step installs vLLM, so a missing vLLM is a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from heterorl.peer.rollout import make_backend
from heterorl.peer.rollout.vllm import BackendUnavailable, unsupported_reason
from heterorl.testing.procs import run_json_check

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_checks(tiny_model_dir):
    return run_json_check("heterorl.testing.vllm_check", str(tiny_model_dir))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_behaviour_logprobs_match_the_learners_recompute(vllm_checks, temperature):
    assert vllm_checks["describe"].startswith("vllm ")
    assert vllm_checks[f"max_abs_diff_T{temperature}"] < 1e-4
    assert vllm_checks[f"logprobs_nonpositive_T{temperature}"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_stops_at_eos_or_the_token_budget(vllm_checks, temperature):
    assert vllm_checks[f"stops_ok_T{temperature}"]
    assert vllm_checks[f"eos_rows_T{temperature}"] > 0  # the tiny model ends most answers with EOS


def test_vllm_takes_new_weights_in_the_running_engine(vllm_checks):
    # generation after the reload matches the new weights, not the old ones (so the prefix cache was reset)
    assert vllm_checks["after_reload_max_abs_diff"] < 1e-4
    assert vllm_checks["after_reload_vs_old_weights_max_abs_diff"] > 1e-2


def test_vllm_refuses_a_checkpoint_that_does_not_fit_and_keeps_its_weights(vllm_checks):
    assert "model.norm.weight" in (vllm_checks["bad_checkpoint_error"] or "")
    assert vllm_checks["after_refusal_max_abs_diff"] < 1e-4


def test_a_dead_vllm_engine_is_restarted_with_the_weights_held(vllm_checks):
    after = vllm_checks["after_engine_death"]
    assert after["restarts"] == 1 and after["backend"] == "vllm" and not after["fell_back"]
    assert after["max_abs_diff"] < 1e-4


def test_a_vllm_engine_that_keeps_dying_is_replaced_by_hf_with_the_weights_held(vllm_checks):
    after = vllm_checks["after_second_death"]
    assert after["backend"] == "hf" and after["fell_back"]
    assert after["max_abs_diff"] < 1e-4


@pytest.fixture(scope="module")
def head_dim_16_model(tmp_path_factory):
    """A model vLLM's CPU attention cannot serve (head_dim 16)."""
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config, build_tokenizer

    out = tmp_path_factory.mktemp("hd16")
    tok = build_tokenizer()
    LlamaForCausalLM(build_config(len(tok), hidden=64, heads=4)).save_pretrained(out)
    tok.save_pretrained(out)
    return out, tok


def test_vllm_says_why_it_cannot_serve_a_model_and_auto_falls_back_to_hf(head_dim_16_model, caplog):
    path, tok = head_dim_16_model
    reason = unsupported_reason(path, "cpu")
    assert reason is not None and "head sizes" in reason and "16" in reason
    with pytest.raises(BackendUnavailable, match="head sizes"):
        make_backend("vllm", path, tok)
    with caplog.at_level("WARNING"):
        backend = make_backend("auto", path, tok)
    assert backend.name == "hf"
    assert "rollout backend: hf, because" in caplog.text and "head sizes" in caplog.text


def test_vllm_missing_is_a_clear_reason(head_dim_16_model, monkeypatch):
    import heterorl.peer.rollout.vllm as v

    monkeypatch.setattr(v, "vllm_version", lambda: None)
    assert "pip install vllm" in unsupported_reason(head_dim_16_model[0], "cpu")
    assert make_backend("auto", head_dim_16_model[0], head_dim_16_model[1]).name == "hf"


def test_vllm_needs_a_local_model_directory(tmp_path):
    assert "config.json" in unsupported_reason(tmp_path / "nowhere", "cpu")


def test_vllm_and_hf_samplers_train_one_swarm(tmp_path, tiny_model_dir):
    """A mixed swarm: one sampler on a live vLLM engine, one on hf; the vLLM one switches checkpoints inside
    its running engine, and the learner takes both kinds of batch, with the engine recorded per batch."""
    out = tmp_path / "mixed"
    steps = 60  # the vLLM engine takes seconds to start: the hf sampler (3× slower) must not finish first
    cmd = [sys.executable, "-m", "heterorl.cli", "local", "--samplers", "2", "--steps", str(steps)]
    cmd += ["--out", str(out), "--model", str(tiny_model_dir), "--no-view", "--lr", "5e-4"]
    cmd += ["--sampler-backends", "vllm", "hf", "--sampler-slowdown", "1", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["batches_rejected"] == 0
    assert "rollouts: vllm" in (out / "sampler-0" / "sampler.log").read_text()
    assert "rollouts: hf" in (out / "sampler-1" / "sampler.log").read_text()
    vllm_versions = summary["samplers"]["sampler-0"]["versions_loaded"]
    assert len(vllm_versions) >= 3 and vllm_versions == sorted(set(vllm_versions)), vllm_versions
    rows = [json.loads(line) for line in (out / "learner" / "metrics.jsonl").read_text().splitlines()]
    engines = {}
    for r in rows:
        for k, n in r["engines"].items():
            engines[k] = engines.get(k, 0) + n
    assert engines.get("vllm/float32", 0) > 0 and engines.get("hf/float32", 0) > 0, engines
    fresh = [r for r in rows if r["mismatch/tokens"] > 0]
    # float32 engines agree with the learner
    assert fresh and max(r["mismatch/abs_max"] for r in fresh) < 1e-3
