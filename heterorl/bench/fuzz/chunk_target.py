"""The ``chunk_request`` target: ``protocol.net.chunks._parse_request`` on random, malformed and mutated
chunk requests, checked against the oracle's reading of ``{"hashes": [1..16 hashes of 32 bytes]}``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import msgpack

from .base import _call, _Outcome, _Target
from .generators import _any_value, _Deep, _pack, _weird
from .oracle import _oracle_chunk_request, _Reject
from .report import _short

if TYPE_CHECKING:
    from .harness import _Harness


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
