"""Learner peers, real processes on 127.0.0.1: two learners and two samplers train one lineage.

Each sampler is given a key whose rendezvous choice is a different learner, so both learners take data. At
every version the writer published, the member's own weights serialise to the signed manifest's chunks
(``lineage.jsonl``); every commit's parent state hash matched (else the member stops). No batch is applied
by both learners. A node speaking the lineage protocol with a key the run does not list, of another run, or
of another model, is refused with the reason.
"""

from __future__ import annotations

import json
import time

import pytest

from heterorl.protocol import ProtocolError, load_or_create_identity
from heterorl.protocol.net.lineage import LineageLink, LineageRefused
from heterorl.protocol.net.node import NetConfig, Node
from heterorl.protocol.net.trajectories import find_learners
from heterorl.protocol.storage.jsonlog import read_rows
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.identity import Identity
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


def _refusal(node: Node, identity: Identity, run_id: str, writer, schema) -> str:
    link = LineageLink(node, identity, run_id, writer.key, schema)
    with pytest.raises((LineageRefused, ProtocolError, ConnectionError, EOFError)) as e:
        link.open(writer.peer_id, writer.maddrs, 0)
    return str(e.value)


def test_two_learners_train_one_lineage_agree_at_every_version_and_refuse_others(tmp_path, tiny_model_dir):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, learners=2)
    try:
        swarm.start_coordinator()
        writer_proc = swarm.start_learner(index=0)
        member_proc = swarm.start_learner(index=1)
        _wait_for(lambda: "joined the lineage" in (swarm.root / "learner.stderr.log").read_text(), 120)
        for i in (0, 1):
            swarm.sampler_key_for(f"sampler-{i}", i)
            swarm.start_sampler(f"sampler-{i}")
        swarm.wait_step(12, timeout=240)
        run_id = _run_id(swarm)
        node = Node.start(Identity.generate(), NetConfig(bootstrap=tuple(swarm.ready["maddrs"])))
        try:
            lookup = find_learners(node, run_id, [bytes.fromhex(swarm.learner_keys[0])])
            writer = node.call(lookup, timeout=30)[0]
            member_id = load_or_create_identity(swarm.learner_dirs[1] / "peer.key")[0]
            schema = _schema(tiny_model_dir)
            stranger = _refusal(node, Identity.generate(), run_id, writer, schema)
            assert "not one of the run's learner keys" in stranger, stranger
            other_run = _refusal(node, member_id, "another-run", writer, schema)
            assert "another-run" in other_run, other_run
            other_model = _refusal(node, member_id, run_id, writer, schema[:-1])
            assert "another model" in other_model, other_model
        finally:
            node.close()
        assert writer_proc.alive() and member_proc.alive()  # the refusals hurt no one
        step = swarm.step()
        swarm.wait_step(step + 3, timeout=120)
    finally:
        swarm.close()
    writer_dir, member_dir = swarm.learner_dirs
    published = [r["version"] for r in read_rows(writer_dir / "lineage.jsonl") if r.get("published")]
    checks = list(read_rows(member_dir / "lineage.jsonl"))
    assert len(published) >= 12 and checks, (published, checks)
    assert all(c["agree"] for c in checks), checks
    agreed = {c["version"] for c in checks}
    assert {v for v in published if v <= max(agreed)} <= agreed  # every version published while it was there
    applied = []
    for d in swarm.learner_dirs:
        with AcceptedLog(d / "accepted.sqlite") as ledger:
            applied.append(set(ledger.applied_ids()))
    assert applied[0] and applied[1], "both learners' batches trained"
    assert not applied[0] & applied[1]  # no batch in two learners' updates
    # (a sampler that starts before its learner is up sends to the other for FAILOVER_S: from step 6 on)
    authors = [{a for r in swarm.metrics(i) if r["step"] > 5 for a in r["rows_by_author"]} for i in (0, 1)]
    keys = [load_or_create_identity(swarm.root / f"sampler-{i}" / "peer.key")[0].public_key.hex()[:16]
            for i in (0, 1)]  # fmt: skip
    assert authors == [{keys[0]}, {keys[1]}], authors  # each sampler stuck to its learner
    final = json.loads((member_dir / "final_stats.json").read_text())
    assert final["lineage"]["lineage/versions_mismatched"] == 0
    wfinal = json.loads((writer_dir / "final_stats.json").read_text())
    assert wfinal["lineage"]["lineage/refused"] >= 3


def _wait_for(ok, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _run_id(swarm: Swarm) -> str:
    import tomllib

    return tomllib.loads((swarm.root / "run.toml").read_text())["run_id"]


def _schema(model_dir):
    from heterorl.peer.model import load_model
    from heterorl.protocol.wire.gradients import parameter_schema

    model, _ = load_model(str(model_dir))
    return parameter_schema(model.named_parameters())
