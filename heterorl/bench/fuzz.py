"""Fuzz the protocol decoders: no crash, no hang, nothing accepted that should not be.

``heterorl bench fuzz --inputs 100000`` (or ``python -m heterorl.bench.fuzz``) feeds malformed inputs to every
function that parses bytes from a peer, and checks three things per input:

- **crash**: the decoder raised anything but its documented refusal (:class:`ProtocolError`; for frames also
  ``EOFError``; the DHT validator must never raise and must return a bool);
- **hang**: one input took more than :data:`HANG_S` seconds (inputs still running after :data:`ABORT_S` are
  interrupted with SIGALRM when the harness runs in the main thread);
- **oracle violation**: an *independent* oracle, written here from the wire format and sharing no code with
  ``protocol/wire/schema.py`` or the decoders, decides for every input whether it must be accepted, and with what
  result. Any disagreement, either way, is a failure: ``accepted_but_should_not`` (the dangerous one),
  ``rejected_but_should_not``, ``wrong_result``, and for frames ``over_read`` (asking the stream for more
  than the cap).

Targets (see :data:`ALL_TARGETS`):

``decode``
    :func:`heterorl.protocol.wire.messages.decode` on random bytes and on mutated valid messages: bit flips, byte
    overwrites, truncation, extension, splicing two messages, and msgpack-level structure mutation (a node of
    the decoded tree replaced, deleted, duplicated, nested a thousand deep, made an ext type...).
``decode_signed``
    the same decoder on structure-aware bodies: wrong types, out-of-range numbers, NaN/inf, positive
    log-probs, token ids outside the vocabulary, mismatched lengths, oversized arrays and strings, extra and
    missing fields, wrong run id, wrong protocol version, wrong message type... each *signed correctly* so
    that the signature check passes and the schema layer is what must refuse.
``frame``
    :func:`heterorl.protocol.net.framing.read_frame` on an ``asyncio.StreamReader`` fed adversarial length
    prefixes, truncated and trailing data, in pieces, with and without EOF.
``dht_record``
    :meth:`heterorl.protocol.net.dht.SignedRecordValidator.validate` on honest, re-signed, forged, tampered and
    wrongly typed ``DHTRecord`` objects: it must never raise and never accept a record not signed by its
    subkey's owner (nor one whose message, key or expiration is wrong).
``chunk_request``
    ``heterorl.protocol.net.chunks._parse_request`` on random and mutated chunk requests.

Inputs come from a seeded :class:`random.Random` generator and, for a share of each target's inputs
(``hypothesis_share``, default 0.2), from hypothesis strategies (``@seed``-ed, no database, generate phase
only), so a run is deterministic for a seed: each target's report carries a digest of every input it saw.
Signing keys are derived from the seed as well (Ed25519 signatures are deterministic).

A hang is re-timed once after a full GC before it counts (a pause or a busy machine is not a hang); a
read_frame loop still running after :data:`FRAME_GUARD_S` is a hang too.

atheris: ``pip install atheris`` works here (3.0 ships a manylinux wheel with libFuzzer built in, no clang
needed), so there is an optional coverage-guided mode: ``heterorl bench fuzz --atheris TARGET [--inputs N]
[--libfuzzer '-max_len=4096 -jobs=2']``. It instruments only ``heterorl.protocol`` (``instrument_all()``
would walk torch: minutes), starts from the target's own seed corpus (random bytes never reach a signed
envelope), applies the same oracles, and stops at the first failure, leaving libFuzzer's ``crash-*`` file
in the working directory. Nothing else imports atheris and it is not a declared dependency. Byte-level
libFuzzer mutation is weak against a signed, msgpack-structured format: 200 000 atheris runs on ``decode``
found nothing that the structure-aware generators here find within a few hundred inputs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import functools
import gc
import hashlib
import json
import math
import random
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from heterorl.protocol.net import framing
from heterorl.protocol.wire import messages
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.identity import Identity

ALL_TARGETS: tuple[str, ...] = ("decode", "decode_signed", "frame", "dht_record", "chunk_request")
# Share of the requested inputs each target gets (normalised over the targets selected).
TARGET_WEIGHTS = {
    "decode": 0.30,
    "decode_signed": 0.30,
    "frame": 0.15,
    "dht_record": 0.15,
    "chunk_request": 0.10,
}
HANG_S = 1.0  # one input slower than this is a hang
ABORT_S = 10.0  # one input still running after this is interrupted (main thread only)
MAX_EXAMPLES = 10  # distinct failure signatures kept per target and failure kind
NOW = 1.7e9  # the DHT validator's clock
FRAME_GUARD_S = 3.0  # a read_frame loop (every call has its own short deadline) still running is a hang

# ---------------------------------------------------------------------------------------------------------
# The wire format, restated from the protocol documentation for the oracle. Deliberately NOT imported from
# protocol/wire/messages.py or protocol/wire/schema.py: if the decoder and this table ever drift apart, the fuzzer
# reports every disagreement.
# ---------------------------------------------------------------------------------------------------------
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20
MAX_ROWS = 4096
MAX_TOKENS = 32768
MAX_TEXT = 4096
PUBKEY_BYTES, SIG_BYTES, HASH_BYTES, BATCH_ID_BYTES = 32, 64, 32, 16
ENVELOPE_KEYS = frozenset({"v", "type", "body", "author", "sig"})
DHT_TTL_S = {"RunSpec": 7 * 86400.0, "CheckpointManifest": 86400.0, "Heartbeat": 600.0, "Provider": 3600.0}
DHT_SKEW_S = 300.0
MAX_RECORD_BYTES = MAX_MESSAGE_BYTES + 256
MAX_HASHES_PER_REQUEST = 16


@dataclasses.dataclass(frozen=True)
class _Int:
    lo: int
    hi: int
    typical_hi: int | None = None  # most generated values stay in [lo, typical_hi]


@dataclasses.dataclass(frozen=True)
class _Num:
    lo: float | None
    hi: float | None


@dataclasses.dataclass(frozen=True)
class _Text:
    n: int


@dataclasses.dataclass(frozen=True)
class _Bin:
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class _Bool:
    pass


@dataclasses.dataclass(frozen=True)
class _List:
    item: Any
    lo: int
    hi: int
    typical: int = 3


@dataclasses.dataclass(frozen=True)
class _Rec:
    fields: tuple[tuple[str, Any], ...]
    optional: tuple[tuple[str, Any], ...] = ()

    def names(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.fields)

    def optional_names(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.optional)


def _rec(_optional: dict[str, Any] | None = None, **fields: Any) -> _Rec:
    return _Rec(tuple(fields.items()), tuple((_optional or {}).items()))


_TOKENS = _List(_Int(0, 1 << 31, typical_hi=99), 0, MAX_TOKENS, typical=6)
_RUN_ID = _Text(128)
_MADDRS = _List(_Text(256), 0, 16)
SPEC: dict[str, _Rec] = {
    "TrajectoryBatch": _rec(
        run_id=_RUN_ID,
        batch_id=_Bin(BATCH_ID_BYTES, BATCH_ID_BYTES),
        policy_version=_Int(0, 1 << 53),
        timestamp=_Num(0.0, 1e11),
        rows=_List(
            _rec(
                group=_Int(0, MAX_ROWS),
                prompt_ids=_TOKENS,
                completion_ids=_TOKENS,
                logprobs=_List(_Num(None, 0.0), 0, MAX_TOKENS),
                reward=_Num(-1e6, 1e6),
            ),
            1,
            MAX_ROWS,
        ),
        _optional={"engine": _Text(16), "engine_dtype": _Text(16)},
    ),
    "CheckpointManifest": _rec(
        run_id=_RUN_ID,
        version=_Int(0, 1 << 53),
        parent_version=_Int(-1, 1 << 53),
        chunk_hashes=_List(_Bin(HASH_BYTES, HASH_BYTES), 1, 1 << 16),
        total_size=_Int(1, 1 << 45),
        dtype=_Text(16),
        chunk_bytes=_Int(4096, 64 << 20),
        _optional={
            "deltas": _List(
                _rec(
                    base_version=_Int(0, 1 << 53),
                    codec=_Text(32),
                    chunk_hashes=_List(_Bin(HASH_BYTES, HASH_BYTES), 1, 1 << 16),
                    total_size=_Int(1, 1 << 45),
                ),
                1,
                8,
            )
        },
    ),
    "RunSpec": _rec(
        run_id=_RUN_ID,
        model=_Text(MAX_TEXT),
        initial_checkpoint=_Bin(HASH_BYTES, HASH_BYTES),
        task=_Text(MAX_TEXT),
        reward=_Text(MAX_TEXT),
        objective=_Text(64),
        hyperparameters=_Text(MAX_TEXT),
        sampling=_rec(
            temperature=_Num(1e-6, 100.0), top_p=_Num(1e-6, 1.0), max_new_tokens=_Int(1, MAX_TOKENS)
        ),
        learner_keys=_List(_Bin(PUBKEY_BYTES, PUBKEY_BYTES), 1, 64),
        vocab_size=_Int(1, 1 << 24),
        max_batch_rows=_Int(1, MAX_ROWS),
    ),
    "Heartbeat": _rec(
        run_id=_RUN_ID,
        role=_Text(16),
        state=_Text(64),
        policy_version=_Int(-1, 1 << 53),
        tokens_per_s=_Num(0.0, 1e12),
        timestamp=_Num(0.0, 1e11),
        peer_id=_Text(128),
        maddrs=_MADDRS,
        hardware=_Text(256),
        stats=_List(_rec(name=_Text(32), value=_Num(-1e15, 1e15)), 0, 64),
        _optional={"backend": _Text(64)},
    ),
    "Provider": _rec(
        run_id=_RUN_ID,
        version=_Int(0, 1 << 53),
        peer_id=_Text(128),
        maddrs=_MADDRS,
        complete=_Bool(),
        timestamp=_Num(0.0, 1e11),
    ),
    "Ack": _rec(run_id=_RUN_ID, batch_id=_Bin(BATCH_ID_BYTES, BATCH_ID_BYTES)),
    "Reject": _rec(
        run_id=_RUN_ID, batch_id=_Bin(0, BATCH_ID_BYTES), reason=_Text(512), retry_after_s=_Num(0.0, 3600.0)
    ),
}
KINDS = tuple(SPEC)
DHT_KINDS = tuple(DHT_TTL_S)
RUN = "run-1"


# --------------------------------------------------------------------------------------------- the oracle


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


# ---------------------------------------------------------------------------------- value generation


class _Deep:
    """A list nested ``depth`` deep (packed by hand: msgpack's packer refuses such depth)."""

    __slots__ = ("depth",)

    def __init__(self, depth: int):
        self.depth = depth

    def __repr__(self) -> str:
        return f"_Deep({self.depth})"


_DEEP_TAG = b"\x00heterorl-fuzz-deep\x00"


def _pack(obj: Any) -> bytes:
    """msgpack.packb, plus _Deep placeholders spliced in as ``[[[...nil...]]]``."""
    deeps: list[int] = []

    def sub(o: Any) -> Any:
        if type(o) is _Deep:
            deeps.append(o.depth)
            return _DEEP_TAG + len(deeps).to_bytes(4, "big")
        if type(o) is dict:
            return {k: sub(v) for k, v in o.items()}
        if type(o) in (list, tuple):
            return [sub(x) for x in o]
        return o

    data = msgpack.packb(sub(obj), use_bin_type=True)
    for i, depth in enumerate(deeps, 1):
        placeholder = msgpack.packb(_DEEP_TAG + i.to_bytes(4, "big"), use_bin_type=True)
        data = data.replace(placeholder, b"\x91" * depth + b"\xc0", 1)
    return data


_TEXT_ALPHABET = "abcxyz019 _-/.:\x00\n\u00e9\u20ac\u2028\U0001f600"


def _text(rng: random.Random, n: int) -> str:
    r = rng.random()
    if r < 0.04:
        return rng.choice("a\u00e9\u20ac\U0001f600") * n  # exactly the limit, 1..4 UTF-8 bytes per char
    if r < 0.10:
        return ""
    return "".join(rng.choice(_TEXT_ALPHABET) for _ in range(rng.randint(1, min(n, 24))))


def _gen(spec: Any, rng: random.Random, big: bool = False) -> Any:
    """A random value the spec admits, biased to boundaries."""
    if isinstance(spec, _Int):
        r = rng.random()
        if spec.typical_hi is not None and r < 0.85:
            return rng.randint(spec.lo, spec.typical_hi)
        if r < 0.5:
            return rng.randint(spec.lo, min(spec.hi, spec.lo + 1000))
        return rng.choice([spec.lo, spec.hi, rng.randint(spec.lo, spec.hi)])
    if isinstance(spec, _Num):
        lo = -1e308 if spec.lo is None else spec.lo
        hi = 1e308 if spec.hi is None else spec.hi
        r = rng.random()
        if r < 0.1:
            return rng.choice([x for x in (spec.lo, spec.hi) if x is not None])
        if r < 0.15 and lo <= 0 <= hi:
            return rng.choice([0.0, -0.0, 0])  # an int is a valid number
        if r < 0.2 and lo <= -5e-324 and hi >= -5e-324:
            return rng.choice([-5e-324, -1e308]) if spec.lo is None else -5e-324
        if r < 0.25:
            return rng.randint(math.ceil(max(lo, -1e6)), math.floor(min(hi, 1e6)))
        if spec.lo is None:
            return -rng.expovariate(1.0) * 10 ** rng.randint(-3, 3)
        return rng.uniform(lo, min(hi, lo + 10 ** rng.randint(0, 6)))
    if isinstance(spec, _Text):
        return _text(rng, spec.n)
    if isinstance(spec, _Bin):
        return rng.randbytes(rng.randint(spec.lo, spec.hi))
    if isinstance(spec, _Bool):
        return rng.random() < 0.5
    if isinstance(spec, _List):
        r = rng.random()
        if big and r < 0.5 or r < 0.05 and spec.hi <= 64:
            n = spec.hi
        else:
            n = rng.randint(spec.lo, max(spec.lo, min(spec.hi, spec.typical)))
        return [_gen(spec.item, rng) for _ in range(n)]
    if isinstance(spec, _Rec):
        body = {k: _gen(s, rng, big) for k, s in spec.fields}
        body.update({k: _gen(s, rng, big) for k, s in spec.optional if rng.random() < 0.5})
        return body
    raise AssertionError(spec)


def valid_body(kind: str, rng: random.Random, big: bool = False) -> dict:
    """A random body the spec admits (TrajectoryBatch rows with one log-prob per completion token)."""
    if big and kind == "TrajectoryBatch":
        body = _gen(SPEC[kind], rng)  # a few rows, one of them MAX_TOKENS long: big lists, small message
        spec_row = dict(SPEC[kind].fields)["rows"].item
        body["rows"][0]["completion_ids"] = _gen(dict(spec_row.fields)["completion_ids"], rng, big=True)
    else:
        body = _gen(SPEC[kind], rng, big=big and kind != "TrajectoryBatch")
    if rng.random() < 0.8:
        body["run_id"] = RUN
    if kind == "TrajectoryBatch":
        for row in body["rows"]:
            if not row["completion_ids"]:
                row["completion_ids"] = [rng.randint(0, 99)]
            row["logprobs"] = [_gen(_Num(None, 0.0), rng) for _ in row["completion_ids"]]
    return body


def _weird(rng: random.Random) -> Any:
    """A value of any msgpack type, chosen for edge cases."""
    pool: list[Any] = [
        None,
        True,
        False,
        0,
        -1,
        1,
        2,
        1 << 31,
        1 << 32,
        (1 << 53) + 1,
        (1 << 63) - 1,
        -(1 << 63),
        (1 << 64) - 1,
        0.0,
        -0.0,
        0.5,
        -0.5,
        1.0,
        1e308,
        -1e308,
        5e-324,
        -5e-324,
        math.nan,
        math.inf,
        -math.inf,
        "",
        "a",
        "\x00",
        "\U0001f600" * 3,
        "a" * 200,
        b"",
        b"\x00",
        [],
        [0],
        [None, None],
        {},
        {"a": 1},
        {"run_id": RUN},
        {b"k": 1},
        {1: 2},
        {None: 1},
        msgpack.ExtType(1, b"x"),
        msgpack.Timestamp(1, 0),
    ]
    r = rng.random()
    if r < 0.04:
        return _Deep(rng.choice([16, 200, 400, 700, 1000, 1023, 1100]))
    if r < 0.12:
        return rng.randbytes(rng.choice([15, 16, 17, 31, 32, 33, 63, 64, 65]))
    if r < 0.18:
        return [_weird(rng) for _ in range(rng.randint(1, 3))]
    if r < 0.22:
        return {rng.choice(["a", "run_id", "", "\x00"]): _weird(rng) for _ in range(rng.randint(1, 3))}
    return rng.choice(pool)


def _mutate_value(spec: Any, v: Any, rng: random.Random) -> Any:
    """A replacement for a value of ``spec``, almost always one it does not admit."""
    if rng.random() < 0.3:
        return _weird(rng)
    if isinstance(spec, _Int):
        return rng.choice(
            [
                spec.lo - 1,
                spec.hi + 1,
                float(v) if type(v) is int else 1.0,
                True,
                False,
                str(v),
                None,
                (1 << 64) - 1,
                -(1 << 63),
                0.5,
            ]
        )
    if isinstance(spec, _Num):
        lo = spec.lo if spec.lo is not None else -1e308
        hi = spec.hi if spec.hi is not None else 1e308
        return rng.choice(
            [
                math.nan,
                math.inf,
                -math.inf,
                math.nextafter(lo, -math.inf),
                math.nextafter(hi, math.inf),
                "1.0",
                None,
                True,
                hi + 1,
                lo - 1,
                -math.nan,
            ]
        )
    if isinstance(spec, _Text):
        return rng.choice(["a" * (spec.n + 1), "\U0001f600" * (spec.n + 1), b"abc", 0, None, ["a"]])
    if isinstance(spec, _Bin):
        options = [rng.randbytes(spec.hi + 1), "x" * spec.hi, None, 0, [0] * spec.hi]
        if spec.lo > 0:
            options.append(rng.randbytes(spec.lo - 1))
        return rng.choice(options)
    if isinstance(spec, _Bool):
        return rng.choice([0, 1, "true", None, 1.0])
    if isinstance(spec, _List):
        r = rng.random()
        if r < 0.3 and (spec.hi <= 4096 or rng.random() < 0.02):
            item = _gen(spec.item, rng)
            return [item] * (spec.hi + 1)  # one item too many
        if r < 0.45 and spec.lo > 0:
            return []
        if r < 0.7 and type(v) is list and v:
            return [*v[:-1], _mutate_value(spec.item, v[-1], rng)]
        return rng.choice([{}, "list", v[0] if type(v) is list and v else None, {"0": v}])
    if isinstance(spec, _Rec):
        d = dict(v) if type(v) is dict else {}
        r = rng.random()
        if r < 0.3 and d:
            d.pop(rng.choice(sorted(d, key=repr)))
        elif r < 0.55:
            d[rng.choice(["extra", "", "RUN_ID", "run_id "])] = _weird(rng)
        elif r < 0.75 and d:
            k = rng.choice(sorted(d, key=repr))
            d[k.encode() if type(k) is str else k] = d.pop(k)  # a bytes key where a string belongs
        elif r < 0.85:
            d[rng.choice([1, None, 2.5])] = 0
        else:
            return list(d.values())
        return d
    raise AssertionError(spec)


def _nodes(spec: Any, v: Any, path: tuple, rng: random.Random) -> Iterator[tuple[tuple, Any]]:
    """(path, spec) of every node of a body tree that follows the spec (a few items of long lists)."""
    yield path, spec
    if isinstance(spec, _Rec) and type(v) is dict:
        for k, s in spec.fields:
            if k in v:
                yield from _nodes(s, v[k], (*path, k), rng)
    elif isinstance(spec, _List) and type(v) is list and v:
        picks = range(len(v)) if len(v) <= 3 else sorted({0, len(v) - 1, rng.randrange(len(v))})
        for i in picks:
            yield from _nodes(spec.item, v[i], (*path, i), rng)


def _get(root: Any, path: tuple) -> Any:
    for p in path:
        root = root[p]
    return root


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


# ------------------------------------------------------------------------------------------- reporting


@dataclasses.dataclass
class TargetStats:
    """Counts for one target. ``violations`` = the three oracle-disagreement counts plus over_read."""

    name: str
    inputs: int = 0
    rejected: int = 0
    accepted: int = 0
    crashes: int = 0
    hangs: int = 0
    accepted_but_should_not: int = 0
    rejected_but_should_not: int = 0
    wrong_result: int = 0
    over_read: int = 0
    harness_errors: int = 0
    max_s: float = 0.0
    total_s: float = 0.0
    sources: dict[str, int] = dataclasses.field(default_factory=dict)
    crash_examples: list[dict] = dataclasses.field(default_factory=list)
    hang_examples: list[dict] = dataclasses.field(default_factory=list)
    violation_examples: list[dict] = dataclasses.field(default_factory=list)
    harness_error_examples: list[dict] = dataclasses.field(default_factory=list)
    slowest: list[dict] = dataclasses.field(default_factory=list)  # the 3 slowest inputs
    digest: str = ""
    _signatures: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    _hasher: Any = dataclasses.field(default_factory=hashlib.sha256, repr=False)

    @property
    def violations(self) -> int:
        return (
            self.accepted_but_should_not + self.rejected_but_should_not + self.wrong_result + self.over_read
        )

    @property
    def mean_s(self) -> float:
        return self.total_s / self.inputs if self.inputs else 0.0

    @property
    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.violations or self.harness_errors)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        d.update(
            violations=self.violations, mean_s=self.mean_s, ok=self.ok, failure_signatures=self._signatures
        )
        return d


