"""DHT records: only the owner of a subkey can write it, and only well-formed, signed records of the right
kind under the right key are stored or returned. Pure validator tests first, then real DHT nodes."""

import dataclasses
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heterorl.protocol import Identity, encode
from heterorl.protocol.net.dht import (
    MAX_TTL_S,
    SignedRecordValidator,
    checkpoints_key,
    key_id,
    make_record,
    peers_key,
    spec_key,
)

ALICE, MALLORY = Identity.generate(), Identity.generate()
RUN = "run-1"
NOW = 1.7e9


def heartbeat(**over):
    body = {
        "run_id": RUN,
        "role": "sampler",
        "state": "generating",
        "policy_version": 1,
        "tokens_per_s": 1.0,
        "timestamp": NOW,
        "peer_id": "12D3KooWAlice",
        "maddrs": ["/ip4/127.0.0.1/tcp/1"],
        "hardware": "cpu",
        "stats": [],
    }
    body.update(over)
    return body


def validator(identity=None):
    return SignedRecordValidator(identity, clock=lambda: NOW)


def alice_record(exp=NOW + 60, key=None, body=None):
    msg = encode("Heartbeat", body or heartbeat(), ALICE)
    return make_record(key or peers_key(RUN), ALICE.public_key, msg, exp, ALICE)


@pytest.mark.fast
def test_owner_record_accepted_and_stripped():
    v = validator()
    rec = alice_record()
    assert v.validate(rec)
    kind, body, author = v.verify_record(rec)
    assert kind == "Heartbeat" and author == ALICE.public_key and body["peer_id"] == "12D3KooWAlice"
    assert msgpack.unpackb(v.strip_value(rec)) == encode(
        "Heartbeat", heartbeat(), ALICE
    )  # Ed25519 is deterministic


@pytest.mark.fast
def test_mallory_cannot_write_alices_subkey():
    msg = encode("Heartbeat", heartbeat(peer_id="12D3KooWMallory"), MALLORY)
    # Mallory's validator does not sign a subkey it does not own: the record goes out unsigned
    unsigned = make_record(peers_key(RUN), ALICE.public_key, msg, NOW + 60, MALLORY)
    assert not validator().validate(unsigned)
    # forging the wrapper with Mallory's own key under Alice's subkey fails too
    forged = _wrap(peers_key(RUN), ALICE.public_key, msg, NOW + 60, MALLORY)
    v = validator()
    assert not v.validate(forged)
    assert "record signature does not match its subkey's owner" in v.refused


@pytest.mark.fast
def test_mallory_cannot_rewrap_alices_message_as_his_own():
    msg = encode("Heartbeat", heartbeat(), ALICE)
    rec = make_record(peers_key(RUN), MALLORY.public_key, msg, NOW + 60, MALLORY)
    v = validator()
    assert not v.validate(rec)
    assert "message author differs from the record owner" in v.refused


@pytest.mark.fast
def test_replay_with_a_new_expiration_refused():
    rec = alice_record(exp=NOW + 60)
    assert validator().validate(rec)
    assert not validator().validate(dataclasses.replace(rec, expiration_time=NOW + 500))


@pytest.mark.fast
def test_wrong_key_for_the_kind_refused():
    v = validator()
    assert not v.validate(alice_record(key=checkpoints_key(RUN)))
    assert not v.validate(alice_record(key=peers_key("other-run")))
    assert not v.validate(alice_record(key=spec_key(RUN)))
    assert sum(v.refused.values()) == 3


@pytest.mark.fast
def test_expiration_bounded_per_kind():
    assert validator().validate(alice_record(exp=NOW + MAX_TTL_S["Heartbeat"]))
    assert not validator().validate(alice_record(exp=NOW + 10 * 86400))


@pytest.mark.fast
def test_messages_that_are_not_records_refused():
    ack = encode("Ack", {"run_id": RUN, "batch_id": b"\x01" * 16}, ALICE)
    assert not validator().validate(make_record(peers_key(RUN), ALICE.public_key, ack, NOW + 60, ALICE))


@pytest.mark.fast
def test_tampered_message_inside_a_valid_wrapper_refused():
    msg = bytearray(encode("Heartbeat", heartbeat(), ALICE))
    msg[-70] ^= 1  # inside the message signature or body
    rec = _wrap(peers_key(RUN), ALICE.public_key, bytes(msg), NOW + 60, ALICE)
    assert not validator().validate(rec)


def _wrap(key, subkey_owner, msg, exp, signer):
    """Build a record whose wrapper is signed by ``signer`` whatever the subkey says."""
    from hivemind.dht.validation import DHTRecord

    from heterorl.protocol.net.dht import _record_bytes

    subkey = msgpack.packb(subkey_owner, use_bin_type=True)
    value = msgpack.packb(msg, use_bin_type=True)
    sig = signer.sign(_record_bytes(key_id(key), subkey, value, exp))
    return DHTRecord(key_id(key), subkey, msgpack.packb([value, sig], use_bin_type=True), exp)


@pytest.mark.fast
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subkey=st.binary(max_size=64), value=st.binary(max_size=512), exp=st.floats(allow_nan=True))
def test_garbage_never_raises_and_is_refused(subkey, value, exp):
    from hivemind.dht.validation import DHTRecord

    assert validator().validate(DHTRecord(key_id(peers_key(RUN)), subkey, value, exp)) is False


@pytest.mark.fast
@settings(max_examples=200, deadline=None)
@given(pos=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_of_a_record_is_refused(pos, flip):
    rec = alice_record()
    value = bytearray(rec.value)
    value[pos % len(value)] ^= flip
    assert not validator().validate(dataclasses.replace(rec, value=bytes(value)))


# ---- real DHT nodes on 127.0.0.1 ----


@pytest.fixture(scope="module")
def three_nodes():
    from heterorl.protocol.net.node import NetConfig, Node

    boot = Node.start(Identity.generate())
    a = Node.start(ALICE, NetConfig(bootstrap=tuple(boot.maddrs)))
    m = Node.start(MALLORY, NetConfig(bootstrap=tuple(boot.maddrs)))
    yield boot, a, m
    for n in (m, a, boot):
        n.close()


def test_real_dht_owner_protection(three_nodes):
    from hivemind.utils import get_dht_time

    boot, a, m = three_nodes
    assert a.call(a.publish("Heartbeat", heartbeat(timestamp=time.time(), peer_id=a.peer_id), 120), 30)
    forged = encode("Heartbeat", heartbeat(timestamp=time.time(), peer_id="12D3KooWForged"), MALLORY)
    stored = m.call(m.dht.store(peers_key(RUN), forged, get_dht_time() + 600, subkey=ALICE.public_key), 30)
    assert not stored
    m.call(m.dht.store(spec_key(RUN), b"garbage", get_dht_time() + 60, subkey=MALLORY.public_key), 30)
    for node in (boot, a):
        records = node.call(node.lookup(peers_key(RUN)), 30)
        assert [(r.author, r.body["peer_id"]) for r in records] == [(ALICE.public_key, a.peer_id)]
        assert node.call(node.lookup(spec_key(RUN)), 30) == []
    assert boot.validator.stats()["dht/records_refused"] >= 1
