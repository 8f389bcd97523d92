"""The oracle: decides, without the decoders' code, what each input must decode to, or why it must be refused.

:class:`Oracle` judges messages and DHT records (authenticity by bookkeeping of every signature the fuzzer
made), :func:`_oracle_frames` what a ``read_frame`` loop must yield, :func:`_oracle_chunk_request` what a
chunk request must parse to. A refusal is signalled by :class:`_Reject`, whose message says why.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import msgpack

from .wire import (
    DHT_SKEW_S,
    DHT_TTL_S,
    ENVELOPE_KEYS,
    HASH_BYTES,
    MAX_HASHES_PER_REQUEST,
    MAX_MESSAGE_BYTES,
    MAX_RECORD_BYTES,
    PROTOCOL_VERSION,
    PUBKEY_BYTES,
    SIG_BYTES,
    SPEC,
    _Bin,
    _Bool,
    _Int,
    _List,
    _Num,
    _Rec,
    _Text,
)


class _Reject(Exception):
    """Raised inside the oracle: this input must be refused (the message says why)."""


def _has_ext(obj: Any) -> bool:
    """Whether a decoded msgpack tree holds an ext value (iterative: trees may be a thousand deep)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, (msgpack.ExtType, msgpack.Timestamp)):
            return True
        if type(o) is list:
            stack.extend(o)
        elif type(o) is dict:
            stack.extend(o.keys())
            stack.extend(o.values())
    return False


def _ocheck(spec: Any, v: Any, path: str) -> Any:
    """The value normalised as a decoder must return it (numbers as floats), or _Reject."""
    if isinstance(spec, _Int):
        if type(v) is not int or not spec.lo <= v <= spec.hi:
            raise _Reject(f"{path}: not an integer in [{spec.lo}, {spec.hi}]")
        return v
    if isinstance(spec, _Num):
        if type(v) not in (int, float) or not math.isfinite(v):
            raise _Reject(f"{path}: not a finite number")
        if (spec.lo is not None and v < spec.lo) or (spec.hi is not None and v > spec.hi):
            raise _Reject(f"{path}: number out of range")
        return float(v)
    if isinstance(spec, _Text):
        if type(v) is not str or len(v) > spec.n:
            raise _Reject(f"{path}: not a string of at most {spec.n} characters")
        return v
    if isinstance(spec, _Bin):
        if type(v) is not bytes or not spec.lo <= len(v) <= spec.hi:
            raise _Reject(f"{path}: not {spec.lo}..{spec.hi} bytes")
        return v
    if isinstance(spec, _Bool):
        if type(v) is not bool:
            raise _Reject(f"{path}: not a bool")
        return v
    if isinstance(spec, _List):
        if type(v) is not list or not spec.lo <= len(v) <= spec.hi:
            raise _Reject(f"{path}: not a list of {spec.lo}..{spec.hi} items")
        return [_ocheck(spec.item, x, f"{path}[]") for x in v]
    if isinstance(spec, _Rec):
        if type(v) is not dict:
            raise _Reject(f"{path}: not a map")
        if not spec.names() <= set(v) <= spec.names() | spec.optional_names():
            raise _Reject(f"{path}: wrong field set")
        fields = spec.fields + tuple((k, s) for k, s in spec.optional if k in v)
        return {k: _ocheck(s, v[k], f"{path}.{k}") for k, s in fields}
    raise AssertionError(spec)


def _ocanon(obj: Any) -> Any:
    if type(obj) is dict:
        return {k: _ocanon(obj[k]) for k in sorted(obj)}
    if type(obj) in (list, tuple):
        return [_ocanon(x) for x in obj]
    return obj


def _osigned_bytes(kind: Any, body: Any, author: Any) -> bytes:
    """What a message signature covers: canonical msgpack of [version, type, body, author]."""
    return msgpack.packb(_ocanon([PROTOCOL_VERSION, kind, body, author]), use_bin_type=True)


def _orecord_bytes(key: Any, subkey: Any, inner: Any, expiration: Any) -> bytes:
    """What a DHT record signature covers."""
    return msgpack.packb([b"heterorl-record-v1", key, subkey, inner, float(expiration)], use_bin_type=True)


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