@dataclasses.dataclass
class FuzzReport:
    seed: int
    requested_inputs: int
    targets: dict[str, TargetStats]
    wall_s: float = 0.0
    hypothesis: str | None = None  # its version, None when not installed (random generator only)

    @property
    def inputs(self) -> int:
        return sum(t.inputs for t in self.targets.values())

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.targets.values())

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "requested_inputs": self.requested_inputs,
            "inputs": self.inputs,
            "wall_s": self.wall_s,
            "inputs_per_s": self.inputs / self.wall_s if self.wall_s else None,
            "hypothesis": self.hypothesis,
            "ok": self.ok,
            "targets": {k: v.to_dict() for k, v in self.targets.items()},
        }

    def format_table(self) -> str:
        cols = (
            "target",
            "inputs",
            "hypoth",
            "rejected",
            "accepted",
            "crashes",
            "hangs",
            "acc_bad",
            "rej_bad",
            "wrong",
            "overread",
            "max_ms",
            "mean_us",
        )
        rows = [cols]
        for t in self.targets.values():
            rows.append(
                (
                    t.name,
                    t.inputs,
                    t.sources.get("hypothesis", 0),
                    t.rejected,
                    t.accepted,
                    t.crashes,
                    t.hangs,
                    t.accepted_but_should_not,
                    t.rejected_but_should_not,
                    t.wrong_result,
                    t.over_read,
                    f"{t.max_s * 1e3:.1f}",
                    f"{t.mean_s * 1e6:.0f}",
                )
            )
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
        lines = [
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        rate = self.inputs / self.wall_s if self.wall_s else 0.0
        lines.append("")
        lines.append(
            f"{self.inputs} inputs in {self.wall_s:.1f} s ({rate:.0f}/s), seed {self.seed}, hypothesis "
            f"{self.hypothesis or 'not installed'}: {'PASS' if self.ok else 'FAIL'}"
        )
        for t in self.targets.values():
            for label, examples in (
                ("crash", t.crash_examples),
                ("hang", t.hang_examples),
                ("violation", t.violation_examples),
                ("harness error", t.harness_error_examples),
            ):
                for ex in examples:
                    if "kind" in ex:  # an oracle violation: what the oracle said, what the decoder did
                        what = f"{ex['kind']}: oracle says {ex['reason']!r}; {ex['detail']}"
                    else:
                        what = f"{ex['error']}: {ex['detail']} at {ex.get('where', '-')}"
                    count = t._signatures.get(ex["signature"], 1)
                    lines.append(
                        f"  {t.name} {label} (x{count}, input #{ex['index']} from {ex['source']}): {what}"
                    )
                    lines.append(f"      input ({ex.get('input_len', '?')} bytes) {ex['input'][:300]}")
                    if ex.get("kwargs"):
                        lines.append(f"      kwargs {ex['kwargs']}")
        return "\n".join(lines)


def _short(b: Any, n: int = 120) -> str:
    if isinstance(b, (bytes, bytearray)) and len(b) > n:
        return f"{bytes(b[:n])!r}...(+{len(b) - n} bytes)"
    r = repr(b)
    return r if len(r) <= 2 * n else r[: 2 * n] + "..."


def _where(tb: Any) -> str:
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        if ("protocol" in fr.filename or "heterorl" in fr.filename) and not fr.filename.endswith("fuzz.py"):
            return (
                f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name}"
            )
    fr = frames[-1] if frames else None
    return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name}" if fr else "-"


