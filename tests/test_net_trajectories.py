"""Trajectory delivery over libp2p streams: exactly once through a learner crash, flow control, refusals."""

from __future__ import annotations

import time

import msgpack
import pytest

from heterorl.protocol import Identity, encode, load_identity
from heterorl.protocol.net.node import NetConfig, Node
from heterorl.protocol.net.trajectories import (
    LearnerAddress,
    TrajectoryReceiver,
    TrajectorySender,
    find_learners,
    new_batch_id,
)
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.outbox import Outbox
from heterorl.protocol.wire import messages


@pytest.fixture
def run(request) -> str:
    return f"traj-{request.node.name[:40]}"


def test_learner_killed_and_restarted_every_batch_lands_exactly_once(bootstrap_node, peers, tmp_path, run):
    key, ledger = tmp_path / "learner.key", tmp_path / "accepted.sqlite"
    boot = ["--bootstrap", *bootstrap_node.maddrs, "--run", run]
    learner = peers("learner", *boot, "--key", str(key), "--ledger", str(ledger))
    learner.wait_event("ready")
    learner_key = load_identity(key).public_key.hex()
    sampler = peers(
        "sampler",
        *boot,
        "--outbox",
        str(tmp_path / "outbox.sqlite"),
        "--learner-key",
        learner_key,
        "--batches",
        "60",
        "--interval",
        "0.1",
        "--timeout",
        "150",
    )
    sampler.wait_event("ready")
    for _ in range(8):  # mid-stream: some batches in, more coming
        learner.wait_event("accepted", 60)
    learner.kill()
    time.sleep(2.0)  # the sampler keeps producing into its outbox meanwhile
    restarted = peers("learner", *boot, "--key", str(key), "--ledger", str(ledger))
    assert restarted.wait_event("ready")["already"] >= 8  # the ledger survived the SIGKILL
    queued = sampler.wait_event("queued", 60)["ids"]
    done = sampler.wait_event("done", 180)
    assert done["pending"] == 0, done
    assert done["net/send_failures"] >= 1  # it did notice the outage
    restarted.stop()
    stats = restarted.wait_event("stats", 30)
    with AcceptedLog(ledger) as log:
        ids = log.applied_ids() + [item.batch_id for item in log.pending()]
        assert sorted(i.hex() for i in ids) == sorted(queued)  # each batch once, none missing
        assert log.count() == len(queued) == 60
    assert stats["logged"] == 60


def _batch(
    identity: Identity, run: str, *, tokens: int = 8, run_id: str | None = None, logprob: float = -0.5
):
    bid = new_batch_id()
    body = {
        "run_id": run_id or run,
        "batch_id": bid,
        "policy_version": 3,
        "timestamp": time.time(),
        "rows": [
            {
                "group": 0,
                "prompt_ids": [1, 2],
                "completion_ids": [3] * tokens,
                "logprobs": [logprob] * tokens,
                "reward": 1.0,
            }
        ],
    }
    if run_id is None and logprob <= 0:
        return bid, encode("TrajectoryBatch", body, identity)
    return bid, _sign_unchecked("TrajectoryBatch", body, identity)  # what a hostile sampler can send


def _sign_unchecked(kind: str, body: dict, identity: Identity) -> bytes:
    """A correctly signed message that skips encode()'s schema check."""
    sig = identity.sign(messages._signed_bytes(messages.PROTOCOL_VERSION, kind, body, identity.public_key))
    return msgpack.packb(
        {
            "v": messages.PROTOCOL_VERSION,
            "type": kind,
            "body": body,
            "author": identity.public_key,
            "sig": sig,
        },
        use_bin_type=True,
    )


@pytest.fixture
def pair(bootstrap_node, tmp_path, run):
    """A learner node with a receiver and a sampler node with an outbox and a sender, in this process."""
    cfg = NetConfig(bootstrap=tuple(bootstrap_node.maddrs))
    lid, sid = Identity.generate(), Identity.generate()
    ln, sn = Node.start(lid, cfg), Node.start(sid, cfg)
    ledger, outbox = AcceptedLog(tmp_path / "l.sqlite"), Outbox(tmp_path / "o.sqlite")
    room = {"open": True}
    receiver = TrajectoryReceiver(
        lid, run, ledger, vocab_size=16, has_room=lambda: room["open"], retry_after_s=0.7
    )
    ln.call(receiver.attach(ln))
    hb = {
        "run_id": run,
        "role": "learner",
        "state": "learning",
        "policy_version": 3,
        "tokens_per_s": 0.0,
        "timestamp": time.time(),
        "peer_id": ln.peer_id,
        "maddrs": ln.plain_maddrs(),
        "hardware": "cpu",
        "stats": [],
    }
    assert ln.call(ln.publish("Heartbeat", hb))
    sender = TrajectorySender(sn, outbox, run, [lid.public_key])
    yield type(
        "Pair",
        (),
        dict(
            ln=ln,
            sn=sn,
            lid=lid,
            sid=sid,
            ledger=ledger,
            outbox=outbox,
            room=room,
            receiver=receiver,
            sender=sender,
            run=run,
        ),
    )
    for n in (sn, ln):
        n.close()
    ledger.close()
    outbox.close()


