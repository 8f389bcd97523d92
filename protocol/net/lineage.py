"""``/heterorl/lineage/1``: several learner peers, one lineage of versions, one writer per step.

A run's learner keys all train; the lowest key among them writes (:class:`LineageWriter`), the others are
members (:class:`LineageLink`). Every version is one step: each learner computes its gradient on version v
from its own batches and sends it (a Contribution); the writer weighs them by tokens, sums them in key order,
clips once, and sends every member the same gradient bytes with a signed Commit naming whose batches it holds.
Every learner then applies those bytes with the same optimiser step, so all hold the same weights at v+1
without the weights ever travelling. The writer alone signs checkpoints; a Commit carries the manifests it
signed since the last one, and each member checks that its own weights serialise to exactly those chunks.

Why not hivemind's averager: its groups are not authenticated (any peer with the group key joins), its DHT
records are unsigned (our validator refuses them), and each peer adds (average - own) to its own copy, which
leaves replicas an ulp apart. What is ours here is a star gather and broadcast on hivemind's P2P streams.

Leave and join. A member that leaves (its stream ends, or it stops contributing) is left out of the next
step; a writer that leaves is replaced by the lowest live key among the others (``find_lineage`` reads who
writes from the learners' heartbeats). A learner that joins at another version, or whose weights hash
otherwise, gets a StateOffer: the writer's weights and optimiser state at a step boundary, two hashed frames,
loaded before it contributes, with the ids of the batches the lineage trained since its version (its own
pending copies of them, which a sampler resent elsewhere when an Ack was lost, are dropped). A member a few
steps behind is sent the commits it missed, in order (the writer keeps the last :data:`HISTORY`).

Trust, per stream: the first frame each way is a signed LineageHello naming the sender's libp2p peer id,
which the stream authenticates, so the Ed25519 key is bound to the connection; the key must be one of the
run's learner keys, the run id and the parameter schema the writer's, the version the writer's. Every later
frame is signed by that key, for the version in progress, and a gradient is checked for size, hash, names,
shapes, dtype and finite values (:mod:`heterorl.protocol.wire.gradients`). A refusal is sent (LineageRefuse,
with the reason), logged and counted; the stream then closes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable

from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.net.trajectories import LearnerAddress
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.gradients import Schema, decode_gradient, gradient_frame_cap, schema_sha256
from heterorl.protocol.wire.identity import Identity
from heterorl.protocol.wire.messages import (
    BATCH_ID_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_TRAINED_IDS,
    decode,
    encode,
    unpack_stats,
)

log = logging.getLogger(__name__)

PROTOCOL = "/heterorl/lineage/1"
HELLO_MAX_BYTES = 4096
CONTRIBUTION_MAX_BYTES = 1 << 20  # a signed Contribution: up to 4096 batch ids
IDLE_S = 1.0  # a member with nothing to contribute hears LineageWait after this, and contributes again
STREAM_IDLE_S = 600.0  # a member's next frame, a commit: a step of a real model on a slow learner is minutes
MANIFESTS_KEPT = 8  # the newest manifests the writer holds for members that have not had them
HISTORY = 4  # commits the writer keeps (with their gradient bytes) for a member that fell behind
STATE_TIMEOUT_S = 300.0  # a state offer: the writer's snapshot, then two frames of the model's size
FRESH_S = 10.0  # a learner's heartbeat younger than this: it is live (heartbeats come every 2 s)


class LineageRefused(ProtocolError):
    """The other side refused this learner (the reason is the writer's, or ours)."""


@dataclasses.dataclass
class Contributed:
    """One learner's part of a step, as the writer holds it."""

    learner: bytes
    version: int
    batch_ids: list[bytes]
    tokens: int
    lr_scale: float
    grads: dict | None  # float32 tensors by parameter name; None with no tokens


@dataclasses.dataclass
class _Round:
    version: int
    future: asyncio.Future  # (commit fields, gradient bytes) once the writer commits
    parts: dict[bytes, Contributed] = dataclasses.field(default_factory=dict)
    closing: bool = False


def _hello(
    identity: Identity, run_id: str, peer_id: str, to: str, schema: Schema, version: int, state: bytes
) -> bytes:
    body = {
        "run_id": run_id,
        "peer_id": peer_id,
        "to_peer_id": to,
        "schema": schema_sha256(schema),
        "version": version,
        "state": state,
    }
    return encode("LineageHello", body, identity)


@dataclasses.dataclass(frozen=True)
class LiveLearner:
    """A learner of the run whose heartbeat is fresh, and whether it says it writes the lineage."""

    address: LearnerAddress
    writes: bool
    version: int


async def find_lineage(node: Node, run_id: str, learner_keys) -> list[LiveLearner]:
    """The run's learners with a heartbeat younger than :data:`FRESH_S`, lowest key first."""
    allowed, now = set(learner_keys), time.time()
    out = {}
    for r in await node.lookup(peers_key(run_id)):
        b = r.body
        if r.kind != "Heartbeat" or b["role"] != "learner" or r.author not in allowed:
            continue
        if now - b["timestamp"] > FRESH_S:
            continue
        stats = unpack_stats(b["stats"])
        address = LearnerAddress(r.author, b["peer_id"], tuple(b["maddrs"]))
        out[r.author] = LiveLearner(address, stats.get("lineage/writer", 0.0) == 1.0, b["policy_version"])
    return [out[k] for k in sorted(out)]


@dataclasses.dataclass(frozen=True)
class Offered:
    """A writer's state, as a joining learner received it (checked against the signed hashes)."""

    version: int
    state: bytes
    weights: bytes
    optimizer: bytes
    trained: list[bytes]  # ids of the batches the lineage trained after the joiner's version


class LineageWriter:
    """The writer's side: members connect, contribute, and hear each commit. Attach to the node with
    :meth:`attach`; the training thread drives the rounds with :meth:`wait_for_data`, :meth:`gather` and
    :meth:`commit`, and hands over each published manifest with :meth:`add_manifest`."""

    def __init__(self, identity: Identity, run_id: str, learner_keys, schema: Schema):
        """Attached by every learner of a lineage; refuses members until :meth:`activate` (it writes)."""
        self.identity, self.run_id, self.schema = identity, run_id, schema
        self.allowed = set(learner_keys) - {identity.public_key}
        self._cap = gradient_frame_cap(schema)
        self._node: Node | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self.active = False
        self._version, self._state = 0, b""  # the lineage's version and its state hash (the next parent)
        self._round: _Round | None = None
        self._history: collections.deque[tuple[int, tuple]] = collections.deque(maxlen=HISTORY)
        self._had: dict[bytes, int] = {}  # connected learner -> newest manifest version it has had
        self._members: set[bytes] = set()  # learners that contributed since they connected: waited for
        # joiners waiting for the writer's state, with the version each is at
        self._state_wanted: list[tuple[asyncio.Future, int]] = []
        self._manifests: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=MANIFESTS_KEPT)
        self.refused: collections.Counter[str] = collections.Counter()
        self.bytes_received = self.bytes_sent = 0

    async def attach(self, node: Node) -> None:
        self._node, self._loop = node, asyncio.get_running_loop()
        await node.add_handler(PROTOCOL, self.handle)

    def activate(self, version: int, state: bytes) -> None:
        """This learner writes from ``version`` (whose weights hash to ``state``) on."""
        with self._cond:
            self._version, self._state, self.active = version, state, True
            self._round = self._new_round()

    def deactivate(self) -> None:
        """This learner stops writing: members waiting for a commit hear why, and elect again."""
        with self._cond:
            self.active, rnd, self._round = False, self._round, None
            self._members.clear()
            self._cond.notify_all()
        if rnd is not None:
            self._node.call_soon(
                _fail, rnd.future, ProtocolError("this learner no longer writes the lineage")
            )

    def set_state(self, version: int, state: bytes) -> None:
        """The writer applied the step to ``version``: its weights now hash to ``state``."""
        with self._cond:
            self._version, self._state = version, state

    def state_wanted(self) -> bool:
        with self._cond:
            return bool(self._state_wanted)

    def offer_state(
        self,
        version: int,
        state: bytes,
        weights: bytes,
        optimizer: bytes,
        trained_since: Callable[[int, int], list[bytes]],
    ) -> None:
        """The training thread's answer to :meth:`state_wanted`: its state between two steps, and for each
        joiner the ids the lineage trained after its version (``trained_since(version, limit)``)."""
        with self._cond:
            waiting, self._state_wanted = self._state_wanted, []
        for fut, since in waiting:
            trained = b"".join(trained_since(since, MAX_TRAINED_IDS))
            self._node.call_soon(_resolve, fut, (version, state, weights, optimizer, trained))

    def _new_round(self) -> _Round:  # under the lock
        return _Round(self._version, self._loop.create_future())

    # ---- the training thread ----

    def members(self) -> list[bytes]:
        """Learners connected to this writer."""
        with self._cond:
            return sorted(self._had)

    def wait_for_data(self, timeout: float) -> bool:
        """Whether a member's contribution with tokens is in the round (waits up to ``timeout`` for one)."""
        with self._cond:
            return self._cond.wait_for(lambda: any(p.tokens for p in self._round.parts.values()), timeout)

    def gather(self, deadline_s: float) -> list[Contributed]:
        """Close the round: wait until every connected member contributed (or ``deadline_s`` passed) and
        return what they sent; a contribution arriving later hears this round's commit without its part."""
        end = time.monotonic() + deadline_s
        with self._cond:
            self._cond.wait_for(
                lambda: set(self._members) <= set(self._round.parts), max(0.0, end - time.monotonic())
            )
            self._round.closing = True
            return [self._round.parts[k] for k in sorted(self._round.parts)]

    def commit(self, fields: dict, gradient: bytes) -> None:
        """Send commit ``fields`` (its version, parent state, applied, tokens, lr_scale, grad_sha256,
        publish) and the ``gradient`` bytes to every member waiting; the next round opens at its version."""
        with self._cond:
            done = self._round
            self._history.append((done.version, (fields, gradient)))
            self._version = fields["version"]
            self._round = self._new_round()
            self._cond.notify_all()
        self._node.call_soon(_resolve, done.future, (fields, gradient))

    def reopen(self) -> None:
        """Undo :meth:`gather` when there turned out to be nothing to step on: the round takes parts again."""
        with self._cond:
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
                "lineage/bytes_received": self.bytes_received,
                "lineage/bytes_sent": self.bytes_sent,
            }

    # ---- a member's stream (the node's loop) ----

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            member = await self._greet(remote, reader, writer)
        except (ProtocolError, FrameError) as e:
            await self._refuse(writer, remote, str(e))
            return
        try:
            await self._serve(member, reader, writer)
        except (ProtocolError, FrameError) as e:
            await self._refuse(writer, member.hex()[:16], str(e))
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
            version, state = self._version, self._state
        offer = None
        if (body["version"], body["state"]) != (version, state):  # its state is not the lineage's: ours
            fut = self._loop.create_future()
            with self._cond:
                self._state_wanted.append((fut, body["version"]))
            offer = await asyncio.wait_for(fut, STATE_TIMEOUT_S)
            version, state = offer[:2]
        hello = _hello(self.identity, self.run_id, self._node.peer_id, remote, self.schema, version, state)
        await write_frame(writer, hello)
        if offer is not None:
            _, state, weights, optimizer, trained = offer
            fields = {
                "run_id": self.run_id,
                "version": version,
                "state": state,
                "weights_sha256": hashlib.sha256(weights).digest(),
                "optimizer_sha256": hashlib.sha256(optimizer).digest(),
                "trained": trained,
            }
            await write_frame(writer, encode("StateOffer", fields, self.identity))
            await write_frame(writer, weights)
            await write_frame(writer, optimizer)
            self.bytes_sent += len(weights) + len(optimizer)
        with self._cond:
            self._had[author] = -1
        # then the manifests it has to check before it takes batches of those versions (version 0's at least)
        await write_frame(writer, self._message(author, "LineageWait", {"version": version}))
        log.info(
            "learner %s joined the lineage at version %d%s",
            author.hex()[:16],
            version,
            " (sent it this state)" if offer else "",
        )
        return author

    async def _serve(self, member: bytes, reader, writer) -> None:
        while True:
            try:
                frame = await read_frame(reader, CONTRIBUTION_MAX_BYTES, STREAM_IDLE_S)
            except EOFError:
                log.info("learner %s left the lineage", member.hex()[:16])
                return
            _, body, author = decode(frame, "Contribution", run_id=self.run_id)
            if author != member:
                raise ProtocolError("a contribution signed by another key than the stream's")
            grads = None
            if body["tokens"]:
                data = await read_frame(reader, self._cap, STREAM_IDLE_S)
                grads = await asyncio.to_thread(decode_gradient, data, body["grad_sha256"], self.schema)
                self.bytes_received += len(data)
            part = Contributed(member, body["version"], list(body["batch_ids"]), body["tokens"],
                               body["lr_scale"], grads)  # fmt: skip
            with self._cond:
                self._members.add(member)  # waited for from its first contribution on
                self._cond.notify_all()
            reply = await self._enter(part)
            if reply is None:  # nothing to give and no round closed meanwhile
                await write_frame(writer, self._message(member, "LineageWait", {"version": part.version}))
                continue
            fields, gradient = reply
            await write_frame(writer, self._message(member, "Commit", fields))
            await write_frame(writer, gradient)
            self.bytes_sent += len(gradient)

    async def _enter(self, part: Contributed):
        """Put ``part`` in its round and wait for that round's commit (None: an empty part that waited
        :data:`IDLE_S` with no round closing, withdrawn). A part for a version the lineage has passed gets
        the commit from that version at once (without the part): the member catches up step by step."""
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
            if not rnd.closing:
                rnd.parts[part.learner] = part
                self._cond.notify_all()
        if part.tokens:
            return await rnd.future
        try:
            return await asyncio.wait_for(asyncio.shield(rnd.future), IDLE_S)
        except TimeoutError:
            with self._cond:
                if not rnd.closing:
                    rnd.parts.pop(part.learner, None)
                    return None
            return await rnd.future  # the round closed with this part in it: its commit follows

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


