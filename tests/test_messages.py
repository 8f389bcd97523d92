"""Signed msgpack messages: round trips, tampering, every refusal reason, and a bounded fuzz."""

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heterorl.protocol import PROTOCOL_VERSION, Identity, ProtocolError, decode, encode
from heterorl.protocol.wire.messages import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.fast  # in `make test-fast`

ALICE = Identity.generate()
RUN = "run-1"


def _batch(**over):
    row = {
        "group": 0,
        "prompt_ids": [1, 5, 6],
        "completion_ids": [7, 2],
        "logprobs": [-0.5, -0.1],
        "reward": 1.0,
    }
    body = {"run_id": RUN, "batch_id": b"\x01" * 16, "policy_version": 3, "timestamp": 1.7e9, "rows": [row]}
    body.update(over)
    return body


BODIES = {
    "TrajectoryBatch": _batch(),
    "CheckpointManifest": {
        "run_id": RUN,
        "version": 2,
        "parent_version": 1,
        "chunk_hashes": [b"h" * 32],
        "total_size": 100,
        "dtype": "float32",
        "chunk_bytes": 4096,
    },
    "RunSpec": {
        "run_id": RUN,
        "model": "tiny",
        "initial_checkpoint": b"c" * 32,
        "task": "arithmetic",
        "reward": "arithmetic_exact",
        "objective": "gepo",
        "hyperparameters": "{}",
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 6},
        "learner_keys": [ALICE.public_key],
        "vocab_size": 100,
        "max_batch_rows": 256,
    },
    "Heartbeat": {
        "run_id": RUN,
        "role": "sampler",
        "state": "generating",
        "policy_version": 3,
        "tokens_per_s": 12.5,
        "timestamp": 1.7e9,
        "peer_id": "12D3KooWExample",
        "maddrs": ["/ip4/127.0.0.1/tcp/4001"],
        "hardware": "cpu x2",
        "stats": [{"name": "batches_sent", "value": 12.0}, {"name": "outbox", "value": 0.0}],
    },
    "Provider": {
        "run_id": RUN,
        "version": 2,
        "peer_id": "12D3KooWExample",
        "maddrs": ["/ip4/127.0.0.1/tcp/4001"],
        "complete": True,
        "timestamp": 1.7e9,
    },
    "Ack": {"run_id": RUN, "batch_id": b"\x01" * 16},
    "Reject": {"run_id": RUN, "batch_id": b"\x01" * 16, "reason": "buffer full", "retry_after_s": 2.0},
}


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_round_trip(kind):
    data = encode(kind, BODIES[kind], ALICE)
    got_kind, body, author = decode(data, expected=kind, run_id=RUN, vocab_size=100)
    assert got_kind == kind and body == BODIES[kind] and author == ALICE.public_key


def test_every_signed_byte_is_covered():
    data = encode("TrajectoryBatch", _batch(), ALICE)
    accepted = 0
    for i in range(len(data)):
        for flip in (0x01, 0x80):
            mutated = bytearray(data)
            mutated[i] ^= flip
            try:
                _, body, author = decode(bytes(mutated))
            except ProtocolError:
                continue
            accepted += 1  # only a re-encoding of the very same content may pass
            assert body == _batch() and author == ALICE.public_key
    assert accepted <= 2


def _envelope(data):
    return msgpack.unpackb(data, raw=False)


def _repack(env):
    return msgpack.packb(env, use_bin_type=True)


def test_author_swap_fails_signature():
    env = _envelope(encode("Ack", BODIES["Ack"], ALICE))
    env["author"] = Identity.generate().public_key
    with pytest.raises(ProtocolError, match="bad signature"):
        decode(_repack(env))


@pytest.mark.parametrize(
    ("data_fn", "kwargs", "match"),
    [
        (lambda: encode("Ack", BODIES["Ack"], ALICE), {"run_id": "other"}, "this peer is in run"),
        (
            lambda: encode("Ack", BODIES["Ack"], ALICE),
            {"expected": "TrajectoryBatch"},
            "expected TrajectoryBatch",
        ),
        (
            lambda: _repack({**_envelope(encode("Ack", BODIES["Ack"], ALICE)), "v": PROTOCOL_VERSION + 1}),
            {},
            "protocol version",
        ),
        (lambda: b"\x00" * (MAX_MESSAGE_BYTES + 1), {}, "exceeds"),
        (lambda: encode("Ack", BODIES["Ack"], ALICE)[:-5], {}, "well-formed"),
        (lambda: b"", {}, "well-formed"),
        (lambda: _repack([1, 2, 3]), {}, "envelope"),
        (lambda: encode("TrajectoryBatch", _batch(), ALICE), {"vocab_size": 7}, "outside the vocabulary"),
    ],
)
def test_refusals(data_fn, kwargs, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data_fn(), **kwargs)


def _forge(body, kind="TrajectoryBatch"):
    """Sign a body without the encoder's validation, as a hostile peer would."""
    from heterorl.protocol.wire.messages import _signed_bytes

    sig = ALICE.sign(_signed_bytes(PROTOCOL_VERSION, kind, body, ALICE.public_key))
    return _repack(
        {"v": PROTOCOL_VERSION, "type": kind, "body": body, "author": ALICE.public_key, "sig": sig}
    )


@pytest.mark.parametrize(
    ("row_over", "match"),
    [
        ({"logprobs": [math.nan, -0.1]}, "not finite"),
        ({"logprobs": [-math.inf, -0.1]}, "not finite"),
        ({"logprobs": [0.5, -0.1]}, "outside"),
        ({"logprobs": [-0.5]}, "log-probs for"),
        ({"completion_ids": [-1, 2]}, "outside"),
        ({"reward": "1"}, "expected a number"),
    ],
)
def test_signed_but_malformed_rows_are_refused(row_over, match):
    row = {**_batch()["rows"][0], **row_over}
    with pytest.raises(ProtocolError, match=match):
        decode(_forge(_batch(rows=[row])))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_protocol_errors(data):
    with pytest.raises(ProtocolError):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_messages(data):
    kind = data.draw(st.sampled_from(sorted(BODIES)))
    raw = bytearray(encode(kind, BODIES[kind], ALICE))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        got_kind, body, _ = decode(bytes(raw))
    except ProtocolError:
        return
    assert got_kind == kind and body == BODIES[kind]


def test_heartbeat_stats_pack_drops_non_finite_and_caps():
    from heterorl.protocol.wire.messages import MAX_STATS, pack_stats, unpack_stats

    packed = pack_stats({"step": 3, "reward": 0.5, "ess": float("nan"), "huge": 1e30, "x" * 40: 1.0})
    assert unpack_stats(packed) == {"huge": 1e15, "reward": 0.5, "step": 3.0, "x" * 32: 1.0}
    assert len(pack_stats({f"k{i}": i for i in range(200)})) == MAX_STATS
    me = Identity.generate()
    body = {**BODIES["Heartbeat"], "stats": packed}
    assert unpack_stats(decode(encode("Heartbeat", body, me))[1]["stats"])["reward"] == 0.5