# --------------------------------------------------------------------------------------------- harness


class _Crash(Exception):
    def __init__(self, exc: BaseException, seconds: float):
        super().__init__(type(exc).__name__)
        self.exc, self.seconds = exc, seconds


class _Hang(BaseException):
    """Raised by SIGALRM into an input that runs past ABORT_S (a BaseException: decoders must not eat it)."""


@dataclasses.dataclass
class _Outcome:
    accepted: bool
    seconds: float
    violation: tuple[str, str, str] | None = None  # (kind, stable reason, detail)


def _call(fn: Callable, *args: Any, allowed: tuple[type[BaseException], ...] = (ProtocolError,), **kw: Any):
    """(accepted, result or refusal, seconds); any exception outside ``allowed`` raises _Crash."""
    t0 = time.perf_counter()
    try:
        result = fn(*args, **kw)
    except allowed as e:
        return False, e, time.perf_counter() - t0
    except Exception as e:
        raise _Crash(e, time.perf_counter() - t0) from e
    return True, result, time.perf_counter() - t0


class _Target:
    name = ""

    def __init__(self, h: _Harness):
        self.h = h

    def generate(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def strategy(self) -> Any:
        raise NotImplementedError

    def execute(self, case: Any) -> _Outcome:
        raise NotImplementedError

    def describe(self, case: Any) -> tuple[bytes, dict]:
        """(input bytes for the digest and the example, extra fields for the example)."""
        raise NotImplementedError

    def from_bytes(self, data: bytes) -> Any:
        """A case from raw fuzzer bytes (atheris)."""
        return self.generate(random.Random(data))

    def corpus(self) -> list[bytes]:
        """Seed inputs for atheris."""
        return [bytes([i]) * 8 for i in range(4)]

    def close(self) -> None:
        pass


class _MessageTarget(_Target):
    """decode(): a case is (data, kwargs); the oracle says what it must return."""

    def execute(self, case: tuple[bytes, dict]) -> _Outcome:
        data, kwargs = case
        accepted, result, dt = _call(messages.decode, data, **kwargs)
        try:
            want = self.h.oracle.message(data, **kwargs)
        except _Reject as r:
            if accepted:
                return _Outcome(True, dt, ("accepted_but_should_not", str(r), f"returned {_short(result)}"))
            return _Outcome(False, dt)
        if not accepted:
            return _Outcome(
                False, dt, ("rejected_but_should_not", str(result).split(":")[0][:60], str(result)[:200])
            )
        if not (isinstance(result, tuple) and len(result) == 3 and result == want):
            return _Outcome(
                True, dt, ("wrong_result", "result differs", f"{_short(result)} != {_short(want)}")
            )
        return _Outcome(True, dt)

    def describe(self, case: tuple[bytes, dict]) -> tuple[bytes, dict]:
        data, kwargs = case
        return bytes(data), {"kwargs": kwargs}

    def _kwargs(self, rng: random.Random, kind: str, body: Any) -> dict:
        kw: dict = {}
        if rng.random() < 0.35:
            kw["expected"] = kind if rng.random() < 0.75 else rng.choice(KINDS)
        if rng.random() < 0.4:
            kw["run_id"] = RUN if rng.random() < 0.85 else "other-run"
        if rng.random() < 0.5:
            kw["vocab_size"] = rng.choice([100, 100, 100, rng.randint(1, 120), 1 << 24, (1 << 31) + 1])
        return kw


class DecodeTarget(_MessageTarget):
    """Byte- and msgpack-level mutations of signed messages, plus random bytes."""

    name = "decode"

    def __init__(self, h: _Harness):
        super().__init__(h)
        rng = random.Random(f"heterorl-fuzz-corpus:{h.seed}")
        seeds: list[tuple[str, bytes]] = []
        for kind in KINDS:
            for i in range(6):
                big = i == 5 and kind in ("TrajectoryBatch", "RunSpec", "Heartbeat")
                seeds.append((kind, h.sign_message(kind, valid_body(kind, rng, big=big), rng)))
        signed_gen = DecodeSignedTarget(h)
        seeds += [("TrajectoryBatch", signed_gen.generate(rng)[0]) for _ in range(24)]
        self.seeds = [(k, s) for k, s in seeds if 0 < len(s) < 1 << 20]
        self.seed_bytes = [s for _, s in self.seeds]

    def generate(self, rng: random.Random) -> tuple[bytes, dict]:
        r = rng.random()
        kind, seed = rng.choice(self.seeds)
        if r < 0.12:
            data = rng.randbytes(rng.choice([0, 1, 2, 5, 16, 64, 256, rng.randint(0, 2048)]))
        elif r < 0.16:
            data = bytes([rng.choice([0x80, 0x85, 0x90, 0xDC, 0xDD, 0xDE, 0xDF, 0xC4, 0xC6, 0xD9, 0xDB])])
            data += rng.randbytes(rng.randint(0, 64))
        elif r < 0.34:
            b = bytearray(seed)
            for _ in range(rng.choice([1, 1, 2, 3, 8])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            data = bytes(b)
        elif r < 0.44:
            b = bytearray(seed)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.choice(
                    [
                        0,
                        0xFF,
                        0x7F,
                        0x80,
                        0xC0,
                        0xC1,
                        0xC2,
                        0xC3,
                        0xD4,
                        0xD9,
                        0xDC,
                        0xDE,
                        0xCF,
                        0xCB,
                        rng.randrange(256),
                    ]
                )
            data = bytes(b)
        elif r < 0.52:
            data = seed[: rng.randrange(len(seed))]
        elif r < 0.56:
            data = seed + rng.choice([b"\x00", b"\xc0", rng.randbytes(rng.randint(1, 16)), seed])
        elif r < 0.64:
            other = rng.choice(self.seed_bytes)
            data = seed[: rng.randrange(len(seed) + 1)] + other[rng.randrange(len(other) + 1) :]
        elif r < 0.68:
            i, j = sorted(rng.randrange(len(seed) + 1) for _ in range(2))
            data = seed[:i] + seed[j:] if rng.random() < 0.5 else seed[:j] + seed[i:j] + seed[j:]
        else:
            try:
                data = self._structure(seed, rng)
            except Exception:  # a seed that is not a packable tree (nested too deep...): truncate instead
                data = seed[:-1]
        return data, self._kwargs(rng, kind, None)

    def _structure(self, seed: bytes, rng: random.Random) -> bytes:
        """Decode, change one node of the tree, re-pack without re-signing."""
        env = msgpack.unpackb(seed, raw=False, strict_map_key=False)
        if type(env) is not dict:
            env = {"v": 1, "type": "Ack", "body": env, "author": b"", "sig": b""}
        nodes: list[tuple] = []
        stack: list[tuple] = [()]
        while stack:
            p = stack.pop()
            nodes.append(p)
            node = _get(env, p)
            if type(node) is dict:
                stack.extend((*p, k) for k in node)
            elif type(node) is list:
                idx = range(len(node)) if len(node) <= 4 else (0, len(node) - 1, rng.randrange(len(node)))
                stack.extend((*p, i) for i in idx)
        r = rng.random()
        path = (rng.choice(["v", "type", "author", "sig", "body"]),) if r < 0.15 else rng.choice(nodes)
        parent = _get(env, path[:-1]) if path else None
        if r < 0.55 or not path:
            env = _set(env, path, _weird(rng))
        elif r < 0.7 and type(parent) is dict:
            del parent[path[-1]]
        elif r < 0.8 and type(parent) is dict:
            parent[rng.choice(["extra", "", "v", "sig"])] = copy.deepcopy(_get(env, path))
        elif r < 0.9:
            other = rng.choice(nodes)
            a, b = _get(env, path), _get(env, other) if other else env
            if other and path and not (other[: len(path)] == path or path[: len(other)] == other):
                _set(env, path, copy.deepcopy(b))
                _set(env, other, copy.deepcopy(a))
        else:
            env = _set(env, path, [_get(env, path)] if rng.random() < 0.5 else {"x": _get(env, path)})
        try:
            return _pack(env)
        except Exception:  # a value msgpack cannot pack (huge int in a key...): fall back to the seed
            return seed

    def strategy(self) -> Any:
        from hypothesis import strategies as st

        seeds = st.integers(0, len(self.seed_bytes) - 1).map(lambda i: self.seed_bytes[i])
        overwrite = st.tuples(
            seeds, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=6)
        )

        def apply(args: tuple) -> bytes:
            seed, edits = args
            b = bytearray(seed)
            for pos, val in edits:
                b[pos % len(b)] = val
            return bytes(b)

        @st.composite
        def restructure(draw: Any) -> bytes:
            try:
                env = msgpack.unpackb(draw(seeds), raw=False, strict_map_key=False)
            except Exception:
                env = None
            if type(env) is not dict:
                env = {"v": 1, "type": "Ack", "body": {}, "author": b"", "sig": b""}
            field = draw(st.sampled_from(["v", "type", "author", "sig", "body", "body.run_id", "body.*"]))
            value = draw(_any_value())
            if field.startswith("body.") and type(env["body"]) is dict and env["body"]:
                keys = sorted(env["body"], key=repr)  # a mutated seed may mix key types
                k = "run_id" if field == "body.run_id" else draw(st.sampled_from(keys))
                env["body"][k] = value
            else:
                env[field.split(".")[0]] = value
            try:
                return _pack(env)
            except Exception:
                return b""

        data = st.one_of(st.binary(max_size=1024), overwrite.map(apply), restructure())
        kwargs = st.fixed_dictionaries(
            {},
            optional={
                "expected": st.sampled_from(KINDS),
                "run_id": st.sampled_from([RUN, "x"]),
                "vocab_size": st.integers(1, 1 << 24),
            },
        )
        return st.tuples(data, kwargs)

    def from_bytes(self, data: bytes) -> tuple[bytes, dict]:
        return data, {}

    def corpus(self) -> list[bytes]:
        return [s for s in self.seed_bytes if len(s) <= 65536]


class DecodeSignedTarget(_MessageTarget):
    """Structure-aware bodies, signed correctly, so the schema layer is what must refuse them."""

    name = "decode_signed"

    def generate(self, rng: random.Random) -> tuple[bytes, dict]:
        kind = rng.choice(KINDS)
        body: Any = valid_body(kind, rng, big=rng.random() < 0.002)
        n_mut = 0 if rng.random() < 0.35 else rng.choice([1, 1, 1, 2, 3])
        for _ in range(n_mut):
            body = self._mutate(kind, body, rng)
        env_kind: Any = kind
        version: Any = PROTOCOL_VERSION
        if rng.random() < 0.06:
            version = rng.choice([0, 2, -1, 1.0, True, "1", None, (1 << 64) - 1, [1], b"\x01", _weird(rng)])
        if rng.random() < 0.05:
            env_kind = rng.choice([*KINDS, "Nope", "", "ack", b"Ack", _weird(rng)])
        kwargs = self._kwargs(rng, kind, body)
        if kind == "TrajectoryBatch" and rng.random() < 0.1 and type(body) is dict:
            self._vocab_edge(body, kwargs, rng)
        return self.h.build_envelope(env_kind, body, rng, version=version, tamper=rng.random() < 0.06), kwargs

    def _mutate(self, kind: str, body: Any, rng: random.Random) -> Any:
        r = rng.random()
        if kind == "TrajectoryBatch" and r < 0.3 and type(body) is dict and type(body.get("rows")) is list:
            rows = [x for x in body["rows"] if type(x) is dict]
            if rows:
                self._row_edge(rng.choice(rows), rng)
                return body
        if r < 0.05:
            return _weird(rng)  # not even a map
        nodes = list(_nodes(SPEC[kind], body, (), rng))
        path, spec = rng.choice(nodes)
        return _set(body, path, _mutate_value(spec, _get(body, path), rng))

    def _row_edge(self, row: dict, rng: random.Random) -> None:
        lp, comp = row.get("logprobs"), row.get("completion_ids")
        if type(lp) is not list or type(comp) is not list:
            return
        r = rng.random()
        if r < 0.3 and lp:
            lp[rng.randrange(len(lp))] = rng.choice(
                [5e-324, 1e-9, 0.5, 1.0, math.nan, math.inf, -math.inf, 0.0, -0.0]
            )
        elif r < 0.5:
            lp.append(-1.0)
        elif r < 0.65 and lp:
            lp.pop()
        elif r < 0.75:
            row["completion_ids"], row["logprobs"] = [], []
        elif r < 0.9 and comp:
            comp[rng.randrange(len(comp))] = rng.choice([-1, (1 << 31) + 1, 1 << 31, 1 << 40, 1.0, True])
        else:
            row["prompt_ids"] = [rng.choice([-1, 1 << 31, (1 << 31) + 1, 100, 99])]

    def _vocab_edge(self, body: dict, kwargs: dict, rng: random.Random) -> None:
        """Make the vocabulary bound bite exactly at a token id present in the batch (or one past it)."""
        rows = body.get("rows")
        ids = [
            t
            for row in (rows if type(rows) is list else [])
            if type(row) is dict
            for f in ("prompt_ids", "completion_ids")
            if type(row.get(f)) is list
            for t in row[f]
            if type(t) is int
        ]
        if ids:
            t = rng.choice(ids)
            kwargs["vocab_size"] = max(1, t + rng.choice([0, 1]))

    def strategy(self) -> Any:
        from hypothesis import strategies as st

        bases = [
            (k, valid_body(k, random.Random(f"heterorl-fuzz-h:{self.h.seed}:{k}:{i}")))
            for k in KINDS
            for i in range(4)
        ]

        @st.composite
        def case(draw: Any) -> tuple[bytes, dict]:
            kind, base = draw(st.sampled_from(bases))
            body: Any = copy.deepcopy(base)
            for _ in range(draw(st.integers(0, 3))):
                nodes = list(_nodes(SPEC[kind], body, (), random.Random(0)))
                path, spec = draw(st.sampled_from(nodes))
                body = _set(body, path, draw(st.one_of(_any_value(), _spec_edges(spec))))
            version = draw(st.sampled_from([1, 1, 1, 1, 1, 0, 2, 1.0, True, "1", None]))
            env_kind = draw(st.sampled_from([kind] * 8 + ["Nope", "Ack", "TrajectoryBatch"]))
            kwargs = draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "expected": st.sampled_from([kind, kind, "Ack"]),
                        "run_id": st.sampled_from([RUN, RUN, "x"]),
                        "vocab_size": st.integers(1, 1 << 24),
                    },
                )
            )
            rng = random.Random(draw(st.integers(0, 1 << 32)))
            return self.h.build_envelope(env_kind, body, rng, version=version), kwargs

        return case()


