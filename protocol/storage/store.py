"""An on-disk, content-addressed chunk store with a size cap: what a peer holds of each checkpoint version.

Layout under ``root`` (everything is files, so a new store on the same root sees what was there)::

    chunks/<hex[:2]>/<hex>            a chunk, named by the hex SHA-256 of its bytes
    manifests/<version:012d>.msg      the signed CheckpointManifest exactly as received
    manifests/<version:012d>.json     sidecar: the decoded body (hashes in hex), so nothing re-decodes

Every write goes to a ``.tmp-*`` file in the target folder, is fsynced and renamed into place, so a crash
leaves either the old state or the new one plus a temp file, which the next open deletes. The sidecar is
written before the ``.msg``; a version exists once its ``.msg`` does. Chunks are re-hashed on every read:
a file that no longer hashes to its name is deleted, never served. Manifests enter last, once every chunk
they list is held ("publish data first, manifest last").

Left out: locking across processes (one writer per root; another process may open it ``read_only``, which
deletes and writes nothing), and re-verifying the ``.msg`` signature on read (peers verify every manifest they
receive; a reader of another's store verifies it again). Thread-safe within a process.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable
from pathlib import Path

from heterorl.protocol.storage.files import TMP_PREFIX, atomic_write
from heterorl.protocol.wire import checkpoint
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.messages import HASH_BYTES, decode

_HEX = frozenset("0123456789abcdef")


def _is_hex_name(name: str) -> bool:
    return len(name) == 2 * HASH_BYTES and set(name) <= _HEX


def _atomic_write(path: Path, data: bytes) -> None:
    """A chunk or manifest file, mode 0600 (the store's files are this peer's user's alone)."""
    atomic_write(path, data, mode=0o600, tmp_prefix=TMP_PREFIX)


def _sidecar(body: dict) -> dict:
    side = {
        "run_id": body["run_id"],
        "version": body["version"],
        "parent_version": body["parent_version"],
        "total_size": body["total_size"],
        "chunk_bytes": body["chunk_bytes"],
        "dtype": body["dtype"],
        "chunk_hashes": [h.hex() for h in body["chunk_hashes"]],
    }
    if "deltas" in body:
        side["deltas"] = [{**d, "chunk_hashes": [h.hex() for h in d["chunk_hashes"]]} for d in body["deltas"]]
    if "term" in body:  # a lineage writer's (protocol/net/lineage.py)
        side["term"] = body["term"]
    return side


def _hashes_of_hex(hexes: list[str]) -> list[bytes]:
    hashes = [bytes.fromhex(h) for h in hexes]
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError("sidecar hash of the wrong length")
    return hashes


def _body_of_sidecar(side: dict) -> dict:
    body = dict(side)
    body["chunk_hashes"] = _hashes_of_hex(side["chunk_hashes"])
    if "deltas" in side:
        body["deltas"] = [{**d, "chunk_hashes": _hashes_of_hex(d["chunk_hashes"])} for d in side["deltas"]]
    checkpoint.check_manifest(body)
    return body


class ChunkStore:
    """Chunks by SHA-256 and the manifests of complete versions under ``root``, capped near ``max_bytes``.

    ``max_bytes`` counts chunk and manifest files. The cap is enforced by :meth:`evict` (also run after
    each :meth:`add_manifest`, keeping ``keep_latest`` versions), which never drops the newest
    ``keep_latest`` versions, so the store can stay over the cap when those alone exceed it.
    """

    def __init__(self, root: Path | str, max_bytes: int, *, keep_latest: int = 2, read_only: bool = False):
        """``read_only``: look into a store another process writes (``heterorl export`` beside a running
        peer): its crash leftovers and corrupt chunks are skipped, not deleted, and the writing methods raise
        PermissionError; FileNotFoundError if there is no store at ``root``."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        if keep_latest < 1:
            raise ValueError("keep_latest must be >= 1")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.keep_latest = keep_latest
        self._chunks_dir = self.root / "chunks"
        self._manifests_dir = self.root / "manifests"
        self._lock = threading.Lock()
        self._sizes: dict[bytes, int] = {}  # chunk hash -> bytes on disk
        self._bodies: dict[int, dict] = {}  # version -> manifest body (from the sidecar)
        self._manifest_bytes: dict[int, int] = {}  # version -> .msg + .json bytes on disk
        self._evicted_bytes = 0
        self._corrupt_dropped = 0
        self.read_only = read_only
        if read_only and not (self._chunks_dir.is_dir() and self._manifests_dir.is_dir()):
            raise FileNotFoundError(f"no chunk store at {self.root}")
        if not read_only:
            self._chunks_dir.mkdir(parents=True, exist_ok=True)
            self._manifests_dir.mkdir(parents=True, exist_ok=True)
        self._scan()

    # --- opening -------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index what is on disk; delete temp files and half-written manifests left by a crash."""
        for sub in self._chunks_dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.startswith(TMP_PREFIX):
                    self._discard(f)
                elif _is_hex_name(f.name) and f.name[:2] == sub.name and f.is_file():
                    self._sizes[bytes.fromhex(f.name)] = f.stat().st_size
        for f in self._manifests_dir.iterdir():
            if f.name.startswith(TMP_PREFIX):
                self._discard(f)
        for f in sorted(self._manifests_dir.glob("*.json")):
            msg = f.with_suffix(".msg")
            try:
                version = int(f.stem)
                body = _body_of_sidecar(json.loads(f.read_text()))
                if body["version"] != version or not msg.is_file():
                    raise ValueError("sidecar without its manifest")
            except (ValueError, KeyError, TypeError, OSError):  # crash between the two writes, or damage
                self._discard(f)
                self._discard(msg)
                continue
            self._bodies[version] = body
            self._manifest_bytes[version] = f.stat().st_size + msg.stat().st_size
        for msg in self._manifests_dir.glob("*.msg"):
            if not msg.with_suffix(".json").exists():  # unusable without its body
                self._discard(msg)

    def _discard(self, path: Path) -> None:
        """Delete a crash leftover, unless this store is only read (its writer may be writing it now)."""
        if not self.read_only:
            path.unlink(missing_ok=True)

    def _check_writable(self) -> None:
        if self.read_only:
            raise PermissionError(f"the chunk store at {self.root} is open read-only")

    # --- chunks --------------------------------------------------------------------------------------

    def _chunk_path(self, h: bytes) -> Path:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"a chunk hash is {HASH_BYTES} bytes")
        x = h.hex()
        return self._chunks_dir / x[:2] / x

    def has(self, h: bytes) -> bool:
        """True iff a chunk file named ``h`` exists (its bytes are checked on :meth:`get`)."""
        return self._chunk_path(h).is_file()

    def get(self, h: bytes) -> bytes | None:
        """The chunk named ``h``, re-hashed; None if not held. A corrupt file is deleted and not served."""
        path = self._chunk_path(h)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if checkpoint.chunk_hash(data) == h:
            return data
        if self.read_only:  # not ours to delete
            return None
        with self._lock:  # re-check under the lock: a concurrent put may have just replaced the file
            try:
                if checkpoint.chunk_hash(path.read_bytes()) != h:
                    path.unlink()
                    self._sizes.pop(h, None)
                    self._corrupt_dropped += 1
            except FileNotFoundError:
                self._sizes.pop(h, None)
        return None

    def put(self, h: bytes, data: bytes) -> None:
        """Store chunk ``data`` under ``h``; ValueError unless sha256(data) == h. Idempotent."""
        self._check_writable()
        path = self._chunk_path(h)
        if checkpoint.chunk_hash(data) != h:
            raise ValueError(f"chunk {h.hex()[:16]}…: data does not hash to its name")
        with self._lock:
            try:
                if checkpoint.chunk_hash(path.read_bytes()) == h:
                    self._sizes[h] = len(data)
                    return
            except FileNotFoundError:
                pass
            path.parent.mkdir(exist_ok=True)
            _atomic_write(path, bytes(data))
            self._sizes[h] = len(data)

    def missing(self, body: dict) -> list[int]:
        """Indices of the chunks of manifest ``body`` (or a delta part) not held, ascending."""
        return [i for i, h in enumerate(body["chunk_hashes"]) if not self.has(h)]

    def held(self, body: dict) -> int:
        """Bytes of manifest ``body``'s checkpoint held here."""
        return sum(
            checkpoint.chunk_length(body, i) for i, h in enumerate(body["chunk_hashes"]) if self.has(h)
        )

    # --- manifests -----------------------------------------------------------------------------------

    def _manifest_path(self, version: int, suffix: str) -> Path:
        return self._manifests_dir / f"{version:012d}{suffix}"

    def add_manifest(self, raw: bytes, body: dict, protect: Iterable[bytes] = ()) -> None:
        """Store signed manifest ``raw`` (decoded, verified and checked by the caller as ``body``).

        ValueError unless every chunk it lists is held, ``raw`` decodes to ``body``, and the version is not
        already held with other bytes (storing the same manifest again is a no-op). Then evicts.
        """
        self._check_writable()
        checkpoint.check_manifest(body)
        try:
            _, decoded, _ = decode(raw, expected="CheckpointManifest")
        except ProtocolError as e:
            raise ValueError(f"manifest bytes refused: {e}") from e
        if decoded != body:
            raise ValueError("manifest bytes do not decode to the body given")
        version = body["version"]
        with self._lock:
            if version in self._bodies:
                if self._read_manifest(version) == bytes(raw):
                    return
                raise ValueError(f"version {version} is already held with a different manifest")
            lacking = [i for i, h in enumerate(body["chunk_hashes"]) if not self.has(h)]
            if lacking:
                raise ValueError(
                    f"version {version}: {len(lacking)} chunks not held (first {lacking[:5]}); "
                    "publish data first, manifest last"
                )
            side = json.dumps(_sidecar(body), sort_keys=True).encode()
            _atomic_write(self._manifest_path(version, ".json"), side)
            _atomic_write(self._manifest_path(version, ".msg"), bytes(raw))
            self._bodies[version] = _body_of_sidecar(_sidecar(body))
            self._manifest_bytes[version] = len(side) + len(raw)
            self._evict_locked(self.keep_latest, set(protect), sweep_orphans=False)

    def _read_manifest(self, version: int) -> bytes | None:
        try:
            return self._manifest_path(version, ".msg").read_bytes()
        except FileNotFoundError:
            return None

    def manifest(self, version: int) -> bytes | None:
        """The signed manifest of ``version`` as received, or None."""
        with self._lock:
            if version not in self._bodies:
                return None
            return self._read_manifest(version)

    def body(self, version: int) -> dict | None:
        """The manifest body of ``version`` (a copy), or None."""
        with self._lock:
            b = self._bodies.get(version)
            if b is None:
                return None
            out = {**b, "chunk_hashes": list(b["chunk_hashes"])}
            if "deltas" in b:
                out["deltas"] = [{**d, "chunk_hashes": list(d["chunk_hashes"])} for d in b["deltas"]]
            return out

    def has_version(self, version: int) -> bool:
        """Whether ``version``'s manifest is stored."""
        with self._lock:
            return version in self._bodies

    def versions(self) -> list[int]:
        """Versions with a stored manifest, ascending."""
        with self._lock:
            return sorted(self._bodies)

    def latest(self) -> int | None:
        """The newest stored version, or None."""
        with self._lock:
            return max(self._bodies, default=None)

    def assemble(self, version: int) -> bytes:
        """Checkpoint bytes of ``version``; KeyError without a manifest, ProtocolError for a lost chunk."""
        body = self.body(version)
        if body is None:
            raise KeyError(f"no manifest for version {version}")
        return self.assemble_part(body, f"version {version}")

    def assemble_part(self, part: dict, what: str = "checkpoint") -> bytes:
        """Bytes of the chunks ``part`` lists (a manifest body or its ``checkpoint.delta_part``), re-hashed;
        ProtocolError for a chunk missing or corrupt on disk."""
        chunks = []
        for i, h in enumerate(part["chunk_hashes"]):
            c = self.get(h)
            if c is None:
                raise ProtocolError(f"{what}: chunk {i} missing or corrupt on disk; fetch it again")
            chunks.append(c)
        return checkpoint.assemble(part, chunks)

    # --- size cap ------------------------------------------------------------------------------------

    def evict(self, keep_latest: int = 2, protect: Iterable[bytes] = ()) -> int:
        """Bring the store under ``max_bytes``; returns the bytes freed (0 when already under it).

        First deletes chunks no manifest references (except ``protect``: say, the chunks of a download
        in progress), then, while still over the cap, the oldest versions beyond the newest
        ``keep_latest`` and the chunks only they referenced.
        """
        self._check_writable()
        if keep_latest < 0:
            raise ValueError("keep_latest must be >= 0")
        with self._lock:
            return self._evict_locked(keep_latest, set(protect), sweep_orphans=True)

    def _evict_locked(self, keep_latest: int, protect: set[bytes], *, sweep_orphans: bool) -> int:
        """Eviction under the lock. Without ``sweep_orphans`` (after add_manifest) only chunks of dropped
        versions are deleted, so chunks put for a version not yet manifested survive without ``protect``."""
        freed = 0
        if self._total_locked() <= self.max_bytes:
            return 0
        referenced = {h for b in self._bodies.values() for h in checkpoint.referenced_hashes(b)}
        if sweep_orphans:
            freed += self._delete_chunks(set(self._sizes) - referenced - protect)
        old = sorted(self._bodies)[: max(0, len(self._bodies) - keep_latest)]
        for version in old:
            if self._total_locked() <= self.max_bytes:
                break
            body = self._bodies.pop(version)
            for suffix in (".msg", ".json"):
                self._manifest_path(version, suffix).unlink(missing_ok=True)
            freed += self._manifest_bytes.pop(version)
            still = {h for b in self._bodies.values() for h in checkpoint.referenced_hashes(b)}
            freed += self._delete_chunks(set(checkpoint.referenced_hashes(body)) - still - protect)
        self._evicted_bytes += freed
        return freed

    def _delete_chunks(self, hashes: set[bytes]) -> int:
        freed = 0
        for h in hashes:
            with contextlib.suppress(FileNotFoundError):
                self._chunk_path(h).unlink()
            freed += self._sizes.pop(h, 0)
        return freed

    def _total_locked(self) -> int:
        return sum(self._sizes.values()) + sum(self._manifest_bytes.values())

    def total_bytes(self) -> int:
        """Bytes of chunk and manifest files held."""
        with self._lock:
            return self._total_locked()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "chunks": len(self._sizes),
                "bytes": self._total_locked(),
                "versions": len(self._bodies),
                "evicted_bytes": self._evicted_bytes,
                "corrupt_dropped": self._corrupt_dropped,
            }