class Oracle:
    """Decides, independently of the decoders, what each input must decode to.

    Authenticity is decided by bookkeeping, not by cryptography: every signature the fuzzer makes is
    registered, and a message (or record) is authentic iff exactly that (signed bytes, author, signature)
    triple was registered. A decoder that accepts anything else accepted a forgery.
    """

    def __init__(self) -> None:
        self.messages: dict[bytes, tuple[bytes, bytes]] = {}
        self.records: dict[bytes, tuple[bytes, bytes]] = {}

    def register_message(self, signed: bytes, author: bytes, sig: bytes) -> None:
        self.messages[_digest(signed)] = (author, sig)

    def register_record(self, signed: bytes, author: bytes, sig: bytes) -> None:
        self.records[_digest(signed)] = (author, sig)

    def message(
        self, data: Any, expected: str | None = None, run_id: str | None = None, vocab_size: int | None = None
    ) -> tuple[str, dict, bytes]:
        """(type, normalised body, author) the message must decode to, or _Reject."""
        if type(data) not in (bytes, bytearray):
            raise _Reject("not bytes")
        if len(data) > MAX_MESSAGE_BYTES:
            raise _Reject("over the size cap")
        try:
            env = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
        except Exception:
            raise _Reject("not one well-formed msgpack object") from None
        if _has_ext(env):
            raise _Reject("ext type")
        if type(env) is not dict or set(env) != ENVELOPE_KEYS:
            raise _Reject("not an envelope")
        if type(env["v"]) is not int or env["v"] != PROTOCOL_VERSION:
            raise _Reject("protocol version is not the integer 1")
        kind = env["type"]
        if type(kind) is not str or kind not in SPEC:
            raise _Reject("unknown type")
        if expected is not None and kind != expected:
            raise _Reject("not the expected type")
        author, sig, body = env["author"], env["sig"], env["body"]
        if type(author) is not bytes or len(author) != PUBKEY_BYTES:
            raise _Reject("author is not a public key")
        if type(sig) is not bytes or len(sig) != SIG_BYTES:
            raise _Reject("sig is not a signature")
        if type(body) is not dict:
            raise _Reject("body is not a map")
        try:
            signed = _osigned_bytes(kind, body, author)
        except Exception:
            raise _Reject("body cannot be canonicalised, so was never signed") from None
        if self.messages.get(_digest(signed)) != (author, sig):
            raise _Reject("not signed by its author")
        norm = _ocheck(SPEC[kind], body, "body")
        if run_id is not None and norm["run_id"] != run_id:
            raise _Reject("wrong run")
        if kind == "TrajectoryBatch":
            for row in norm["rows"]:
                if not row["completion_ids"] or len(row["logprobs"]) != len(row["completion_ids"]):
                    raise _Reject("rows: one log-prob per completion token, at least one token")
                if vocab_size is not None and any(
                    t >= vocab_size for t in row["prompt_ids"] + row["completion_ids"]
                ):
                    raise _Reject("rows: token id outside the vocabulary")
        return kind, norm, author

    def record(self, rec: Any, now: float) -> tuple[str, dict, bytes]:
        """(kind, body, author) of a DHT record the validator must accept, or _Reject."""
        key, subkey, value, exp = (
            getattr(rec, f, None) for f in ("key", "subkey", "value", "expiration_time")
        )
        if not all(type(x) in (bytes, bytearray) for x in (key, subkey, value)):
            raise _Reject("key, subkey and value must be bytes")
        if not isinstance(exp, (int, float)):
            raise _Reject("expiration is not a number")
        if len(value) > MAX_RECORD_BYTES:
            raise _Reject("record too large")
        try:
            author = msgpack.unpackb(bytes(subkey), raw=False, strict_map_key=False)
            wrapped = msgpack.unpackb(bytes(value), raw=False, strict_map_key=False)
        except Exception:
            raise _Reject("not msgpack") from None
        if type(author) is not bytes or len(author) != PUBKEY_BYTES:
            raise _Reject("subkey is not a public key")
        if type(wrapped) is not list or len(wrapped) != 2:
            raise _Reject("value is not [message, sig]")
        inner, sig = wrapped
        if type(inner) is not bytes or type(sig) is not bytes or len(sig) != SIG_BYTES:
            raise _Reject("value is not [message, sig]")
        try:
            signed = _orecord_bytes(bytes(key), bytes(subkey), inner, exp)
        except Exception:
            raise _Reject("record cannot be encoded, so was never signed") from None
        if self.records.get(_digest(signed)) != (author, sig):
            raise _Reject("record not signed by its subkey's owner")
        try:
            message = msgpack.unpackb(inner, raw=False, strict_map_key=False)
        except Exception:
            raise _Reject("inner value not msgpack") from None
        if type(message) is not bytes:
            raise _Reject("inner value not a message")
        kind, body, msg_author = self.message(message)
        if kind not in DHT_TTL_S:
            raise _Reject("not a DHT kind")
        if msg_author != author:
            raise _Reject("message author is not the record owner")
        if _key_id(_key_name(kind, body)) != bytes(key):
            raise _Reject("stored under the wrong key")
        if not math.isfinite(exp):  # NaN and ±inf: an expiration must be a real, bounded time
            raise _Reject("expiration not finite")
        if not exp <= now + DHT_TTL_S[kind] + DHT_SKEW_S:
            raise _Reject("expiration not bounded by the kind's TTL")
        return kind, body, author


def _key_name(kind: str, body: dict) -> str:
    run = body["run_id"]
    suffix = {"RunSpec": "spec", "CheckpointManifest": "checkpoints", "Heartbeat": "peers"}.get(kind)
    return f"heterorl/{run}/{suffix}" if suffix else f"heterorl/{run}/providers/{body['version']}"


@functools.lru_cache(maxsize=4096)
def _key_id(name: str) -> bytes:
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=name).to_bytes()


def _oracle_frames(stream: bytes, eof: bool, max_bytes: int, max_frames: int) -> list:
    """What a loop of read_frame calls must yield: frames, then a terminal 'eof' / FrameError kind."""
    out: list = []
    pos = 0
    while len(out) < max_frames:
        rest = len(stream) - pos
        if rest == 0:
            out.append("eof" if eof else "timeout")
            break
        if rest < 4:
            out.append("truncated" if eof else "timeout")
            break
        n = int.from_bytes(stream[pos : pos + 4], "big")
        if n > max_bytes:
            out.append("oversized")
            break
        if rest - 4 < n:
            out.append("truncated" if eof else "timeout")
            break
        out.append(stream[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


def _oracle_chunk_request(frame: Any) -> list[bytes]:
    try:
        req = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        raise _Reject("not msgpack") from None
    if _has_ext(req):
        raise _Reject("ext type")
    if type(req) is not dict or set(req) != {"hashes"}:
        raise _Reject("not {'hashes': ...}")
    hashes = req["hashes"]
    if type(hashes) is not list or not 1 <= len(hashes) <= MAX_HASHES_PER_REQUEST:
        raise _Reject("not a list of 1..16 hashes")
    if not all(type(h) is bytes and len(h) == HASH_BYTES for h in hashes):
        raise _Reject("hash not 32 bytes")
    return hashes
