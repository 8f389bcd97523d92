"""Sparse lossless checkpoint deltas: the stored bits that changed between two safetensors files, compressed.

After an optimizer step most float32 master weights change, but most of their bf16 roundings do not (PULSE,
arXiv 2602.03839: ~99 % of per-step changes vanish in bf16). A delta records, for every tensor, the positions
whose stored words changed and the change, so ``apply_delta(parent, encode_delta(parent, child)) == child``
byte for byte. What is compressed (one zstd frame for the whole delta, so tensors share a dictionary):

- positions as gaps between successive changed flat indices (uint32; first gap counts from -1), then
- the change of each word as an unsigned wrapping difference (``new - old`` mod 2**bits: one ulp up is 1,
  one ulp down is all ones), both split into byte planes (all low bytes, then the next...), so the mostly
  zero high bytes form long runs zstd squeezes to almost nothing.

Tied tensors (``lm_head.weight`` beside ``embed_tokens.weight``) change identically and travel once, as an
alias. Both files must share one safetensors header (same names, shapes, dtypes, hence the same offsets): a
delta patches words in place and never moves them. The delta names its parent by the SHA-256 of the parent's
bytes, so it cannot be applied to another state. Pure functions on bytes (numpy, zstandard); no torch, no I/O.

Encoding is two steps: finding the changed words (:func:`encode_delta` compares the two files with numpy) and
packing them (:func:`pack_delta`), so a learner can find them on its GPU instead
(``heterorl.peer.learner.device_delta``) and still make the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import msgpack
import numpy as np

from heterorl.protocol.wire.errors import ProtocolError

FORMAT = "heterorl-delta/1"
CODEC = "sparse-zstd"  # the manifest's name for this format
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (JSON) longer than this is refused
MAX_TENSORS = 1 << 16
_WORD = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
         "F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8}  # fmt: skip
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(ProtocolError):
    """A delta that cannot be made (layouts differ) or applied (wrong parent, malformed, out of bounds)."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one tensor's words lie in a safetensors file."""

    name: str
    word: int  # bytes per element
    start: int  # absolute byte offset in the file
    count: int  # elements


def layout(data: bytes | bytearray | memoryview) -> tuple[bytes, list[Tensor]]:
    """The raw header bytes of safetensors ``data`` and its tensors in file order; DeltaError if malformed."""
    if len(data) < 8:
        raise DeltaError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if not 2 <= n <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise DeltaError(f"safetensors header length {n} out of range")
    header = bytes(data[: 8 + n])
    try:
        entries = json.loads(header[8:])
    except ValueError as e:
        raise DeltaError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(entries, dict) or len(entries) > MAX_TENSORS + 1:
        raise DeltaError("safetensors header is not a map of at most 65536 tensors")
    tensors, body = [], len(data) - 8 - n
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        try:
            word, shape, (s, t) = _WORD[e["dtype"]], e["shape"], e["data_offsets"]
            count = math.prod(int(d) for d in shape)
        except (KeyError, TypeError, ValueError):
            raise DeltaError(f"tensor {name!r}: unsupported dtype or malformed entry") from None
        if not (isinstance(s, int) and isinstance(t, int) and 0 <= s <= t <= body and t - s == count * word):
            raise DeltaError(f"tensor {name!r}: offsets {s}..{t} do not fit {count} x {word} bytes")
        tensors.append(Tensor(name, word, 8 + n + s, count))
    tensors.sort(key=lambda x: x.start)
    return header, tensors


def _view(buf: bytes | bytearray, t: Tensor) -> np.ndarray:
    return np.frombuffer(buf, dtype=_UINT[t.word], count=t.count, offset=t.start)


def _planes(a: np.ndarray) -> bytes:
    """Little-endian words as byte planes: every word's byte 0, then every byte 1, ..."""
    return a.astype(a.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1, a.itemsize).T.tobytes()


def _unplanes(raw: bytes, dtype: type, n: int) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    return (
        np.frombuffer(raw, np.uint8).reshape(size, n).T.copy().view(np.dtype(dtype).newbyteorder("<"))[:, 0]
    )


