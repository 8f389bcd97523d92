"""In-memory stand-ins for the network under the protocol services, for fast tests without processes.

- :func:`stream_pair`: two ends of one duplex byte stream, each an ``asyncio.StreamReader`` and a writer with
  ``asyncio.StreamWriter``'s methods (``write``, ``drain``, ``close``, ...). ``drain()`` applies the reader's
  real back-pressure (asyncio's pause/resume of a transport); closing either end closes the stream both
  ways, as closing a libp2p stream does: the other end reads what was sent, then EOF, and its writes fail.
- :class:`FakeDHT`: one shared record table with hivemind's store/get semantics for subkeyed records
  (per subkey, the later expiration wins; expired records vanish), run through the same
  :class:`~heterorl.protocol.net.dht.SignedRecordValidator` hivemind calls: the writer's validator signs,
  the storing replica's validates, the reader's validates again and strips. Its clock can be advanced.
- :class:`FakeNetwork` and :class:`FakeNode`: peers with the parts of
  :class:`~heterorl.protocol.net.node.Node` the services use (``publish``, ``lookup``, ``add_handler``,
  ``open_stream``, ``spawn``, ``addresses``, ``peer_id``), so a ``TrajectoryReceiver`` / ``TrajectorySender``
  pair, a ``ChunkServer`` and ``fetch_checkpoint`` run unchanged on one event loop.
  ``publish`` and ``lookup`` are Node's own code; ``publish_message`` repeats Node's steps with the fake's
  clock in place of hivemind's.

Not modelled: routing, replication, NAT, a daemon that dies, latency (add ``asyncio.sleep`` in a handler).
Everything runs on the calling event loop; nothing here is thread-safe (use it from one loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from heterorl.protocol.net.dht import MAX_TTL_S, SignedRecordValidator, record_key
from heterorl.protocol.net.node import Node, StreamHandler, serve_stream
from heterorl.protocol.wire.identity import Identity
from heterorl.protocol.wire.messages import decode

log = logging.getLogger(__name__)

STREAM_LIMIT = 1 << 16  # asyncio's default reader limit: back-pressure above twice this many unread bytes

# ---- duplex streams ----


class _Transport:
    """What a StreamReader pauses when its buffer fills: here, the other end's ``drain()``."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()

    def pause_reading(self) -> None:
        self.writable.clear()

    def resume_reading(self) -> None:
        self.writable.set()


class _Stream:
    """One duplex stream: two readers, a transport per direction, one closed flag for both ends."""

    def __init__(self, limit: int) -> None:
        self.readers = (asyncio.StreamReader(limit=limit), asyncio.StreamReader(limit=limit))
        self.transports = (_Transport(), _Transport())
        for reader, transport in zip(self.readers, self.transports, strict=True):
            reader.set_transport(transport)
        self.closed = asyncio.Event()
        self.bytes = [0, 0]  # written by end 0, by end 1

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for reader, transport in zip(self.readers, self.transports, strict=True):
            reader.feed_eof()
            transport.resume_reading()  # wake writers blocked in drain(): they raise


class FakeStreamWriter:
    """The write end of one side of a fake stream; the methods of ``asyncio.StreamWriter`` the code uses."""

    def __init__(self, stream: _Stream, end: int) -> None:
        self._stream, self._end = stream, end
        self._peer_reader = stream.readers[1 - end]
        self._transport = stream.transports[1 - end]

    @property
    def bytes_written(self) -> int:
        return self._stream.bytes[self._end]

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._stream.closed.is_set():
            return  # as a closed transport does: dropped; drain() raises
        data = bytes(data)
        self._stream.bytes[self._end] += len(data)
        self._peer_reader.feed_data(data)

    def writelines(self, data: list[bytes]) -> None:
        for d in data:
            self.write(d)

    async def drain(self) -> None:
        if not self._stream.closed.is_set():
            await self._transport.writable.wait()
        if self._stream.closed.is_set():
            raise ConnectionResetError("stream closed")

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        self._stream.close()

    def is_closing(self) -> bool:
        return self._stream.closed.is_set()

    async def wait_closed(self) -> None:
        await self._stream.closed.wait()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


Pair = tuple[asyncio.StreamReader, FakeStreamWriter]


