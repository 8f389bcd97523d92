"""A run's data set over the swarm: the host's coordinator stores it as chunks and announces itself as its
provider; every peer fetches it by the id the RunSpec names, verifies it, keeps it, and serves it in turn.

The format (manifest, id, caps) is :mod:`protocol.wire.dataset`. The transfer is the checkpoints' own: the
chunk protocol (:mod:`.chunks`: any peer's ChunkServer serves every chunk its store holds), Provider records
under the data set's key (:func:`.dht.dataset_providers_key`), and the resumable :class:`~.fetch.Download`
that bans a provider serving a chunk that does not hash to the manifest. The manifest itself is fetched
first by its hash alone, its length capped at :data:`~protocol.wire.dataset.MAX_MANIFEST_BYTES`; the assembled
whole is checked against the manifest's sha256. Manifest and chunks stay in the peer's chunk store, so a
restarted peer fetches nothing again.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack

from heterorl.protocol.net.chunks import HELD, NOT_HELD, PROTOCOL, Provider, _announce, find_providers
from heterorl.protocol.net.fetch import ChunkFetch, Download, FetchError, FetchReport
from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import chunk_hash
from heterorl.protocol.wire.dataset import MAX_MANIFEST_BYTES, check_whole, make_manifest, read_manifest
from heterorl.protocol.wire.errors import ProtocolError

log = logging.getLogger(__name__)

REANNOUNCE_S = 1200.0  # Provider records live an hour (dht.MAX_TTL_S): announce again well within it
FETCH_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 60.0
MAX_BACKOFF_S = 10.0  # between rounds of asking for the manifest while nobody serves it


def store_dataset(store: ChunkStore, data: bytes) -> bytes:
    """Host side: data set ``data`` into ``store``, its chunks first and its manifest last; returns its id.
    ValueError if it is empty or over the cap (:func:`~protocol.wire.dataset.make_manifest`)."""
    dataset_id, raw, chunks = make_manifest(data)
    body = read_manifest(raw, dataset_id)
    for h, c in zip(body["chunk_hashes"], chunks, strict=True):
        store.put(h, c)
    store.put(dataset_id, raw)
    return dataset_id


def held_dataset(store: ChunkStore, dataset_id: bytes) -> bytes | None:
    """The data set's bytes if ``store`` holds its manifest and every chunk (each re-hashed), else None."""
    raw = store.get(dataset_id)
    if raw is None:
        return None
    body = read_manifest(raw, dataset_id)
    if store.missing(body):
        return None
    try:
        data = store.assemble_part(body, "data set")
        check_whole(body, data)
    except ProtocolError:
        return None
    return data


async def keep_announced(node: Node, run_id: str, dataset_id: bytes, every_s: float = REANNOUNCE_S) -> None:
    """Announce this peer as a complete provider of the data set now and every ``every_s``, until cancelled
    (its owner's task group cancels it when the peer leaves)."""
    while True:
        await _announce(node, run_id, 0, complete=True, dataset=dataset_id)
        await asyncio.sleep(every_s)


class DatasetFetch(ChunkFetch):
    """One data set's download: its manifest from whoever serves it, then its chunks (:class:`Download`)."""

    def __init__(self, node: Node, store: ChunkStore, run_id: str, dataset_id: bytes, **limits):
        """``limits``: :class:`~.fetch.ChunkFetch`'s keyword arguments."""
        super().__init__(node, store, FetchReport(version=0, total_bytes=0), **limits)  # no version: 0
        self.run_id, self.dataset_id = run_id, dataset_id
        self.what = f"data set {dataset_id.hex()[:16]}"

    async def lookup(self) -> list[Provider]:
        return await find_providers(self.node, self.run_id, 0, dataset=self.dataset_id)

    async def announce_partial(self) -> None:
        await _announce(self.node, self.run_id, 0, complete=False, dataset=self.dataset_id)

    async def run(self) -> bytes:
        """The verified data set, fetched into the store where it is not held already."""
        raw = await asyncio.to_thread(self.store.get, self.dataset_id)
        if raw is None:
            raw = await self.manifest()
        body = read_manifest(raw, self.dataset_id)
        self.report.total_bytes = body["total_size"]
        await asyncio.to_thread(self.store.put, self.dataset_id, raw)
        missing = await asyncio.to_thread(self.store.missing, body)
        if missing:
            n = len(body["chunk_hashes"])
            log.info(
                "%s: fetching %d of %d chunks (%d bytes)", self.what, len(missing), n, body["total_size"]
            )
            await Download(self, body, missing).run()
        data = await asyncio.to_thread(self.store.assemble_part, body, self.what)
        check_whole(body, data)
        return data

    async def manifest(self) -> bytes:
        """The manifest's bytes from the first provider that serves ones hashing to the id; FetchError at the
        deadline. A provider that serves other bytes, or announces more than the cap, is banned."""
        backoff = 0.5
        while True:
            for p in await self.find():
                if p.peer_id not in self.banned:
                    raw = await self._ask(p)
                    if raw is not None:
                        return raw
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise FetchError(f"{self.what}: no provider served its manifest in time")
            log.info("%s: no provider serves it yet; asking again in %.1f s", self.what, backoff)
            await asyncio.sleep(min(backoff, left))
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    async def _ask(self, p: Provider) -> bytes | None:
        writer = None
        try:
            reader, writer = await asyncio.wait_for(
                self.node.open_stream(p.peer_id, PROTOCOL, p.maddrs), self.request_timeout
            )
            await write_frame(writer, msgpack.packb({"hashes": [self.dataset_id]}))
            reply = await read_frame(reader, MAX_MANIFEST_BYTES + 1, self.request_timeout)
            if reply == NOT_HELD:
                return None
            if reply[:1] != HELD or chunk_hash(reply[1:]) != self.dataset_id:
                raise ProtocolError("served a manifest that does not hash to the data set's id")
            return reply[1:]
        except ProtocolError as e:
            if isinstance(e, FrameError) and e.kind != "oversized":  # crashed or slow, not hostile
                log.info("provider %s: %s; trying others", p.peer_id[-8:], e)
            else:
                log.warning("provider %s: %s; banned for this download", p.peer_id[-8:], e)
                self.banned.add(p.peer_id)
                self.report.bad_providers.append(p.peer_id)
            return None
        except Exception as e:  # unreachable, stream reset, daemon error: try the others
            log.info("provider %s unreachable (%s: %s)", p.peer_id[-8:], type(e).__name__, e)
            return None
        finally:
            if writer is not None:
                writer.close()


async def fetch_dataset(
    node: Node,
    store: ChunkStore,
    run_id: str,
    dataset_id: bytes,
    *,
    providers: list[Provider] | None = None,
    timeout: float = FETCH_TIMEOUT_S,
    request_timeout: float = REQUEST_TIMEOUT_S,
    refresh_s: float = 1.0,
) -> bytes:
    """Data set ``dataset_id`` of run ``run_id``, verified, from ``store`` or else from its providers (the
    DHT's, or ``providers`` in tests) into ``store``. FetchError when it stays unavailable until ``timeout``;
    ProtocolError for a manifest that is not one (over the caps, malformed)."""
    fetch = DatasetFetch(
        node,
        store,
        run_id,
        dataset_id,
        providers=providers,
        streams_per_provider=2,
        chunks_per_request=4,
        deadline=time.monotonic() + timeout,
        request_timeout=request_timeout,
        progress=None,
        refresh_s=refresh_s,
    )
    return await fetch.run()