class LineageLink:
    """A member's link to the writer: :meth:`open` (the hellos), then :meth:`exchange` each step (a sync
    facade over the node's loop for the training thread)."""

    def __init__(self, node: Node, identity: Identity, run_id: str, writer_key: bytes, schema: Schema):
        self.node, self.identity, self.run_id = node, identity, run_id
        self.writer_key, self.schema = writer_key, schema
        self._cap = gradient_frame_cap(schema)
        self._stream = None
        self.manifests: list[bytes] = []
        self.bytes_sent = self.bytes_received = 0

    def open(self, peer_id: str, maddrs, version: int, state: bytes, timeout: float = STATE_TIMEOUT_S):
        """The hellos with the writer at ``peer_id``; the writer's :class:`Offered` state when this learner's
        (``version``, weights hashing to ``state``) is not the lineage's, else None."""
        return self.node.call(self._open(peer_id, maddrs, version, state), timeout=timeout)

    async def _open(self, peer_id: str, maddrs, version: int, state: bytes) -> Offered | None:
        reader, writer = await self.node.open_stream(peer_id, PROTOCOL, maddrs)
        me = self.node.peer_id
        await write_frame(
            writer, _hello(self.identity, self.run_id, me, peer_id, self.schema, version, state)
        )
        frame = await read_frame(reader, MAX_MESSAGE_BYTES, STATE_TIMEOUT_S)
        kind, body, author = decode(frame, run_id=self.run_id)
        self._check_writer(kind, body, author, "LineageHello")
        if body["peer_id"] != peer_id or body["to_peer_id"] != me:
            raise ProtocolError("the writer's hello names other peers than this stream's")
        if body["schema"] != schema_sha256(self.schema):
            raise ProtocolError("the writer's hello is for another model")
        offered = None
        if (body["version"], body["state"]) != (version, state):
            frame = await read_frame(reader, MAX_MESSAGE_BYTES, STATE_TIMEOUT_S)
            kind, offer, author = decode(frame, run_id=self.run_id)
            self._check_writer(kind, offer, author, "StateOffer")
            weights = await read_frame(reader, self._cap, STATE_TIMEOUT_S)
            optimizer = await read_frame(reader, 2 * self._cap, STATE_TIMEOUT_S)
            if hashlib.sha256(weights).digest() != offer["weights_sha256"]:
                raise ProtocolError("the offered weights do not hash to the signed weights_sha256")
            if hashlib.sha256(optimizer).digest() != offer["optimizer_sha256"]:
                raise ProtocolError(
                    "the offered optimiser state does not hash to the signed optimizer_sha256"
                )
            trained = offer["trained"]
            if len(trained) % BATCH_ID_BYTES:
                raise ProtocolError("the offer's trained batch ids are not a whole number of ids")
            ids = [trained[i : i + BATCH_ID_BYTES] for i in range(0, len(trained), BATCH_ID_BYTES)]
            offered = Offered(offer["version"], offer["state"], weights, optimizer, ids)
            self.bytes_received += len(weights) + len(optimizer)
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

    def exchange(self, contribution: bytes, gradient: bytes | None) -> tuple[str, dict, dict | None]:
        """Send a signed Contribution (and its gradient frame); the writer's answer: ("Commit", body,
        gradient tensors, checked) or ("LineageWait", body, None)."""
        return self.node.call(self._exchange(contribution, gradient))

    async def _exchange(self, contribution: bytes, gradient: bytes | None):
        reader, writer = self._stream
        await write_frame(writer, contribution)
        if gradient is not None:
            await write_frame(writer, gradient)
            self.bytes_sent += len(gradient)
        try:
            frame = await read_frame(reader, MAX_MESSAGE_BYTES, STREAM_IDLE_S)
        except EOFError:
            raise ConnectionError("the writer closed the lineage stream") from None
        kind, body, author = decode(frame, run_id=self.run_id)
        self._check_writer(kind, body, author, ("Commit", "LineageWait"))
        if kind == "LineageWait":
            return kind, body, None
        data = await read_frame(reader, self._cap, STREAM_IDLE_S)
        self.bytes_received += len(data)
        grads = await asyncio.to_thread(decode_gradient, data, body["grad_sha256"], self.schema)
        return kind, body, grads

    def close(self) -> None:
        if self._stream is not None:
            self.node.call_soon(self._stream[1].close)
            self._stream = None
