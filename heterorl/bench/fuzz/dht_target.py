"""The ``dht_record`` target: :meth:`protocol.net.dht.SignedRecordValidator.validate` on honest, forged,
re-signed, tampered and wrongly typed records. It must never raise, and accept only what the oracle accepts.
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import msgpack

from .base import _call, _Crash, _Outcome, _Target
from .config import NOW
from .decode_targets import DecodeSignedTarget
from .generators import _Deep, _pack, _weird, valid_body
from .oracle import _key_name, _Reject
from .report import _short
from .wire import DHT_KINDS, DHT_SKEW_S, DHT_TTL_S, KINDS, MAX_RECORD_BYTES, RUN

if TYPE_CHECKING:
    from .harness import _Harness


_RECORD_FIELDS = ("key", "subkey", "value", "expiration_time")


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
