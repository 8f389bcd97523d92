"""Which signed manifest names which version: the index a batch's ``manifest_sha256`` is looked up in (a batch
names the exact weights it was sampled on).

Two sources: the learner's chunk store (the versions it holds, read from the store's own files on a miss, so
it never disagrees with the store; its eviction takes versions out too), and manifests its lineage's writer
signed that it does not hold (:meth:`ManifestIndex.note`: published while it was away): their batches are
the lineage's, though this learner cannot recompute them.
"""

from __future__ import annotations

import collections
import hashlib
import threading

NOTED_KEPT = 1024  # manifests signed by the writer and not held here


class ManifestIndex:
    """sha256 of a stored manifest's signed bytes <-> its version (``store``: a ChunkStore)."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._by_hash: dict[bytes, int] = {}
        self._by_version: dict[int, bytes] = {}
        self._noted: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # not held: signed only

    def note(self, version: int, sha256: bytes) -> None:
        """A manifest of ``version`` the lineage's writer signed, which this learner does not hold."""
        with self._lock:
            self._noted[bytes(sha256)] = version
            while len(self._noted) > NOTED_KEPT:
                self._noted.popitem(last=False)

    def _refresh(self) -> None:  # under the lock
        held = set(self.store.versions())
        for v in [v for v in self._by_version if v not in held]:
            self._by_hash.pop(self._by_version.pop(v), None)
        for v in held - set(self._by_version):
            raw = self.store.manifest(v)
            if raw is not None:
                h = hashlib.sha256(raw).digest()
                self._by_version[v], self._by_hash[h] = h, v

    def version_of(self, sha256: bytes) -> int | None:
        """The version whose stored manifest hashes to ``sha256``, or None."""
        with self._lock:
            if bytes(sha256) not in self._by_hash:
                self._refresh()
            return self._by_hash.get(bytes(sha256), self._noted.get(bytes(sha256)))

    def hash_of(self, version: int) -> bytes | None:
        """The sha256 of the stored manifest of ``version``, or None."""
        with self._lock:
            if version not in self._by_version:
                self._refresh()
            return self._by_version.get(version)