def test_learners_are_found_in_the_dht_only_when_the_run_allows_them(pair):
    found = pair.sn.call(find_learners(pair.sn, pair.run, [pair.lid.public_key]))
    assert [(f.key, f.peer_id) for f in found] == [(pair.lid.public_key, pair.ln.peer_id)]
    assert pair.sn.call(find_learners(pair.sn, pair.run, [Identity.generate().public_key])) == []


def test_ack_then_duplicate_is_acked_but_logged_once(pair):
    bid, raw = _batch(pair.sid, pair.run)
    for _ in range(2):
        pair.outbox.put(bid, raw, 3)
        assert pair.sn.call(pair.sender.send_due(), 30) == 1
        assert len(pair.outbox) == 0
    assert pair.ledger.count() == 1 and pair.ledger.seen(bid)
    assert pair.receiver.accepted == 1 and pair.receiver.duplicates == 1
    assert pair.sender.acked == 2 and len(pair.sender.latencies) == 2


def test_full_learner_defers_and_the_sampler_waits_as_told(pair):
    pair.room["open"] = False
    bid, raw = _batch(pair.sid, pair.run)
    pair.outbox.put(bid, raw, 3)
    t0 = time.time()
    assert pair.sn.call(pair.sender.send_due(), 30) == 0
    t1 = time.time()
    assert pair.sender.deferred == 1 and pair.receiver.deferred == 1 and len(pair.outbox) == 1
    # due exactly the learner's retry_after_s (0.7 s) after its reply, no sooner (no polling before it); the
    # bounds come from the clock around each call, so a loaded machine's slow round trip cannot fail this
    before = time.time()
    wait = pair.outbox.next_due_in()
    after = time.time()
    assert after + wait >= t0 + 0.7 and (wait == 0 or before + wait <= t1 + 0.7), (t0, t1, before, wait)
    if time.time() < t0 + 0.5:  # well before it is due (a loaded machine may already be past that)
        assert pair.outbox.due() == []
    pair.room["open"] = True
    while (wait := pair.outbox.next_due_in()) > 0:
        time.sleep(wait)
    assert pair.sn.call(pair.sender.send_due(), 30) == 1
    assert pair.ledger.seen(bid) and len(pair.outbox) == 0


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: _batch(p.sid, p.run, run_id="another-run"), "run"),
        (lambda p: _batch(p.sid, p.run, logprob=float("nan")), "finite"),
        (lambda p: _batch(p.sid, p.run, logprob=0.5), ""),
    ],
)
def test_bad_batches_are_refused_for_good_and_never_logged(pair, make, reason):
    bid, raw = make(pair)
    pair.outbox.put(bid, raw, 3)
    assert pair.sn.call(pair.sender.send_due(), 30) == 0
    assert len(pair.outbox) == 0 and pair.sender.rejected == 1  # a final Reject: not retried
    assert reason in pair.outbox.rejections()[0].reason
    assert not pair.ledger.seen(bid) and pair.ledger.count() == 0
    assert sum(pair.receiver.rejected.values()) == 1 and sum(pair.receiver.strikes.values()) == 1


def test_forged_signature_is_refused(pair):
    bid, raw = _batch(pair.sid, pair.run)
    forged = bytearray(raw)
    forged[-5] ^= 0x01  # inside the signature
    pair.outbox.put(bid, bytes(forged), 3)
    assert pair.sn.call(pair.sender.send_due(), 30) == 0
    assert "signature" in pair.outbox.rejections()[0].reason
    assert pair.ledger.count() == 0


def test_admit_hook_refusal_counts_against_the_author(pair):
    pair.receiver.admit = lambda body, author: "claimed rewards disagree"
    bid, raw = _batch(pair.sid, pair.run)
    pair.outbox.put(bid, raw, 3)
    assert pair.sn.call(pair.sender.send_due(), 30) == 0
    assert pair.receiver.strikes[pair.sid.public_key.hex()] == 1
    assert "disagree" in pair.outbox.rejections()[0].reason and not pair.ledger.seen(bid)


def test_unreachable_learner_keeps_the_batch_and_backs_off(pair, bootstrap_node):
    ghost = LearnerAddress(
        pair.lid.public_key, bootstrap_node.peer_id, ()
    )  # a live peer without the protocol
    pair.sender._fixed = [ghost]
    bid, raw = _batch(pair.sid, pair.run)
    pair.outbox.put(bid, raw, 3)
    assert pair.sn.call(pair.sender.send_due(), 30) == 0
    assert pair.sender.failures == 1 and len(pair.outbox) == 1 and pair.outbox.next_due_in() > 0
