"""DHT key names per run and the record validator that keeps the shared table honest.

Every record a HeteroRL peer publishes lives under a per-run key, in a *subkey* equal to its author's Ed25519
public key, and its value is a signed protocol message (:mod:`protocol.wire.messages`) wrapped with a
second signature
over (key, subkey, value, expiration). hivemind calls :class:`SignedRecordValidator` on every record another
peer asks us to store and on every record a lookup returns, so:

- a peer can write only its own subkey (the record signature must verify against the subkey's key);
- a replayed old record cannot get a fresh expiration (the expiration is signed);
- the value must decode as a message of the kind that belongs under that key, signed by the same author;
- expirations are bounded per kind, so garbage cannot squat in the table forever.

Anything else is refused and counted. The validator never raises: hivemind treats False as "refuse".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify
from heterorl.protocol.wire.messages import MAX_MESSAGE_BYTES, decode

log = logging.getLogger(__name__)

KEY_PREFIX = "heterorl"
# How long a record may live, per kind; publishers refresh well before that.
MAX_TTL_S = {"RunSpec": 7 * 86400.0, "CheckpointManifest": 86400.0, "Heartbeat": 600.0, "Provider": 3600.0}
CLOCK_SKEW_S = 300.0
MAX_RECORD_BYTES = MAX_MESSAGE_BYTES + 256


def spec_key(run_id: str) -> str:
    return f"{KEY_PREFIX}/{run_id}/spec"


def checkpoints_key(run_id: str) -> str:
    return f"{KEY_PREFIX}/{run_id}/checkpoints"


def peers_key(run_id: str) -> str:
    return f"{KEY_PREFIX}/{run_id}/peers"


def providers_key(run_id: str, version: int) -> str:
    return f"{KEY_PREFIX}/{run_id}/providers/{version}"


def dataset_providers_key(run_id: str, dataset_id: bytes) -> str:
    """Where the Provider records of a run's data set (protocol/wire/dataset.py) live: a key per data set."""
    return f"{KEY_PREFIX}/{run_id}/datasets/{dataset_id.hex()}/providers"


def record_key(kind: str, body: dict) -> str:
    """The one DHT key a message of ``kind`` may be published under."""
    if kind == "RunSpec":
        return spec_key(body["run_id"])
    if kind == "CheckpointManifest":
        return checkpoints_key(body["run_id"])
    if kind == "Heartbeat":
        return peers_key(body["run_id"])
    if kind == "Provider" and "dataset" in body:
        return dataset_providers_key(body["run_id"], body["dataset"])
    if kind == "Provider":
        return providers_key(body["run_id"], body["version"])
    raise ProtocolError(f"{kind} messages are not DHT records")


def key_id(key: str) -> bytes:
    """The bytes hivemind hands validators in place of the key (a hash: validators never see the name)."""
    return DHTID.generate(source=key).to_bytes()


def _record_bytes(key: bytes, subkey: bytes, value: bytes, expiration_time: float) -> bytes:
    return msgpack.packb(
        [b"heterorl-record-v1", key, subkey, value, float(expiration_time)], use_bin_type=True
    )


def _unpack(data: bytes) -> object:
    return msgpack.unpackb(data, raw=False, max_ext_len=0, max_map_len=0, max_array_len=2)


class SignedRecordValidator(RecordValidatorBase):
    """Sign what ``identity`` publishes; refuse every record that is not a well-formed, owned HeteroRL record.

    ``clock`` is injectable for tests. ``stats()`` counts refusals by reason.
    """

    def __init__(self, identity: Identity | None = None, clock=time.time):
        self._identity = identity
        self._clock = clock
        self._own_subkey = msgpack.packb(identity.public_key, use_bin_type=True) if identity else None
        self.refused: collections.Counter[str] = collections.Counter()
        self.accepted = 0

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._identity is None or record.subkey != self._own_subkey:
            return record.value  # not ours to sign: validate() will refuse it
        sig = self._identity.sign(
            _record_bytes(record.key, record.subkey, record.value, record.expiration_time)
        )
        return msgpack.packb([record.value, sig], use_bin_type=True)

    def strip_value(self, record: DHTRecord) -> bytes:
        try:
            inner, _ = _unpack(record.value)
            return inner
        except Exception:  # only called after validate() succeeded; be safe anyway
            return record.value

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except ProtocolError as e:
            reason = str(e).split(":")[0][:80]
            self.refused[reason] += 1
            log.debug("refused DHT record: %s", e)
            return False
        except Exception as e:  # malformed beyond what the checks anticipate: still a refusal, never a crash
            self.refused[f"malformed ({type(e).__name__})"] += 1
            return False
        self.accepted += 1
        return True

    def verify_record(self, record: DHTRecord) -> tuple[str, dict, bytes]:
        """Like validate(), but returns (kind, body, author) or raises ProtocolError with the reason."""
        return self._check(record)

    def _check(self, record: DHTRecord) -> tuple[str, dict, bytes]:
        if len(record.value) > MAX_RECORD_BYTES:
            raise ProtocolError(f"record too large: {len(record.value)} bytes")
        try:
            author = _unpack(record.subkey)
            wrapped = _unpack(record.value)
        except Exception:
            raise ProtocolError("record not well-formed msgpack") from None
        if not isinstance(author, bytes) or len(author) != PUBLIC_KEY_BYTES:
            raise ProtocolError("subkey is not an author public key")
        if not (isinstance(wrapped, list) and len(wrapped) == 2):
            raise ProtocolError("record value not a signed pair")
        inner, sig = wrapped
        if not isinstance(inner, bytes) or not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
            raise ProtocolError("record value not a signed pair")
        if not verify(author, sig, _record_bytes(record.key, record.subkey, inner, record.expiration_time)):
            raise ProtocolError("record signature does not match its subkey's owner")
        message = _unpack(inner)
        if not isinstance(message, bytes):
            raise ProtocolError("record value is not a message")
        kind, body, msg_author = decode(message)
        if kind not in MAX_TTL_S:
            raise ProtocolError(f"{kind} messages are not DHT records")
        if msg_author != author:
            raise ProtocolError("message author differs from the record owner")
        if key_id(record_key(kind, body)) != record.key:
            raise ProtocolError(f"{kind} stored under a key it does not belong to")
        try:
            expiration = float(record.expiration_time)
        except (TypeError, ValueError, OverflowError):
            raise ProtocolError("expiration is not a number") from None
        if not math.isfinite(expiration):
            raise ProtocolError("expiration is not a finite number")
        if not expiration <= self._clock() + MAX_TTL_S[kind] + CLOCK_SKEW_S:
            raise ProtocolError(f"expiration too far ahead for a {kind}")
        return kind, body, author

    def stats(self) -> dict[str, int]:
        return {"dht/records_accepted": self.accepted, "dht/records_refused": sum(self.refused.values())}

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator)


def make_record(
    key: str, author: bytes, message: bytes, expiration_time: float, identity: Identity
) -> DHTRecord:
    """Build the signed record hivemind would store (used by tests and the fuzz script)."""
    subkey = msgpack.packb(author, use_bin_type=True)
    value = msgpack.packb(message, use_bin_type=True)
    record = DHTRecord(key_id(key), subkey, value, expiration_time)
    signed = SignedRecordValidator(identity).sign_value(record)
    return dataclasses.replace(record, value=signed)
