"""Fetching a checkpoint version from the swarm: a delta against a version held if one is offered, else the
full state, chunk by chunk from many providers, verified against the signed manifest.

:class:`CheckpointFetch` names the steps (plan, pick_delta, try_delta, full, commit); :class:`Download` is the
chunk download itself (workers over providers, a corrupt provider banned, resumable), for any
:class:`ChunkFetch` (a run's data set is fetched the same way: :mod:`protocol.net.datasets`). The serving side
and the wire format of a chunk request are in :mod:`protocol.net.chunks`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable

import msgpack

from heterorl.protocol.net.chunks import (
    HELD,
    NOT_HELD,
    PROTOCOL,
    Provider,
    _announce,
    find_providers,
    verify_manifest,
)
from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire import delta as delta_codec
from heterorl.protocol.wire.checkpoint import (
    chunk_hash,
    chunk_length,
    delta_part,
    split,
    verify_chunk,
)
from heterorl.protocol.wire.errors import ProtocolError

log = logging.getLogger(__name__)

SLOW_REBUILD_ENV = "HETERORL_TEST_SLOW_REBUILD_S"  # tests only: seconds to pause after each rebuilt chunk


class FetchError(RuntimeError):
    """A checkpoint version could not be fetched (no honest provider held some chunk in time)."""


@dataclasses.dataclass
class FetchReport:
    """What one download did: bytes over the wire vs. reused, per provider, who was caught serving garbage."""

    version: int
    total_bytes: int
    fetched_bytes: int = 0
    reused_bytes: int = 0
    chunks_fetched: int = 0
    seconds: float = 0.0
    from_provider: dict[str, int] = dataclasses.field(default_factory=dict)
    bad_providers: list[str] = dataclasses.field(default_factory=list)
    via: str = "full"  # "delta" when rebuilt from a delta against a held version
    delta_base: int = -1  # that version
    delta_error: str = ""  # why a delta was refused (the full state was fetched instead)


async def fetch_checkpoint(
    node: Node,
    store: ChunkStore,
    manifest_raw: bytes,
    *,
    run_id: str,
    learner_keys: Iterable[bytes],
    providers: list[Provider] | None = None,
    streams_per_provider: int = 2,
    chunks_per_request: int = 4,
    timeout: float = 600.0,
    request_timeout: float = 60.0,
    progress: Callable[[FetchReport, int], None] | None = None,
    refresh_s: float = 1.0,
    use_delta: bool = True,
) -> FetchReport:
    """Fetch a signed manifest's version into ``store`` (by its delta when that is cheaper), then store the
    manifest and announce it.

    Providers come from the DHT (``providers`` overrides, for tests). ``progress(report, bytes_to_fetch)``
    is called after every stored chunk (on the network loop: keep it quick). Raises ProtocolError for a
    manifest the run does not allow, FetchError when chunks stay unavailable until ``timeout``.
    """
    body, _ = verify_manifest(manifest_raw, run_id, learner_keys)
    fetch = CheckpointFetch(
        node,
        store,
        body,
        run_id=run_id,
        providers=providers,
        streams_per_provider=streams_per_provider,
        chunks_per_request=chunks_per_request,
        deadline=time.monotonic() + timeout,
        request_timeout=request_timeout,
        progress=progress,
        refresh_s=refresh_s,
    )
    return await fetch.run(manifest_raw, use_delta=use_delta)


class ChunkFetch:
    """What a :class:`Download` needs from the fetch it belongs to: the store, the limits, the report, and
    (per kind of content) where its providers are found and how this peer says it holds some of it.

    :class:`CheckpointFetch` fetches a checkpoint version; ``protocol.net.datasets`` a run's data set."""

    what = "content"  # names the content in log lines and errors ("version 3")

    def __init__(
        self,
        node: Node,
        store: ChunkStore,
        report: FetchReport,
        *,
        providers: list[Provider] | None,
        streams_per_provider: int,
        chunks_per_request: int,
        deadline: float,
        request_timeout: float,
        progress: Callable[[FetchReport, int], None] | None,
        refresh_s: float,
    ):
        """``providers`` overrides the lookups (tests); ``progress(report, bytes_to_fetch)`` is called after
        every stored chunk, on the network loop."""
        self.node, self.store, self.report = node, store, report
        self.providers, self.deadline = providers, deadline
        self.streams, self.per_request = streams_per_provider, chunks_per_request
        self.request_timeout, self.progress, self.refresh_s = request_timeout, progress, refresh_s
        self.banned: set[str] = set()  # for the whole download: a liar is not asked for the full state either
        self.announced = False
        self.start = time.monotonic()

    async def find(self) -> list[Provider]:
        """The providers to ask now (``providers`` when given, else a DHT lookup)."""
        return self.providers if self.providers is not None else await self.lookup()

    async def lookup(self) -> list[Provider]:
        raise NotImplementedError

    async def announce_partial(self) -> None:
        """Say in the DHT that this peer holds some of the content (after its first stored chunk)."""
        raise NotImplementedError


