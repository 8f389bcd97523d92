"""The lineage role's own judgement (peer/daemon/learner_lineage.py), on a stand-in learner: no network.

A restarted learner counts the versions its chunk store holds as published (else honest batches of them were
refused as "newer than any published" until its first commit); the writer's vet of a member's part (batches
the lineage trained, another copy's bytes or tokens); a refused part's batches dropped, never resent; only the
writer, within its lease, for a version it committed, may sign; the heartbeat's reservation."""

from __future__ import annotations

import hashlib
import time
import types

import pytest

from heterorl.peer.daemon.learner_lineage import LineageRole
from heterorl.peer.learner.buffer import Buffered, TrajectoryBuffer
from heterorl.peer.learner.election import Lease
from heterorl.peer.learner.trainer import Trainer
from heterorl.protocol import encode
from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.identity import Identity

pytestmark = pytest.mark.fast

RUN = "role-unit"
SAMPLER = Identity.generate()


class Store:
    def __init__(self, versions=()):
        self._versions = list(versions)

    def versions(self):
        return list(self._versions)

    def manifest(self, v):
        return None


def _role(tmp_path, store_versions=()):
    from test_lineage_math import model
    from test_trainer import options

    me = Identity.generate()
    s = RunSettings(
        run_id=RUN, learner_keys=(me.public_key, b"\x02" * 32), vocab_size=37, initial_checkpoint=b"h" * 32
    )
    learner = types.SimpleNamespace(
        settings=s,
        world_size=1,
        trainer=Trainer(model(), options(), pad_id=0),
        identity=me,
        node=types.SimpleNamespace(peer_id="12D3KooWStandIn"),
        store=Store(store_versions),
        state_dir=tmp_path,
        ledger=AcceptedLog(tmp_path / "accepted.sqlite"),
        buffer=TrajectoryBuffer(8),
        trust=types.SimpleNamespace(manifests=types.SimpleNamespace(note=lambda v, h: None)),
        publisher=types.SimpleNamespace(published_version=-1),
    )
    return LineageRole(learner), learner


def _batch(n: int, tokens: int = 3) -> tuple[dict, bytes]:
    body = {
        "run_id": RUN,
        "batch_id": n.to_bytes(16, "big"),
        "policy_version": 0,
        "timestamp": 1.7e9 + n,
        "rows": [
            {"group": 0, "prompt_ids": [1, 2], "completion_ids": [3] * tokens, "logprobs": [-0.5] * tokens,
             "reward": 1.0}
        ],
    }  # fmt: skip
    return body, encode("TrajectoryBatch", body, SAMPLER)


def test_a_restarted_learner_counts_the_versions_its_store_holds_as_published(tmp_path):
    role, _ = _role(tmp_path, store_versions=(40, 41, 42))
    assert role.published_version() == 42  # before: -1 until its first commit came
    fresh, _ = _role(tmp_path / "b", store_versions=())
    assert fresh.published_version() == -1


def test_the_writer_vets_the_batches_a_part_names(tmp_path):
    role, learner = _role(tmp_path)
    body, raw = _batch(1, tokens=3)
    learner.ledger.accept(body["batch_id"], SAMPLER.public_key, 0, raw, time.time())
    sha = hashlib.sha256(raw).digest()
    assert role._vet(b"m" * 32, [(body["batch_id"], sha, 3)]) is None  # a resend both hold: the same bytes
    assert "other bytes" in role._vet(b"m" * 32, [(body["batch_id"], b"\x00" * 32, 3)])
    assert "holds 3" in role._vet(b"m" * 32, [(body["batch_id"], sha, 300)])  # tokens it does not hold
    learner.ledger.record_lineage([(b"\x09" * 16, b"\x09" * 32)], 5, "trained")
    assert "lineage trained" in role._vet(b"m" * 32, [(b"\x09" * 16, b"\x09" * 32, 3)])


def test_a_refused_part_is_dropped_and_never_resent(tmp_path):
    role, learner = _role(tmp_path)
    items = []
    for n in (1, 2):
        body, raw = _batch(n)
        learner.ledger.accept(body["batch_id"], SAMPLER.public_key, 0, raw, time.time())
        items.append(
            Buffered(body["batch_id"], SAMPLER.public_key, body, time.time(), hashlib.sha256(raw).digest())
        )
    role._refused(items, {"batch_ids": [items[0].batch_id], "reason": "it names batches the lineage trained"})
    assert [b.batch_id for b in learner.buffer.take_groups(1, timeout=0)] == [items[1].batch_id]  # kept
    assert "refused them" in learner.ledger.dropped()[items[0].batch_id]  # gone for good, with the reason
    assert [it.batch_id for it in learner.ledger.pending()] == [items[1].batch_id]


def test_only_the_writer_signs_within_its_lease_a_version_it_committed(tmp_path):
    role, learner = _role(tmp_path)
    assert "does not write" in role.may_sign(0)
    role.writer.active = True  # (as activate() would: no network here)
    now = [1000.0]
    role.lease = Lease(term=2, held=0, clock=lambda: now[0])
    assert "lapsed" in role.may_sign(0)
    role.lease.stored(now[0], reserved=20)
    role.lease.confirmed(now[0] + 1)
    assert role.may_sign(0) is None
    assert "not a state this writer committed" in role.may_sign(7)
    role.lease.fence("a writer in term 3")
    assert "fenced" in role.may_sign(0)
    status = role.lineage_status()
    assert status["writes"] and status["term"] == role.term and status["reserved"] >= status["applied"] + 8
