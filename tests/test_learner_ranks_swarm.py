"""A learner over two ranks (FSDP2, gloo on CPU) in a real swarm on 127.0.0.1: it trains, publishes, stops in
order, exits non-zero when a rank dies, and resumes from its save; every batch counts once."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from heterorl.localswarm import stop_all
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


def _rank(learner, rank: int) -> psutil.Process:
    """The process of ``rank`` under the learner's torchrun (which runs under ``heterorl peer --nproc``)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.Process(learner.p.pid).children(recursive=True):
            try:
                if p.environ().get("RANK") == str(rank):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.5)
    raise TimeoutError(f"no rank {rank} under the learner")


def test_a_two_rank_learner_trains_publishes_fails_whole_and_resumes(tmp_path, tiny_model_dir):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, micro_batch_tokens=512)
    try:
        swarm.start_coordinator()
        learner = swarm.start_learner("--nproc", "2")
        sampler = swarm.start_sampler("s0")
        swarm.wait_step(3, timeout=300)
        rows = swarm.metrics()
        assert all(r["ranks"] == 2 for r in rows)
        deadline = time.monotonic() + 90  # the coordinator sees versions as they are announced
        while (swarm.view().get("latest_version") or 0) < 1 and time.monotonic() < deadline:
            time.sleep(1)
        assert swarm.view()["latest_version"] >= 1, swarm.logs()  # published and announced to the swarm
        rank1_log = (swarm.learner_dir / "learner.rank1.log").read_text()
        assert "rank 1 of 2" in rank1_log

        # a rank that dies takes the learner down, non-zero, for its supervisor to restart
        _rank(learner, 1).kill()
        assert learner.p.wait(120) != 0
        at_kill = swarm.step()

        learner = swarm.start_learner("--nproc", "2")
        swarm.wait_step(at_kill + 3, timeout=300)
        # a stop signal to the peer: rank 0 publishes and saves the last version, then ends rank 1; all exit 0
        learner.terminate(120)
        assert learner.p.returncode == 0, swarm.logs()
        log = (swarm.learner_dir / "learner.log").read_text()
        assert "resumed from my own state" in log and "2 rank(s)" in log
        final = json.loads((swarm.learner_dir / "final_stats.json").read_text())
        assert final["ranks"] == 2 and final["published_version"] == final["step"] == swarm.step()
        stop_all([sampler])

        seen, twice = set(), []
        for row in swarm.metrics():
            for b in row["batches"]:
                if b in seen:
                    twice.append(b)
                seen.add(b)
        assert not twice  # exactly once across the kill and the restart
        with AcceptedLog(swarm.learner_dir / "accepted.sqlite") as ledger:
            assert {bytes.fromhex(b) for b in seen} <= set(ledger.applied_ids())
        steps = [r["step"] for r in swarm.metrics()]
        assert steps == sorted(set(steps))
    finally:
        swarm.close()
