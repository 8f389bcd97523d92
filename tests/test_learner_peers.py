"""Learner peers, real processes on 127.0.0.1: two learners (one on torch's fused AdamW, one on its per-tensor
loop) and two samplers train one lineage; the writer is SIGKILLed, the other writes on in a higher term, and
the killed one comes back, takes the lineage's state and agrees, with no resync ever.

The learners elect who writes (the newest state, the lowest key on a tie). Each sampler is given a key whose
rendezvous choice is a different learner, so both learners take data. At every version the writer published,
the member's own weights serialise to the signed manifest's chunks, and after every commit its weights hash
to the commit's state (``lineage.jsonl``; else it resyncs, counted). No version number names two manifests:
the survivor numbers its first commit above what the dead writer reserved. No batch is applied by both
learners, not even one a sampler resent to the survivor because the killed writer's Ack was lost (the
rejoined learner hears that the lineage trained it, and drops its own copy). No honest sampler is struck, not
for claiming a version published while the rejoined learner was away. A node speaking the lineage protocol
with a key the run does not list, of another run, or of another model, is refused with the reason.
"""

from __future__ import annotations

import json
import time

import pytest

from heterorl.peer.learner.election import FRESH_S
from heterorl.protocol import ProtocolError, load_or_create_identity
from heterorl.protocol.net.lineage import LineageLink, LineageRefused
from heterorl.protocol.net.node import NetConfig, Node
from heterorl.protocol.storage.jsonlog import read_rows
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.identity import Identity
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


def _refusal(node: Node, identity: Identity, run_id: str, writer, schema) -> str:
    link = LineageLink(node, identity, run_id, writer.key, schema)
    with pytest.raises((LineageRefused, ProtocolError, ConnectionError, EOFError)) as e:
        link.open(writer.peer_id, writer.maddrs, 0, bytes(32), term=0)
    return str(e.value)


