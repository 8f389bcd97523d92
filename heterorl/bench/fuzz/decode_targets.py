"""The ``decode`` and ``decode_signed`` targets: :func:`protocol.wire.messages.decode` against the oracle.

``decode`` mutates signed messages at the byte and msgpack-tree level (and feeds random bytes);
``decode_signed`` builds structure-aware bad bodies and signs them correctly, so that the schema layer, not
the signature check, is what must refuse them.
"""

from __future__ import annotations

import copy
import math
import random
from typing import TYPE_CHECKING, Any

import msgpack

from heterorl.protocol.wire import messages

from .base import _call, _Outcome, _Target
from .generators import _any_value, _get, _mutate_value, _nodes, _pack, _set, _spec_edges, _weird, valid_body
from .oracle import _Reject
from .report import _short
from .wire import KINDS, PROTOCOL_VERSION, RUN, SPEC

if TYPE_CHECKING:
    from .harness import _Harness


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
