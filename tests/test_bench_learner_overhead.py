"""`python -m heterorl.bench.learner_overhead`: the learner's pipeline without the network, on a small
architecture, every side: it runs, publishes what each side says, and reports its figures."""

from __future__ import annotations

import json
import subprocess
import sys


def test_every_side_runs_and_publishes_as_it_says(tmp_path):
    out = tmp_path / "o.json"
    cmd = [sys.executable, "-m", "heterorl.bench.learner_overhead", "--arch", "tiny-arch", "--updates", "4"]
    cmd += ["--warmup", "1", "--threads", "1", "--sides", "no_publishing", "background", "inline"]
    cmd += [
        "--prompts",
        "2",
        "--group-size",
        "2",
        "--prompt-len",
        "8",
        "--new-tokens",
        "8",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    none, background, inline = res["no_publishing"], res["background"], res["inline"]
    assert none["published"] == 0 and not none["publisher_s"]
    assert inline["published"] == 5  # version 0, then every update, on the training thread
    assert 1 <= background["published"] <= 5  # version 0, then as many as the free publisher took
    assert background["publisher_s"]["save"] > 0  # the first background version carries the state
    for side in (none, background, inline):
        assert side["update_s"] > 0 and side["fwd_bwd_s"] > 0 and side["rate_vs_no_publishing"] > 0
    assert "update rate" in done.stdout
