"""A run's data set as content-addressed chunks: bytes <-> a small manifest, named by the manifest's hash.

The host's coordinator cuts the data set (a JSONL file) into fixed-size chunks like a checkpoint's
(:func:`.checkpoint.split`) and writes a manifest, itself stored and served as one more chunk::

    msgpack {"format": "heterorl-dataset/1", "total_size": N, "chunk_bytes": C,
             "chunk_hashes": [sha256 of each chunk, in order], "sha256": sha256 of the whole}

The data set's id is the SHA-256 of the manifest's bytes; the RunSpec carries it as 64 hex characters in
``task.params.dataset`` (a few hundred chunk hashes would not fit the RunSpec's hyperparameters). A peer
holding only the id can thus check the manifest, each chunk against it, and the whole against its hash:
nobody but the RunSpec's signer chooses the bytes. Everything from the network is capped before it is read:
a manifest of more than :data:`MAX_MANIFEST_BYTES`, or one claiming more than :data:`MAX_DATASET_BYTES` of
data, is refused. Pure: no files, no sockets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgpack

from heterorl.protocol.wire import schema as s
from heterorl.protocol.wire.checkpoint import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, check_part, chunk_hash, split
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.messages import HASH_BYTES

FORMAT = "heterorl-dataset/1"
DATASET_CHUNK_BYTES = 1 << 20  # what a host cuts a data set into
MAX_DATASET_BYTES = 256 << 20  # the largest data set a peer accepts (every peer holds it whole in memory)
MAX_DATASET_CHUNKS = 4096
MAX_MANIFEST_BYTES = 1 << 18  # 4096 hashes and the other fields fit with room to spare
DATASET_PARAM = "dataset"  # the task parameter that names a data set by its id (hex)
# tasks with a parameter of their own called "dataset", which names no data set of the run: reasoning_gym's is
# the name of one of the reasoning-gym library's data sets
OWN_DATASET_PARAM = frozenset({"reasoning_gym"})

_MANIFEST = s.record(
    {
        "format": s.text(32),
        "total_size": s.integer(1, MAX_DATASET_BYTES),
        "chunk_bytes": s.integer(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES),
        "chunk_hashes": s.array(s.binary(HASH_BYTES, HASH_BYTES), MAX_DATASET_CHUNKS, min_len=1),
        "sha256": s.binary(HASH_BYTES, HASH_BYTES),
    }
)


def make_manifest(data: bytes, chunk_bytes: int = DATASET_CHUNK_BYTES) -> tuple[bytes, bytes, list[bytes]]:
    """``(dataset id, manifest bytes, chunks)`` for data set ``data``; ValueError if it is empty or over
    :data:`MAX_DATASET_BYTES`."""
    if not data:
        raise ValueError("an empty data set has no records")
    if len(data) > MAX_DATASET_BYTES:
        raise ValueError(f"data set of {len(data)} bytes exceeds the {MAX_DATASET_BYTES}-byte cap")
    chunks = split(data, chunk_bytes)
    if len(chunks) > MAX_DATASET_CHUNKS:
        raise ValueError(f"{len(chunks)} chunks exceed a data set's {MAX_DATASET_CHUNKS}; use larger chunks")
    body = {
        "format": FORMAT,
        "total_size": len(data),
        "chunk_bytes": chunk_bytes,
        "chunk_hashes": [chunk_hash(c) for c in chunks],
        "sha256": hashlib.sha256(data).digest(),
    }
    raw = msgpack.packb(body, use_bin_type=True)
    return chunk_hash(raw), raw, chunks


def read_manifest(raw: bytes, dataset_id: bytes) -> dict:
    """The manifest body of data set ``dataset_id`` from ``raw`` (a peer's reply); ProtocolError unless
    ``raw`` hashes to the id, is within the caps and is a well-formed manifest whose sizes agree. The body is
    a part :func:`.checkpoint.chunk_length`, :func:`~.checkpoint.verify_chunk` and the chunk store read."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ProtocolError(
            f"data set manifest of {len(raw)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte cap"
        )
    if chunk_hash(raw) != dataset_id:
        raise ProtocolError("data set manifest does not hash to the data set's id")
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_map_len=8,
            max_array_len=MAX_DATASET_CHUNKS,
            max_str_len=64,
            max_bin_len=HASH_BYTES,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types on malformed input
        raise ProtocolError(f"data set manifest is not well-formed msgpack ({type(e).__name__})") from None
    body = _MANIFEST(body, "dataset manifest")
    if body["format"] != FORMAT:
        raise ProtocolError(f"data set manifest format {body['format']!r}; this peer reads {FORMAT!r}")
    check_part(body, "data set ")
    return body


def check_whole(body: dict, data: bytes) -> None:
    """ProtocolError unless ``data``, assembled from verified chunks, is the whole the manifest names."""
    if len(data) != body["total_size"] or hashlib.sha256(data).digest() != body["sha256"]:
        raise ProtocolError("the assembled data set does not hash to its manifest's sha256")


def dataset_id_of(task_name: str, params: Mapping[str, Any]) -> bytes | None:
    """The data set a run's task names by id (task ``jsonl`` with ``params.dataset``: 64 hex characters), or
    None for a task without one; ValueError for a ``dataset`` that is not such an id. In a task of
    :data:`OWN_DATASET_PARAM`, ``dataset`` is the task's own parameter, never an id."""
    if DATASET_PARAM not in params or task_name in OWN_DATASET_PARAM:
        return None
    value = params[DATASET_PARAM]
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != HASH_BYTES or task_name != "jsonl":
        raise ValueError(
            f"task.params.{DATASET_PARAM} must be a data set's id ({2 * HASH_BYTES} hex characters) of a "
            f"'jsonl' task, got {str(value)[:80]!r} for task {task_name!r}"
        )
    return raw
