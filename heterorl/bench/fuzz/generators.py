"""Input material driven by the wire schemas: valid bodies, edge-case values, mutations, msgpack packing.

Seeded-random side: :func:`valid_body` (a body the spec admits, biased to boundaries), :func:`_weird` (any
msgpack value chosen for edge cases), :func:`_mutate_value` (a replacement the spec does not admit) and the
tree helpers :func:`_nodes` / :func:`_get` / :func:`_set`. :func:`_pack` packs trees holding :class:`_Deep`
(nesting msgpack's packer refuses). Hypothesis side: :func:`_any_value` and :func:`_spec_edges`. The targets
build their cases from these.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from typing import Any

import msgpack

from .wire import RUN, SPEC, _Bin, _Bool, _Int, _List, _Num, _Rec, _Text


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
