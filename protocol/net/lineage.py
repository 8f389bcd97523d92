"""``/heterorl/lineage/2``: several learner peers, one lineage of versions, one writer per term.

A run's learner keys all train; one of them writes in a numbered term (who, and when: :mod:`~heterorl.peer.
learner.election`), the others are members. Every version is one step: each learner computes its gradient on
version v from its own batches and sends it (a Contribution naming each batch by id, sha256 and tokens); the
writer checks each part's bounds, clips it, weighs it by its tokens and adds it to the step's sum as it
arrives (:class:`~heterorl.peer.learner.combine.Accumulator`: one part in memory at a time), takes the AdamW
step on the combined gradient itself, and sends every member the same signed Commit with the **parameter
update** (the bytes each learner adds to its float32 weights: one IEEE addition, so replicas stay
bit-identical on any hardware, whatever optimiser kernel each runs) and the combined gradient (which members'
own optimiser moments take, so that any of them can write next). The writer alone signs checkpoints; a Commit
carries the manifests it signed since the last one, and each member checks that its own weights serialise to
exactly those chunks.

With ``[lineage] exchange = "sparse"`` (:class:`Exchange`) a part is a compressed frame of the member's own
AdamW step instead of a float32 gradient, and a Commit carries one compressed frame (the writer's combination,
compressed again) and an empty second frame; every member adds the same decoded values, so the same holds.

Why not hivemind's averager: its groups are not authenticated (any peer with the group key joins), its DHT
records are unsigned (our validator refuses them), and each peer adds (average - own) to its own copy, which
leaves replicas an ulp apart. What is ours here is a star gather and broadcast on hivemind's P2P streams.

Leave and join. A member that leaves (its stream ends, or it stops contributing) is left out of the next step.
A learner that joins at another version, or whose weights hash otherwise, gets a StateOffer: the writer's
weights and optimiser state at a step boundary, and the lineage's window of trained batches (id and sha256 of
each, from ``trained_from`` on), three hashed frames, loaded before it contributes (the joiner replays what it
trained that the lineage did not, and drops what the lineage trained). A member a few steps behind is sent the
commits it missed, in order (the writer keeps the last :data:`HISTORY`). A writer that stops writing (a higher
term, or it leaves) refuses every member and every joiner waiting for its state at once, with the reason.

Liveness. While a member's part waits for its commit, the writer sends a keepalive (a pending LineageWait)
every :data:`KEEPALIVE_S`; a member that hears nothing for :data:`WRITER_SILENT_S` calls the writer gone,
even when its connection never closed (a writer paused, or its link cut).

Trust, per stream: the first frame each way is a signed LineageHello naming the sender's libp2p peer id,
which the stream authenticates, so the Ed25519 key is bound to the connection; the key must be one of the
run's learner keys, the run id and the parameter schema the writer's. Every later frame is signed by that key,
for the term and version in progress, and a gradient is checked for size, hash, names, shapes, dtype and
finite values (:mod:`heterorl.protocol.wire.gradients`). A part that breaks the rules of
:func:`~heterorl.peer.learner.combine.part_refusal` (or that the writer's ``vet`` refuses: batches the lineage
trained, bytes or tokens other than the writer's own copy's) is left out of the step at once, the reply
saying why (``refused``: its learner drops those batches, never resent); a malformed or mis-signed frame is
refused (LineageRefuse, with the reason), logged and counted, and the stream closes.
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
from collections.abc import Callable

from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.gradients import Schema, decode_gradient, gradient_frame_cap, schema_sha256
from heterorl.protocol.wire.identity import Identity
from heterorl.protocol.wire.messages import (
    BATCH_ID_BYTES,
    HASH_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_TRAINED_IDS,
    decode,
    encode,
)
from heterorl.protocol.wire.sparse_gradient import DEFAULT_K, decode_part, flat_size, frame_size

log = logging.getLogger(__name__)

PROTOCOL = "/heterorl/lineage/2"
HELLO_MAX_BYTES = 4096
IDLE_S = 1.0  # a member with nothing to contribute hears a LineageWait after this, and contributes again
KEEPALIVE_S = 2.0  # while a member's part waits for its commit, the writer says so this often
WRITER_SILENT_S = 6.0  # a member that hears nothing from its writer this long calls it gone (< FRESH_S)
MEMBER_IDLE_S = 600.0  # a member's next contribution: a step of a real model on a slow learner is minutes
MANIFESTS_KEPT = 64  # the newest manifests the writer holds for members that have not had them
HISTORY = 1  # commits the writer keeps (with their frames) for a member that fell behind a step
STATE_TIMEOUT_S = 300.0  # a state offer: the writer's snapshot, then frames of the model's size
TRAINED_ENTRY_BYTES = BATCH_ID_BYTES + HASH_BYTES  # a trained batch in a StateOffer's window: id, sha256

NamedBatch = tuple[bytes, bytes, int]  # (batch id, sha256 of its signed bytes, tokens)


class LineageRefused(ProtocolError):
    """The other side refused this learner (the reason is the writer's, or ours)."""


class WriterGone(ConnectionError):
    """The writer closed the stream, or was silent for :data:`WRITER_SILENT_S`."""


@dataclasses.dataclass
class Part:
    """One learner's part of a step, as the writer took it."""

    learner: bytes
    version: int
    batches: list[NamedBatch]
    lr_scale: float

    @property
    def tokens(self) -> int:
        return sum(t for _, _, t in self.batches)

    @property
    def batch_ids(self) -> list[bytes]:
        return [b for b, _, _ in self.batches]


@dataclasses.dataclass
class Gathered:
    """A closed round: what the members put in it (their gradients already in the writer's accumulator)."""

    version: int
    parts: list[Part]  # accepted, in arrival order
    named: set[bytes]  # every batch id those parts name


@dataclasses.dataclass(frozen=True)
class Refused:
    """A part the writer left out for good: its learner drops these batches (never resent)."""

    batch_ids: list[bytes]
    reason: str


@dataclasses.dataclass
class _Round:
    version: int
    future: asyncio.Future  # (commit fields, update bytes, gradient bytes) once the writer commits
    parts: dict[bytes, Part] = dataclasses.field(default_factory=dict)
    contributed: set[bytes] = dataclasses.field(default_factory=set)  # members heard from in this round
    named: set[bytes] = dataclasses.field(default_factory=set)
    closing: bool = False
    busy: int = 0  # parts being added to the accumulator


def _hello(
    identity: Identity,
    run_id: str,
    peer_id: str,
    to: str,
    schema: Schema,
    version: int,
    state: bytes,
    term: int,
) -> bytes:
    body = {
        "run_id": run_id,
        "peer_id": peer_id,
        "to_peer_id": to,
        "schema": schema_sha256(schema),
        "version": version,
        "state": state,
        "term": term,
    }
    return encode("LineageHello", body, identity)


@dataclasses.dataclass(frozen=True)
class Offered:
    """A writer's state, as a joining learner received it (checked against the signed hashes)."""

    term: int
    version: int
    state: bytes
    weights: bytes
    optimizer: bytes
    trained: list[tuple[bytes, bytes]]  # (batch id, sha256) of every batch the lineage trained ...
    trained_from: int  # ... from this version on


@dataclasses.dataclass(frozen=True)
class StateForJoiner:
    """The writer's answer to a joiner (:meth:`LineageWriter.offer_state`)."""

    term: int
    version: int
    state: bytes
    weights: bytes
    optimizer: bytes
    trained: list[tuple[bytes, bytes]]
    trained_from: int


def pack_trained(trained: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(bytes(i) + bytes(h) for i, h in trained[:MAX_TRAINED_IDS])


def unpack_trained(data: bytes) -> list[tuple[bytes, bytes]]:
    if len(data) % TRAINED_ENTRY_BYTES:
        raise ProtocolError("the offer's trained batches are not a whole number of (id, sha256) entries")
    n = TRAINED_ENTRY_BYTES
    return [(data[i : i + BATCH_ID_BYTES], data[i + BATCH_ID_BYTES : i + n]) for i in range(0, len(data), n)]


@dataclasses.dataclass(frozen=True)
class Exchange:
    """How a part and a commit's update travel (the run's ``[lineage]``): float32 safetensors (dense, the
    commit with the combined gradient as a second frame), or compressed frames of ``k`` values in each chunk
    of 4 096 (sparse, :mod:`heterorl.protocol.wire.sparse_gradient`; the commit's second frame is empty)."""

    schema: Schema
    sparse: bool = False
    k: int = DEFAULT_K

    @property
    def cap(self) -> int:
        """The largest part or update frame: a sparse frame's exact size, a dense gradient's cap."""
        return frame_size(flat_size(self.schema), self.k) if self.sparse else gradient_frame_cap(self.schema)

    def decode(self, data: bytes, sha256: bytes) -> dict:
        """A part's or an update's tensors by name, every field checked (ProtocolError)."""
        if self.sparse:
            return decode_part(data, sha256, self.schema, self.k)
        return decode_gradient(data, sha256, self.schema)


Vet = Callable[[bytes, list[NamedBatch]], "str | None"]
Accumulate = Callable[[Part, dict], None]


class LineageWriter:
    """The writer's side: members connect, contribute, and hear each commit. Attach to the node with
    :meth:`attach`; the training thread drives the rounds with :meth:`wait_for_data`, :meth:`gather` and
    :meth:`commit`, answers joiners with :meth:`offer_state`, and hands over each published manifest with
    :meth:`add_manifest`.

    ``refusal(batches, lr_scale, has_gradient)``: a part's bounds (pure; the reason or None). ``vet(learner,
    batches)``: the learner's own judgement of the batches a part names (off the loop: it reads the ledger).
    ``accumulate(part, gradient)``: add an accepted part's gradient to the step's sum (off the loop)."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        learner_keys,
        schema: Schema,
        *,
        refusal: Callable[[list[NamedBatch], float, bool], str | None],
        vet: Vet,
        accumulate: Accumulate,
        exchange: Exchange | None = None,
    ):
        """Attached by every learner of a lineage; refuses members until :meth:`activate` (it writes).
        ``exchange``: how parts travel (default: dense)."""
        self.identity, self.run_id, self.schema = identity, run_id, schema
        self.refusal, self.vet, self.accumulate = refusal, vet, accumulate
        self.codec = exchange if exchange is not None else Exchange(schema)
        self.allowed = set(learner_keys) - {identity.public_key}
        self._cap = self.codec.cap
        self._node: Node | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self.active = False
        self.term = 0
        self._version, self._state = 0, b""  # the lineage's version and its state hash (the next parent)
        self._round: _Round | None = None
        self._history: collections.deque[tuple[int, tuple]] = collections.deque(maxlen=HISTORY)
        self._had: dict[bytes, int] = {}  # connected learner -> newest manifest version it has had
        self._members: set[bytes] = set()  # learners that contributed since they connected: waited for
        self._state_wanted: list[tuple[asyncio.Future, int]] = []  # joiners waiting, with their versions
        self._manifests: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=MANIFESTS_KEPT)
        self.refused: collections.Counter[str] = collections.Counter()
        self.parts_refused: collections.Counter[str] = collections.Counter()
        self.bytes_received = self.bytes_sent = 0

    async def attach(self, node: Node) -> None:
        self._node, self._loop = node, asyncio.get_running_loop()
        self._one_part = asyncio.Semaphore(1)
        await node.add_handler(PROTOCOL, self.handle)

    def activate(self, term: int, version: int, state: bytes) -> None:
        """This learner writes in ``term`` from ``version`` (whose weights hash to ``state``) on."""
        with self._cond:
            self.term, self._version, self._state, self.active = term, version, state, True
            self._history.clear()
            self._round = self._new_round()

    def deactivate(self, why: str) -> None:
        """This learner stops writing: members waiting for a commit and joiners waiting for its state hear
        why at once, and elect again."""
        with self._cond:
            self.active, rnd, self._round = False, self._round, None
            waiting, self._state_wanted = self._state_wanted, []
            self._members.clear()
            self._cond.notify_all()
        error = ProtocolError(f"this learner no longer writes the lineage: {why}")
        if rnd is not None:
            self._node.call_soon(_fail, rnd.future, error)
        for fut, _ in waiting:
            self._node.call_soon(_fail, fut, error)

    def state_wanted(self) -> bool:
        with self._cond:
            return bool(self._state_wanted)

    def offer_state(self, make: Callable[[int], StateForJoiner]) -> None:
        """The training thread's answer to :meth:`state_wanted`: ``make(joiner's version)`` is its state
        between two steps (and the window of trained batches) for each joiner waiting."""
        with self._cond:
            waiting, self._state_wanted = self._state_wanted, []
        for fut, since in waiting:
            self._node.call_soon(_resolve, fut, make(since))

    def _new_round(self) -> _Round:  # under the lock
        return _Round(self._version, self._loop.create_future())

    # ---- the training thread ----

    def members(self) -> list[bytes]:
        """Learners connected to this writer."""
        with self._cond:
            return sorted(self._had)

    def named(self) -> set[bytes]:
        """Batch ids the open round's parts name so far (the writer's own part leaves them out)."""
        with self._cond:
            return set(self._round.named) if self._round is not None else set()

    def wait_for_data(self, timeout: float) -> bool:
        """Whether a member's part with batches is in the round (waits up to ``timeout`` for one)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._round is not None and bool(self._round.parts), timeout)

    def gather(self, deadline_s: float) -> Gathered:
        """Close the round: wait until every connected member contributed (or ``deadline_s`` passed) and the
        parts taken are in the sum; a part arriving later hears this round's commit without it."""
        end = time.monotonic() + deadline_s
        with self._cond:
            if self._round is None:
                raise ProtocolError("this learner no longer writes the lineage")
            self._cond.wait_for(
                lambda: self._round is None or self._members <= self._round.contributed,
                max(0.0, end - time.monotonic()),
            )
            rnd = self._round
            if rnd is None:
                raise ProtocolError("this learner no longer writes the lineage")
            rnd.closing = True
            self._cond.wait_for(lambda: rnd.busy == 0)
            return Gathered(rnd.version, list(rnd.parts.values()), set(rnd.named))

    def commit(self, fields: dict, update: bytes, gradient: bytes) -> None:
        """Send commit ``fields`` and its two frames to every member waiting; the next round opens at its
        version."""
        with self._cond:
            done = self._round
            if done is None:
                raise ProtocolError("this learner no longer writes the lineage")
            self._history.append((done.version, (fields, update, gradient)))
            self._version, self._state = fields["version"], fields["state"]
            self._round = self._new_round()
            self._cond.notify_all()
        self._node.call_soon(_resolve, done.future, (fields, update, gradient))

    def reopen(self) -> None:
        """Undo :meth:`gather` when there was nothing to step on: the round takes parts again (its sum, empty
        or not, stays)."""
        with self._cond:
            if self._round is not None:
                self._round.closing = False

    def add_manifest(self, version: int, raw: bytes) -> None:
        """A version the writer published: every member gets its signed manifest with its next reply."""
        with self._cond:
            self._manifests.append((version, raw))

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {
                "lineage/members": len(self._had),
                "lineage/refused": sum(self.refused.values()),
                "lineage/parts_refused": sum(self.parts_refused.values()),
                "lineage/bytes_received": self.bytes_received,
                "lineage/bytes_sent": self.bytes_sent,
            }

    # ---- a member's stream (the node's loop) ----

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            member = await self._greet(remote, reader, writer)
        except (ProtocolError, FrameError, TimeoutError) as e:
            await self._refuse(writer, remote, str(e) or type(e).__name__)
            return
        try:
            await self._serve(member, reader, writer)
        except (ProtocolError, FrameError) as e:
            await self._refuse(writer, member.hex()[:16], str(e))
        except (ConnectionError, OSError) as e:
            log.info("learner %s's stream broke: %s", member.hex()[:16], e)
        finally:
            with self._cond:
                self._had.pop(member, None)
                self._members.discard(member)
                self._cond.notify_all()

    async def _greet(self, remote: str, reader, writer) -> bytes:
        frame = await read_frame(reader, HELLO_MAX_BYTES, 30.0)
        _, body, author = decode(frame, "LineageHello", run_id=self.run_id)
        if author not in self.allowed:
            raise ProtocolError(f"key {author.hex()[:16]} is not one of the run's learner keys")
        if body["peer_id"] != remote:
            raise ProtocolError("the hello names another peer id than the stream's")
        if body["to_peer_id"] != self._node.peer_id:
            raise ProtocolError("the hello is addressed to another peer")
        if body["schema"] != schema_sha256(self.schema):
            raise ProtocolError(
                "another model: its parameters' names, shapes or dtype differ from the writer's"
            )
        with self._cond:
            if not self.active:
                raise ProtocolError("this learner does not write the lineage")
            if body["term"] > self.term:
                raise ProtocolError(f"the learner knows term {body['term']}, this writer's is {self.term}")
            term, version, state = self.term, self._version, self._state
        offer: StateForJoiner | None = None
        if (body["version"], body["state"]) != (version, state):  # its state is not the lineage's: ours
            fut = self._loop.create_future()
            with self._cond:
                if not self.active:
                    raise ProtocolError("this learner does not write the lineage")
                self._state_wanted.append((fut, body["version"]))
            offer = await asyncio.wait_for(fut, STATE_TIMEOUT_S)
            term, version, state = offer.term, offer.version, offer.state
        hello = _hello(
            self.identity, self.run_id, self._node.peer_id, remote, self.schema, version, state, term
        )
        await write_frame(writer, hello)
        if offer is not None:
            trained = pack_trained(offer.trained)
            fields = {
                "run_id": self.run_id,
                "term": term,
                "version": version,
                "state": state,
                "weights_sha256": hashlib.sha256(offer.weights).digest(),
                "optimizer_sha256": hashlib.sha256(offer.optimizer).digest(),
                "trained_sha256": hashlib.sha256(trained).digest(),
                "trained_from": offer.trained_from,
            }
            await write_frame(writer, encode("StateOffer", fields, self.identity))
            for frame in (offer.weights, offer.optimizer, trained):
                await write_frame(writer, frame)
            self.bytes_sent += len(offer.weights) + len(offer.optimizer) + len(trained)
        with self._cond:
            self._had[author] = -1
        # then the manifests it has to check before it takes batches of those versions (version 0's at least)
        wait = {"version": version, "term": term, "pending": False}
        await write_frame(writer, self._message(author, "LineageWait", wait))
        log.info("learner %s joined the lineage at version %d%s", author.hex()[:16], version,
                 " (sent it this state)" if offer else "")  # fmt: skip
        return author

    async def _serve(self, member: bytes, reader, writer) -> None:
        while True:
            try:
                frame = await read_frame(reader, HELLO_MAX_BYTES * 256, MEMBER_IDLE_S)
            except EOFError:
                log.info("learner %s left the lineage", member.hex()[:16])
                return
            _, body, author = decode(frame, "Contribution", run_id=self.run_id)
            if author != member:
                raise ProtocolError("a contribution signed by another key than the stream's")
            if body["term"] != self.term:
                raise ProtocolError(f"a contribution for term {body['term']}, this writer's is {self.term}")
            batches = [(bytes(b["batch_id"]), bytes(b["sha256"]), b["tokens"]) for b in body["batches"]]
            data = await read_frame(reader, self._cap, MEMBER_IDLE_S) if body["grad_sha256"] else None
            if data is not None:
                self.bytes_received += len(data)
            part = Part(member, body["version"], batches, body["lr_scale"])
            with self._cond:
                self._members.add(member)  # waited for from its first contribution on
                self._cond.notify_all()
            reply = await self._enter(part, data, body["grad_sha256"])
            if reply is None or isinstance(reply, Refused):  # no round closed meanwhile, or left out for good
                wait = {"version": part.version, "term": self.term, "pending": False}
                if reply is not None:
                    wait["refused"] = {"batch_ids": reply.batch_ids, "reason": reply.reason[:256]}
                await write_frame(writer, self._message(member, "LineageWait", wait))
                continue
            if isinstance(reply, asyncio.Future):  # its part is in the round: keepalives until the commit
                reply = await self._await_commit(reply, member, part.version, writer)
            fields, update, gradient = reply
            await write_frame(writer, self._message(member, "Commit", fields))
            await write_frame(writer, update)
            await write_frame(writer, gradient)
            self.bytes_sent += len(update) + len(gradient)

    async def _await_commit(self, future: asyncio.Future, member: bytes, version: int, writer):
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(future), KEEPALIVE_S)
            except TimeoutError:
                wait = {"version": version, "term": self.term, "pending": True}
                await write_frame(writer, self._message(member, "LineageWait", wait))

    async def _enter(self, part: Part, data: bytes | None, grad_sha256: bytes):
        """Put ``part`` in its round. Returns the round's future (a part with batches: its commit follows),
        the commit at once (a part for a version the lineage has passed gets the one from that version,
        without the part: the member catches up step by step), :class:`Refused` (left out for good), or None
        (an empty part that waited :data:`IDLE_S` with no round closing)."""
        with self._cond:
            rnd = self._round
            if not self.active or rnd is None:
                raise ProtocolError("this learner no longer writes the lineage")
            if part.version != rnd.version:
                missed = next((c for v, c in self._history if v == part.version), None)
                if missed is None:
                    raise ProtocolError(
                        f"a contribution for version {part.version}, the lineage is at {rnd.version}"
                    )
                return missed
            rnd.contributed.add(part.learner)
            self._cond.notify_all()
        if not part.batches:
            if data is not None:
                raise ProtocolError("a gradient frame for a part naming no batches")
            try:
                return await asyncio.wait_for(asyncio.shield(rnd.future), IDLE_S)
            except TimeoutError:
                return rnd.future if rnd.future.done() else None
        reason = self.refusal(part.batches, part.lr_scale, data is not None)
        if reason is None:
            reason = await asyncio.to_thread(self.vet, part.learner, part.batches)
        with self._cond:
            if reason is None and rnd.named & set(part.batch_ids):
                reason = "it names a batch another part of this step names"
            if reason is not None:
                self.parts_refused[reason.split(":")[0][:60]] += 1
                log.warning("lineage: refused %s's part of %d batches: %s", part.learner.hex()[:16],
                            len(part.batches), reason)  # fmt: skip
                return Refused(part.batch_ids, reason)
            if rnd.closing:
                return rnd.future  # too late for this step: the commit comes without it
            rnd.busy += 1
            rnd.named.update(part.batch_ids)
        try:
            async with self._one_part:  # one member's gradient in memory at a time, whatever the members
                grads = await asyncio.to_thread(self.codec.decode, data, grad_sha256)
                await asyncio.to_thread(self.accumulate, part, grads)
                del grads
        except BaseException:
            with self._cond:
                rnd.named.difference_update(part.batch_ids)
                rnd.busy -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            rnd.parts[part.learner] = part
            rnd.busy -= 1
            self._cond.notify_all()
        return rnd.future

    def _message(self, member: bytes, kind: str, fields: dict) -> bytes:
        """``fields`` with the manifests ``member`` has not had, signed."""
        with self._cond:
            had = self._had.get(member, -1)
            new = [(v, raw) for v, raw in self._manifests if v > had]
            if new:
                self._had[member] = new[-1][0]
        return encode(
            kind, {**fields, "run_id": self.run_id, "manifests": [raw for _, raw in new]}, self.identity
        )

    async def _refuse(self, writer, who: str, reason: str) -> None:
        self.refused[reason.split(":")[0][:60]] += 1
        log.warning("lineage: refused %s: %s", who, reason)
        with contextlib.suppress(Exception):
            await write_frame(
                writer,
                encode("LineageRefuse", {"run_id": self.run_id, "reason": reason[:512]}, self.identity),
            )


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
        future.exception()  # retrieved: a round no member waited on is no error to log