@functools.cache
def _any_value() -> Any:
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(1 << 63), (1 << 64) - 1)
        | st.floats()
        | st.text(max_size=16)
        | st.binary(max_size=40)
        | st.builds(_Deep, st.integers(1, 1100))
    )
    return st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
        max_leaves=8,
    )


@functools.cache
def _spec_edges(spec: Any) -> Any:
    """Values at and just past a spec's bounds."""
    from hypothesis import strategies as st

    if isinstance(spec, _Int):
        return st.sampled_from([spec.lo, spec.hi, spec.lo - 1, spec.hi + 1, float(spec.lo)])
    if isinstance(spec, _Num):
        vals = [
            x
            for b in (spec.lo, spec.hi)
            if b is not None
            for x in (b, math.nextafter(b, -math.inf), math.nextafter(b, math.inf))
        ]
        return st.sampled_from(vals or [0.0]) | st.floats()
    if isinstance(spec, _Text):
        return st.sampled_from(["a" * spec.n, "a" * (spec.n + 1), "\u20ac" * spec.n])
    if isinstance(spec, _Bin):
        return st.binary(min_size=max(0, spec.lo - 1), max_size=spec.hi + 1)
    if isinstance(spec, _List):
        return st.lists(st.integers(-1, 1 << 32), max_size=spec.hi + 1 if spec.hi <= 64 else 8)
    return st.none()


