"""Sparse lossless deltas (protocol/wire/delta.py): exact round trips, a refusal for every malformed input."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
import torch
import zstandard

from heterorl.protocol.wire.checkpoint import serialize_state_dict
from heterorl.protocol.wire.delta import (
    DeltaError,
    apply_delta,
    changed_fraction,
    encode_delta,
    layout,
    read_header,
)

pytestmark = pytest.mark.fast  # in `make test-fast`


def _state(seed: int = 0, n: int = 3000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(50, 16, generator=g) * 0.05
    return {
        "embed.weight": emb,
        "lm_head.weight": emb.clone(),  # tied, as real models are
        "layer.weight": torch.randn(n, generator=g) * 0.05,
        "norm.weight": torch.ones(16),
        "steps": torch.arange(4, dtype=torch.int64),
    }


def _step(state: dict[str, torch.Tensor], lr: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """An Adam-like step: every float element moves by ~lr (the float32 master changes everywhere)."""
    g = torch.Generator().manual_seed(seed)
    out = {
        k: v + lr * torch.randn(v.shape, generator=g).sign() if v.is_floating_point() else v
        for k, v in state.items()
    }
    out["lm_head.weight"] = out["embed.weight"].clone()
    return out


def _bytes(state: dict[str, torch.Tensor], dtype: torch.dtype) -> bytes:
    return serialize_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("lr", [1e-4, 1e-2, 1.0])
def test_round_trip_is_bit_exact(dtype, lr):
    a = _state()
    b = _step(a, lr)
    pa, pb = _bytes(a, dtype), _bytes(b, dtype)
    d = encode_delta(pa, pb)
    assert apply_delta(pa, d) == pb
    info, entries, _ = read_header(d)
    assert info.base == hashlib.sha256(pa).digest()
    # the changed count is exactly the elements whose stored words differ
    assert info.changed == round(changed_fraction(pa, pb) * sum(t.count for t in layout(pa)[1]))


def test_bf16_rounding_hides_small_steps_and_the_delta_is_small():
    a = _state(n=200_000)
    b = _step(a, 1e-6)
    pa32, pb32 = _bytes(a, torch.float32), _bytes(b, torch.float32)
    pa, pb = _bytes(a, torch.bfloat16), _bytes(b, torch.bfloat16)
    assert changed_fraction(pa32, pb32) > 0.9  # the float32 master moved nearly everywhere
    frac = changed_fraction(pa, pb)
    assert 0 < frac < 0.05  # its bf16 rounding hardly at all
    d = encode_delta(pa, pb)
    assert len(d) < 0.05 * len(pa)
    assert apply_delta(pa, d) == pb


def test_tied_tensors_travel_once():
    a = _state()
    b = _step(a, 1e-2)
    pa, pb = _bytes(a, torch.bfloat16), _bytes(b, torch.bfloat16)
    _, entries, _ = read_header(encode_delta(pa, pb))
    by_name = {e[0]: e for e in entries}
    assert by_name["lm_head.weight"][2] == "embed.weight" or by_name["embed.weight"][2] == "lm_head.weight"
    untied = dict(b, **{"lm_head.weight": b["lm_head.weight"] + 0.5})
    _, entries, _ = read_header(encode_delta(pa, _bytes(untied, torch.bfloat16)))
    assert all(e[2] == "" for e in entries)


def test_no_change_is_an_empty_delta():
    pa = _bytes(_state(), torch.bfloat16)
    d = encode_delta(pa, pa)
    info, entries, _ = read_header(d)
    assert entries == [] and info.changed == 0 and apply_delta(pa, d) == pa


def test_another_layout_is_refused():
    a = _state()
    pa = _bytes(a, torch.bfloat16)
    other = _bytes({**a, "extra": torch.zeros(3)}, torch.bfloat16)
    with pytest.raises(DeltaError, match="publish in full"):
        encode_delta(pa, other)
    with pytest.raises(DeltaError, match="publish in full"):
        encode_delta(pa, _bytes(a, torch.float32))


def test_a_delta_for_another_parent_is_refused():
    a, b, c = _state(0), _step(_state(0), 1e-2), _state(5)
    d = encode_delta(_bytes(a, torch.bfloat16), _bytes(b, torch.bfloat16))
    with pytest.raises(DeltaError, match="another parent"):
        apply_delta(_bytes(c, torch.bfloat16), d)


def _tamper(d: bytes, **changes) -> bytes:
    env = msgpack.unpackb(d, raw=False)
    env.update(changes)
    return msgpack.packb(env, use_bin_type=True)


def test_malformed_deltas_are_refused_not_crashes():
    a = _state()
    pa, pb = _bytes(a, torch.bfloat16), _bytes(_step(a, 1e-2), torch.bfloat16)
    d = encode_delta(pa, pb)
    env = msgpack.unpackb(d, raw=False)
    entries = env["tensors"]
    cases = {
        "not msgpack": b"\xc1garbage",
        "wrong format": _tamper(d, format="other/9"),
        "extra key": msgpack.packb({**env, "x": 1}, use_bin_type=True),
        "unknown tensor": _tamper(d, tensors=[["nope", 1, ""]] + entries[1:]),
        "repeated tensor": _tamper(d, tensors=entries + entries[:1]),
        "too many changes": _tamper(d, tensors=[[entries[0][0], 10**9, ""]] + entries[1:]),
        "bad alias": _tamper(d, tensors=[[entries[0][0], entries[0][1], "layer.weight"]] + entries[1:]),
        "size lies": _tamper(d, size=env["size"] + 4),
        "bomb": _tamper(d, data=zstandard.ZstdCompressor().compress(bytes(env["size"] * 50))),
        "garbage data": _tamper(d, data=b"\x28\xb5\x2f\xfd" + bytes(40)),
        "bool count": _tamper(d, tensors=[[entries[0][0], True, ""]] + entries[1:]),
    }
    for why, bad in cases.items():
        with pytest.raises(DeltaError):
            apply_delta(pa, bad)
            pytest.fail(why)


def test_positions_out_of_bounds_or_not_increasing_are_refused():
    a = _state()
    pa = _bytes(a, torch.bfloat16)
    # a one-element change, then rewrite its gap to point past the tensor's end / to repeat a position
    b = {k: v.clone() for k, v in a.items()}
    b["norm.weight"][3] = 2.0
    d = encode_delta(pa, _bytes(b, torch.bfloat16))
    env = msgpack.unpackb(d, raw=False)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(env["data"]))
    for gap in (17, 0):  # position 16 of 16 elements; gap 0 repeats position -1
        raw[0:4] = gap.to_bytes(1, "little") + bytes(3)  # byte planes: the 4 bytes of one gap, in order
        bad = _tamper(d, data=zstandard.ZstdCompressor().compress(bytes(raw)))
        with pytest.raises(DeltaError):
            apply_delta(pa, bad)


def test_layout_refuses_malformed_safetensors():
    for bad in (b"", b"\x00" * 7, (10**9).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"[]"):
        with pytest.raises(DeltaError):
            layout(bad)
    # offsets that do not fit the dtype and shape
    header = b'{"t":{"dtype":"BF16","shape":[4],"data_offsets":[0,6]}}'
    with pytest.raises(DeltaError, match="offsets"):
        layout(len(header).to_bytes(8, "little") + header + bytes(8))


def test_manifest_deltas_are_checked_together_and_survive_the_store(tmp_path):
    from heterorl.protocol import Identity, ProtocolError, encode
    from heterorl.protocol.storage.store import ChunkStore
    from heterorl.protocol.wire.checkpoint import add_delta, check_manifest, manifest_body, referenced_hashes
    from heterorl.protocol.wire.delta import CODEC

    ident = Identity.generate()
    store = ChunkStore(tmp_path / "s", max_bytes=1 << 30)
    states = [_bytes(_step(_state(), 1e-3 * v, seed=v), torch.bfloat16) for v in range(3)]
    bodies = []
    for v, data in enumerate(states):
        body, chunks = manifest_body("r", v, v - 1, data, "bfloat16", 4096)
        for base in range(v):  # a delta against every older version
            chunks += add_delta(body, base, encode_delta(states[base], data), CODEC)
        for h, c in zip(referenced_hashes(body), chunks, strict=True):
            store.put(h, c)
        store.add_manifest(encode("CheckpointManifest", body, ident), body)
        bodies.append(body)
    again = ChunkStore(tmp_path / "s", max_bytes=1 << 30)  # reopened: the sidecar keeps the deltas
    assert again.body(2) == bodies[2] and [d["base_version"] for d in again.body(2)["deltas"]] == [0, 1]
    for d in bodies[2]["deltas"]:
        from heterorl.protocol.wire.checkpoint import delta_part

        assert (
            apply_delta(again.assemble(d["base_version"]), again.assemble_part(delta_part(bodies[2], d)))
            == (states[2])
        )
    with pytest.raises(ValueError, match="new, older base"):
        add_delta(dict(bodies[2]), 1, b"x", CODEC)
    bad = {**bodies[2], "deltas": [bodies[2]["deltas"][0]] * 2}
    with pytest.raises(ProtocolError, match="each once"):
        check_manifest(bad)
    bad = {**bodies[1], "deltas": [{**bodies[1]["deltas"][0], "base_version": 1}]}
    with pytest.raises(ProtocolError, match="not older"):
        check_manifest(bad)
    bad = {**bodies[1], "deltas": [{**bodies[1]["deltas"][0], "total_size": 10**7}]}
    with pytest.raises(ProtocolError, match="delta chunks"):
        check_manifest(bad)


def test_eviction_keeps_the_delta_chunks_of_kept_versions_and_drops_those_of_evicted_ones(tmp_path):
    from heterorl.protocol import Identity, encode
    from heterorl.protocol.storage.store import ChunkStore
    from heterorl.protocol.wire.checkpoint import add_delta, delta_part, manifest_body, referenced_hashes
    from heterorl.protocol.wire.delta import CODEC

    ident = Identity.generate()
    states = [_bytes(_step(_state(n=20_000), 1e-3 * v, seed=v), torch.bfloat16) for v in range(4)]
    store = ChunkStore(tmp_path / "s", max_bytes=1 << 30)
    bodies = []
    for v, data in enumerate(states):
        body, chunks = manifest_body("r", v, v - 1, data, "bfloat16", 4096)
        if v:
            chunks += add_delta(body, v - 1, encode_delta(states[v - 1], data), CODEC)
        for h, c in zip(referenced_hashes(body), chunks, strict=True):
            store.put(h, c)
        store.add_manifest(encode("CheckpointManifest", body, ident), body)
        bodies.append(body)
    store.max_bytes = 1  # over the cap: only the newest versions stay
    store.evict(keep_latest=2)
    assert store.versions() == [2, 3]
    kept = delta_part(bodies[3], bodies[3]["deltas"][0])
    assert store.missing(kept) == []  # a kept version's delta is still served
    assert apply_delta(store.assemble(2), store.assemble_part(kept)) == states[3]
    gone = bodies[1]["deltas"][0]["chunk_hashes"]
    assert not any(store.has(h) for h in gone)  # an evicted version's delta went with it
