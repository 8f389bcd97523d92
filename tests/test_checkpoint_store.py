"""Checkpoint chunking (pure) and the on-disk ChunkStore: round trips, the delta property, corruption,
crash leftovers, restarts and eviction. A real ~1 MB state dict in 64 KiB chunks."""

import json
import subprocess
import sys
import threading

import pytest
import torch

from heterorl.protocol import Identity, ProtocolError, decode, encode
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import (
    CHUNK_BYTES,
    assemble,
    check_manifest,
    chunk_hash,
    chunk_length,
    deserialize_state_dict,
    manifest_body,
    serialize_state_dict,
    split,
    verify_chunk,
)

pytestmark = pytest.mark.fast  # in `make test-fast`

CB = 64 << 10
RUN = "run-ckpt"
LEARNER = Identity.generate()


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(96, 1024, generator=g),  # 384 KiB
        "layer0.weight": torch.randn(64, 1024, generator=g),  # 256 KiB
        "layer0.bias": torch.randn(1000, generator=g),
        "layer1.weight": torch.randn(64, 1024, generator=g).to(torch.bfloat16),  # 128 KiB
        "head.weight": torch.randn(64, 1024, generator=g),  # 256 KiB
        "step": torch.tensor([7], dtype=torch.int64),
    }


def _version(state, version, parent=None):
    data = serialize_state_dict(state)
    body, chunks = manifest_body(RUN, version, version - 1 if parent is None else parent, data, "float32", CB)
    return data, body, chunks, encode("CheckpointManifest", body, LEARNER)


def _publish(store, state, version):
    data, body, chunks, raw = _version(state, version)
    for h, c in zip(body["chunk_hashes"], chunks, strict=True):
        store.put(h, c)
    store.add_manifest(raw, body)
    return body