def stream_pair(limit: int = STREAM_LIMIT) -> tuple[Pair, Pair]:
    """Two connected ends ``(reader, writer)``: what one end writes, the other end's reader reads.

    Call it inside a running event loop (asyncio's readers bind to it).
    """
    stream = _Stream(limit)
    return (
        (stream.readers[0], FakeStreamWriter(stream, 0)),
        (stream.readers[1], FakeStreamWriter(stream, 1)),
    )


# ---- DHT ----


@dataclasses.dataclass
class _Stored:
    value: bytes  # the signed value, as a replica keeps it
    expiration_time: float


class FakeDHT:
    """The swarm's record table, one replica for all. ``clock`` + :meth:`advance` is everyone's time.

    ``validator`` is the storing replica's (it signs nothing; ``validator.refused`` counts what it turned
    away, by reason); ``stores`` counts the records it kept.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._offset = 0.0
        self.validator = SignedRecordValidator(None, clock=self.now)
        self._table: dict[bytes, dict[bytes, _Stored]] = {}
        self.stores = 0

    def now(self) -> float:
        return self._clock() + self._offset

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for every record and validator of this DHT."""
        self._offset += seconds

    def node(self, identity: Identity | None) -> FakeDHTNode:
        return FakeDHTNode(self, SignedRecordValidator(identity, clock=self.now))

    def put_raw(self, key: str, subkey: bytes, value: bytes, expiration_time: float) -> None:
        """Store serialized ``subkey``/``value`` bytes unchecked: a hostile replica's table."""
        self._table.setdefault(DHTID.generate(source=key).to_bytes(), {})[subkey] = _Stored(
            value, expiration_time
        )

    def _store(self, record: DHTRecord) -> bool:
        """A replica's rpc_store: validate, then keep it unless the same subkey holds a later expiration."""
        if record.expiration_time < self.now() or not self.validator.validate(record):
            return False
        held = self._table.setdefault(record.key, {})
        old = held.get(record.subkey)
        if old is not None and old.expiration_time >= record.expiration_time:
            return False
        held[record.subkey] = _Stored(record.value, record.expiration_time)
        self.stores += 1
        return True

    def _records(self, key_bytes: bytes) -> list[DHTRecord]:
        now, held = self.now(), self._table.get(key_bytes, {})
        for subkey in [s for s, v in held.items() if v.expiration_time < now]:
            del held[subkey]
        return [DHTRecord(key_bytes, s, v.value, v.expiration_time) for s, v in held.items()]


class FakeDHTNode:
    """One peer's view of a :class:`FakeDHT`: ``store`` and ``get`` as ``hivemind.dht.DHTNode`` has them."""

    def __init__(self, dht: FakeDHT, validator: SignedRecordValidator) -> None:
        self.swarm, self.validator = dht, validator

    async def store(
        self, key: str, value: Any, expiration_time: float, subkey: Any = None, **kwargs: Any
    ) -> bool:
        await asyncio.sleep(0)  # a store is a network round trip: other tasks run meanwhile
        record = DHTRecord(
            DHTID.generate(source=key).to_bytes(),
            MSGPackSerializer.dumps(subkey),
            MSGPackSerializer.dumps(value),
            float(expiration_time),
        )
        record = dataclasses.replace(record, value=self.validator.sign_value(record))
        return self.swarm._store(record)

    async def get(self, key: str, latest: bool = False, **kwargs: Any) -> ValueWithExpiration | None:
        """Every live subkey under ``key``; None when there is none or, as hivemind's ``DHTProtocol`` does
        with a replica's reply, when any record fails this peer's validator (the whole reply is dropped)."""
        await asyncio.sleep(0)
        records = self.swarm._records(DHTID.generate(source=key).to_bytes())
        if not records or not all(self.validator.validate(r) for r in records):
            return None
        out = {
            MSGPackSerializer.loads(r.subkey): ValueWithExpiration(
                MSGPackSerializer.loads(self.validator.strip_value(r)), r.expiration_time
            )
            for r in records
        }
        return ValueWithExpiration(out, max(r.expiration_time for r in records))


# ---- peers ----


