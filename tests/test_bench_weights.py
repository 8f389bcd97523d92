"""`heterorl bench weights` on the tiny model: real RL updates, their bf16 deltas, exact rebuilds."""

from __future__ import annotations

import json
import subprocess
import sys

from heterorl.bench.weights import unique_bytes
from heterorl.protocol.checkpoint import serialize_state_dict


def test_bench_weights_on_the_tiny_model_writes_exact_small_deltas(tmp_path, tiny_model_dir):
    out = tmp_path / "w.json"
    cmd = [sys.executable, "-m", "heterorl.cli", "bench", "weights", "--models", "tiny", "--updates", "2"]
    cmd += ["--lrs", "5e-4", "1e-5", "--model-dir", str(tiny_model_dir), "--threads", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| tiny | 0.0005 |" in done.stdout
    m = json.loads(out.read_text())["models"]["tiny"]
    assert m["bit_identical"] is True and m["dtype"] == "bfloat16" and m["lr"] == 5e-4
    assert 0 < m["delta_ratio"] < 1 and m["full_bytes"] > m["unique_bytes"]  # tied embeddings counted once
    assert [r["version"] for r in m["versions"]] == [1, 2]
    for r in m["versions"]:
        assert 0 < r["changed_frac"] <= 1 and r["delta_bytes"] > 0 and r["bit_identical"] is True
    hi, lo = m["by_lr"]
    assert (hi["lr"], lo["lr"]) == (5e-4, 1e-5)
    # a smaller step flips fewer bf16 roundings: fewer changed words and a smaller delta
    assert lo["changed_frac"] < hi["changed_frac"] and lo["delta_ratio"] < hi["delta_ratio"]
    assert all(r["reward_first"] is not None for r in m["by_lr"])  # the updates were RL on sampled rollouts


def test_unique_bytes_counts_a_tied_tensor_once():
    import torch

    emb = torch.randn(10, 4)
    tied = serialize_state_dict({"a": emb, "b": emb.clone(), "c": torch.ones(3)})
    untied = serialize_state_dict({"a": emb, "b": emb + 1, "c": torch.ones(3)})
    assert len(tied) - unique_bytes(tied) == 10 * 4 * 4
    assert unique_bytes(untied) == len(untied)
