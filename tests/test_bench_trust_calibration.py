"""heterorl bench trust-calibration: honest hf batches of the tiny model pass the learner's spot checks."""

from __future__ import annotations

import json

import pytest

from heterorl.bench import trust_calibration

pytestmark = pytest.mark.slow

KEYS = {
    "model",
    "published",
    "engine",
    "batches",
    "tokens_per_batch",
    "logprob_dev_median",
    "logprob_dev_p99",
    "logprob_dev_max",
    "row_logprob_dev_max",
    "row_logprob_gap_max",
    "row_abs_z_max",
    "seed_margin_max",
    "reproduced_min",
    "abs_z_p50",
    "abs_z_p99",
    "abs_z_max",
    "z_mean",
    "author_z",
    "refused",
    "false_refusal_rate",
    "refusal_reasons",
    "batch_z",
    "batch_logprob_dev",
    "margin",
    "seconds",
}


def test_honest_hf_batches_of_the_tiny_model_pass(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "calibration.json"
    argv = ["--models", "tiny", "--engines", "hf/float32,hf/bfloat16", "--batches", "4"]
    argv += ["--tiny-model", str(tiny_model_dir), "--json", str(out)]
    assert trust_calibration.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and data["rows_per_batch"] == 16 and data["skipped"] == []
    assert data["thresholds"]["max_logprob_dev"] > 0
    results = {r["engine"]: r for r in data["results"]}
    assert set(results) == {"hf/float32", "hf/bfloat16"}
    for r in results.values():
        assert set(r) == KEYS
        assert r["model"] == "tiny" and r["published"] == "float32" and r["batches"] == 4
        assert r["tokens_per_batch"] > 0 and len(r["batch_z"]) == len(r["batch_logprob_dev"]) == 4
        margins = {"logprob_dev", "row_logprob_dev", "typicality_z", "row_logprob_gap", "row_typicality_z"}
        assert set(r["margin"]) == margins | {"seed_margin"}
        assert all(0 <= m < 1 for m in r["margin"].values()), r["margin"]  # honest: under every threshold
    f32 = results["hf/float32"]
    assert f32["logprob_dev_max"] < 1e-3 and f32["row_logprob_dev_max"] < 1e-3
    assert f32["refused"] == 0 and f32["false_refusal_rate"] == 0.0
    assert f32["seed_margin_max"] < 1e-3 and f32["reproduced_min"] == 1.0  # the same engine replays its seeds
    assert results["hf/bfloat16"]["row_logprob_gap_max"] > f32["row_logprob_gap_max"]
    assert "| tiny | float32 | hf/bfloat16 |" in capsys.readouterr().out
