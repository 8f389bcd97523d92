"""The swarm across "hosts": coordinator, two learners (one lineage) and samplers each in their own network
namespace.

They reach each other only through their 10.X.0.N addresses on a bridge the test makes (no loopback between
them). The learners train one lineage across hosts, with the dense exchange and no overlap, and agree at every
version; each sampler sticks to its own learner. One sampler's link is cut for a while and restored: it must
rejoin and its queued batches must arrive.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from heterorl.protocol import load_or_create_identity
from heterorl.protocol.storage.jsonlog import read_rows
from heterorl.testing import netns
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


def no_netns() -> str | None:
    """Why this machine cannot make network namespaces (not root, or the kernel or container refuses), or
    None. A missing `ip` is no such reason: the test fails, naming it (`make install` installs iproute2)."""
    if os.geteuid() != 0:
        return "no netns: making network namespaces needs root"
    if shutil.which("ip") is None:
        return None
    name = f"hrlprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"no netns: this machine refuses `ip netns add` ({r.stderr.strip()[:200]})"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
    return None


@pytest.fixture(scope="module", autouse=True)
def _netns_support():
    reason = no_netns()
    if reason is not None:
        pytest.skip(reason)
    assert netns.available() is None, f"{netns.available()}: `make install` installs iproute2"


def test_swarm_across_namespaces_survives_a_cut_link(tmp_path, tiny_model_dir):
    with netns.Lan(["coord", "learner", "learner2", "s0", "s1"]) as lan:
        # the dense exchange (the default), not overlapped (test_learner_peers: sparse, overlapped)
        dense = '[lineage]\nexchange = "dense"\noverlap = false\n'
        swarm = Swarm(tmp_path / "swarm", tiny_model_dir, learners=2, extra_toml=dense)
        try:
            here = {h: ["--host-maddrs", f"/ip4/{lan.addr(h)}/tcp/0"] for h in lan.hosts}
            ready = swarm.start_coordinator(*here["coord"], wrap=lan.wrap("coord"))
            assert all(f"/ip4/{lan.addr('coord')}/" in m for m in ready["maddrs"])
            swarm.start_learner(*here["learner"], wrap=lan.wrap("learner"), index=0)
            swarm.start_learner(*here["learner2"], wrap=lan.wrap("learner2"), index=1)
            swarm.sampler_key_for("s0", 1)  # s0 sends to the second learner, s1 to the first (metrics())
            swarm.sampler_key_for("s1", 0)
            swarm.start_sampler("s0", *here["s0"], wrap=lan.wrap("s0"))
            swarm.start_sampler("s1", *here["s1"], wrap=lan.wrap("s1"))
            s1_key = load_or_create_identity(swarm.root / "s1" / "peer.key")[0].public_key.hex()[:16]
            swarm.wait_step(4, timeout=240)
            deadline = time.monotonic() + 180  # s1 may join later than s0 (a loaded machine): wait for it
            while not any(s1_key in r["authors"] for r in swarm.metrics()):
                assert time.monotonic() < deadline, swarm.logs()
                time.sleep(1)

            lan.cut("s1")
            cut_at = time.monotonic()
            time.sleep(2)
            cut_step = swarm.step()
            swarm.wait_step(cut_step + 6, timeout=180)  # the run goes on with s0 alone
            # longer than a send's 30 s timeout: s1's sends fail, back off, and its outbox holds the batches
            time.sleep(max(0.0, 40 - (time.monotonic() - cut_at)))
            lan.restore("s1")
            restored_at = time.time()
            deadline = time.monotonic() + 120
            while not any(s1_key in r["authors"] and r["time"] > restored_at for r in swarm.metrics()):
                assert time.monotonic() < deadline, swarm.logs()
                time.sleep(1)
            # `heterorl status` from another host sees the whole swarm through the coordinator's address
            cmd = [*lan.wrap("s0"), sys.executable, "-m", "heterorl.cli", "status", *here["s0"], "--json"]
            for _ in range(5):  # s1's heartbeat may need a moment to be stored again after the cut
                status = subprocess.run(
                    [*cmd, "--bootstrap", *ready["maddrs"]], capture_output=True, text=True, timeout=120
                )
                assert status.returncode == 0, status.stderr[-3000:]
                snap = json.loads(status.stdout)
                roles = sorted(p["role"] for p in snap["peers"] if p["alive"])
                if roles == ["learner", "learner", "sampler", "sampler"]:
                    break
            assert roles == ["learner", "learner", "sampler", "sampler"], snap["peers"]
            log = (swarm.root / "s1" / "sampler.log").read_text()
            assert "not delivered" in log  # it did notice the cut
        finally:
            swarm.close()
    checks = [r for d in swarm.learner_dirs for r in read_rows(d / "lineage.jsonl") if "agree" in r]
    assert len(checks) >= 10 and all(r["agree"] for r in checks), checks  # one lineage across hosts
    s0_key = load_or_create_identity(swarm.root / "s0" / "peer.key")[0].public_key.hex()[:16]
    assert any(s0_key in r["authors"] for r in swarm.metrics(1))  # the second learner trained too
