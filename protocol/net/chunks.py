"""Checkpoint distribution over libp2p streams: serve held chunks, announce versions, find them (the fetch is
in :mod:`protocol.net.fetch`).

Wire protocol ``/heterorl/chunks/1`` on one stream, any number of rounds:

- request frame: msgpack ``{"hashes": [h, ...]}`` with at most :data:`MAX_HASHES_PER_REQUEST` 32-byte hashes;
- one reply frame per requested hash, in order: ``b"\\x00" + chunk`` when held, ``b"\\x01"`` when not.

The fetcher knows each chunk's exact length from the signed manifest, so every reply is read under a cap of
that length plus one byte; a chunk that does not hash to the manifest bans its provider for this download and
the chunk is fetched elsewhere. Chunks are stored as they arrive, so an interrupted download resumes with
what is missing, and a chunk already held (say from the parent version) is never fetched again. The
manifest enters the store last, after every chunk verified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Iterable

import msgpack

from heterorl.protocol.net.dht import checkpoints_key, dataset_providers_key, providers_key
from heterorl.protocol.net.framing import read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import (
    check_manifest,
)
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.messages import HASH_BYTES, decode

log = logging.getLogger(__name__)

PROTOCOL = "/heterorl/chunks/1"
MAX_HASHES_PER_REQUEST = 16
MAX_REQUEST_BYTES = 64 + MAX_HASHES_PER_REQUEST * (HASH_BYTES + 2)
REQUEST_IDLE_S = 60.0
HELD, NOT_HELD = b"\x00", b"\x01"


class UploadLimit:
    """Token bucket shared by all of a server's streams: a volunteer's upload cap in bytes per second."""

    def __init__(self, bytes_per_s: float, burst_s: float = 0.25):
        if bytes_per_s <= 0:
            raise ValueError("upload limit must be positive")
        self.rate, self.capacity = bytes_per_s, bytes_per_s * burst_s
        self.tokens, self.stamp = self.capacity, time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:  # FIFO among streams
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class ChunkServer:
    """Serves every chunk its store holds, to anyone: chunks are content-addressed, so nothing to forge.

    ``upload_bytes_per_s`` caps what this peer uploads in total (None: no cap).
    """

    def __init__(self, store: ChunkStore, upload_bytes_per_s: float | None = None):
        self.store = store
        self.limit = UploadLimit(upload_bytes_per_s) if upload_bytes_per_s else None
        self.bytes_served = 0
        self.requests = 0

    async def attach(self, node: Node) -> None:
        await node.add_handler(PROTOCOL, self.handle)

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                frame = await read_frame(reader, MAX_REQUEST_BYTES, REQUEST_IDLE_S)
            except EOFError:
                return
            hashes = _parse_request(frame)
            self.requests += 1
            for h in hashes:
                data = await asyncio.to_thread(self.store.get, h)
                if data is None:
                    await write_frame(writer, NOT_HELD)
                else:
                    if self.limit is not None:
                        await self.limit.take(len(data))
                    await write_frame(writer, HELD + data)
                    self.bytes_served += len(data)

    def stats(self) -> dict[str, int]:
        return {"net/chunk_bytes_served": self.bytes_served, "net/chunk_requests": self.requests}


def _parse_request(frame: bytes) -> list[bytes]:
    try:
        req = msgpack.unpackb(frame, raw=False, max_ext_len=0, max_array_len=MAX_HASHES_PER_REQUEST)
    except Exception:
        raise ProtocolError("chunk request is not well-formed msgpack") from None
    if not isinstance(req, dict) or set(req) != {"hashes"} or not isinstance(req["hashes"], list):
        raise ProtocolError("chunk request must be {'hashes': [...]}")
    hashes = req["hashes"]
    if not 1 <= len(hashes) <= MAX_HASHES_PER_REQUEST:
        raise ProtocolError(f"chunk request with {len(hashes)} hashes")
    if not all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes):
        raise ProtocolError("chunk request hashes must be 32-byte strings")
    return hashes


@dataclasses.dataclass(frozen=True)
class Provider:
    peer_id: str
    maddrs: tuple[str, ...] = ()


def verify_manifest(raw: bytes, run_id: str, learner_keys: Iterable[bytes]) -> tuple[dict, bytes]:
    """Decode a CheckpointManifest and refuse it unless a learner the RunSpec allows signed it."""
    _, body, author = decode(raw, expected="CheckpointManifest", run_id=run_id)
    if author not in set(learner_keys):
        raise ProtocolError("checkpoint manifest not signed by a learner this run allows")
    check_manifest(body)
    return body, author


async def latest_manifest(
    node: Node, run_id: str, learner_keys: Iterable[bytes], min_version: int = 0
) -> tuple[bytes, dict] | None:
    """The newest CheckpointManifest in the DHT signed by an allowed learner (``>= min_version``), or None.

    Records from other authors are skipped (and logged); nothing unverified is returned.
    """
    keys = set(learner_keys)
    best: tuple[bytes, dict] | None = None
    for r in await node.lookup(checkpoints_key(run_id)):
        try:
            body, _ = verify_manifest(r.raw, run_id, keys)
        except ProtocolError as e:
            log.warning("ignored a checkpoint manifest from %s: %s", r.author.hex()[:12], e)
            continue
        if body["version"] >= min_version and (best is None or body["version"] > best[1]["version"]):
            best = (r.raw, body)
    return best


async def find_providers(
    node: Node, run_id: str, version: int, *, dataset: bytes | None = None
) -> list[Provider]:
    """Other peers that announced chunks of checkpoint ``version``, or of the data set ``dataset`` (version
    0), in random order."""
    key = providers_key(run_id, version) if dataset is None else dataset_providers_key(run_id, dataset)
    out = [
        Provider(r.body["peer_id"], tuple(r.body["maddrs"]))
        for r in await node.lookup(key)
        if r.kind == "Provider"
        and r.body["version"] == version
        and r.body.get("dataset") == dataset
        and r.body["peer_id"] != node.peer_id
    ]
    random.shuffle(out)  # spread load: every fetcher picking the same first provider is no swarm
    return out


async def _announce(
    node: Node, run_id: str, version: int, *, complete: bool, dataset: bytes | None = None
) -> None:
    """A Provider record: this peer holds chunks of checkpoint ``version`` (or of data set ``dataset``)."""
    extra = {} if dataset is None else {"dataset": dataset}
    try:
        await node.publish(
            "Provider",
            {
                "run_id": run_id,
                "version": version,
                "peer_id": node.peer_id,
                "maddrs": await node.addresses(),
                "complete": complete,
                "timestamp": time.time(),
                **extra,
            },
        )
    except Exception as e:
        what = f"version {version}" if dataset is None else f"data set {dataset.hex()[:16]}"
        log.warning("could not announce %s as a provider: %s", what, e)


async def publish_checkpoint(node: Node, store: ChunkStore, manifest_raw: bytes, body: dict) -> None:
    """Learner side: chunks into the store first, then the provider record, then the manifest (last)."""
    await asyncio.to_thread(store.add_manifest, manifest_raw, body)
    await announce_checkpoint(node, manifest_raw, body)


async def announce_checkpoint(node: Node, manifest_raw: bytes, body: dict) -> None:
    """The DHT half of :func:`publish_checkpoint`, for a manifest already in the store."""
    await _announce(node, body["run_id"], body["version"], complete=True)
    if not await node.publish_message(manifest_raw):
        raise RuntimeError(f"the DHT did not store the manifest of version {body['version']}")
