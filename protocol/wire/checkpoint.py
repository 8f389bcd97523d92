"""Checkpoints as content-addressed chunks: safetensors bytes <-> fixed-size chunks and a manifest body.

A checkpoint is the safetensors serialisation of a state dict, cut into fixed-size chunks (the last one
shorter), each named by its SHA-256. Fixed size on purpose: safetensors writes a deterministic header and
fixed tensor offsets for the same names, shapes and dtypes, so a tensor that did not change between versions
gives the same chunks, which peers already hold from the parent version.

A version may also be offered as a sparse delta against an older one (:mod:`delta`, cut into chunks the same
way): a peer that holds the base fetches the delta's chunks instead, rebuilds the full bytes and checks every
chunk against the manifest's full ``chunk_hashes`` (so the delta is exact or refused). Peers then hold and
serve the full state too, so a newcomer or a peer that missed a version fetches it in full from anyone.

The manifest body lists the chunk hashes in order, the total size and the chunk size; signing and the wire
form are :mod:`messages` (``CheckpointManifest``). Everything here is pure: no files, no sockets. torch and
safetensors are imported inside the two functions that need them, so this module imports without torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from heterorl.protocol.wire.errors import ProtocolError

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_CHUNKS = 1 << 16  # the CheckpointManifest schema's cap on chunk_hashes
MAX_DELTAS = 8  # and on its deltas (messages.MAX_DELTAS)


def _check_chunk_bytes(chunk_bytes: int) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise ValueError(f"chunk_bytes must be an integer, got {type(chunk_bytes).__name__}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes {chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    return chunk_bytes


def chunk_hash(data: bytes) -> bytes:
    """SHA-256 digest of ``data`` (32 bytes): a chunk's name."""
    return hashlib.sha256(data).digest()