class CheckpointFetch(ChunkFetch):
    """One version's download, in named steps: plan (what is held), delta (fetch it and rebuild the full
    state, when the base is held and the delta is smaller than what is missing), full (fetch the chunks
    still missing), commit (manifest into the store, announce as a complete provider)."""

    def __init__(self, node: Node, store: ChunkStore, body: dict, *, run_id: str, **limits):
        """``limits``: :class:`ChunkFetch`'s keyword arguments."""
        super().__init__(
            node, store, FetchReport(version=body["version"], total_bytes=body["total_size"]), **limits
        )
        self.body, self.run_id, self.version = body, run_id, body["version"]
        self.what = f"version {self.version}"

    async def lookup(self) -> list[Provider]:
        return await find_providers(self.node, self.run_id, self.version)

    async def announce_partial(self) -> None:
        await _announce(self.node, self.run_id, self.version, complete=False)

    async def run(self, manifest_raw: bytes, *, use_delta: bool = True) -> FetchReport:
        missing = await self.plan()
        delta = await self.pick_delta(missing) if missing and use_delta else None
        if delta is not None:
            await self.try_delta(delta)
        missing = await asyncio.to_thread(self.store.missing, self.body)
        if missing:
            await Download(self, self.body, missing).run()
        await self.commit(manifest_raw)
        return self.report

    async def plan(self) -> list[int]:
        missing = await asyncio.to_thread(self.store.missing, self.body)
        r = self.report
        r.reused_bytes = r.total_bytes - sum(chunk_length(self.body, i) for i in missing)
        return missing

    async def pick_delta(self, missing: list[int]) -> dict | None:
        """The smallest offered delta whose base this store holds, if it costs less than what is missing."""
        held = set(await asyncio.to_thread(self.store.versions))
        offered = self.body.get("deltas", [])
        usable = [d for d in offered if d["base_version"] in held and d["codec"] == delta_codec.CODEC]
        best = min(usable, key=lambda d: d["total_size"], default=None)
        if best is None:
            if offered:
                log.debug("version %d: no delta against a version held here; fetching in full", self.version)
            return None
        return best if best["total_size"] < sum(chunk_length(self.body, i) for i in missing) else None

    async def try_delta(self, delta: dict) -> None:
        """Fetch ``delta`` and rebuild the full state from it; on a refused delta the full fetch follows."""
        part = delta_part(self.body, delta)
        try:
            todo = await asyncio.to_thread(self.store.missing, part)
            if todo:
                await Download(self, part, todo).run()
            await asyncio.to_thread(rebuild_from_delta, self.store, self.body, delta)
            self.report.via, self.report.delta_base = "delta", delta["base_version"]
        except delta_codec.DeltaError as e:  # the learner signed it, so no provider is to blame
            log.error("version %d: delta refused (%s); fetching the full state", self.version, e)
            self.report.delta_error = str(e)

    async def commit(self, manifest_raw: bytes) -> None:
        still = await asyncio.to_thread(self.store.missing, self.body)
        if still:
            raise FetchError(f"version {self.version}: chunks {still[:5]} missing after the download")
        await asyncio.to_thread(self.store.add_manifest, manifest_raw, self.body)
        self.report.seconds = time.monotonic() - self.start
        await _announce(self.node, self.run_id, self.version, complete=True)