class Change(NamedTuple):
    """One tensor's changed words: what :func:`pack_delta` packs (found by :func:`encode_delta` on the CPU, or
    on the tensors' own device by ``heterorl.peer.learner.device_delta``)."""

    name: str
    word: int  # bytes per element
    count: int  # elements in the tensor
    index: np.ndarray  # flat indices of the changed elements, strictly increasing
    diff: np.ndarray  # their wrapping differences ``new - old`` mod 2**(8 * word), in the same order


def encode_delta(parent: bytes, child: bytes, level: int = 3, threads: int = 0) -> bytes:
    """The delta that turns safetensors ``parent`` into ``child``; DeltaError if their headers differ."""
    header, tensors = layout(parent)
    if len(child) != len(parent) or bytes(child[: len(header)]) != header:
        raise DeltaError("parent and child differ in tensor names, shapes or dtypes; publish in full")

    def changes() -> Iterator[Change]:
        for t in tensors:
            old, new = _view(parent, t), _view(child, t)
            idx = np.flatnonzero(old != new)
            yield Change(t.name, t.word, t.count, idx, new[idx] - old[idx])  # unsigned: wraps mod 2**bits

    return pack_delta(hashlib.sha256(parent).digest(), changes(), level, threads)


def pack_delta(parent_sha256: bytes, changes: Iterable[Change], level: int = 3, threads: int = 0) -> bytes:
    """The delta of ``changes`` (every tensor of the file in file order; unchanged ones may be left out)
    against the parent whose bytes hash to ``parent_sha256``: gaps and byte planes, tensors whose changes are
    identical (tied weights) once as an alias, one zstd frame, the envelope. Pure packing: how the changes
    were found does not show in the bytes."""
    import zstandard

    if len(parent_sha256) != 32:
        raise ValueError("parent_sha256 must be a 32-byte SHA-256 digest")
    entries, parts, seen = [], [], {}
    for c in changes:
        idx = np.ascontiguousarray(c.index, dtype=np.int64)
        diff = np.ascontiguousarray(c.diff, dtype=_UINT[c.word])
        if not idx.size:
            continue
        if c.count > 1 << 32:
            raise DeltaError(f"tensor {c.name}: {c.count} elements exceed the format's 2**32")
        gaps = np.diff(idx, prepend=-1)
        if idx.shape != diff.shape or gaps.min() < 1 or idx[-1] >= c.count:
            raise ValueError(f"tensor {c.name}: indices unpaired or not increasing inside {c.count}")
        key = (c.word, c.count, hashlib.sha256(idx.tobytes() + diff.tobytes()).digest())
        if key in seen:
            entries.append([c.name, int(idx.size), seen[key]])
            continue
        seen[key] = c.name
        entries.append([c.name, int(idx.size), ""])
        parts += [_planes(gaps.astype(np.uint32)), _planes(diff)]
    raw = b"".join(parts)
    z = zstandard.ZstdCompressor(level=level, threads=threads).compress(raw)
    body = {"format": FORMAT, "base": bytes(parent_sha256), "size": len(raw), "tensors": entries}
    return msgpack.packb({**body, "data": z}, use_bin_type=True)


def file_order(data: bytes | bytearray | memoryview) -> list[str]:
    """Names of the tensors of safetensors ``data`` in file order (the order deltas list them in)."""
    return [t.name for t in layout(data)[1]]


@dataclasses.dataclass(frozen=True)
class DeltaInfo:
    base: bytes  # SHA-256 of the parent's bytes
    changed: int  # elements whose stored word changed (aliases counted again)
    tensors: int  # tensors that changed
    raw_bytes: int  # before compression