class FrameTarget(_Target):
    """read_frame() in a loop over one adversarial stream."""

    name = "frame"
    MAX_FRAMES = 8

    def __init__(self, h: _Harness):
        super().__init__(h)
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def generate(self, rng: random.Random) -> tuple:
        max_bytes = rng.choice([0, 1, 3, 4, 100, 608, 65536, 1 << 24, (1 << 32) - 1, rng.randint(0, 1 << 20)])
        r = rng.random()
        if r < 0.15:
            stream = rng.randbytes(rng.choice([0, 1, 3, 4, 5, 8, 64, rng.randint(0, 512)]))
        else:
            stream = b""
            for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 9])):
                cap = min(max_bytes, 4096 if rng.random() < 0.98 else 1 << 17)
                n = rng.choice([0, 1, cap, rng.randint(0, min(cap, 300))])
                header = rng.choice([n] * 6 + [max_bytes, max_bytes + 1, (1 << 32) - 1, 1 << 31, n + 1])
                header = min(header, (1 << 32) - 1)
                stream += header.to_bytes(4, "big") + rng.randbytes(n)
            if rng.random() < 0.3 and stream:
                stream = stream[: rng.randrange(len(stream))]
            if rng.random() < 0.1:
                stream += rng.randbytes(rng.randint(1, 6))
        eof = rng.random() < 0.93
        cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.choice([0, 1, 3]))) if eof else []
        return stream, eof, max_bytes, tuple(cuts)

    def strategy(self) -> Any:
        from hypothesis import strategies as st

        frame = st.tuples(st.one_of(st.none(), st.integers(0, (1 << 32) - 1)), st.binary(max_size=64))

        def build(args: tuple) -> tuple:
            max_bytes, frames, tail, cut, eof = args
            stream = b"".join((len(p) if h is None else h).to_bytes(4, "big") + p for h, p in frames) + tail
            if cut is not None:
                stream = stream[:cut]
            return stream, eof, max_bytes, ()

        return st.tuples(
            st.one_of(st.sampled_from([0, 1, 4, 608, 65536]), st.integers(0, (1 << 32) - 1)),
            st.lists(frame, max_size=5),
            st.binary(max_size=6),
            st.none() | st.integers(0, 400),
            st.sampled_from([True] * 9 + [False]),
        ).map(build)

    def from_bytes(self, data: bytes) -> tuple:
        head = data[:5].ljust(5, b"\x00")
        return data[5:], bool(head[4] & 1), int.from_bytes(head[:4], "big") >> (head[4] >> 3), ()

    def describe(self, case: tuple) -> tuple[bytes, dict]:
        stream, eof, max_bytes, cuts = case
        return stream, {"eof": eof, "max_bytes": max_bytes, "cuts": list(cuts)}

    def execute(self, case: tuple) -> _Outcome:
        stream, eof, max_bytes, cuts = case
        box: dict = {"max_request": 0}
        t0 = time.perf_counter()
        try:
            got = self.loop.run_until_complete(
                asyncio.wait_for(self._read_all(stream, eof, max_bytes, cuts, box), FRAME_GUARD_S)
            )
        except (TimeoutError, asyncio.TimeoutError):  # read_frame's own deadline did not hold
            raise _Hang(f"read_frame loop still running after {FRAME_GUARD_S:g} s") from None
        except _Crash as c:
            c.seconds = time.perf_counter() - t0
            raise
        except _Hang:
            self._cancel_pending()
            raise
        dt = time.perf_counter() - t0
        want = _oracle_frames(stream, eof, max_bytes, self.MAX_FRAMES)
        refused, must_refuse = (bool(x) and x[-1] in _FRAME_REFUSALS for x in (got, want))
        if box["max_request"] > max(max_bytes, framing.HEADER_BYTES):
            return _Outcome(
                not refused,
                dt,
                (
                    "over_read",
                    "read past the cap",
                    f"asked for {box['max_request']} bytes under a {max_bytes} cap",
                ),
            )
        if got != want:
            if must_refuse and not refused:
                kind = "accepted_but_should_not"
            elif refused and not must_refuse:
                kind = "rejected_but_should_not"
            else:
                kind = "wrong_result"
            tail = want[-1] if want and isinstance(want[-1], str) else "frame"
            return _Outcome(
                not refused, dt, (kind, f"want ...{tail}", f"got {_short(got, 40)}, want {_short(want, 40)}")
            )
        return _Outcome(not refused, dt)

    def _cancel_pending(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    async def _read_all(self, stream: bytes, eof: bool, max_bytes: int, cuts: tuple, box: dict) -> list:
        reader = _CountingReader()
        loop = asyncio.get_running_loop()
        bounds = [0, *cuts, len(stream)]
        parts = [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        if parts[0]:
            reader.feed_data(parts[0])
        if len(parts) == 1:
            if eof:
                reader.feed_eof()
        else:  # the rest arrives while read_frame waits (EOF cases only, so timeouts stay deterministic)

            def feed(i: int) -> None:
                if parts[i]:
                    reader.feed_data(parts[i])
                if i + 1 < len(parts):
                    loop.call_soon(feed, i + 1)
                else:
                    reader.feed_eof()

            loop.call_soon(feed, 1)
        timeout = 2.0 if eof else 0.005  # with EOF every read ends at once: 2 s is never waited for
        out: list = []
        try:
            for _ in range(self.MAX_FRAMES):
                try:
                    frame = await framing.read_frame(reader, max_bytes, timeout)
                except EOFError:
                    out.append("eof")
                    break
                except framing.FrameError as e:
                    out.append(e.kind)
                    break
                except Exception as e:
                    raise _Crash(e, 0.0) from e
                if not isinstance(frame, bytes):
                    raise _Crash(TypeError(f"read_frame returned {type(frame).__name__}"), 0.0)
                out.append(frame)
        finally:
            box["max_request"] = reader.max_request
        return out


_FRAME_REFUSALS = ("truncated", "oversized", "timeout")
_RECORD_FIELDS = ("key", "subkey", "value", "expiration_time")


class _CountingReader(asyncio.StreamReader):
    """A StreamReader that remembers the largest read it was asked for (the 'allocation' a peer can force)."""

    max_request = 0

    async def readexactly(self, n: int) -> bytes:
        self.max_request = max(self.max_request, n)
        return await super().readexactly(n)

    async def read(self, n: int = -1) -> bytes:
        self.max_request = max(self.max_request, n if n >= 0 else 1 << 62)
        return await super().read(n)

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        self.max_request = 1 << 62
        return await super().readuntil(separator)


class DHTRecordTarget(_Target):
    """SignedRecordValidator.validate() on honest, forged, re-signed and tampered records."""

    name = "dht_record"

    def __init__(self, h: _Harness):
        super().__init__(h)
        from heterorl.protocol.net import dht

        self.dht = dht
        self.validator = dht.SignedRecordValidator(None, clock=lambda: NOW)
        self.signed = DecodeSignedTarget(h)
        rng = random.Random(f"heterorl-fuzz-dht:{h.seed}")
        self.bases = [self._honest(rng, kind) for kind in DHT_KINDS for _ in range(4)]

    def _honest(self, rng: random.Random, kind: str | None = None, body: Any = None, **kw: Any) -> Any:
        kind = kind or rng.choice(DHT_KINDS)
        body = body if body is not None else valid_body(kind, rng)
        author = kw.pop("author", None) or rng.choice(self.h.honest)
        msg = self.h.sign_message(kind, body, rng, identity=author)
        name = _key_name(kind, body) if type(body) is dict and kind in DHT_KINDS else "heterorl/x/peers"
        exp = kw.pop("exp", NOW + rng.uniform(-600, DHT_TTL_S.get(kind, 600.0)))
        return self.h.build_record(name, author, msg, exp, **kw)

    def generate(self, rng: random.Random) -> Any:
        from hivemind.dht.validation import DHTRecord

        h = self.h
        r = rng.random()
        if r < 0.25:
            return self._honest(rng)
        if r < 0.32:  # exactly at / just past the TTL bound, and NaN/inf expirations, all properly signed
            kind = rng.choice(DHT_KINDS)
            limit = NOW + DHT_TTL_S[kind] + DHT_SKEW_S
            exp = rng.choice(
                [
                    limit,
                    math.nextafter(limit, math.inf),
                    limit + 1,
                    math.nan,
                    math.inf,
                    -math.inf,
                    0.0,
                    -1e300,
                    int(limit),
                ]
            )
            return self._honest(rng, kind, exp=exp)
        if r < 0.38:  # a non-DHT message, properly signed and wrapped
            kind = rng.choice([k for k in KINDS if k not in DHT_KINDS])
            return self._honest(rng, kind)
        if r < 0.46:  # a signed but malformed message inside a properly signed record
            author = rng.choice(h.honest)
            data, _ = self.signed.generate(rng)
            return h.build_record(f"heterorl/{RUN}/peers", author, data, NOW + 60, signer=author)
        if r < 0.56:  # forgeries
            victim, mallory = h.honest[0], h.mallory
            kind = rng.choice(DHT_KINDS)
            body = valid_body(kind, rng)
            name = _key_name(kind, body)
            own = h.sign_message(kind, body, rng, identity=rng.choice([victim, mallory]))
            which = rng.randrange(3)
            if which == 0:  # Mallory signs a record under the victim's subkey
                return h.build_record(name, victim, own, NOW + 60, signer=mallory)
            if which == 1:  # Mallory re-wraps the victim's message under her own subkey
                msg = h.sign_message(kind, body, rng, identity=victim)
                return h.build_record(name, mallory, msg, NOW + 60, signer=mallory)
            return h.build_record(name, victim, own, NOW + 60, sig=rng.randbytes(64))
        if r < 0.62:  # honest record under another key
            kind = rng.choice(DHT_KINDS)
            body = valid_body(kind, rng)
            author = rng.choice(h.honest)
            msg = h.sign_message(kind, body, rng, identity=author)
            other_kind = rng.choice(DHT_KINDS)
            name = rng.choice(
                [
                    _key_name(other_kind, valid_body(other_kind, rng)),
                    f"heterorl/{RUN}/peers",
                    f"heterorl/other/{rng.choice(['spec', 'peers', 'checkpoints'])}",
                    "heterorl//peers",
                    "",
                ]
            )
            return h.build_record(name, author, msg, NOW + 60)
        base = rng.choice(self.bases)
        fields = {
            "key": base.key,
            "subkey": base.subkey,
            "value": base.value,
            "expiration_time": base.expiration_time,
        }
        f = rng.choice(list(fields))
        v = fields[f]
        r2 = rng.random()
        if f == "expiration_time":
            fields[f] = rng.choice(
                [
                    v + 1e-3,
                    v - 1,
                    int(v),
                    v + DHT_TTL_S["RunSpec"],
                    math.nan,
                    None,
                    "1",
                    b"\x00" * 8,
                    True,
                    -v,
                    _weird(rng),
                ]
            )
        elif r2 < 0.4:
            b = bytearray(v)
            for _ in range(rng.choice([1, 1, 2, 5])):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            fields[f] = bytes(b)
        elif r2 < 0.55:
            fields[f] = v[: rng.randrange(len(v))]
        elif r2 < 0.62:
            fields[f] = v + rng.randbytes(rng.randint(1, 8))
        elif r2 < 0.7:
            fields[f] = bytearray(v)
        elif r2 < 0.8 and f == "value":
            inner, sig = msgpack.unpackb(v)
            fields[f] = _pack(
                rng.choice(
                    [
                        [inner, sig, b""],
                        [inner],
                        [sig, inner],
                        {"v": inner},
                        [inner, sig[:63]],
                        [msgpack.unpackb(inner), sig],
                        [inner, None],
                        [_Deep(rng.choice([10, 1100])), sig],
                    ]
                )
            )
        elif r2 < 0.86 and f == "subkey":
            fields[f] = rng.choice(
                [
                    msgpack.packb(rng.randbytes(rng.choice([31, 33]))),
                    v[1:],
                    msgpack.packb(h.mallory.public_key),
                    msgpack.packb(v.hex()),
                ]
            )
        elif r2 < 0.999:
            fields[f] = rng.choice(
                [None, "", 0, v.hex(), [v], rng.randbytes(rng.randint(0, 40)), _weird(rng)]
            )
        else:
            fields["value"] = b"\x00" * (MAX_RECORD_BYTES + 1)
        return DHTRecord(**fields)

    def strategy(self) -> Any:
        from hivemind.dht.validation import DHTRecord
        from hypothesis import strategies as st

        def build(args: tuple) -> Any:
            i, field, replacement, flips, resign = args
            base = self.bases[i]
            fields = {
                "key": base.key,
                "subkey": base.subkey,
                "value": base.value,
                "expiration_time": base.expiration_time,
            }
            if field == "expiration_time":
                fields[field] = replacement
            elif field != "none":
                b = bytearray(fields[field])
                for pos, val in flips:
                    b[pos % len(b)] = val
                fields[field] = bytes(b)
            if (
                resign
                and field in ("key", "expiration_time")
                and isinstance(fields["expiration_time"], (int, float))
            ):
                owner = next(i for i in self.h.identities if msgpack.packb(i.public_key) == base.subkey)
                inner = msgpack.unpackb(base.value)[0]
                return self.h.build_record(
                    None, owner, msgpack.unpackb(inner), fields["expiration_time"], key=fields["key"]
                )
            return DHTRecord(**fields)

        return st.tuples(
            st.integers(0, len(self.bases) - 1),
            st.sampled_from(["none", "key", "subkey", "value", "expiration_time"]),
            st.floats() | st.integers(-(1 << 63), 1 << 63) | st.sampled_from([NOW, NOW + 600, NOW + 900.0]),
            st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4),
            st.booleans(),
        ).map(build)

    def describe(self, rec: Any) -> tuple[bytes, dict]:
        parts = [getattr(rec, f, None) for f in ("key", "subkey", "value", "expiration_time")]
        blob = b"|".join(
            bytes(p) if isinstance(p, (bytes, bytearray)) else repr(p).encode()[:200] for p in parts
        )
        return blob, {"record": {f: _short(p, 60) for f, p in zip(_RECORD_FIELDS, parts, strict=True)}}

    def execute(self, rec: Any) -> _Outcome:
        accepted, result, dt = _call(self.validator.validate, rec, allowed=())
        if type(result) is not bool:
            raise _Crash(TypeError(f"validate returned {type(result).__name__}, not a bool"), dt)
        try:
            self.h.oracle.record(rec, NOW)
        except _Reject as r:
            if result:
                return _Outcome(True, dt, ("accepted_but_should_not", str(r), "validate() returned True"))
            return _Outcome(False, dt)
        if not result:
            refused = ", ".join(sorted(self.validator.refused))[:200]
            return _Outcome(False, dt, ("rejected_but_should_not", "honest record refused", refused))
        return _Outcome(True, dt)


class ChunkRequestTarget(_Target):
    name = "chunk_request"

    def __init__(self, h: _Harness):
        super().__init__(h)
        from heterorl.protocol.net import chunks

        self.chunks = chunks

    def generate(self, rng: random.Random) -> bytes:
        r = rng.random()
        hashes = [rng.randbytes(32) for _ in range(rng.randint(1, 16))]
        if r < 0.25:
            return msgpack.packb({"hashes": hashes})
        if r < 0.35:
            return rng.randbytes(rng.choice([0, 1, 2, 8, 40, rng.randint(0, 700)]))
        if r < 0.55:
            n = rng.choice([0, 17, 1, 16, 100])
            hs: list[Any] = [rng.randbytes(32) for _ in range(n)]
            if hs and rng.random() < 0.7:
                hs[rng.randrange(n)] = rng.choice(
                    [rng.randbytes(31), rng.randbytes(33), b"", "h" * 32, 32, None, [b"x" * 32], _weird(rng)]
                )
            return _pack({"hashes": hs})
        if r < 0.7:
            return _pack(
                rng.choice(
                    [
                        {"hashes": hashes, "extra": 1},
                        {b"hashes": hashes},
                        {"Hashes": hashes},
                        [hashes],
                        {"hashes": {"0": hashes[0]}},
                        {"hashes": hashes[0]},
                        {"hashes": _weird(rng)},
                        _weird(rng),
                        {1: hashes},
                        {"hashes": [msgpack.ExtType(1, hashes[0])]},
                        {"hashes": _Deep(1100)},
                    ]
                )
            )
        valid = msgpack.packb({"hashes": hashes})
        b = bytearray(valid)
        r2 = rng.random()
        if r2 < 0.4:
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            return bytes(b)
        if r2 < 0.6:
            return valid[: rng.randrange(len(valid))]
        if r2 < 0.7:
            return valid + rng.randbytes(rng.randint(1, 4))
        b[rng.randrange(len(b))] = rng.choice([0xDC, 0xDD, 0xC7, 0xD4, 0xC4, 0xDA, 0x81, 0x82, 0x90, 0x9F])
        return bytes(b)

    def strategy(self) -> Any:
        from hypothesis import strategies as st

        hashes = st.lists(st.binary(min_size=30, max_size=34), max_size=18)
        return st.one_of(
            st.binary(max_size=700),
            hashes.map(lambda hs: msgpack.packb({"hashes": hs})),
            st.dictionaries(st.sampled_from(["hashes", "x", ""]), _any_value(), max_size=2).map(_pack),
            _any_value().map(_pack),
        )

    def from_bytes(self, data: bytes) -> bytes:
        return data

    def corpus(self) -> list[bytes]:
        rng = random.Random(0)
        return [msgpack.packb({"hashes": [rng.randbytes(32) for _ in range(n)]}) for n in (1, 2, 16)]

    def describe(self, case: bytes) -> tuple[bytes, dict]:
        return bytes(case), {}

    def execute(self, frame: bytes) -> _Outcome:
        accepted, result, dt = _call(self.chunks._parse_request, frame)
        try:
            want = _oracle_chunk_request(frame)
        except _Reject as r:
            return _Outcome(
                accepted, dt, ("accepted_but_should_not", str(r), _short(result)) if accepted else None
            )
        if not accepted:
            return _Outcome(False, dt, ("rejected_but_should_not", str(result)[:60], str(result)[:200]))
        if result != want:
            return _Outcome(True, dt, ("wrong_result", "result differs", _short(result)))
        return _Outcome(True, dt)


_TARGET_CLASSES: dict[str, type[_Target]] = {
    "decode": DecodeTarget,
    "decode_signed": DecodeSignedTarget,
    "frame": FrameTarget,
    "dht_record": DHTRecordTarget,
    "chunk_request": ChunkRequestTarget,
}


def _identity(seed: int, name: str) -> Identity:
    raw = hashlib.sha256(f"heterorl-fuzz-key:{seed}:{name}".encode()).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(raw))


