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
import logging
import threading
import time

from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.gradients import Schema, decode_gradient, gradient_frame_cap, schema_sha256
from heterorl.protocol.wire.identity import Identity
from heterorl.protocol.wire.messages import MAX_MESSAGE_BYTES, decode, encode

log = logging.getLogger(__name__)

PROTOCOL = "/heterorl/lineage/1"
HELLO_MAX_BYTES = 4096
CONTRIBUTION_MAX_BYTES = 1 << 20  # a signed Contribution: up to 4096 batch ids
IDLE_S = 1.0  # a member with nothing to contribute hears LineageWait after this, and contributes again
STREAM_IDLE_S = 600.0  # a member's next frame, a commit: a step of a real model on a slow learner is minutes
MANIFESTS_KEPT = 8  # the newest manifests the writer holds for members that have not had them


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
    identity: Identity, run_id: str, peer_id: str, to_peer_id: str, schema: Schema, version: int
) -> bytes:
    body = {
        "run_id": run_id,
        "peer_id": peer_id,
        "to_peer_id": to_peer_id,
        "schema": schema_sha256(schema),
        "version": version,
    }
    return encode("LineageHello", body, identity)


class LineageWriter:
    """The writer's side: members connect, contribute, and hear each commit. Attach to the node with
    :meth:`attach`; the training thread drives the rounds with :meth:`wait_for_data`, :meth:`gather` and
    :meth:`commit`, and hands over each published manifest with :meth:`add_manifest`."""

    def __init__(self, identity: Identity, run_id: str, learner_keys, schema: Schema, version: int):
        self.identity, self.run_id, self.schema = identity, run_id, schema
        self.allowed = set(learner_keys) - {identity.public_key}
        self._cap = gradient_frame_cap(schema)
        self._node: Node | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._version = version
        self._round: _Round | None = None
        self._last: tuple[int, tuple] | None = None  # (parent version, commit) for a member just behind
        self._members: dict[bytes, int] = {}  # connected member -> newest manifest version it has had
        self._manifests: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=MANIFESTS_KEPT)
        self.refused: collections.Counter[str] = collections.Counter()
        self.bytes_received = self.bytes_sent = 0

    async def attach(self, node: Node) -> None:
        self._node, self._loop = node, asyncio.get_running_loop()
        with self._cond:
            self._round = self._new_round()
        await node.add_handler(PROTOCOL, self.handle)

    def _new_round(self) -> _Round:  # under the lock
        return _Round(self._version, self._loop.create_future())

    # ---- the training thread ----

    def members(self) -> list[bytes]:
        with self._cond:
            return sorted(self._members)

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
            self._last = (done.version, (fields, gradient))
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
                "lineage/members": len(self._members),
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
                self._members.pop(member, None)
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
            version = self._version
        if body["version"] != version:
            raise ProtocolError(
                f"at version {body['version']}, the lineage at {version}: joining at another version "
                "(a state transfer) is not supported yet"
            )
        await write_frame(
            writer, _hello(self.identity, self.run_id, self._node.peer_id, remote, self.schema, version)
        )
        with self._cond:
            self._members[author] = -1
            self._cond.notify_all()
        # then the manifests it has to check before it takes batches of those versions (version 0's at least)
        await write_frame(writer, self._message(author, "LineageWait", {"version": version}))
        log.info("learner %s joined the lineage at version %d", author.hex()[:16], version)
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
        :data:`IDLE_S` with no round closing, withdrawn)."""
        with self._cond:
            if self._last is not None and part.version == self._last[0]:
                return self._last[1]  # the round closed before this arrived: its commit, without this part
            rnd = self._round
            if part.version != rnd.version:
                raise ProtocolError(
                    f"a contribution for version {part.version}, the lineage is at {rnd.version}"
                )
            if not rnd.closing:
                rnd.parts[part.learner] = part
                self._cond.notify_all()
        if part.tokens:
            return await rnd.future
        try:
            return await asyncio.wait_for(asyncio.shield(rnd.future), IDLE_S)
        except TimeoutError:
            with self._cond:
                if rnd.closing:
                    pass  # the round closed with this part in it: its commit follows
                else:
                    rnd.parts.pop(part.learner, None)
                    return None
            return await rnd.future

    def _message(self, member: bytes, kind: str, fields: dict) -> bytes:
        """``fields`` with the manifests ``member`` has not had, signed."""
        with self._cond:
            had = self._members.get(member, -1)
            new = [(v, raw) for v, raw in self._manifests if v > had]
            if new:
                self._members[member] = new[-1][0]
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

    def open(self, peer_id: str, maddrs, version: int, timeout: float = 30.0) -> None:
        self.node.call(self._open(peer_id, maddrs, version), timeout=timeout)

    async def _open(self, peer_id: str, maddrs, version: int) -> None:
        reader, writer = await self.node.open_stream(peer_id, PROTOCOL, maddrs)
        await write_frame(
            writer, _hello(self.identity, self.run_id, self.node.peer_id, peer_id, self.schema, version)
        )
        frame = await read_frame(reader, MAX_MESSAGE_BYTES, 30.0)
        kind, body, author = decode(frame, run_id=self.run_id)
        self._check_writer(kind, body, author, "LineageHello")
        if body["peer_id"] != peer_id or body["to_peer_id"] != self.node.peer_id:
            raise ProtocolError("the writer's hello names other peers than this stream's")
        if body["schema"] != schema_sha256(self.schema) or body["version"] != version:
            raise ProtocolError("the writer's hello is for another model or version")
        frame = await read_frame(reader, MAX_MESSAGE_BYTES, 30.0)
        kind, body, author = decode(frame, run_id=self.run_id)
        self._check_writer(kind, body, author, "LineageWait")
        self.manifests = list(body["manifests"])  # published before this member joined: to check now
        self._stream = (reader, writer)

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