def read_header(delta: bytes, max_raw_bytes: int = 1 << 40) -> tuple[DeltaInfo, list[list], bytes]:
    """Decode and check a delta's envelope (no decompression yet); DeltaError if malformed."""
    try:
        d = msgpack.unpackb(delta, raw=False, max_ext_len=0, max_array_len=MAX_TENSORS, max_map_len=8)
    except Exception:
        raise DeltaError("delta is not well-formed msgpack") from None
    if not isinstance(d, dict) or set(d) != {"format", "base", "size", "tensors", "data"}:
        raise DeltaError("delta envelope must have format, base, size, tensors, data")
    if d["format"] != FORMAT:
        raise DeltaError(f"unknown delta format {d['format']!r}")
    base, size, entries, data = d["base"], d["size"], d["tensors"], d["data"]
    if not (isinstance(base, bytes) and len(base) == 32 and isinstance(data, bytes)):
        raise DeltaError("delta base hash or data of the wrong type")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_raw_bytes:
        raise DeltaError(f"delta size {size!r} out of range")
    if not isinstance(entries, list) or not all(
        isinstance(e, list)
        and len(e) == 3
        and isinstance(e[0], str)
        and isinstance(e[1], int)
        and not isinstance(e[1], bool)
        and e[1] >= 1
        and isinstance(e[2], str)
        for e in entries
    ):
        raise DeltaError("delta tensor list malformed: expected [name, changed >= 1, alias]")
    changed = sum(e[1] for e in entries)
    return DeltaInfo(base, changed, len(entries), size), entries, data


def apply_delta(parent: bytes, delta: bytes) -> bytes:
    """``child`` from ``parent`` and ``encode_delta(parent, child)``; DeltaError for anything that misfits.

    Every bound is checked before a word is written: the parent's hash, names known and not repeated, aliases
    naming an earlier patch of the same shape, sizes adding up to the decompressed length (which is capped, so
    a small delta cannot expand without limit), and positions strictly increasing inside the tensor.
    """
    import zstandard

    info, entries, data = read_header(delta, max_raw_bytes=12 * len(parent))
    if hashlib.sha256(parent).digest() != info.base:
        raise DeltaError("delta is for another parent state")
    _, tensors = layout(parent)
    by_name = {t.name: t for t in tensors}
    need, patched, counts = 0, {}, {}
    for name, count, alias in entries:
        t = by_name.get(name)
        if t is None or name in patched:
            raise DeltaError(f"delta names tensor {name!r}, unknown or repeated")
        if count > t.count:
            raise DeltaError(f"delta changes {count} elements of {name!r}, which has {t.count}")
        if alias:
            src = by_name.get(alias)
            if alias not in patched or src.word != t.word or src.count != t.count or counts[alias] != count:
                raise DeltaError(
                    f"delta alias {name!r} -> {alias!r} does not name an earlier patch of its shape"
                )
        else:
            need += count * (4 + t.word)
        patched[name], counts[name] = None, count
    if need != info.raw_bytes:
        raise DeltaError(f"delta entries need {need} bytes, its header says {info.raw_bytes}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=info.raw_bytes)
    except zstandard.ZstdError as e:
        raise DeltaError(f"delta data does not decompress: {e}") from None
    if len(raw) != info.raw_bytes:
        raise DeltaError(f"delta data is {len(raw)} bytes, its header says {info.raw_bytes}")
    out, pos = bytearray(parent), 0
    for name, count, alias in entries:
        t = by_name[name]
        if alias:
            idx, diff = patched[alias]
        else:
            gaps = _unplanes(raw[pos : pos + 4 * count], np.uint32, count)
            pos += 4 * count
            diff = _unplanes(raw[pos : pos + t.word * count], _UINT[t.word], count)
            pos += t.word * count
            if gaps.size and (gaps.min() < 1):
                raise DeltaError(f"delta positions of {name!r} are not strictly increasing")
            idx = np.cumsum(gaps, dtype=np.int64) - 1
            if idx[-1] >= t.count:
                raise DeltaError(f"delta position {int(idx[-1])} outside {name!r} ({t.count} elements)")
        view = _view(out, t)
        view[idx] = view[idx] + diff
        patched[name] = (idx, diff)
    return bytes(out)


def changed_fraction(parent: bytes, child: bytes) -> float:
    """Fraction of stored elements (over every tensor) whose word differs between two same-layout files."""
    _, tensors = layout(parent)
    total = sum(t.count for t in tensors)
    diff = sum(int(np.count_nonzero(_view(parent, t) != _view(child, t))) for t in tensors)
    return diff / max(total, 1)