class _Harness:
    """Keys, the oracle's signature bookkeeping, and the per-input bookkeeping of a run."""

    def __init__(self, seed: int):
        self.seed = seed
        self.oracle = Oracle()
        self.honest = [_identity(seed, "alice"), _identity(seed, "bob")]
        self.mallory = _identity(seed, "mallory")
        self.identities = [*self.honest, self.mallory]
        self._alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    # -- signing (every signature is registered with the oracle)
    def sign_message(
        self, kind: str, body: Any, rng: random.Random, identity: Identity | None = None
    ) -> bytes:
        return self.build_envelope(kind, body, rng, identity=identity)

    def build_envelope(
        self,
        kind: Any,
        body: Any,
        rng: random.Random,
        version: Any = PROTOCOL_VERSION,
        identity: Identity | None = None,
        tamper: bool = False,
    ) -> bytes:
        ident = identity or rng.choice(self.honest)
        author = ident.public_key
        try:
            signed = _osigned_bytes(kind, body, author)
            sig = ident.sign(signed)
            self.oracle.register_message(signed, author, sig)
        except Exception:  # unsignable (a _Deep, a mix of key types): any signature will do, none is valid
            sig = rng.randbytes(SIG_BYTES)
        env: dict[Any, Any] = {"v": version, "type": kind, "body": body, "author": author, "sig": sig}
        if tamper:
            r = rng.random()
            if r < 0.2:
                env["author"] = rng.choice(
                    [self.mallory.public_key, author[:31], author + b"\x00", author.hex()]
                )
            elif r < 0.4:
                env["sig"] = rng.choice([sig[:63], sig + b"\x00", bytes([sig[0] ^ 1]) + sig[1:], sig.hex()])
            elif r < 0.6:
                env[rng.choice(["extra", "", "V"])] = 1
            elif r < 0.8:
                del env[rng.choice(sorted(env))]
            else:
                env = [env[k] for k in ("v", "type", "body", "author", "sig")]
        try:
            return _pack(env)
        except Exception:  # e.g. an int key beyond 64 bits
            return msgpack.packb({"v": 1, "type": "Ack", "body": {}, "author": author, "sig": sig})

    def build_record(
        self,
        key_name: str | None,
        owner: Identity,
        message: bytes,
        exp: Any,
        signer: Identity | None = None,
        sig: bytes | None = None,
        key: bytes | None = None,
    ) -> Any:
        from hivemind.dht.validation import DHTRecord

        key = key if key is not None else _key_id(key_name or "")
        subkey = msgpack.packb(owner.public_key, use_bin_type=True)
        inner = msgpack.packb(message, use_bin_type=True)
        if sig is None:
            signer = signer or owner
            signed = _orecord_bytes(key, subkey, inner, exp)
            sig = signer.sign(signed)
            self.oracle.register_record(signed, signer.public_key, sig)
        return DHTRecord(key, subkey, msgpack.packb([inner, sig], use_bin_type=True), exp)

    # -- running
    def run_case(self, target: _Target, stats: TargetStats, case: Any, source: str, index: int) -> str | None:
        """Run one input; returns a failure kind (crash / hang / violation kind) or None."""
        stats.inputs += 1
        stats.sources[source] = stats.sources.get(source, 0) + 1
        blob, extra = target.describe(case)
        stats._hasher.update(len(blob).to_bytes(8, "big") + blob + repr(sorted(extra.items())).encode()[:256])
        failure = None
        example = {"index": index, "source": source, "input": _short(blob), "input_len": len(blob), **extra}
        if len(blob) <= 8192:
            example["input_hex"] = blob.hex()
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, ABORT_S)
        try:
            outcome = target.execute(case)
        except _Crash as c:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats.crashes += 1
            stats.rejected += 1
            where = _where(c.exc.__traceback__)
            self._example(
                stats,
                stats.crash_examples,
                f"crash:{type(c.exc).__name__}:{where}",
                {**example, "error": type(c.exc).__name__, "detail": str(c.exc)[:200], "where": where},
            )
            self._time(stats, c.seconds, example)
            return "crash"
        except _Hang as e:
            stats.hangs += 1
            self._example(
                stats,
                stats.hang_examples,
                "hang:aborted",
                {**example, "error": "hang", "detail": str(e) or f"aborted after {ABORT_S:g} s"},
            )
            return "hang"
        except Exception as e:  # a bug in this harness, not in the decoder: reported apart, still a failure
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats.harness_errors += 1
            self._example(
                stats,
                stats.harness_error_examples,
                f"harness:{type(e).__name__}",
                {**example, "error": type(e).__name__, "detail": traceback.format_exc()[-600:]},
            )
            return "harness_error"
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        self._time(stats, outcome.seconds, example)
        if outcome.accepted:
            stats.accepted += 1
        else:
            stats.rejected += 1
        if outcome.seconds > HANG_S and self._still_slow(target, case, outcome.seconds):
            stats.hangs += 1
            failure = "hang"
            self._example(
                stats,
                stats.hang_examples,
                "hang:slow",
                {**example, "error": "hang", "detail": f"{outcome.seconds:.2f} s"},
            )
        if outcome.violation:
            kind, reason, detail = outcome.violation
            setattr(stats, kind, getattr(stats, kind) + 1)
            self._example(
                stats,
                stats.violation_examples,
                f"{kind}:{reason}",
                {**example, "kind": kind, "reason": reason, "detail": detail},
            )
            failure = kind
        return failure

    def _still_slow(self, target: _Target, case: Any, first: float) -> bool:
        """A slow input is timed once more after a full GC: a pause or a busy machine is not a hang."""
        gc.collect()
        try:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, ABORT_S)
            again = target.execute(case).seconds
        except _Hang:
            return True
        except Exception:  # it crashed the second time: the first run decided the verdict already
            again = first
        finally:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        return again > HANG_S

    @staticmethod
    def _time(stats: TargetStats, seconds: float, example: dict) -> None:
        stats.total_s += seconds
        stats.max_s = max(stats.max_s, seconds)
        if len(stats.slowest) < 3 or seconds > stats.slowest[-1]["seconds"]:
            keep = ("index", "source", "input_len", "input", "kwargs")
            stats.slowest.append({"seconds": seconds, **{k: example[k] for k in keep if k in example}})
            stats.slowest.sort(key=lambda e: -e["seconds"])
            del stats.slowest[3:]

    @staticmethod
    def _example(stats: TargetStats, bucket: list, signature: str, example: dict) -> None:
        if signature in stats._signatures:
            stats._signatures[signature] += 1
            return
        stats._signatures[signature] = 1
        if len(bucket) < MAX_EXAMPLES:
            bucket.append({"signature": signature, **example})


