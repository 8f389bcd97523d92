"""``heterorl bench exchange`` on the tiny model: real RL gradients through one learner's error feedback and
the codec, and the JSON the acceptance check reads."""

from __future__ import annotations

import json

from heterorl.cli import main


def test_bench_exchange_prints_and_writes_its_figures_for_real_gradients(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "x.json"
    argv = ["bench", "exchange", "--models", "tiny", "--model-dir", str(tiny_model_dir), "--updates", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    m = json.loads(out.read_text())["models"]["tiny"]
    assert m["updates"] == 3 and m["params"] == 137_728
    assert (
        m["frame_bytes"] < 0.005 * m["dense_bytes"]
        and m["bytes_ratio"] == m["frame_bytes"] / m["dense_bytes"]
    )
    assert 0 < m["cosine"] <= 1 and 0 <= m["residual_rel"] < 1
    assert m["encode_s"] > 0 and m["decode_s"] > 0
    assert "| tiny | 137,728 |" in capsys.readouterr().out
    assert main([*argv, "--k", "6"]) == 2  # not a multiple of 4