class FakeNetwork:
    """Peers reaching each other by peer id over :func:`stream_pair` streams, sharing a :class:`FakeDHT`."""

    def __init__(self, dht: FakeDHT | None = None) -> None:
        self.dht = dht or FakeDHT()
        self.nodes: dict[str, FakeNode] = {}
        self.streams_opened = 0

    def node(self, identity: Identity | None = None) -> FakeNode:
        node = FakeNode(self, identity or Identity.generate())
        self.nodes[node.peer_id] = node
        return node

    async def aclose(self) -> None:
        for node in list(self.nodes.values()):
            await node.aclose()


class FakeNode:
    """A peer on a :class:`FakeNetwork`: the surface of :class:`~heterorl.protocol.net.node.Node` that
    :mod:`~heterorl.protocol.net.trajectories` and :mod:`~heterorl.protocol.net.chunks` use."""

    publish = Node.publish
    lookup = Node.lookup

    def __init__(self, network: FakeNetwork, identity: Identity) -> None:
        self.network, self.identity = network, identity
        self.dht = network.dht.node(identity)
        self.validator = self.dht.validator
        self.peer_id = "12D3KooWFake" + identity.public_key.hex()[:24]
        self._handlers: dict[str, StreamHandler] = {}
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[FakeStreamWriter] = set()
        self.closed = False

    def _require_loop(self, what: str) -> None:
        """Node's guard for its core coroutines: here every coroutine runs on the one test loop."""
        asyncio.get_running_loop()

    def call_soon(self, callback: Any, *args: Any) -> None:
        """Node.call_soon: a plain callback on the (running, single) loop, e.g. TrajectorySender.notify()."""
        if not self.closed:
            asyncio.get_running_loop().call_soon(callback, *args)

    # ---- DHT records ----

    async def publish_message(self, message: bytes, ttl_s: float | None = None) -> bool:
        """Node.publish_message's steps, with the fake DHT's clock for the expiration."""
        kind, body, author = decode(message)
        if author != self.identity.public_key:
            raise ValueError("a node publishes only messages it signed itself")
        ttl = min(ttl_s or MAX_TTL_S[kind], MAX_TTL_S[kind])
        return bool(
            await self.dht.store(record_key(kind, body), message, self.network.dht.now() + ttl, subkey=author)
        )

    async def addresses(self) -> list[str]:
        return [f"/fake/{self.peer_id}"]

    def plain_maddrs(self) -> list[str]:
        return [f"/fake/{self.peer_id}"]

    @property
    def maddrs(self) -> list[str]:
        return [f"/fake/{self.peer_id}/p2p/{self.peer_id}"]

    def known_dht_peers(self) -> int:
        return sum(1 for p in self.network.nodes.values() if p is not self and not p.closed)

    def daemon_alive(self) -> bool:
        return not self.closed

    # ---- tasks and streams ----

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A background task owned by this node (cancelled at :meth:`aclose`)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        self._handlers[name] = handler

    async def open_stream(
        self, peer_id: str, name: str, maddrs: Any = ()
    ) -> tuple[asyncio.StreamReader, FakeStreamWriter]:
        """A stream to ``peer_id``'s handler for ``name``; ConnectionError when it is gone or lacks one."""
        if self.closed:
            raise ConnectionError("this node is closed")
        await asyncio.sleep(0)
        remote = self.network.nodes.get(peer_id)
        if remote is None or remote.closed:
            raise ConnectionError(f"peer {peer_id[-8:]} is not reachable")
        handler = remote._handlers.get(name)
        if handler is None:
            raise ConnectionError(f"peer {peer_id[-8:]} does not serve {name}")
        (reader, writer), (their_reader, their_writer) = stream_pair()
        self.network.streams_opened += 1
        self._writers.add(writer)
        remote._writers.add(their_writer)
        remote.spawn(remote._serve(name, handler, self.peer_id, their_reader, their_writer))
        return reader, writer

    async def _serve(
        self,
        name: str,
        handler: StreamHandler,
        remote: str,
        reader: asyncio.StreamReader,
        writer: FakeStreamWriter,
    ) -> None:
        """What Node.add_handler wraps around a handler (:func:`serve_stream`), the writer then forgotten."""
        try:
            await serve_stream(name, handler, remote, reader, writer)
        finally:
            self._writers.discard(writer)

    async def aclose(self) -> None:
        """Leave: streams closed (both ends see it), tasks cancelled; its DHT records stay to expire."""
        self.closed = True
        for w in list(self._writers):
            w.close()
        self._writers.clear()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