def _raise_hang(signum: int, frame: Any) -> None:
    raise _Hang()


def _hypothesis_version() -> str | None:
    try:
        import hypothesis
    except ImportError:
        return None
    return hypothesis.__version__


def _run_hypothesis(
    h: _Harness, target: _Target, stats: TargetStats, n: int, seed: int, tick: Callable
) -> None:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    count = [0]

    @hseed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(target.strategy())
    def one(case: Any) -> None:
        if count[0] >= n:
            return
        h.run_case(target, stats, case, "hypothesis", count[0])
        count[0] += 1
        tick()

    one()


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done, self.bar = total, enabled, 0, None
        self._pending, self._last = 0, time.monotonic()
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="in", mininterval=1.0, dynamic_ncols=True)
            except ImportError:
                pass

    def target(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)
        elif self.enabled:
            print(f"fuzz: {name}...", file=sys.stderr, flush=True)

    def tick(self) -> None:
        self.done += 1
        self._pending += 1
        if self._pending >= 128:
            self.flush()

    def flush(self) -> None:
        if self.bar is not None:
            self.bar.update(self._pending)
        elif self.enabled and time.monotonic() - self._last > 5:
            self._last = time.monotonic()
            print(f"fuzz: {self.done}/{self.total} inputs", file=sys.stderr, flush=True)
        self._pending = 0

    def close(self) -> None:
        self.flush()
        if self.bar is not None:
            self.bar.close()


