"""Trajectory delivery: samplers stream signed TrajectoryBatches to learners, learners answer Ack or Reject.

Wire protocol ``/heterorl/trajectories/1`` on one long-lived stream: the sampler writes frames holding signed
TrajectoryBatch messages, up to ``WINDOW`` before it reads a reply, and the learner answers each with one
frame holding its signed Ack or Reject for that batch id, in the order the frames came. Delivery is
at-least-once from the sampler (its :class:`~.outbox.Outbox` keeps a batch on disk until acknowledged,
retrying with backoff) and exactly-once at the learner (its :class:`~.ledger.AcceptedLog` dedupes by batch id
and is written before the Ack goes out).

A Reject with ``retry_after_s > 0`` is flow control ("my buffer is full, come back later"): the sampler keeps
the batch and waits that long. A Reject with ``retry_after_s == 0`` is final (malformed, wrong run, bad
signature, rewards that do not recompute): the sampler drops the batch and logs the reason.

A run may list several learners: each sampler sends to one of them, chosen by rendezvous hashing of its key
(:func:`rendezvous_order`), so its record at that learner stays whole; it moves to the next in that order only
while a send to its first choice fails (``FAILOVER_S``), never because a learner is busy.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable

from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.outbox import Outbox
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.identity import Identity
from heterorl.protocol.wire.messages import BATCH_ID_BYTES, MAX_MESSAGE_BYTES, decode, encode

log = logging.getLogger(__name__)

PROTOCOL = "/heterorl/trajectories/1"
REPLY_MAX_BYTES = 4096
STREAM_IDLE_S = 300.0
DEFAULT_RETRY_AFTER_S = 2.0
LEARNER_REFRESH_S = 3.0
LATENCY_SAMPLES = 2048
# seconds a learner is passed over after a send to it failed: its samplers go to the next learner in
# rendezvous order, then back to it (a "busy" Reject moves no one: that learner is up, records stay whole)
FAILOVER_S = 10.0


@dataclasses.dataclass(frozen=True)
class Deferral:
    """An admission check's "not now": flow control, not a refusal (the sampler keeps the batch and retries
    after ``retry_after_s``), e.g. a rate limit on authors without a record."""

    reason: str
    retry_after_s: float


Admit = Callable[[dict, bytes], "str | Deferral | None"]
"""Learner-side check of a decoded batch body and its author: None to accept, the reason to refuse, or a
:class:`Deferral`."""


@dataclasses.dataclass(frozen=True)
class LearnerAddress:
    """Where a learner takes batches: its key (from the RunSpec's learner_keys), peer id and addresses."""

    key: bytes
    peer_id: str
    maddrs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class IntakeCounts:
    """A :class:`TrajectoryReceiver`'s counters at one moment, taken under its lock: every batch handled so
    far is in exactly one of accepted, duplicates, deferred and rejected (refusals by category: malformed,
    admit, frame); ``strikes`` are the refusals per author (hex key, or ``peer:ID`` before a key is known),
    so ``sum(rejected.values()) == sum(strikes.values())``. The dicts are copies."""

    accepted: int = 0
    duplicates: int = 0
    deferred: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    strikes: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_received: int = 0

    @property
    def refused(self) -> int:
        return sum(self.rejected.values())


DEFAULT_INTAKE_WORKERS = 2
# frames a sender writes on one stream before it reads their replies (and the receiver checks at once): the
# round trip of one batch (its ledger fsync at the learner, the network) is not paid once per batch
WINDOW = 4


class TrajectoryReceiver:
    """Learner side: validate, dedupe, log durably, then acknowledge.

    Every frame is checked in a bounded pool of ``workers`` threads, never on the node's event loop (a batch
    is up to 16 MiB of msgpack to decode, a signature to verify, and the learner's own checks): decode,
    signature, schema and run, dedupe against the ledger, flow control, then ``admit`` (the learner's
    checks, cheapest first), and only then the ledger write and ``on_accept``; the Ack goes out after all of
    them. ``on_accept(body, author, raw)`` hands an accepted batch to the training buffer; ``has_room()``
    says whether the buffer has room (flow control).
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        ledger: AcceptedLog,
        *,
        vocab_size: int | None = None,
        admit: Admit | None = None,
        on_accept: Callable[[dict, bytes, bytes], None] | None = None,
        has_room: Callable[[], bool] = lambda: True,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        workers: int = DEFAULT_INTAKE_WORKERS,
    ):
        self.identity, self.run_id, self.ledger = identity, run_id, ledger
        self.vocab_size, self.admit, self.on_accept, self.has_room = vocab_size, admit, on_accept, has_room
        self.retry_after_s, self.max_message_bytes = retry_after_s, max_message_bytes
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="intake")
        # the counters below are written from the pool's threads, only under this lock; read them all at once
        # with counts() (reading the attributes one by one sees a moment's counters torn)
        self._lock = threading.Lock()
        self.accepted = 0
        self.duplicates = 0
        self.deferred = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self.strikes: collections.Counter[str] = collections.Counter()  # refusals per author (hex key / peer)
        self.bytes_received = 0

    async def attach(self, node: Node) -> None:
        await node.add_handler(PROTOCOL, self.handle)

    def close(self) -> None:
        """Stop the intake pool (after the node closed: no handler hands it frames any more)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read frames off one stream and check them in the pool, up to ``WINDOW`` at a time (a sender may
        write that many before it reads a reply); the replies go back in the frames' order."""
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[asyncio.Future | None] = asyncio.Queue(maxsize=WINDOW)
        replier = asyncio.ensure_future(self._write_replies(replies, writer))
        try:
            while not replier.done():
                try:
                    frame = await read_frame(reader, self.max_message_bytes, STREAM_IDLE_S)
                except EOFError:
                    return
                except FrameError as e:
                    self._refuse(f"peer:{remote}", "frame", e)
                    if e.kind == "oversized":  # cannot resynchronise after an unread payload
                        done = loop.create_future()
                        done.set_result(self._reply(b"", f"refused: {e}", 0.0))
                        await replies.put(done)
                    return
                with self._lock:
                    self.bytes_received += len(frame)
                await replies.put(loop.run_in_executor(self._pool, self.process, remote, frame))
        finally:
            if not replier.done():
                await replies.put(None)  # the replies to what was read still go out
            await asyncio.gather(replier, return_exceptions=True)

    @staticmethod
    async def _write_replies(replies: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        while (pending := await replies.get()) is not None:
            await write_frame(writer, await pending)

    def process(self, remote: str, frame: bytes) -> bytes:
        """Every check of one frame, the ledger write and the hand-over; the signed reply (any thread)."""
        try:
            _, body, author = decode(frame, "TrajectoryBatch", run_id=self.run_id, vocab_size=self.vocab_size)
        except ProtocolError as e:
            self._refuse(f"peer:{remote}", "malformed", e)
            return self._reply(b"", f"refused: {e}", 0.0)
        batch_id = body["batch_id"]
        if self.ledger.seen(batch_id):
            self._count("duplicates")
            return self._reply(batch_id, None)
        if not self.has_room():
            self._count("deferred")
            return self._reply(batch_id, "buffer full", self.retry_after_s)
        if self.admit is not None:
            reason = self.admit(body, author)
            if isinstance(reason, Deferral):
                self._count("deferred")
                return self._reply(batch_id, reason.reason, max(0.1, reason.retry_after_s))
            if reason is not None:
                self._refuse(author.hex(), "admit", reason)
                return self._reply(batch_id, f"refused: {reason}", 0.0)
        if self.ledger.accept(batch_id, author, body["policy_version"], frame, time.time()):
            self._count("accepted")
            if self.on_accept is not None:
                self.on_accept(body, author, frame)
        else:
            self._count("duplicates")
        return self._reply(batch_id, None)

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def _refuse(self, who: str, category: str, reason: object) -> None:
        with self._lock:
            self.rejected[category] += 1
            self.strikes[who] += 1
            n = self.strikes[who]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th... of a sender: logs stay bounded under a flood
            log.warning("refused a trajectory batch from %s (refusal %d): %s", who[:16], n, reason)

    def _reply(self, batch_id: bytes, reason: str | None, retry_after_s: float = 0.0) -> bytes:
        if reason is None:
            return encode("Ack", {"run_id": self.run_id, "batch_id": batch_id}, self.identity)
        body = {
            "run_id": self.run_id,
            "batch_id": batch_id,
            "reason": reason[:512],
            "retry_after_s": retry_after_s,
        }
        return encode("Reject", body, self.identity)

    def counts(self) -> IntakeCounts:
        """Every counter at one moment (:class:`IntakeCounts`), copied under the lock the intake threads
        write them under: safe from any thread."""
        with self._lock:
            return IntakeCounts(
                accepted=self.accepted,
                duplicates=self.duplicates,
                deferred=self.deferred,
                rejected=dict(self.rejected),
                strikes=dict(self.strikes),
                bytes_received=self.bytes_received,
            )

    def stats(self) -> dict[str, float]:
        c = self.counts()
        return {
            "net/batches_accepted": c.accepted,
            "net/batches_duplicate": c.duplicates,
            "net/batches_deferred": c.deferred,
            "net/batches_rejected": c.refused,
            "net/bytes_received": c.bytes_received,
        }


async def find_learners(node: Node, run_id: str, learner_keys: Iterable[bytes]) -> list[LearnerAddress]:
    """Learners announce themselves with Heartbeat records (role "learner"); keep those the run allows."""
    allowed = set(learner_keys)
    return [
        LearnerAddress(r.author, r.body["peer_id"], tuple(r.body["maddrs"]))
        for r in await node.lookup(peers_key(run_id))
        if r.kind == "Heartbeat" and r.body["role"] == "learner" and r.author in allowed
    ]


def rendezvous_order(author: bytes, learners: list[LearnerAddress]) -> list[LearnerAddress]:
    """The learners in ``author``'s order of preference (highest-random-weight hashing): by
    ``sha256(b"heterorl-hrw" + author + key)``, highest first. A function of the author and the learners
    alone, not of their order; authors spread evenly, and a learner leaving moves only the authors it had."""

    def score(learner: LearnerAddress) -> tuple[bytes, str, tuple[str, ...]]:
        return (
            hashlib.sha256(b"heterorl-hrw" + author + learner.key).digest(),
            learner.peer_id,
            learner.maddrs,
        )

    return sorted(learners, key=score, reverse=True)


class TrajectorySender:
    """Sampler side: drain the outbox to the run's learners; retry, back off and obey flow control.

    Run :meth:`run` as a node-owned task (``node.spawn(sender.run())``); call :meth:`notify` after putting
    into the outbox to wake it. ``learners`` overrides the DHT lookup (tests). ``on_change()`` is called on
    the loop after each batch's outcome (Ack, Reject, a failed send, no learner to send to), so a sampler
    waiting for room in its outbox or for the learner's word wakes then (it must not block). ``author`` is the
    sampler's public key: it picks the learner (:func:`rendezvous_order`, failover in :meth:`_pick`).
    """

    def __init__(
        self,
        node: Node,
        outbox: Outbox,
        run_id: str,
        learner_keys: Iterable[bytes],
        *,
        learners: list[LearnerAddress] | None = None,
        request_timeout: float = 30.0,
        on_change: Callable[[], object] = lambda: None,
        author: bytes = b"",
    ):
        self.node, self.outbox, self.run_id, self.on_change = node, outbox, run_id, on_change
        self.author = author
        self.learner_keys = list(learner_keys)
        self._fixed = learners
        self.request_timeout = request_timeout
        self._wake = asyncio.Event()
        self._streams: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._learners: list[LearnerAddress] = []
        self._learners_at = 0.0
        self._failed_until: dict[bytes, float] = {}  # learner key -> monotonic time it is passed over until
        self.sent = 0
        self.acked = 0
        self.rejected = 0
        self.deferred = 0
        self.failures = 0
        self.bytes_sent = 0
        # round trip of the Ack, and outbox put → Ack (queueing and retries included; wall clock)
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)
        self.delivery_latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)
        self.state = "idle"
        self.busy_until = 0.0  # monotonic time until which the learner asked us to hold off ("busy")

    def learner_busy_for(self) -> float:
        """Seconds the learner last asked us to wait (0 once it acknowledged a batch or the time passed)."""
        return max(0.0, self.busy_until - time.monotonic())

    def notify(self) -> None:
        """Wake the sender (thread-safe); call after outbox.put."""
        self.node.call_soon(self._wake.set)

    async def run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before looking: a put (and notify) from now on is not missed
                wait = await asyncio.to_thread(self.outbox.next_due_in)
                if wait is not None and wait > 0 and await self._learners_changed():
                    continue
                if wait is None or wait > 0:
                    self.state = "idle" if wait is None else "waiting for retry"
                    timeout = 5.0 if wait is None else min(wait, LEARNER_REFRESH_S)
                    with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                    continue
                await self.send_due()
        finally:
            for _, w in self._streams.values():
                w.close()

    async def send_due(self) -> int:
        """Send every due outbox item once, up to ``WINDOW`` of them on a stream before reading their
        replies; returns how many were acknowledged."""
        items = await asyncio.to_thread(self.outbox.due, 16)
        acked = 0
        for start in range(0, len(items), WINDOW):
            window = items[start : start + WINDOW]
            learners = await self._current_learners()
            if not learners:
                self.state = "waiting for a learner"
                for item in window:
                    await asyncio.to_thread(self.outbox.retry, item.batch_id)
                self.on_change()
                continue
            learner = self._pick(learners)
            self.state = "sending"
            try:
                acked += await self._send_window(learner, window)
            finally:
                self.on_change()
        return acked

    def _pick(self, learners: list[LearnerAddress]) -> LearnerAddress:
        """The first learner in rendezvous order not passed over after a failed send (else the first)."""
        order = rendezvous_order(self.author, learners)
        now = time.monotonic()
        return next((lr for lr in order if self._failed_until.get(lr.key, 0.0) <= now), order[0])

    async def _send_window(self, learner: LearnerAddress, items: list) -> int:
        """Write every item's frame, then read their replies in order; what got no good reply is retried."""
        start = time.monotonic()
        answered = 0
        acked = 0
        try:
            reader, writer = await self._stream(learner)
            for item in items:
                await write_frame(writer, item.data)
            for item in items:
                reply = await read_frame(reader, REPLY_MAX_BYTES, self.request_timeout)
                kind, body, author = decode(reply, run_id=self.run_id)
                if author != learner.key or kind not in ("Ack", "Reject"):
                    raise ProtocolError("reply not an Ack or Reject signed by that learner")
                if body["batch_id"] not in (item.batch_id, b""):
                    raise ProtocolError("reply for another batch")
                answered += 1
                acked += await self._on_reply(item, kind, body, time.monotonic() - start)
        except Exception as e:  # learner gone, stream broken, garbage reply: keep the batches, back off
            self.failures += 1
            self._failed_until[learner.key] = time.monotonic() + FAILOVER_S
            self._drop_stream(learner)
            self._learners_at = 0.0  # look the learners up again
            for item in items[answered:]:
                delay = await asyncio.to_thread(self.outbox.retry, item.batch_id)
                log.info(
                    "batch %s not delivered (%s: %s); retry in %.1f s",
                    item.batch_id.hex()[:8],
                    type(e).__name__,
                    e,
                    delay,
                )
        return acked

    async def _on_reply(self, item, kind: str, body: dict, round_trip_s: float) -> int:
        """One batch's Ack or Reject acted on: acknowledged (1), or kept for later, or dropped for good."""
        self.sent += 1
        self.bytes_sent += len(item.data)
        if kind == "Ack":
            self.acked += 1
            self.busy_until = 0.0
            self.latencies.append(round_trip_s)
            self.delivery_latencies.append(max(0.0, time.time() - item.created_at))
            await asyncio.to_thread(self.outbox.ack, item.batch_id)
            return 1
        if body["retry_after_s"] > 0:
            self.deferred += 1
            self.state = "learner busy"
            self.busy_until = time.monotonic() + body["retry_after_s"]
            await asyncio.to_thread(self.outbox.retry, item.batch_id, retry_after_s=body["retry_after_s"])
            return 0
        self.rejected += 1
        log.warning("learner rejected batch %s: %s", item.batch_id.hex()[:8], body["reason"])
        await asyncio.to_thread(self.outbox.reject, item.batch_id, body["reason"])
        return 0

    async def _learners_changed(self) -> bool:
        """While backing off: look the learners up again; if one (re)appeared, make the queue due now."""
        if self._fixed is not None or time.monotonic() - self._learners_at < LEARNER_REFRESH_S:
            return False
        before = set(self._learners)
        now = await self._current_learners()
        if set(now) - before:
            n = await asyncio.to_thread(self.outbox.retry_all_now)
            log.info("a learner (re)appeared; retrying %d queued batch(es) now", n)
            return n > 0
        return False

    async def _current_learners(self) -> list[LearnerAddress]:
        if self._fixed is not None:
            return self._fixed
        if time.monotonic() - self._learners_at > LEARNER_REFRESH_S or not self._learners:
            try:
                self._learners = await find_learners(self.node, self.run_id, self.learner_keys)
            except Exception as e:
                log.info("learner lookup failed: %s", e)
            self._learners_at = time.monotonic()
        return self._learners

    async def _stream(self, learner: LearnerAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if learner.peer_id not in self._streams:
            self._streams[learner.peer_id] = await asyncio.wait_for(
                self.node.open_stream(learner.peer_id, PROTOCOL, learner.maddrs), self.request_timeout
            )
        return self._streams[learner.peer_id]

    def _drop_stream(self, learner: LearnerAddress) -> None:
        pair = self._streams.pop(learner.peer_id, None)
        if pair is not None:
            pair[1].close()

    def stats(self) -> dict[str, float]:
        return {
            "net/batches_sent": self.sent,
            "net/batches_acked": self.acked,
            "net/batches_rejected": self.rejected,
            "net/batches_deferred": self.deferred,
            "net/send_failures": self.failures,
            "net/bytes_sent": self.bytes_sent,
        }


def new_batch_id() -> bytes:
    import os

    return os.urandom(BATCH_ID_BYTES)
