"""`heterorl bench weights` on the tiny model: real RL updates, their bf16 deltas, exact rebuilds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from heterorl.bench.weights import DEFAULTS, _list_runs, main, state_sizes


def test_bench_weights_on_the_tiny_model_writes_exact_small_deltas(tmp_path, tiny_model_dir):
    out = tmp_path / "w.json"
    cmd = [sys.executable, "-m", "heterorl.cli", "bench", "weights", "--models", "tiny", "--updates", "2"]
    cmd += ["--lrs", "5e-4", "1e-5", "--model-dir", str(tiny_model_dir), "--threads", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| tiny | 0.0005 | 2 |" in done.stdout and "| tiny | 1e-05 | 2 |" in done.stdout
    r = json.loads(out.read_text())
    assert r["command"].startswith("heterorl bench weights --models tiny") and r["date"]
    m = r["models"]["tiny"]
    assert m["bit_identical"] is True and m["dtype"] == "bfloat16" and m["lr"] == 5e-4
    assert 0 < m["delta_ratio"] <= 1 and 0 < m["delta_ratio_unique"] <= 1
    # the full file holds the tied lm_head twice: the unique bytes are the full bytes less one embedding
    assert m["full_bytes"] > m["unique_bytes"] > 2 * m["params"] > 0
    assert [v["version"] for v in m["versions"]] == [1, 2]
    for v in m["versions"]:
        assert 0 < v["changed_frac"] <= 1 and 0 < v["delta_bytes"] <= m["full_bytes"]
        assert v["ratio"] == v["delta_bytes"] / m["full_bytes"] and v["bit_identical"] is True
        assert v["encode_s"] > 0 and v["apply_s"] > 0
    # every version of every run (2 learning rates x 2 updates) was measured and rebuilt bit for bit
    rebuilt = [(run["lr"], v["version"], v["bit_identical"]) for run in m["by_lr"] for v in run["versions"]]
    assert rebuilt == [(lr, n, True) for lr in (5e-4, 1e-5) for n in (1, 2)]
    hi, lo = m["by_lr"]
    assert (hi["lr"], lo["lr"]) == (5e-4, 1e-5) and hi["delta_ratio"] == m["delta_ratio"]
    # a smaller step flips fewer bf16 roundings: fewer changed words and a smaller delta
    assert lo["changed_frac"] < hi["changed_frac"] and lo["delta_ratio"] < hi["delta_ratio"]
    for run in m["by_lr"]:  # the updates were RL on sampled, scored rollouts
        assert len(run["reward_curve"]) == 2 and 0 <= run["reward_first"] <= 1


def test_help_explains_and_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "bit for bit" in capsys.readouterr().out
    assert main(["--model-dir", "x"]) == 2 and "exactly one --models" in capsys.readouterr().err
    assert main(["--models", "tiny", "--updates", "0"]) == 2


def test_state_sizes_counts_a_tied_tensor_once():
    import torch

    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4)
    m.head = torch.nn.Linear(4, 10, bias=False)
    m.head.weight = m.emb.weight
    m.norm = torch.nn.LayerNorm(4)  # weight and bias: same size, both ones/zeros at init, still distinct
    assert state_sizes(m) == (10 * 4 + 4 + 4, 10 * 4)


def test_default_runs_and_overrides():
    smol = DEFAULTS["smollm2-135m"]
    assert _list_runs(smol, None, None) == [(1e-6, 8), (5e-6, 4)]
    assert _list_runs(smol, [1e-6, 2e-6, 4e-6], None) == [(1e-6, 8), (2e-6, 4), (4e-6, 4)]
    assert _list_runs(smol, None, 3) == [(1e-6, 3), (5e-6, 3)]