def _split(inputs: int, targets: Sequence[str]) -> dict[str, int]:
    weights = [TARGET_WEIGHTS[t] for t in targets]
    total = sum(weights)
    shares = {t: int(inputs * w / total) for t, w in zip(targets, weights, strict=False)}
    shares[targets[0]] += inputs - sum(shares.values())
    return shares


def run_fuzz(
    inputs: int = 100_000,
    seed: int = 0,
    targets: Sequence[str] = ALL_TARGETS,
    progress: bool = True,
    hypothesis_share: float = 0.2,
) -> FuzzReport:
    """Fuzz the chosen targets with ``inputs`` inputs in all (split by :data:`TARGET_WEIGHTS`)."""
    targets = list(dict.fromkeys(targets))
    unknown = [t for t in targets if t not in _TARGET_CLASSES]
    if unknown or not targets:
        raise ValueError(f"unknown fuzz targets {unknown}; valid: {', '.join(ALL_TARGETS)}")
    hyp = _hypothesis_version()
    shares = _split(inputs, targets)
    h = _Harness(seed)
    report = FuzzReport(seed=seed, requested_inputs=inputs, targets={}, hypothesis=hyp)
    bar = _Progress(inputs, progress)
    old_handler = signal.signal(signal.SIGALRM, _raise_hang) if h._alarm else None
    t0 = time.perf_counter()
    try:
        for name in targets:
            bar.target(name)
            stats = TargetStats(name)
            report.targets[name] = stats
            target = _TARGET_CLASSES[name](h)
            try:
                n = shares[name]
                n_h = int(n * hypothesis_share) if hyp else 0
                if n_h:
                    _run_hypothesis(h, target, stats, n_h, seed, bar.tick)
                rng = random.Random(f"heterorl-fuzz:{seed}:{name}")
                i = 0
                while stats.inputs < n:
                    try:
                        case = target.generate(rng)
                    except Exception as e:  # a generator bug: counted as a failed input, never silent
                        stats.inputs += 1
                        stats.harness_errors += 1
                        h._example(
                            stats,
                            stats.harness_error_examples,
                            f"generate:{type(e).__name__}",
                            {
                                "index": i,
                                "source": "random",
                                "input": "-",
                                "error": type(e).__name__,
                                "detail": traceback.format_exc()[-600:],
                            },
                        )
                    else:
                        h.run_case(target, stats, case, "random", i)
                    i += 1
                    bar.tick()
            finally:
                target.close()
            stats.digest = stats._hasher.hexdigest()
    finally:
        if h._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
        bar.close()
    report.wall_s = time.perf_counter() - t0
    return report


# ------------------------------------------------------------------------------------------------ atheris


class FuzzFailure(AssertionError):
    """Raised into libFuzzer (atheris) for a crash, hang or oracle violation, so that it saves the input."""


def _instrument_protocol(atheris: Any) -> int:
    """Coverage-instrument every function of heterorl.protocol, closures included (instrument_all() would
    also walk torch and hivemind: tens of thousands of functions, minutes)."""
    import types

    done = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith("heterorl.protocol"):
            try:
                atheris.instrument_func(obj)
                done += 1
            except Exception:  # a function atheris cannot patch stays uninstrumented
                pass
    print(f"INFO: instrumented {done} heterorl.protocol functions", file=sys.stderr)
    return done


def atheris_main(argv: Sequence[str] | None = None) -> int:
    """Coverage-guided fuzzing of one target with atheris: ``TARGET [libFuzzer flags...]``."""
    try:
        import atheris
    except ImportError:
        print(
            "atheris is not installed (pip install atheris); the built-in fuzzer needs nothing extra",
            file=sys.stderr,
        )
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and not argv[0].startswith("-") else "decode"
    if name not in _TARGET_CLASSES:
        print(f"unknown target {name!r}; valid: {', '.join(ALL_TARGETS)}", file=sys.stderr)
        return 2
    h = _Harness(0)
    h._alarm = False  # libFuzzer's -timeout does this job
    target = _TARGET_CLASSES[name](h)
    stats = TargetStats(name)

    def one(data: bytes) -> None:
        failure = h.run_case(target, stats, target.from_bytes(data), "atheris", stats.inputs)
        if failure:
            examples = stats.crash_examples + stats.hang_examples + stats.violation_examples
            raise FuzzFailure(f"{name}: {failure}: {json.dumps(examples[-1:], default=str)[:2000]}")

    _instrument_protocol(atheris)
    flags = [a for a in argv if a.startswith("-")]
    dirs = [a for a in argv if not a.startswith("-")]
    if not any(a.startswith("-runs") for a in flags):
        flags.append("-runs=100000")
    if not any(a.startswith("-timeout") for a in flags):
        flags.append(f"-timeout={max(1, int(HANG_S))}")
    if not any(a.startswith("-max_len") for a in flags):
        flags.append("-max_len=65536")
    if not dirs:  # start from the target's own seeds: random bytes never reach a signed envelope
        import tempfile

        corpus = tempfile.mkdtemp(prefix=f"heterorl-fuzz-{name}-")
        for i, data in enumerate(target.corpus()):
            with open(f"{corpus}/seed-{i:03d}", "wb") as f:
                f.write(data)
        dirs = [corpus]
        print(f"INFO: corpus in {corpus}", file=sys.stderr)
    atheris.Setup([sys.argv[0], *flags, *dirs], one)
    atheris.Fuzz()
    return 0


# ---------------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs in all (default 100000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed: a run is deterministic for it")
    parser.add_argument(
        "--targets", default=",".join(ALL_TARGETS), help=f"comma-separated subset of: {','.join(ALL_TARGETS)}"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the full report as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--hypothesis-share",
        type=float,
        default=0.2,
        help="share of each target's inputs drawn from hypothesis strategies (default 0.2)",
    )
    parser.add_argument(
        "--atheris",
        metavar="TARGET",
        help="instead: coverage-guided atheris/libFuzzer run of one target "
        "(needs `pip install atheris`; exits the process when done)",
    )
    parser.add_argument(
        "--libfuzzer",
        metavar="FLAGS",
        default="",
        help="with --atheris: extra libFuzzer flags in one string, e.g. '-max_len=4096 -jobs=2'",
    )


def run_from_args(args: argparse.Namespace) -> int:
    if getattr(args, "atheris", None):
        runs = [f"-runs={args.inputs}", f"-seed={args.seed + 1}"]
        return atheris_main([args.atheris, *runs, *shlex.split(args.libfuzzer)])
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets or args.inputs < 0 or not 0 <= args.hypothesis_share <= 1:
        print(
            f"error: --targets takes a comma-separated subset of {','.join(ALL_TARGETS)} "
            f"(got {args.targets!r}); --inputs >= 0; 0 <= --hypothesis-share <= 1",
            file=sys.stderr,
        )
        return 2
    report = run_fuzz(
        args.inputs, args.seed, targets, progress=not args.no_progress, hypothesis_share=args.hypothesis_share
    )
    print(report.format_table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
        print(f"report written to {args.json}")
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="heterorl bench fuzz", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
