"""Learner peers, real processes on 127.0.0.1: two learners and two samplers train one lineage; the writer
is SIGKILLed, the other writes on, and the killed one comes back, takes the lineage's state and agrees.

The learners elect who writes (the lowest live key, or whoever was up first). Each sampler is given a key
whose rendezvous choice is a different learner, so both learners take data. At
every version the writer published, the member's own weights serialise to the signed manifest's chunks
(``lineage.jsonl``); every commit's parent state hash matched (else the member resyncs, counted). No batch is
applied by both learners, not even one a sampler resent to the survivor because the killed writer's Ack was
lost (the rejoined learner hears that the lineage trained it, and drops its own copy). No honest sampler
is struck, not for claiming a version published while the rejoined learner was away. A node speaking the
lineage protocol with a key the run does not list, of another run, or of another model, is refused with the
reason.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from heterorl.protocol import ProtocolError, load_or_create_identity
from heterorl.protocol.net.lineage import LineageLink, LineageRefused, find_lineage
from heterorl.protocol.net.node import NetConfig, Node
from heterorl.protocol.storage.jsonlog import read_rows
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.identity import Identity
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


def _refusal(node: Node, identity: Identity, run_id: str, writer, schema) -> str:
    link = LineageLink(node, identity, run_id, writer.key, schema)
    with pytest.raises((LineageRefused, ProtocolError, ConnectionError, EOFError)) as e:
        link.open(writer.peer_id, writer.maddrs, 0, bytes(32))
    return str(e.value)


def test_two_learners_train_one_lineage_agree_at_every_version_and_refuse_others(tmp_path, tiny_model_dir):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, learners=2)
    try:
        swarm.start_coordinator()
        procs = [swarm.start_learner(index=0), swarm.start_learner(index=1)]
        logs = [swarm.root / f"{d.name}.stderr.log" for d in swarm.learner_dirs]
        _wait_for(lambda: any("joined the lineage" in p.read_text() for p in logs if p.exists()), 120, swarm)
        for i in (0, 1):
            swarm.sampler_key_for(f"sampler-{i}", i)
            swarm.start_sampler(f"sampler-{i}")
        swarm.wait_step(12, timeout=240)
        run_id = _run_id(swarm)
        node = Node.start(Identity.generate(), NetConfig(bootstrap=tuple(swarm.ready["maddrs"])))
        try:
            live = node.call(
                find_lineage(node, run_id, [bytes.fromhex(k) for k in swarm.learner_keys]), timeout=30
            )
            writer = next(x.address for x in live if x.writes)
            w = [bytes.fromhex(k) for k in swarm.learner_keys].index(writer.key)  # who writes: elected
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
        published = [r["version"] for r in read_rows(writer_dir / "lineage.jsonl") if r.get("published")]
        checks = list(read_rows(member_dir / "lineage.jsonl"))
        assert len(published) >= 12 and checks, (published, checks)
        agreed = {c["version"] for c in checks if c["agree"]}
        assert all(c["agree"] for c in checks), checks
        assert {
            v for v in published if v <= max(agreed)
        } <= agreed  # every version published while it was there

        # the writer is SIGKILLed: the member writes on, and signs its next version within 2 steps + 5 s
        times = [r["time"] for r in swarm.metrics(w)][-10:]
        step_s = sorted(b - a for a, b in zip(times, times[1:], strict=False))[len(times) // 2 - 1]
        killed_at = time.time()
        procs[w].kill()
        _wait_for(lambda: _signed_after(member_dir, killed_at), 60, swarm)
        took = _signed_after(member_dir, killed_at) - killed_at
        assert took <= 2 * step_s + 5, (took, step_s)
        # it comes back: it joins the new writer with its state, and agrees within 2 versions
        back_at = time.time()
        procs[w] = swarm.start_learner(index=w)
        _wait_for(
            lambda: [r for r in read_rows(writer_dir / "lineage.jsonl") if r["time"] > back_at], 120, swarm
        )
        step = swarm.metrics(1 - w)[-1]["step"]
        swarm.wait_step(step + 4, timeout=120)  # (learner 0's rows: either learner records every version)
        closed_at = time.time()  # what the learners do as the swarm is torn down is not under test
    finally:
        swarm.close()
    log = (swarm.root / f"{writer_dir.name}.stderr.log").read_text()
    joined = int(re.findall(r"member of \w+'s lineage at version (\d+)", log)[-1])
    assert (
        "took" in log and "state at version" in log
    )  # its state was not the lineage's: it took the writer's
    # the state it took hashed as the writer's (checked on load), every commit after named that hash as its
    # parent (else a resync), and every version published after the join serialised to the signed chunks
    after = [r for r in read_rows(writer_dir / "lineage.jsonl") if back_at < r["time"] < closed_at]
    assert after and all(r["agree"] for r in after), after
    back = json.loads((writer_dir / "final_stats.json").read_text())["lineage"]
    assert back["lineage/resyncs"] == 0 and back["lineage/versions_mismatched"] == 0, back
    signed = [
        r["version"]
        for r in read_rows(member_dir / "lineage.jsonl")
        if r.get("published") and r["time"] < closed_at
    ]
    checked = {r["version"] for r in after}
    assert {v for v in signed if joined < v <= max(checked)} <= checked, (joined, signed, after)
    assert all(r.get("agree", True) for r in read_rows(member_dir / "lineage.jsonl"))
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
        assert not stats["bans"] and not stats["strikes"], (d.name, stats["bans"], stats["strikes"])
    final = json.loads((member_dir / "final_stats.json").read_text())  # it wrote since the kill
    assert final["lineage"]["lineage/takeovers"] == 1 and final["lineage"]["lineage/versions_mismatched"] == 0


def _signed_after(d, t: float) -> float | None:
    """When learner ``d`` first published a version after ``t`` (it writes), or None."""
    return next(
        (r["time"] for r in read_rows(d / "lineage.jsonl") if r.get("published") and r["time"] > t), None
    )


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