def test_two_learners_train_one_lineage_agree_at_every_version_and_refuse_others(tmp_path, tiny_model_dir):
    sparse = '[lineage]\nexchange = "sparse"\n'  # overlapped (the default); tests/test_swarm_netns.py: dense
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, learners=2, extra_toml=sparse)
    try:
        swarm.start_coordinator()
        kernels = [[], ["--adamw", "loop"]]  # learner-1 on another AdamW implementation than the fused one
        procs = [swarm.start_learner(*kernels[0], index=0), swarm.start_learner(*kernels[1], index=1)]
        logs = [swarm.root / f"{d.name}.stderr.log" for d in swarm.learner_dirs]
        _wait_for(lambda: any("joined the lineage" in p.read_text() for p in logs if p.exists()), 120, swarm)
        for i in (0, 1):
            swarm.sampler_key_for(f"sampler-{i}", i)
            swarm.start_sampler(f"sampler-{i}")
        swarm.wait_step(12, timeout=240)
        run_id = _run_id(swarm)
        keys = [bytes.fromhex(k) for k in swarm.learner_keys]
        w = next(i for i, d in enumerate(swarm.learner_dirs) if _rows(d, "writer"))  # who writes: elected
        # a version is published when its publisher is idle (else a later one is): wait for 12 of them
        _wait_for(lambda: len(_rows(swarm.learner_dirs[w], "published")) >= 12, 120, swarm)
        node = Node.start(Identity.generate(), NetConfig(bootstrap=tuple(swarm.ready["maddrs"])))
        try:
            writer = _address(node, run_id, keys[w])
            member_id = load_or_create_identity(swarm.learner_dirs[1 - w] / "peer.key")[0]
            schema = _schema(tiny_model_dir)
            stranger = _refusal(node, Identity.generate(), run_id, writer, schema)
            assert "not one of the run's learner keys" in stranger, stranger
            other_run = _refusal(node, member_id, "another-run", writer, schema)
            assert "another-run" in other_run, other_run
            other_model = _refusal(node, member_id, run_id, writer, schema[:-1])
            assert "another model" in other_model, other_model
        finally:
            node.close()
        assert all(p.alive() for p in procs)  # the refusals hurt no one
        writer_dir, member_dir = swarm.learner_dirs[w], swarm.learner_dirs[1 - w]
        published = [r["version"] for r in _rows(writer_dir, "published")]
        checks = _rows(member_dir, "checked")
        assert len(published) >= 12 and checks, (published, checks)
        agreed = {c["version"] for c in checks if c["agree"]}
        assert all(c["agree"] for c in checks), checks
        assert {v for v in published if v <= max(agreed)} <= agreed  # every version published meanwhile
        term = _rows(writer_dir, "writer")[-1]["term"]

        # the writer is SIGKILLed: the member writes on in a higher term once the dead writer's heartbeat is
        # stale on its own clock (FRESH_S) and its lease has run out
        killed_at = time.time()
        procs[w].kill()
        _wait_for(lambda: _signed_after(member_dir, killed_at), 90, swarm)
        took = _signed_after(member_dir, killed_at) - killed_at
        assert took <= FRESH_S + 20, took
        took_over = _rows(member_dir, "writer")[-1]
        assert took_over["term"] > term
        # its first commit is above everything the dead writer may have signed (its reservation)
        assert took_over["first_version"] > max(published)
        # it comes back: it joins the new writer with its state, and agrees from then on
        back_at = time.time()
        procs[w] = swarm.start_learner(*kernels[w], index=w)
        _wait_for(lambda: [r for r in _rows(writer_dir, "checked") if r["time"] > back_at], 120, swarm)
        step = swarm.metrics(1 - w)[-1]["step"]
        swarm.wait_step(step + 4, timeout=120)  # (learner 0's rows: either learner records every version)
        closed_at = time.time()  # what the learners do as the swarm is torn down is not under test
    finally:
        swarm.close()
    log = (swarm.root / f"{writer_dir.name}.stderr.log").read_text()
    assert (
        "took" in log and "state at version" in log
    )  # its state was not the lineage's: it took the writer's

    # the state it took hashed as the writer's (checked on load), every commit after named that hash as its
    # parent and gave the commit's state (else a resync), and every version published after the join
    # serialised to the signed chunks
    after = [r for r in _rows(writer_dir, "checked") if back_at < r["time"] < closed_at]
    assert after and all(r["agree"] for r in after), after
    back = json.loads((writer_dir / "final_stats.json").read_text())["lineage"]
    assert back["lineage/resyncs"] == 0 and back["lineage/versions_mismatched"] == 0, back
    # one version number, one manifest, one state per (term, version), across both learners' logs
    manifests, states = {}, {}
    for d in swarm.learner_dirs:
        for r in _rows(d, "published") + _rows(d, "checked"):
            manifests.setdefault(r["version"], set()).add(r["manifest"])
        for r in _rows(d, "commit"):
            states.setdefault((r["term"], r["version"]), set()).add(r["state"])
    assert all(len(m) == 1 for m in manifests.values()), {v: m for v, m in manifests.items() if len(m) > 1}
    assert all(len(x) == 1 for x in states.values()), {k: x for k, x in states.items() if len(x) > 1}
    applied = []
    for d in swarm.learner_dirs:
        with AcceptedLog(d / "accepted.sqlite") as ledger:
            applied.append(set(ledger.applied_ids()))
    assert applied[0] and applied[1], "both learners' batches trained"
    assert not applied[0] & applied[1]  # no batch in two learners' updates
    # each sampler sticks to its learner: until the kill, the survivor trained on its own sampler's rows only
    # (a sampler that starts before its learner is up sends to the other for FAILOVER_S: from step 6 on)
    key = load_or_create_identity(swarm.root / f"sampler-{1 - w}" / "peer.key")[0].public_key.hex()[:16]
    rows = [
        r for r in swarm.metrics(1 - w) if r["step"] > 5 and r["time"] < killed_at and r["rows_by_author"]
    ]
    assert rows and {a for r in rows for a in r["rows_by_author"]} == {key}, rows
    for d in swarm.learner_dirs:  # the samplers are honest: claims of versions the lineage published while
        # the rejoined learner was away are not "never published" to it
        stats = json.loads((d / "final_stats.json").read_text())
        struck = {a: r for a, r in stats["authors"].items() if r["strikes"] or r["banned"]}
        assert not stats["bans"] and not struck, (d.name, stats["bans"], struck)
    for d in swarm.learner_dirs:  # every learner saved its state, the member too (a restart resumes there)
        assert (d / "state" / "CURRENT").exists(), d.name
    final = json.loads((member_dir / "final_stats.json").read_text())  # it wrote since the kill
    assert final["lineage"]["lineage/takeovers"] == 1 and final["lineage"]["lineage/versions_mismatched"] == 0
    # one learner on the fused AdamW, one on the per-tensor loop: never a resync, at every version the same
    assert final["lineage"]["lineage/resyncs"] == 0 and back["lineage/resyncs"] == 0


def _rows(d, event: str) -> list[dict]:
    return [r for r in read_rows(d / "lineage.jsonl") if r.get("event") == event]


def _address(node: Node, run_id: str, key: bytes):
    """A learner's address, as its heartbeat in the DHT says."""
    from heterorl.protocol.net.dht import peers_key
    from heterorl.protocol.net.trajectories import LearnerAddress

    records = node.call(node.lookup(peers_key(run_id)), timeout=30)
    hb = next(r.body for r in records if r.author == key and r.kind == "Heartbeat")
    return LearnerAddress(key, hb["peer_id"], tuple(hb["maddrs"]))


def _signed_after(d, t: float) -> float | None:
    """When learner ``d`` first published a version after ``t`` (it writes), or None."""
    return next((r["time"] for r in _rows(d, "published") if r["time"] > t), None)


def _wait_for(ok, timeout: float, swarm: Swarm) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s\n{swarm.logs()}"
        time.sleep(0.5)


def _run_id(swarm: Swarm) -> str:
    import tomllib

    return tomllib.loads((swarm.root / "run.toml").read_text())["run_id"]


def _schema(model_dir):
    from heterorl.peer.model import load_model
    from heterorl.protocol.wire.gradients import parameter_schema

    model, _ = load_model(str(model_dir))
    return parameter_schema(model.named_parameters())
