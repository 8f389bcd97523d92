"""A peer's presence on the network: one go-libp2p daemon, one hivemind DHT node, our stream handlers.

Everything network-side runs on a private asyncio loop in a background thread, so that a peer's main
thread can spend seconds in torch (generation, a learner step) while its DHT node keeps answering and its
chunk server keeps serving. A :class:`Node` has two halves:

- the async core: coroutines (:meth:`Node.publish`, :meth:`Node.lookup`, :meth:`Node.open_stream`, ...) that
  run on the node's loop only (they refuse any other loop). Services await them from their handlers;
- a thin synchronous facade for other threads: :meth:`Node.call` (run a coroutine there and wait),
  :meth:`Node.spawn` (a background task the node owns and cancels at :meth:`Node.close`),
  :meth:`Node.call_soon` (a plain callback there, e.g. to set an event) and reads that never block
  (:attr:`Node.maddrs`, cached at start). The blocking entries (``call``, ``close``) raise RuntimeError when
  called from the loop's own thread, where they would wait for themselves forever.

Layering: hivemind P2P streams → :mod:`protocol.net.framing` → typed services
(:mod:`protocol.net.chunks`, :mod:`protocol.net.trajectories`) → peer logic in ``heterorl.peer``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from heterorl.protocol.net.config import NetConfig, sweep_stale_sockets
from heterorl.protocol.net.dht import MAX_TTL_S, SignedRecordValidator, record_key
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.identity import Identity
from heterorl.protocol.wire.messages import decode, encode

log = logging.getLogger(__name__)

StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class DaemonDied(RuntimeError):
    """The go-libp2p daemon under a Node exited: the node is useless and the peer should restart."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One verified DHT record: its author's key, the message kind and body, and the raw signed message."""

    author: bytes
    kind: str
    body: dict
    raw: bytes
    expiration_time: float


async def serve_stream(
    name: str, handler: StreamHandler, remote: str, reader: asyncio.StreamReader, writer: Any
) -> None:
    """Run a protocol handler on one incoming stream: a peer hanging up is quiet, a refused stream is logged
    (INFO: peers send garbage), a failing handler is logged with its traceback; the stream is closed after."""
    try:
        await handler(remote, reader, writer)
    except (EOFError, ConnectionError, asyncio.IncompleteReadError):
        pass
    except ProtocolError as e:
        log.info("%s: stream from %s refused: %s", name, remote[-8:], e)
    except Exception:
        log.exception("%s: handler failed on a stream from %s", name, remote[-8:])
    finally:
        writer.close()