def rebuild_from_delta(store: ChunkStore, body: dict, delta: dict) -> None:
    """Apply ``delta`` (one of ``body``'s, held) to its base (held) and store the full state's chunks;
    DeltaError unless the result is, chunk for chunk, the state the manifest signs. Chunks are stored one by
    one, each atomically, and the manifest only after: a peer killed here keeps its last good version."""
    base = store.assemble(delta["base_version"])
    data = store.assemble_part(delta_part(body, delta), f"version {body['version']} delta")
    state = delta_codec.apply_delta(base, data)
    chunks = split(state, body["chunk_bytes"])
    if len(state) != body["total_size"] or [chunk_hash(c) for c in chunks] != body["chunk_hashes"]:
        raise delta_codec.DeltaError("it reconstructs a state other than the one the manifest signs")
    pause = float(os.environ.get(SLOW_REBUILD_ENV, "0") or 0)
    log.info("version %d: rebuilt from the delta against version %d", body["version"], delta["base_version"])
    for h, c in zip(body["chunk_hashes"], chunks, strict=True):
        store.put(h, c)
        if pause:
            time.sleep(pause)  # tests: widen the window in which a SIGKILL lands mid-apply


class Download:
    """Fetch the chunks ``todo`` of ``part`` (a manifest body, its delta part, a data set's manifest) from the
    providers ``fetch`` finds.

    Workers run per provider (``streams`` each); every ``refresh_s`` (sooner when nothing runs) the DHT is
    asked again, so peers that began fetching this version after us start serving us mid-download. A chunk
    that does not hash to the manifest bans its provider; a provider that lacks a chunk is asked for others.
    """

    def __init__(self, fetch: ChunkFetch, part: dict, todo: list[int]):
        self.f, self.part = fetch, part
        self.todo: collections.deque[int] = collections.deque(todo)
        self.to_fetch = sum(chunk_length(part, i) for i in todo)
        self.lacks: dict[str, set[int]] = collections.defaultdict(set)
        self.running: collections.Counter[str] = collections.Counter()
        self.live: list[Provider] = []  # the providers found at the last lookup, less the banned

    async def run(self) -> None:
        f, tasks = self.f, set()
        next_lookup, fetched_at_lookup, backoff = 0.0, -1, 0.5
        try:
            while self.todo or tasks:
                now = time.monotonic()
                if now > f.deadline:
                    raise FetchError(f"{f.what}: {len(self.todo)} chunks still missing at the deadline")
                if self.todo and now >= next_lookup:
                    found = await f.find()
                    live = [p for p in found if p.peer_id not in f.banned]
                    for p in live:
                        if self.running[p.peer_id] < f.streams:
                            self.lacks[p.peer_id].clear()  # forgive misses: they may hold more now
                    self.live = live
                    self._start_workers(tasks)
                    stalled = f.report.chunks_fetched == fetched_at_lookup
                    fetched_at_lookup = f.report.chunks_fetched
                    if stalled and not any(self.running.values()):
                        log.info(
                            "%s: %d chunks not available yet from %d providers; retrying in %.1f s",
                            f.what,
                            len(self.todo),
                            len(live),
                            backoff,
                        )
                        next_lookup = time.monotonic() + backoff
                        backoff = min(backoff * 2, 10.0)
                    else:
                        next_lookup = time.monotonic() + f.refresh_s
                        backoff = 0.5
                # with nothing left to hand out no lookup is due: wait for the workers, looking again every
                # refresh_s (a worker may hand chunks back); an expired lookup time would spin here instead
                wake_at = next_lookup if self.todo else time.monotonic() + f.refresh_s
                wait_s = max(0.0, wake_at - time.monotonic())
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                    tasks -= done
                    for t in done:
                        t.result()  # workers catch what they expect; anything else is a bug worth raising
                    # chunks a provider turned out to lack went back to todo: the others take them now
                    # (a provider's workers end when it has nothing they may take)
                    self._start_workers(tasks)
                elif self.todo:
                    await asyncio.sleep(wait_s)
        finally:
            for t in tasks:
                t.cancel()

    def _start_workers(self, tasks: set[asyncio.Future]) -> None:
        """Up to ``streams`` workers for each live provider that may hold a chunk still to fetch."""
        f = self.f
        for p in self.live:
            if p.peer_id in f.banned or not any(i not in self.lacks[p.peer_id] for i in self.todo):
                continue
            for _ in range(f.streams - self.running[p.peer_id]):
                self.running[p.peer_id] += 1
                tasks.add(asyncio.ensure_future(self._run_worker(p)))

    async def _run_worker(self, p: Provider) -> None:
        try:
            await self._worker(p)
        finally:
            self.running[p.peer_id] -= 1

    async def _worker(self, p: Provider) -> None:
        f, part, report = self.f, self.part, self.f.report
        reader = writer = None
        try:
            while p.peer_id not in f.banned:
                take = _take(self.todo, self.lacks[p.peer_id], f.per_request)
                if not take:
                    return
                try:
                    if writer is None:
                        reader, writer = await asyncio.wait_for(
                            f.node.open_stream(p.peer_id, PROTOCOL, p.maddrs), f.request_timeout
                        )
                    await write_frame(
                        writer, msgpack.packb({"hashes": [part["chunk_hashes"][i] for i in take]})
                    )
                    for n, i in enumerate(take):
                        reply = await read_frame(reader, chunk_length(part, i) + 1, f.request_timeout)
                        if reply[:1] == NOT_HELD and len(reply) == 1:
                            self.lacks[p.peer_id].add(i)
                            self.todo.append(i)
                            take[n] = -1
                            continue
                        if reply[:1] != HELD or not verify_chunk(part, i, reply[1:]):
                            raise ProtocolError(f"chunk {i} does not hash to the manifest")
                        await asyncio.to_thread(f.store.put, part["chunk_hashes"][i], reply[1:])
                        report.fetched_bytes += len(reply) - 1
                        report.chunks_fetched += 1
                        report.from_provider[p.peer_id] = (
                            report.from_provider.get(p.peer_id, 0) + len(reply) - 1
                        )
                        take[n] = -1
                        if f.progress is not None:
                            f.progress(report, self.to_fetch)
                        if not f.announced:
                            f.announced = True
                            f.node.spawn(f.announce_partial())
                except ProtocolError as e:
                    if isinstance(e, FrameError) and e.kind != "oversized":  # crashed or slow, not hostile
                        log.info("provider %s: %s; trying others", p.peer_id[-8:], e)
                        self.lacks[p.peer_id].update(i for i in take if i >= 0)
                    elif p.peer_id not in f.banned:  # its other streams stop at their next request
                        log.warning("provider %s served bad data (%s); routed around", p.peer_id[-8:], e)
                        f.banned.add(p.peer_id)
                        report.bad_providers.append(p.peer_id)
                    self.todo.extend(i for i in take if i >= 0)
                    return
                except Exception as e:  # unreachable, stream reset, daemon error: try the others
                    log.info("provider %s unreachable (%s: %s)", p.peer_id[-8:], type(e).__name__, e)
                    self.lacks[p.peer_id].update(i for i in take if i >= 0)
                    self.todo.extend(i for i in take if i >= 0)
                    return
        finally:
            if writer is not None:
                writer.close()


def _take(todo: collections.deque[int], lacks: set[int], k: int) -> list[int]:
    take, skipped = [], []
    while todo and len(take) < k:
        i = todo.popleft()
        (skipped if i in lacks else take).append(i)
    todo.extend(skipped)
    return take
