"""heterorl bench chaos end to end, on a short schedule: two learners of one lineage, two samplers, a fault
every 6–8 s for 24 s (in network namespaces when run as root), then 12 s quiet. It must run the faults, stop
everything and write its JSON, with every invariant at 0 and versions published after the last fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

KEYS = {
    "faults",
    "fault_kinds",
    "invariants",
    "versions_after_last_fault",
    "versions_published",
    "info",
    "seed",
    "duration_s",
    "link_mbit",
    "netns",
}
INVARIANTS = {"forks", "honest_strikes", "trained_twice", "disagreements", "crashed"}


def test_a_short_chaos_campaign_runs_its_faults_and_reports(tmp_path, tiny_model_dir):
    out = tmp_path / "c.json"
    cmd = [sys.executable, "-m", "heterorl.cli", "bench", "chaos", "--learners", "2", "--samplers", "2"]
    cmd += ["--duration", "24", "--quiet-s", "12", "--fault-every-s", "6", "8", "--seed", "3"]
    cmd += ["--model-dir", str(tiny_model_dir), "--out", str(tmp_path / "work"), "--json", str(out)]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.exists(), r.stdout[-3000:] + r.stderr[-5000:]
    result = json.loads(out.read_text())
    assert set(result) >= KEYS and set(result["invariants"]) >= INVARIANTS
    assert result["faults"] > 0 and sum(result["fault_kinds"].values()) == result["faults"]
    assert result["netns"] == (os.geteuid() == 0) and result["seed"] == 3
    assert "faults survived" in r.stdout

    # the invariants (on the code before learner peers had terms and leases: forks and crashes)
    exits = [(e["name"], e["code"], e["log_tail"][-1500:]) for e in result["info"]["exits"]]
    assert all(v == 0 for v in result["invariants"].values()), f"{json.dumps(result['invariants'])} {exits}"
    assert result["versions_after_last_fault"] > 0, result["info"]
    assert r.returncode == 0, r.stdout[-3000:]