class Node:
    """Create with :meth:`Node.start`; close with :meth:`Node.close` (idempotent).

    Coroutine methods are the async core: await them on the node's loop (from a handler, a spawned task, or
    a coroutine given to :meth:`call`). Plain methods are the facade: safe from any thread, and those that
    wait for the loop refuse its own thread.
    """

    def __init__(self, identity: Identity, config: NetConfig):
        self.identity = identity
        self.config = config
        self.validator = SignedRecordValidator(identity)
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_exception)
        self._thread = threading.Thread(target=self._run_loop, name="heterorl-net", daemon=True)
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.p2p: Any = None
        self.dht: Any = None
        self.peer_id = ""
        self._visible: tuple[str, ...] = ()  # the daemon's visible multiaddrs (with /p2p/<our id>), cached

    def _on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """hivemind's daemon-control tasks fail with a reset connection as the daemon stops, or with an
        incomplete read when the daemon hands over a stream that its remote peer closed before the stream's
        header came (a peer that left mid-connect): no error either way."""
        benign = (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError)
        if isinstance(context.get("exception"), benign):
            log.debug("network loop: %s (%s)", context.get("message"), context.get("exception"))
            return
        loop.default_exception_handler(context)

    @classmethod
    def start(cls, identity: Identity, config: NetConfig | None = None) -> Node:
        """Start the daemon and join the DHT; raises RuntimeError saying what failed."""
        removed = sweep_stale_sockets()
        if removed:
            log.info("removed %d stale libp2p daemon socket(s) left by killed peers", removed)
        self = cls(identity, config or NetConfig())
        self._thread.start()
        try:
            self.call(self._astart(), timeout=self.config.startup_timeout * 2 + 30)
        except BaseException:
            self.close()
            raise
        return self

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _astart(self) -> None:
        from hivemind.dht.node import DHTNode
        from hivemind.p2p import P2P

        c = self.config
        try:
            self.p2p = await P2P.create(
                initial_peers=list(c.bootstrap) or None,
                host_maddrs=list(c.host_maddrs),
                announce_maddrs=list(c.announce_maddrs) or None,
                dht_mode="client" if c.client_mode else "server",
                use_relay=c.use_relay,
                use_auto_relay=c.use_auto_relay,
                startup_timeout=c.startup_timeout,
                identity_path=c.identity_path,
            )
        except Exception as e:
            raise RuntimeError(f"the libp2p daemon did not start: {e}") from e
        try:
            self.dht = await DHTNode.create(
                p2p=self.p2p,
                initial_peers=list(c.bootstrap) or None,
                client_mode=c.client_mode,
                record_validator=self.validator,
                ensure_bootstrap_success=True,
            )
        except Exception as e:
            await self.p2p.shutdown()
            failed = ", ".join(c.bootstrap) or "-"
            raise RuntimeError(f"could not join the DHT through {failed}: {e}") from e
        self.peer_id = self.p2p.peer_id.to_base58()
        try:
            await self.refresh_addresses()
        except Exception as e:  # asked again on first use (addresses())
            log.warning("our own addresses are not known yet: %s", e)

    # ---- the synchronous facade (any thread; the blocking parts refuse the loop's own thread) ----

    def on_loop_thread(self) -> bool:
        """True when running on the node's own loop thread (where the blocking facade must not be used)."""
        return threading.get_ident() == self._thread.ident

    def _refuse_loop_thread(self, what: str) -> None:
        if self.on_loop_thread():
            raise RuntimeError(
                f"Node.{what}() waits for the network loop and was called from that loop's own thread, "
                "where it would wait for itself forever: await the coroutine instead"
            )

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the network loop and return its result (from any thread but the loop's own)."""
        try:
            if self._closed:
                raise RuntimeError("node is closed")
            self._refuse_loop_thread("call")
        except RuntimeError:
            coro.close()  # never to run: no "coroutine was never awaited" warning either
            raise
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"network call did not finish in {timeout} s") from None

    def spawn(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run ``coro`` as a background task owned by this node (cancelled at close); any thread, no wait.

        RuntimeError once the node is closed (the task would never run)."""
        if self._closed:
            coro.close()
            raise RuntimeError("node is closed")

        async def owned() -> Any:
            task = asyncio.current_task()
            self._tasks.add(task)
            try:
                return await coro
            finally:
                self._tasks.discard(task)

        return asyncio.run_coroutine_threadsafe(owned(), self._loop)

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Run the plain function ``callback(*args)`` on the network loop soon (any thread, no wait): e.g.
        ``node.call_soon(event.set)`` to wake a task waiting on an ``asyncio.Event``. Once the node is
        closed nothing runs on its loop any more, and the callback is dropped."""
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(callback, *args)

    @property
    def maddrs(self) -> list[str]:
        """Addresses other peers can use to reach (and bootstrap through) this node, ``/p2p/<id>`` included.

        Learned once at start and cached (:meth:`refresh_addresses` asks the daemon again): never blocks.
        """
        return [a if "/p2p/" in a else f"{a}/p2p/{self.peer_id}" for a in self._visible]

    def plain_maddrs(self) -> list[str]:
        """Listening addresses without the /p2p suffix (what goes into Heartbeat and Provider records);
        cached like :attr:`maddrs`, never blocks."""
        return [a.split("/p2p/")[0] for a in self._visible]

    def check_daemon(self) -> None:
        """Raise :class:`DaemonDied` once the go-libp2p daemon has exited."""
        if not self.daemon_alive():
            raise DaemonDied("the libp2p daemon died; exiting so that a supervisor restarts this peer")

    def daemon_alive(self) -> bool:
        """False once the go-libp2p daemon process has exited (the node is then useless: restart the peer)."""
        # hivemind keeps the daemon's process private; its public is_alive says only whether we stopped it
        child = getattr(self.p2p, "_child", None)
        return child is None or child.returncode is None

    def known_dht_peers(self) -> int:
        """How many DHT peers our routing table holds (0 after a long outage: time to :meth:`rejoin`)."""
        return len(self.dht.protocol.routing_table.uid_to_peer_id)

    # ---- the async core: coroutines that run on the node's loop ----

    def _require_loop(self, what: str) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise RuntimeError(
                f"Node.{what}() runs on the node's own loop: use node.call(...) or node.spawn(...) from "
                "other threads"
            )

    async def daemon_exited(self) -> None:
        """Return once the go-libp2p daemon process exits (a watch for :meth:`check_daemon`); never for a
        daemon this node did not start."""
        self._require_loop("daemon_exited")
        child = getattr(self.p2p, "_child", None)  # hivemind keeps its process private (daemon_alive)
        if child is None:
            await asyncio.get_running_loop().create_future()
        await child.wait()

    async def refresh_addresses(self) -> list[str]:
        """Ask the daemon for our visible addresses now (e.g. after a relay reservation) and cache them;
        returns them without the /p2p suffix, like :meth:`addresses`."""
        self._require_loop("refresh_addresses")
        self._visible = tuple(str(a) for a in await self.p2p.get_visible_maddrs(latest=True))
        return self.plain_maddrs()

    async def addresses(self) -> list[str]:
        """Our listening multiaddrs without the /p2p suffix (what Heartbeat and Provider records carry):
        the cached ones, asking the daemon only while none are known."""
        self._require_loop("addresses")
        if not self._visible:
            return await self.refresh_addresses()
        return self.plain_maddrs()

    async def publish(self, kind: str, body: dict, ttl_s: float | None = None) -> bool:
        """Sign ``body`` as a ``kind`` message and store it under its run key in our own subkey."""
        return await self.publish_message(encode(kind, body, self.identity), ttl_s)

    async def publish_message(self, message: bytes, ttl_s: float | None = None) -> bool:
        """Store a message this node signed (e.g. a manifest kept as bytes) under the key it belongs to."""
        from hivemind.utils import get_dht_time

        self._require_loop("publish_message")
        kind, body, author = decode(message)
        if author != self.identity.public_key:
            raise ValueError("a node publishes only messages it signed itself")
        ttl = min(ttl_s or MAX_TTL_S[kind], MAX_TTL_S[kind])
        ok = await self.dht.store(record_key(kind, body), message, get_dht_time() + ttl, subkey=author)
        return bool(ok)

    async def lookup(self, key: str) -> list[Record]:
        """All current records under ``key``, each re-verified; refused ones are dropped and logged."""
        self._require_loop("lookup")
        found = await self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for subkey, item in found.value.items():
            try:
                if not isinstance(item.value, bytes):
                    raise ProtocolError("record value is not a message")
                kind, body, author = decode(item.value)
                if author != subkey:
                    raise ProtocolError("record author differs from its subkey")
                out.append(Record(author, kind, body, item.value, item.expiration_time))
            except ProtocolError as e:
                log.warning("ignored a DHT record under %s: %s", key, e)
        return out

    async def rejoin(self, maddrs: Sequence[str] = ()) -> int:
        """Ping the bootstrap (and ``maddrs``) peers again and look up our neighbours; returns who answered.

        hivemind forgets peers that stop answering; after a network outage a node may know nobody and would
        keep storing its records only locally.
        """
        from hivemind.p2p import PeerID

        self._require_loop("rejoin")
        answered = 0
        for m in dict.fromkeys([*self.config.bootstrap, *maddrs]):
            if "/p2p/" not in m or m.endswith(self.peer_id):
                continue
            peer_id = m.split("/p2p/")[-1]
            try:
                await asyncio.wait_for(self.connect(peer_id, [m.split("/p2p/")[0]]), 5)
                answered += (
                    await asyncio.wait_for(self.dht.protocol.call_ping(PeerID.from_base58(peer_id)), 5)
                    is not None
                )
            except Exception as e:
                log.debug("rejoin through %s failed: %s", m, e)
        if answered:
            await asyncio.wait_for(self.dht.find_nearest_nodes([self.dht.node_id]), 10)
        return answered

    # ---- streams ----

    async def connect(self, peer_id: str, maddrs: Sequence[str]) -> None:
        """Have the daemon dial ``peer_id`` at ``maddrs`` (multiaddrs without /p2p); raises if it cannot."""
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        self._require_loop("connect")
        # the one use of hivemind's daemon client: its P2P has no public connect (hivemind does the same)
        await self.p2p._client.connect(PeerID.from_base58(peer_id), [Multiaddr(m) for m in maddrs])

    async def add_handler(self, name: str, handler: StreamHandler) -> None:
        """Serve protocol ``name``; ``handler(remote_peer_id, reader, writer)``, closing the stream after.

        Handlers run on the node's loop: blocking work (sqlite, files) goes through ``asyncio.to_thread``."""
        self._require_loop("add_handler")

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_stream(name, handler, info.peer_id.to_base58(), reader, writer)

        await self.p2p.add_binary_stream_handler(name, on_stream)

    async def open_stream(
        self, peer_id: str, name: str, maddrs: Sequence[str] = ()
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open a stream to ``peer_id`` for protocol ``name``, dialling ``maddrs`` first when given."""
        from hivemind.p2p import PeerID

        self._require_loop("open_stream")
        if maddrs:
            try:
                await self.connect(peer_id, maddrs)
            except Exception as e:
                log.debug("dialling %s at %s failed: %s", peer_id[-8:], list(maddrs), e)
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        return reader, writer

    # ---- lifecycle ----

    def close(self) -> None:
        """Stop background tasks, leave the DHT, stop the daemon and the loop thread. Idempotent.

        Not from the loop's own thread (RuntimeError): it waits for the loop to shut the network down."""
        if self._closed:
            return
        self._refuse_loop_thread("close")
        self._closed = True
        if self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self._aclose(), self._loop)
            try:
                fut.result(20)
            except Exception as e:
                log.warning("network shutdown was not clean: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self.dht is not None:
            # a dead daemon (a Ctrl-C reaches its process group too) answers nothing: do not wait for it
            try:
                await asyncio.wait_for(self.dht.shutdown(), 10 if self.daemon_alive() else 0.5)
            except Exception as e:
                log.debug("DHT shutdown: %s", e)
        if self.p2p is not None:
            await self.p2p.shutdown()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:  # hivemind's own background jobs
            t.cancel()
        if others:
            await asyncio.wait(others, timeout=5)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