@dataclasses.dataclass(frozen=True)
class Reply:
    """The writer's answer to a contribution: a Commit with its update and gradient frames (tensors,
    checked), or a LineageWait (``update`` and ``gradient`` None)."""

    kind: str
    body: dict
    update: dict | None = None
    gradient: dict | None = None


class LineageLink:
    """A member's link to the writer: :meth:`open` (the hellos), then :meth:`exchange` each step (a sync
    facade over the node's loop for the training thread)."""

    def __init__(
        self,
        node: Node,
        identity: Identity,
        run_id: str,
        writer_key: bytes,
        schema: Schema,
        exchange: Exchange | None = None,
    ):
        self.node, self.identity, self.run_id = node, identity, run_id
        self.writer_key, self.schema = writer_key, schema
        self.codec = exchange if exchange is not None else Exchange(schema)
        self._cap = gradient_frame_cap(schema)  # the offered weights' (float32, dense)
        self._stream = None
        self.term = 0
        self.manifests: list[bytes] = []
        self.bytes_sent = self.bytes_received = 0

    def open(
        self, peer_id: str, maddrs, version: int, state: bytes, term: int, timeout: float = STATE_TIMEOUT_S
    ) -> Offered | None:
        """The hellos with the writer at ``peer_id``; the writer's :class:`Offered` state when this learner's
        (``version``, weights hashing to ``state``) is not the lineage's, else None. ``term``: the highest
        this learner knows (a writer of a lower one is refused)."""
        return self.node.call(self._open(peer_id, maddrs, version, state, term), timeout=timeout)

    async def _open(self, peer_id: str, maddrs, version: int, state: bytes, term: int) -> Offered | None:
        reader, writer = await self.node.open_stream(peer_id, PROTOCOL, maddrs)
        try:
            return await self._hellos(reader, writer, peer_id, version, state, term)
        except BaseException:
            writer.close()
            raise

    async def _hellos(self, reader, writer, peer_id: str, version: int, state: bytes, term: int):
        me = self.node.peer_id
        await write_frame(
            writer, _hello(self.identity, self.run_id, me, peer_id, self.schema, version, state, term)
        )
        frame = await read_frame(reader, MAX_MESSAGE_BYTES, STATE_TIMEOUT_S)
        kind, body, author = decode(frame, run_id=self.run_id)
        self._check_writer(kind, body, author, "LineageHello")
        if body["peer_id"] != peer_id or body["to_peer_id"] != me:
            raise ProtocolError("the writer's hello names other peers than this stream's")
        if body["schema"] != schema_sha256(self.schema):
            raise ProtocolError("the writer's hello is for another model")
        if body["term"] < term:
            raise LineageRefused(
                f"the writer's term {body['term']} is below term {term}, which this learner knows"
            )
        self.term = body["term"]
        offered = None
        if (body["version"], body["state"]) != (version, state):
            frame = await read_frame(reader, MAX_MESSAGE_BYTES, STATE_TIMEOUT_S)
            kind, offer, author = decode(frame, run_id=self.run_id)
            self._check_writer(kind, offer, author, "StateOffer")
            weights = await read_frame(reader, self._cap, STATE_TIMEOUT_S)
            optimizer = await read_frame(reader, 2 * self._cap, STATE_TIMEOUT_S)
            trained = await read_frame(reader, MAX_TRAINED_IDS * TRAINED_ENTRY_BYTES, STATE_TIMEOUT_S)
            for name, data in (("weights", weights), ("optimizer", optimizer), ("trained", trained)):
                if hashlib.sha256(data).digest() != offer[f"{name}_sha256"]:
                    raise ProtocolError(f"the offered {name} do not hash to the signed {name}_sha256")
            offered = Offered(
                offer["term"], offer["version"], offer["state"], weights, optimizer, unpack_trained(trained),
                offer["trained_from"],
            )  # fmt: skip
            self.bytes_received += len(weights) + len(optimizer) + len(trained)
        frame = await read_frame(reader, MAX_MESSAGE_BYTES, 30.0)
        kind, body, author = decode(frame, run_id=self.run_id)
        self._check_writer(kind, body, author, "LineageWait")
        self.manifests = list(body["manifests"])  # published before this member joined: to check now
        self._stream = (reader, writer)
        return offered

    def _check_writer(self, kind: str, body: dict, author: bytes, expected: tuple | str) -> None:
        if kind == "LineageRefuse":
            raise LineageRefused(f"the writer refused: {body['reason']}")
        if author != self.writer_key:
            raise ProtocolError("a lineage message not signed by the writer")
        if kind not in ((expected,) if isinstance(expected, str) else expected):
            raise ProtocolError(f"expected {expected} from the writer, got {kind}")

    def exchange(self, contribution: bytes, gradient: bytes | None) -> Reply:
        """Send a signed Contribution (and its gradient frame); the writer's answer (keepalives skipped).
        :class:`WriterGone` when the stream ends or the writer is silent for :data:`WRITER_SILENT_S`."""
        return self.node.call(self._exchange(contribution, gradient))

    def send(self, contribution: bytes, gradient: bytes | None) -> concurrent.futures.Future:
        """:meth:`exchange` without waiting: the future of the writer's answer (cancel it to give it up)."""
        return self.node.spawn(self._exchange(contribution, gradient))

    async def _exchange(self, contribution: bytes, gradient: bytes | None) -> Reply:
        reader, writer = self._stream
        await write_frame(writer, contribution)
        if gradient is not None:
            await write_frame(writer, gradient)
            self.bytes_sent += len(gradient)
        manifests: list[bytes] = []  # signed manifests keepalives brought meanwhile
        while True:
            frame = await self._read(reader, MAX_MESSAGE_BYTES)
            kind, body, author = decode(frame, run_id=self.run_id)
            self._check_writer(kind, body, author, ("Commit", "LineageWait"))
            if body["term"] != self.term:
                raise ProtocolError(f"a message of term {body['term']} on a stream of term {self.term}")
            manifests += body["manifests"]
            body = {**body, "manifests": manifests}
            if kind == "LineageWait" and body["pending"]:
                continue  # a keepalive: the part waits in the round
            if kind == "LineageWait":
                return Reply(kind, body)
            sparse = self.codec.sparse
            update = await self._read(reader, self.codec.cap)
            grad = await self._read(reader, 0 if sparse else self.codec.cap)
            self.bytes_received += len(update) + len(grad)
            decoded = await asyncio.to_thread(self.codec.decode, update, body["update_sha256"])
            combined = None
            if not sparse:
                combined = await asyncio.to_thread(decode_gradient, grad, body["grad_sha256"], self.schema)
            return Reply(kind, body, decoded, combined)

    async def _read(self, reader, cap: int) -> bytes:
        try:
            return await read_frame(reader, cap, WRITER_SILENT_S)
        except EOFError:
            raise WriterGone("the writer closed the lineage stream") from None
        except FrameError as e:
            if e.kind in ("timeout", "truncated"):
                raise WriterGone(f"the writer went silent or its stream broke ({e})") from None
            raise

    def close(self) -> None:
        if self._stream is not None:
            self.node.call_soon(self._stream[1].close)
            self._stream = None
