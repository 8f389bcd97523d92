"""A lineage member's check of each published version: its own weights against the writer's signed manifest.

A member keeps the weights of every version the writer said it publishes (:meth:`Adopter.keep`, a few at a
time). When the signed manifest of one arrives (:meth:`Adopter.adopt`), the member serialises its own weights
exactly as the publisher does and compares the chunk hashes. A match means this learner holds the published
bytes: its chunks and the writer's manifest go into its chunk store (its trust gate checks claims of that
version against them) and ``log`` records it (``lineage.jsonl``: a ``checked`` row with the manifest's
sha256). A mismatch is logged and counted, and recorded too.
A manifest of a version this learner has not reached yet (the writer went on while its state travelled to a
joiner) waits until the member keeps that version's weights.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Callable

from heterorl.protocol import decode
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import manifest_body, serialize_state_dict
from heterorl.protocol.wire.errors import ProtocolError

log = logging.getLogger(__name__)

KEPT = (
    2  # versions awaiting their manifest (the writer publishes one at a time, announced with the next reply)
)


class Adopter:
    def __init__(
        self,
        run_id: str,
        writer_key: bytes,
        store: ChunkStore,
        dtype: str,
        *,
        on_adopted: Callable[[int, dict], None] | None = None,
        log: Callable[[dict], None] | None = None,
        on_signed: Callable[[int, bytes], None] | None = None,
    ):
        """``on_adopted(version, weights)``: a version checked and stored; ``log(row)``: each check's row;
        ``on_signed(version, sha256)``: every manifest the writer signed, held here or not."""
        self.run_id, self.writer_key, self.store, self.dtype = run_id, writer_key, store, dtype
        self.on_adopted, self.log, self.on_signed = on_adopted, log, on_signed
        self._kept: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self._early: dict[int, bytes] = {}  # manifests of versions not reached yet (at most KEPT)
        self._reached = -1  # the version kept last
        self.published_version = -1
        self.agreed = self.mismatched = self.unchecked = 0

    def keep(self, version: int, snapshot) -> None:
        """The weights of ``version`` (a Snapshot), until its manifest comes."""
        self._kept[version] = snapshot.weights
        self._reached = version  # where this learner is (a rejoin may go back)
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)
        raw = self._early.pop(version, None)
        for old in [k for k in self._early if k < version]:  # versions this learner stepped past unkept
            self._early.pop(old)
            self.unchecked += 1
        if raw is not None:
            self.adopt(raw)

    def adopt(self, raw: bytes) -> bool | None:
        """Check a manifest the writer signed against this learner's weights of its version: True (agree:
        stored), False (disagree), None (not a version kept here: published before this learner had it; or
        not reached yet: kept for :meth:`keep`)."""
        try:
            _, body, author = decode(raw, "CheckpointManifest", run_id=self.run_id)
        except ProtocolError as e:
            raise ProtocolError(f"a manifest in the writer's reply: {e}") from None
        if author != self.writer_key:
            raise ProtocolError("a manifest in the writer's reply not signed by the writer")
        v = body["version"]
        if self.on_signed is not None:
            self.on_signed(v, hashlib.sha256(raw).digest())
        if v > self._reached:  # not reached yet: checked when its weights are kept
            self._early[v] = raw
            while len(self._early) > KEPT:
                self._early.pop(min(self._early))
                self.unchecked += 1
            return None
        weights = self._kept.pop(v, None)
        for old in [k for k in self._kept if k < v]:  # versions the writer skipped: never published
            del self._kept[old]
        if weights is None:
            self.unchecked += 1
            return None
        data = serialize_state_dict(weights)
        mine, chunks = manifest_body(self.run_id, v, body["parent_version"], data, body["dtype"])
        agree = all(mine[k] == body[k] for k in ("chunk_hashes", "total_size", "chunk_bytes"))
        if agree:
            for h, c in zip(mine["chunk_hashes"], chunks, strict=True):
                self.store.put(h, c)
            try:
                self.store.add_manifest(raw, body)
            except ValueError as e:  # this version held with another signature (this learner's, before)
                log.info("version %d: the writer's manifest not stored: %s", v, e)
            self.published_version = max(self.published_version, v)
            self.agreed += 1
            if self.on_adopted is not None:
                self.on_adopted(v, weights)
        else:
            self.mismatched += 1
            log.error(
                "version %d: this learner's weights do not serialise to the writer's signed manifest", v
            )
        if self.log is not None:
            self.log(
                {
                    "event": "checked",
                    "version": v,
                    "manifest": hashlib.sha256(raw).hexdigest(),
                    "agree": agree,
                }
            )
        return agree

    def stats(self) -> dict[str, float]:
        return {
            "lineage/versions_agreed": self.agreed,
            "lineage/versions_mismatched": self.mismatched,
            "lineage/versions_unchecked": self.unchecked,
        }
