"""The learner's publisher: every step of making a version public, on its own thread, off the training path.

The training thread hands over a :class:`~heterorl.peer.learner.trainer.Snapshot` (copies made between two
updates) and goes on training. The publisher thread then, in this order:

1. if the snapshot carries the learner's state (every ``learner.save_every_s`` seconds: a save of a real
   model is gigabytes), saves it (atomic, fsynced) and prunes the ledger up to that step, so a restart
   resumes from here. A restart from a save older than the newest published version goes on numbering
   after that version (:class:`~.learner.Learner`), so no version number is ever published twice;
2. serialises the weights (already rounded to the checkpoint dtype), cuts them into content-addressed chunks,
   and diffs them against up to ``learner.deltas`` earlier versions (sparse deltas), on the trainer's device
   for the versions it published itself (:func:`~heterorl.peer.learner.device_delta.device_delta`: the same
   bytes as the CPU codec, only the changed words leave the GPU);
3. signs the manifest, stores chunks and manifest in the chunk store (which serves them), and hands the
   manifest to the :class:`~.announcer.Announcer` (the DHT announce runs on the node's loop).

It holds one version at a time: :meth:`Publisher.offer` takes a snapshot only while the publisher is free, so
a learner that updates faster than it can publish skips versions and publishes the newest one next (samplers
want the newest anyway), and no snapshot is copied only to be dropped. While idle it retries an announce the
DHT refused, and announces the newest version again before its DHT records expire.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from heterorl.protocol import ProtocolError, encode
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import (
    add_delta,
    manifest_body,
    referenced_hashes,
    serialize_state_dict,
)
from heterorl.protocol.wire.delta import CODEC as DELTA_CODEC
from heterorl.protocol.wire.delta import encode_delta, file_order
from heterorl.protocol.wire.identity import Identity

from ..learner.device_delta import device_delta
from ..learner.trainer import Snapshot, Trainer
from .announcer import Announcer
from .priority import lower_thread_priority

log = logging.getLogger(__name__)

RETRY_ANNOUNCE_S = 5.0  # while idle, an announce the DHT refused is tried again this often
# while idle, the newest version is announced again this often: its provider record lives an hour in the
# DHT (protocol/net/dht.py MAX_TTL_S), and a newcomer to a run whose learner paused must still find it
REANNOUNCE_S = 1200.0
# a delta over this share of the full version is offered against the newest base only: older bases' deltas are
# larger still and save little, while diffing and compressing each costs CPU (every float32 word moves each
# update, e.g. the tiny model's 40 % deltas; bf16 roundings of a real model's update: 1-2 %)
MAX_OLDER_DELTA_SHARE = 0.25
PUBLISHER_NICE = 5  # the publisher thread's priority below the training thread's (Linux)


class Publisher:
    """Publishes snapshots of the learner's versions on the thread that runs :meth:`run`."""

    def __init__(
        self,
        *,
        run_id: str,
        identity: Identity,
        store: ChunkStore,
        ledger: AcceptedLog,
        announcer: Announcer,
        state_root: Path,
        checkpoint_dtype: str,
        deltas: int,
        save_every_s: float = 0.0,
        on_published: Callable[[int, dict], None] | None = None,
        may_sign: Callable[[int], str | None] | None = None,
        term: Callable[[], int | None] | None = None,
    ):
        """``save_every_s``: :meth:`save_due` asks for a snapshot with the state this often (0: always);
        ``on_published(version, weights)`` hears each version published (the spot checker keeps a few).
        Learner peers: ``may_sign(version)`` says why this learner may not sign ``version`` now (asked just
        before the signature and just after it: a version is signed once, by its lineage's writer, within its
        lease), ``term()`` the writer's term each manifest carries."""
        self.on_published, self.may_sign, self.term = on_published, may_sign, term
        self.refused_to_sign = 0
        self.run_id, self.identity, self.store, self.ledger = run_id, identity, store, ledger
        self.announcer, self.state_root = announcer, state_root
        self.checkpoint_dtype, self.deltas, self.save_every_s = checkpoint_dtype, deltas, save_every_s
        self._saved_at = -float("inf")  # monotonic time of the last state save (the first one is due at once)
        self.saved_version = -1
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._working = False
        self._closed = False
        # the last versions published here, as (version, sha256 of their bytes, their tensors on the trainer's
        # device): bases the next version's deltas are diffed against where the tensors are
        self._recent: collections.deque[tuple[int, bytes, dict]] = collections.deque(maxlen=max(1, deltas))
        self.published_version = -1  # the newest version in the store, signed (set before its announce)
        self._announced_at = 0.0  # monotonic time of its last announce
        self.published = 0
        # cumulative seconds: wall in save / build / announce, and this thread's CPU time over all three
        self.seconds: collections.Counter[str] = collections.Counter()
        self.delta_bytes = self.full_bytes = 0  # of the versions published with a delta

    # ---- the training thread's side ----

    def offer(self, make: Callable[[], Snapshot]) -> bool:
        """If the publisher is free: ``make()`` a snapshot (on the caller's thread, now) and publish it in
        the background; True. False while it is busy with an earlier version (offer again later)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the publisher is closed")
            if self._working or self._pending is not None:
                return False
            self._pending = make()
            self._cond.notify_all()
            return True

    def save_due(self) -> bool:
        """Whether the next snapshot should carry the learner's state to save."""
        return time.monotonic() - self._saved_at >= self.save_every_s

    def publish_now(self, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` on the caller's thread, once the background one is done (start and leave)."""
        with self._cond:
            self._cond.wait_for(self._idle)
            self._working = True
        self._publish_working(snapshot)

    def idle(self) -> bool:
        with self._cond:
            return self._idle()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or being published; False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout)

    def _idle(self) -> bool:  # under the lock
        return not self._working and self._pending is None

    def close(self) -> None:
        """End :meth:`run` once the version in hand is published (a pending one is still published)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- the publisher thread ----

    def run(self) -> None:
        """Publish what is offered until closed (the thread's body); an error here stops the learner."""
        lower_thread_priority(PUBLISHER_NICE)  # the training thread comes first for the CPU
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed, self._retry_in())
                snapshot, self._pending = self._pending, None
                if snapshot is None and self._closed:
                    return
                self._working = snapshot is not None
            if snapshot is None:
                self._refresh()
                continue
            self._publish_working(snapshot)

    def _publish_working(self, snapshot: Snapshot) -> None:
        """:meth:`_publish` while marked working; marked idle after it, whatever happened."""
        try:
            self._publish(snapshot)
        finally:
            with self._cond:
                self._working = False
                self._cond.notify_all()

    def _retry_in(self) -> float | None:
        if self.announcer.has_failed():
            return RETRY_ANNOUNCE_S
        if self.published_version < 0:
            return None
        return max(0.0, self._announced_at + REANNOUNCE_S - time.monotonic())

    def _refresh(self) -> None:
        """While idle: retry a refused announce, or announce the newest version again when it is due."""
        v = self.published_version
        if self.announcer.has_failed():
            self.announcer.retry_failed(v)
        elif v >= 0 and time.monotonic() - self._announced_at >= REANNOUNCE_S:
            raw, body = self.store.manifest(v), self.store.body(v)
            if raw is not None and body is not None:
                self.announcer.announce(raw, body)
            self._announced_at = time.monotonic()

    def _publish(self, snap: Snapshot) -> None:
        cpu, t0 = time.thread_time(), time.perf_counter()
        if snap.model_state is not None:
            Trainer.save(self.state_root, snap, {"run_id": self.run_id})
            self.ledger.prune_applied(snap.version)  # a restart resumes here: older payloads never replay
            self._saved_at, self.saved_version = time.monotonic(), snap.version
        if not snap.publish:  # a lineage member's save: it signs nothing
            self.seconds.update({"save": time.perf_counter() - t0, "cpu": time.thread_time() - cpu})
            return
        t1 = time.perf_counter()
        v = snap.version
        raw, body = self.store.manifest(v), self.store.body(v)
        data = serialize_state_dict(snap.weights)
        these = True  # whether the version published holds these very weights
        if raw is None or body is None:
            older = [x for x in self.store.versions() if x < v]
            parent = self.published_version if self.published_version >= 0 else max(older, default=-1)
            body, chunks = manifest_body(self.run_id, v, parent, data, self.checkpoint_dtype)
            term = self.term() if self.term is not None else None
            if term is not None:
                body["term"] = term
            if self.deltas:
                chunks += self._deltas(body, older, data, snap.weights)
            if self._refuses(v):
                return
            raw = encode("CheckpointManifest", body, self.identity)
            if self._refuses(v):  # it lost the right while signing (a pause): the signature never leaves
                return
            for h, c in zip(referenced_hashes(body), chunks, strict=True):
                self.store.put(h, c)
            self._recent.append((v, hashlib.sha256(data).digest(), snap.weights))
        elif manifest_body(self.run_id, v, body["parent_version"], data, self.checkpoint_dtype)[0][
            "chunk_hashes"
        ] == list(body["chunk_hashes"]):  # built before a restart from these very weights
            self._recent.append((v, hashlib.sha256(data).digest(), snap.weights))
        else:  # the version a restart found published, made from a later state than the one resumed from:
            these = False  # announced again as it is; not a base to diff on, nor what a check recomputes with
        t2 = time.perf_counter()
        self.store.add_manifest(raw, body)
        self.published_version = v
        if self.on_published is not None and these:  # else the checker reads the version from the store
            self.on_published(v, snap.weights)
        self.published += 1
        self.announcer.announce(raw, body)  # on the node's loop: the DHT round trips do not wait here
        self._announced_at = time.monotonic()
        t3 = time.perf_counter()
        self.seconds.update(
            {"save": t1 - t0, "build": t2 - t1, "announce": t3 - t2, "cpu": time.thread_time() - cpu}
        )

    def _refuses(self, version: int) -> bool:
        why = self.may_sign(version) if self.may_sign is not None else None
        if why is not None:
            self.refused_to_sign += 1
            log.warning("version %d not signed: %s", version, why)
        return why is not None

    def _deltas(self, body: dict, older: list[int], data: bytes, weights: dict) -> list[bytes]:
        """Offer version ``body`` also as sparse deltas against each of the ``deltas`` most recent ``older``
        published versions, so a peer up to that many versions behind still fetches one delta; returns their
        chunks. A base this publisher still holds is diffed on the tensors' device (the GPU of a GPU learner:
        only the changed words come to the CPU); another is read back from the store and diffed there. A
        base gone from the store is skipped; a delta that would not save half the bytes ends the list, and
        one over ``MAX_OLDER_DELTA_SHARE`` of them is the last."""
        newest_first = sorted(older, reverse=True)
        held = {v: (sha, tensors) for v, sha, tensors in self._recent}
        order = file_order(data)
        chunks: list[bytes] = []
        for base in newest_first[: self.deltas]:
            try:
                if base in held:
                    delta = device_delta(held[base][1], weights, held[base][0], order)
                else:
                    delta = encode_delta(self.store.assemble(base), data)
            except (KeyError, ProtocolError) as e:  # evicted, or another layout: no delta from it
                log.info("version %d: no delta against version %d: %s", body["version"], base, e)
                continue
            if len(delta) > len(data) // 2:
                break  # an older base differs more: its delta would be no smaller
            if base == newest_first[0]:
                self.delta_bytes += len(delta)
                self.full_bytes += len(data)
            chunks += add_delta(body, base, delta, DELTA_CODEC)
            if len(delta) > len(data) * MAX_OLDER_DELTA_SHARE:
                break  # deltas this large save little: older bases (larger still) are not worth the CPU
        return chunks

    def stats(self) -> dict[str, float]:
        """Cumulative figures for the learner's metrics rows."""
        return {
            **{f"publish_{k}_s": v for k, v in self.seconds.items()},
            "published_version": self.published_version,
            "published": self.published,
            "saved_version": self.saved_version,
            "refused_to_sign": self.refused_to_sign,
            "delta_ratio": self.delta_bytes / self.full_bytes if self.full_bytes else None,
        }