def split(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """Cut ``data`` into ``chunk_bytes``-sized pieces, the last one shorter; ValueError for a bad size."""
    n = _check_chunk_bytes(chunk_bytes)
    return [bytes(data[i : i + n]) for i in range(0, len(data), n)]


def serialize_state_dict(state_dict: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes of ``state_dict``: keys sorted, tensors detached, on CPU and contiguous.

    Tensors that share storage (tied weights) are cloned, since safetensors refuses shared memory.
    """
    from safetensors.torch import save

    out, seen = {}, set()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return save(out)


def deserialize_state_dict(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of safetensors bytes (never unpickles; malformed bytes raise from safetensors)."""
    from safetensors.torch import load

    return load(bytes(data))


def manifest_body(
    run_id: str, version: int, parent_version: int, data: bytes, dtype: str, chunk_bytes: int = CHUNK_BYTES
) -> tuple[dict, list[bytes]]:
    """The unsigned CheckpointManifest body for checkpoint bytes ``data``, and its chunks in order.

    Sign it with ``messages.encode("CheckpointManifest", body, identity)`` after the chunks are published.
    """
    if not data:
        raise ValueError("an empty checkpoint has no chunks")
    chunks = split(data, chunk_bytes)
    if len(chunks) > MAX_CHUNKS:
        raise ValueError(f"{len(chunks)} chunks exceed the manifest's {MAX_CHUNKS}; use a larger chunk_bytes")
    body = {
        "run_id": run_id,
        "version": version,
        "parent_version": parent_version,
        "chunk_hashes": [chunk_hash(c) for c in chunks],
        "total_size": len(data),
        "dtype": dtype,
        "chunk_bytes": chunk_bytes,
    }
    return body, chunks


def add_delta(body: dict, base_version: int, delta: bytes, codec: str) -> list[bytes]:
    """Offer manifest ``body``'s version also as ``delta`` against ``base_version``; its chunks, in order.

    The delta is cut like the checkpoint (``body["chunk_bytes"]``); ``chunk_hashes`` stay the full state's,
    so whoever applies the delta checks the result chunk by chunk against what the learner signed.
    """
    deltas = body.setdefault("deltas", [])
    if not 0 <= base_version < body["version"] or any(d["base_version"] == base_version for d in deltas):
        raise ValueError(f"a delta for version {body['version']} needs a new, older base, got {base_version}")
    if len(deltas) >= MAX_DELTAS:
        raise ValueError(f"a manifest offers at most {MAX_DELTAS} deltas")
    chunks = split(delta, body["chunk_bytes"])
    if not chunks or len(chunks) > MAX_CHUNKS:
        raise ValueError(f"a delta of {len(delta)} bytes does not fit a manifest")
    deltas.append(
        {
            "base_version": base_version,
            "codec": codec,
            "chunk_hashes": [chunk_hash(c) for c in chunks],
            "total_size": len(delta),
        }
    )
    return chunks


def delta_part(body: dict, delta: dict) -> dict:
    """One of manifest ``body``'s deltas as a manifest-like part (chunk_hashes, total_size, chunk_bytes) for
    :func:`chunk_length`, :func:`verify_chunk` and :func:`assemble`."""
    return {
        "chunk_hashes": delta["chunk_hashes"],
        "total_size": delta["total_size"],
        "chunk_bytes": body["chunk_bytes"],
    }


def referenced_hashes(body: dict) -> list[bytes]:
    """Every chunk a manifest names: its full state's, then its deltas'."""
    return list(body["chunk_hashes"]) + [h for d in body.get("deltas", ()) for h in d["chunk_hashes"]]


def check_manifest(body: dict) -> None:
    """Raise ProtocolError unless the chunk count, chunk size and total size of ``body`` agree.

    The schema checks each field alone; this checks them together:
    ``len(chunk_hashes) == ceil(total_size / chunk_bytes)``, and the same for each delta, whose base must be
    an older version, each named once.
    """
    check_part(body)
    bases = [d["base_version"] for d in body.get("deltas", ())]
    if len(set(bases)) != len(bases) or len(bases) > MAX_DELTAS:
        raise ProtocolError(f"manifest deltas name the bases {bases}: at most {MAX_DELTAS}, each once")
    for d in body.get("deltas", ()):
        if not 0 <= d["base_version"] < body["version"]:
            raise ProtocolError(f"delta base {d['base_version']} is not older than version {body['version']}")
        check_part(delta_part(body, d), "delta ")


def check_part(body: dict, what: str = "") -> None:
    """ProtocolError unless a part's (a manifest's, a delta's, a data set's) chunk size is in bounds and its
    chunk count is ``ceil(total_size / chunk_bytes)``."""
    chunk_bytes, total = body["chunk_bytes"], body["total_size"]
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ProtocolError(
            f"manifest chunk_bytes {chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"
        )
    if total < 1:
        raise ProtocolError(f"manifest {what}total_size {total} is not positive")
    expected = -(-total // chunk_bytes)
    if len(body["chunk_hashes"]) != expected:
        raise ProtocolError(
            f"manifest lists {len(body['chunk_hashes'])} {what}chunks; {total} bytes in {chunk_bytes}-byte "
            f"chunks make {expected}"
        )


def chunk_length(body: dict, index: int) -> int:
    """Exact length of chunk ``index`` of a (checked) manifest: ``chunk_bytes``, the last one shorter."""
    n = len(body["chunk_hashes"])
    if not 0 <= index < n:
        raise IndexError(f"chunk {index} of a {n}-chunk manifest")
    if index < n - 1:
        return body["chunk_bytes"]
    return body["total_size"] - (n - 1) * body["chunk_bytes"]


def verify_chunk(body: dict, index: int, data: bytes) -> bool:
    """True iff ``data`` has chunk ``index``'s length and hashes to its manifest entry."""
    return len(data) == chunk_length(body, index) and chunk_hash(data) == body["chunk_hashes"][index]


def assemble(body: dict, chunks: Sequence[bytes]) -> bytes:
    """Checkpoint bytes from every chunk of ``body`` (a manifest or a :func:`delta_part`) in order;
    ProtocolError on any mismatch."""
    check_part(body)
    if len(chunks) != len(body["chunk_hashes"]):
        raise ProtocolError(f"{len(chunks)} chunks for a {len(body['chunk_hashes'])}-chunk manifest")
    for i, c in enumerate(chunks):
        if c is None or not verify_chunk(body, i, c):
            raise ProtocolError(f"chunk {i} does not match the manifest")
    data = b"".join(chunks)
    if len(data) != body["total_size"]:  # implied by the checks above; kept as the contract's last word
        raise ProtocolError(f"assembled {len(data)} bytes, manifest says {body['total_size']}")
    return data