def _spans(data: bytes) -> dict[str, tuple[int, int]]:
    """File byte range of each tensor, from the safetensors header (8-byte length, JSON, data)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
        for k, v in header.items()
        if k[0] != "_"
    }


def _chunk_file(store, h):
    return store.root / "chunks" / h.hex()[:2] / h.hex()


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


# --- pure chunking ---------------------------------------------------------------------------------------


def test_split_sizes_and_validation():
    data = bytes(range(256)) * 1000  # 256000 bytes
    chunks = split(data, 4096)
    assert [len(c) for c in chunks[:-1]] == [4096] * (len(chunks) - 1)
    assert len(chunks) == 63 and len(chunks[-1]) == 256000 - 62 * 4096
    assert b"".join(chunks) == data
    assert len(split(data)) == 1 and CHUNK_BYTES == 4 << 20
    for bad in (4095, (64 << 20) + 1, 0, True):
        with pytest.raises(ValueError):
            split(data, bad)
    with pytest.raises(ValueError):
        manifest_body(RUN, 1, 0, data, "float32", 1024)
    with pytest.raises(ValueError):
        manifest_body(RUN, 1, 0, b"", "float32", CB)
    assert chunk_hash(b"abc").hex().startswith("ba7816bf") and len(chunk_hash(b"")) == 32


def test_serialization_is_deterministic_and_round_trips():
    state = _state()
    data = serialize_state_dict(state)
    assert serialize_state_dict(dict(reversed(list(state.items())))) == data  # key order does not matter
    _assert_same(deserialize_state_dict(data), state)
    t = torch.randn(8, 8)
    tied = serialize_state_dict({"a": t, "b": t, "c": t.t()})  # shared storage, non-contiguous view
    out = deserialize_state_dict(tied)
    assert torch.equal(out["a"], t) and torch.equal(out["b"], t) and torch.equal(out["c"], t.t())


def test_manifest_lengths_verify_and_assemble():
    data, body, chunks, _ = _version(_state(), 1)
    check_manifest(body)
    assert len(chunks) == -(-len(data) // CB) > 10 and body["chunk_bytes"] == CB
    lengths = [chunk_length(body, i) for i in range(len(chunks))]
    assert lengths == [len(c) for c in chunks] and sum(lengths) == len(data) and lengths[-1] < CB
    with pytest.raises(IndexError):
        chunk_length(body, len(chunks))
    assert all(verify_chunk(body, i, c) for i, c in enumerate(chunks))
    assert not verify_chunk(body, 0, chunks[1])  # right length, wrong hash
    assert not verify_chunk(body, 0, chunks[0][:-1])
    assert assemble(body, chunks) == data
    bad = [
        chunks[:-1],
        chunks + [chunks[-1]],
        [chunks[1], chunks[0], *chunks[2:]],
        [*chunks[:-1], chunks[-1] + b"\0"],
        [bytes([chunks[0][0] ^ 1]) + chunks[0][1:], *chunks[1:]],
    ]
    for b in bad:
        with pytest.raises(ProtocolError):
            assemble(body, b)


def test_check_manifest_rejects_inconsistent_counts():
    _, body, _, _ = _version(_state(), 1)
    for over in (
        {"chunk_hashes": body["chunk_hashes"] + [b"x" * 32]},
        {"chunk_hashes": body["chunk_hashes"][:-1]},
        {"chunk_bytes": CB * 2},
        {"total_size": body["total_size"] + CB},
        {"chunk_bytes": 1024},
    ):
        with pytest.raises(ProtocolError):
            check_manifest({**body, **over})
    check_manifest({**body, "total_size": body["total_size"] - 1})  # still the same number of chunks


def test_manifest_signs_and_decodes():
    _, body, _, raw = _version(_state(), 3, parent=2)
    kind, decoded, author = decode(raw, expected="CheckpointManifest", run_id=RUN)
    assert kind == "CheckpointManifest" and author == LEARNER.public_key and decoded == body
    assert decoded["chunk_bytes"] == CB
    check_manifest(decoded)
    with pytest.raises(ProtocolError):  # the schema bounds chunk_bytes too
        encode("CheckpointManifest", {**body, "chunk_bytes": 1024}, LEARNER)
    with pytest.raises(ProtocolError):
        encode("CheckpointManifest", {k: v for k, v in body.items() if k != "chunk_bytes"}, LEARNER)


def test_changing_one_tensor_changes_only_its_chunks():
    state = _state()
    data1, body1, _, _ = _version(state, 1)
    state2 = {**state, "layer0.weight": state["layer0.weight"] + 1.0}
    data2, body2, _, _ = _version(state2, 2)
    assert len(data1) == len(data2) and _spans(data1) == _spans(data2)
    start, end = _spans(data1)["layer0.weight"]
    expected = {i for i in range(len(body1["chunk_hashes"])) if i * CB < end and (i + 1) * CB > start}
    changed = {
        i for i, (a, b) in enumerate(zip(body1["chunk_hashes"], body2["chunk_hashes"], strict=True)) if a != b
    }
    assert changed == expected
    assert 0 < len(changed) < len(body1["chunk_hashes"]) - 4


def test_module_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['safetensors'] = None\n"
        "import heterorl.protocol.wire.checkpoint as c, heterorl.protocol.storage.store\n"
        "assert len(c.split(b'x' * 10000, 4096)) == 3"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the store -------------------------------------------------------------------------------------------


def test_store_round_trip_and_delta(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    state = _state()
    body1 = _publish(store, state, 1)
    assert store.versions() == [1] and store.latest() == 1 and store.missing(body1) == []
    assert store.held(body1) == body1["total_size"]
    _assert_same(deserialize_state_dict(store.assemble(1)), state)
    _, decoded, _ = decode(store.manifest(1), expected="CheckpointManifest")
    assert decoded == body1 and store.manifest(9) is None
    with pytest.raises(KeyError):
        store.assemble(9)

    state2 = {**state, "head.weight": state["head.weight"] * 2}
    data2, body2, chunks2, raw2 = _version(state2, 2)
    need = store.missing(body2)
    start, end = _spans(data2)["head.weight"]
    assert set(need) == {i for i in range(len(chunks2)) if i * CB < end and (i + 1) * CB > start}
    assert store.held(body2) == body2["total_size"] - sum(chunk_length(body2, i) for i in need)
    for i in need:
        store.put(body2["chunk_hashes"][i], chunks2[i])
    store.add_manifest(raw2, body2)
    store.add_manifest(raw2, body2)  # the same manifest again: a no-op
    assert store.versions() == [1, 2] and store.assemble(2) == data2
    _assert_same(deserialize_state_dict(store.assemble(2)), state2)


def test_put_checks_hash_and_is_idempotent(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    data = b"z" * 5000
    h = chunk_hash(data)
    with pytest.raises(ValueError):
        store.put(h, data + b"!")
    with pytest.raises(ValueError):
        store.put(h[:31], data)
    assert not store.has(h) and store.get(h) is None and store.total_bytes() == 0
    store.put(h, data)
    store.put(h, data)
    assert store.get(h) == data and store.stats()["chunks"] == 1 and store.total_bytes() == 5000
    assert [p.name for p in _chunk_file(store, h).parent.iterdir()] == [h.hex()]  # no temp files left


def test_corrupt_chunk_is_deleted_not_served(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    body = _publish(store, _state(), 1)
    h = body["chunk_hashes"][3]
    path = _chunk_file(store, h)
    good = path.read_bytes()
    path.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])  # same length, one byte flipped
    assert store.has(h)  # existence only; bytes are checked on read
    assert store.get(h) is None
    assert not path.exists() and not store.has(h) and store.missing(body) == [3]
    assert store.stats()["corrupt_dropped"] == 1 and store.held(body) == body["total_size"] - CB
    with pytest.raises(ProtocolError):
        store.assemble(1)
    store.put(h, good)
    assert store.get(h) == good and store.assemble(1)


def test_add_manifest_needs_every_chunk_and_matching_bytes(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    _, body, chunks, raw = _version(_state(), 1)
    with pytest.raises(ValueError, match="publish data first"):
        store.add_manifest(raw, body)
    for h, c in list(zip(body["chunk_hashes"], chunks, strict=True))[:-1]:
        store.put(h, c)
    with pytest.raises(ValueError, match="1 chunks not held"):
        store.add_manifest(raw, body)
    assert store.versions() == [] and list((tmp_path / "manifests").iterdir()) == []
    store.put(body["chunk_hashes"][-1], chunks[-1])
    with pytest.raises(ValueError):  # bytes that are not this body
        store.add_manifest(raw, {**body, "version": 7})
    with pytest.raises(ValueError):  # tampered: the signature fails
        store.add_manifest(raw[:-1] + bytes([raw[-1] ^ 1]), body)
    store.add_manifest(raw, body)
    other = encode("CheckpointManifest", {**body, "dtype": "bfloat16"}, LEARNER)
    with pytest.raises(ValueError, match="different manifest"):
        store.add_manifest(other, {**body, "dtype": "bfloat16"})
    assert store.manifest(1) == raw


def test_restart_sees_everything_and_cleans_crash_leftovers(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    state = _state()
    body = _publish(store, state, 1)
    before = (store.stats(), store.total_bytes(), store.manifest(1))
    h = body["chunk_hashes"][0]
    leftovers = [
        _chunk_file(store, h).parent / ".tmp-abc123",
        tmp_path / "manifests" / ".tmp-xyz",
        tmp_path / "manifests" / "000000000005.json",  # crash between sidecar and manifest
        tmp_path / "manifests" / "000000000006.msg",  # manifest without its sidecar
    ]
    for p in leftovers:
        p.write_bytes(b"half-written")

    again = ChunkStore(tmp_path, max_bytes=1 << 30)
    assert not any(p.exists() for p in leftovers)
    assert (again.stats(), again.total_bytes(), again.manifest(1)) == before
    assert again.versions() == [1] and again.has(h) and again.missing(body) == []
    _assert_same(deserialize_state_dict(again.assemble(1)), state)


def test_a_read_only_store_reads_beside_its_writer_and_changes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no chunk store"):
        ChunkStore(tmp_path / "none", max_bytes=1, read_only=True)
    assert not (tmp_path / "none").exists()
    writer = ChunkStore(tmp_path, max_bytes=1 << 30)
    state = _state()
    body = _publish(writer, state, 1)
    h = body["chunk_hashes"][0]
    in_flight = [_chunk_file(writer, h).parent / ".tmp-abc123", tmp_path / "manifests" / ".tmp-xyz"]
    for p in in_flight:  # the writer's temp files, mid-write
        p.write_bytes(b"half-written")
    files = sorted(p for p in tmp_path.rglob("*"))
    reader = ChunkStore(tmp_path, max_bytes=1, read_only=True)  # over its cap, too
    _assert_same(deserialize_state_dict(reader.assemble(1)), state)
    path = _chunk_file(writer, body["chunk_hashes"][1])
    path.write_bytes(b"\x00" + path.read_bytes()[1:])
    assert reader.get(body["chunk_hashes"][1]) is None and path.exists()  # corrupt: refused, left there
    for write in (lambda: reader.put(h, b"x"), lambda: reader.add_manifest(b"", body), reader.evict):
        with pytest.raises(PermissionError, match="read-only"):
            write()
    assert sorted(p for p in tmp_path.rglob("*")) == files and all(p.exists() for p in in_flight)


def test_eviction_keeps_newest_versions_and_their_chunks(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1)  # always over the cap: keep only the newest two
    state = _state()
    bodies = {}
    for v, name in enumerate(["embed.weight", "layer0.weight", "head.weight"], start=1):
        state = {**state, name: state[name] + v}
        bodies[v] = _publish(store, state, v)
    assert store.versions() == [2, 3]
    kept = set(bodies[2]["chunk_hashes"]) | set(bodies[3]["chunk_hashes"])
    only_v1 = set(bodies[1]["chunk_hashes"]) - kept
    shared = set(bodies[1]["chunk_hashes"]) & kept
    assert only_v1 and shared
    assert all(store.has(h) for h in kept) and not any(store.has(h) for h in only_v1)
    assert store.manifest(1) is None and not (tmp_path / "manifests" / "000000000001.json").exists()
    assert store.missing(bodies[2]) == [] and store.missing(bodies[3]) == []
    sizes = sum(_chunk_file(store, h).stat().st_size for h in kept)
    manifests = sum(p.stat().st_size for p in (tmp_path / "manifests").iterdir())
    assert store.total_bytes() == sizes + manifests and store.stats()["evicted_bytes"] > 0

    # An in-progress download of version 5: orphan chunks survive the automatic eviction of add_manifest.
    orphans = [bytes([i]) * 5000 for i in range(3)]
    for c in orphans:
        store.put(chunk_hash(c), c)
    state = {**state, "layer0.bias": state["layer0.bias"] - 1}
    bodies[4] = _publish(store, state, 4)
    assert store.versions() == [3, 4] and all(store.has(chunk_hash(c)) for c in orphans)

    protect = [chunk_hash(c) for c in orphans[:2]]
    total = store.total_bytes()
    freed = store.evict(protect=protect)
    assert freed == 5000 and store.total_bytes() == total - freed
    assert [store.has(chunk_hash(c)) for c in orphans] == [True, True, False]
    assert store.versions() == [3, 4]
    freed = store.evict(keep_latest=1)
    assert freed > 10000 and store.versions() == [4] and store.missing(bodies[4]) == []
    assert not any(store.has(h) for h in protect)
    _assert_same(deserialize_state_dict(store.assemble(4)), state)

    again = ChunkStore(tmp_path, max_bytes=1)
    assert again.versions() == [4] and again.total_bytes() == store.total_bytes()


def test_eviction_is_a_no_op_under_the_cap(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    state = _state()
    for v in range(1, 5):
        state = {**state, "head.weight": state["head.weight"] + 1}
        _publish(store, state, v)
    store.put(chunk_hash(b"o" * 4096), b"o" * 4096)
    assert store.evict(keep_latest=0) == 0 and store.versions() == [1, 2, 3, 4]
    assert store.has(chunk_hash(b"o" * 4096))
    with pytest.raises(ValueError):
        ChunkStore(tmp_path, max_bytes=0)


def test_concurrent_puts_gets_and_eviction(tmp_path):
    store = ChunkStore(tmp_path, max_bytes=1 << 30)
    chunks = [bytes([i]) * (4096 + i) for i in range(64)]
    errors = []

    def writer():
        try:
            for c in chunks:
                store.put(chunk_hash(c), c)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(3):
                for c in chunks:
                    got = store.get(chunk_hash(c))
                    assert got is None or got == c
                store.evict()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (writer, writer, reader, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(store.get(chunk_hash(c)) == c for c in chunks)
    assert store.total_bytes() == sum(map(len, chunks)) and store.stats()["corrupt_dropped"] == 0
