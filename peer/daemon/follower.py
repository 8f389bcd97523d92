"""The sampler's checkpoint follower: on the network loop, find the newest allowed checkpoint, fetch it (by a
sparse delta where one fits), prepare its tensors, and hand them to the generating thread between batches."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable

import torch

from heterorl.protocol.net.chunks import latest_manifest
from heterorl.protocol.net.fetch import FetchReport, fetch_checkpoint
from heterorl.protocol.net.node import Node
from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import deserialize_state_dict

from .weights import weights_hash

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 30.0
FETCH_TIMEOUT_S = 120.0  # one attempt; a retry resumes from the chunks already stored
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0  # after a failed lookup or fetch: doubling between these


@dataclasses.dataclass
class Prepared:
    """A fetched version, its tensors ready for ``load_weights``, and how getting it went."""

    version: int
    digest: bytes  # sha256 of its signed manifest
    state: dict[str, torch.Tensor]
    report: FetchReport
    held: int | None  # the version held while it was fetched
    started: float  # wall clock
    fetch_s: float
    prepare_s: float  # assemble + deserialize
    batches_during_fetch: int  # batches finished with the held version meanwhile


class CheckpointFollower:
    """Runs on the node's loop: finds the newest allowed manifest, fetches and prepares it, hands it over.

    The main thread polls :meth:`take` between batches and calls :meth:`swapped` once it loaded (or refused)
    the version; the next fetch starts only then, so at most one prepared state waits in memory and every
    fetch knows which version is generated with meanwhile. Lookups back off while nothing changes (the DHT
    is shared by every peer); failures are logged and retried with backoff, never raised; a manifest whose
    weights were refused is never fetched again. ``on_change()`` (mostly on the loop: it must not block) is
    called whenever what the main thread waits on changes: a version prepared, a fetch begun or ended, a newer
    version known, a retry scheduled, a version refused.
    """

    def __init__(
        self,
        node: Node,
        store: ChunkStore,
        settings: RunSettings,
        held: Callable[[], int | None],
        batches: Callable[[], int],
        check_every_s: float = 0.5,
        check_max_s: float = 5.0,
        on_change: Callable[[], object] = lambda: None,
    ):
        self.node, self.store, self.settings = node, store, settings
        self.held, self.batches, self.on_change = held, batches, on_change
        self.check_every_s, self.check_max_s = check_every_s, max(check_every_s, check_max_s)
        self.newest = -1  # the newest version known (last lookup), -1: none yet
        self.fetching: int | None = None
        self.failures = 0
        self.retry_at = 0.0  # monotonic: when a failed lookup or fetch is tried again
        self.refused: set[bytes] = set()
        self.last_refused: int | None = None
        self._ready: Prepared | None = None
        self._handing = False  # a prepared version is ready or being swapped in
        self._handed = asyncio.Event()  # set (on the loop) once the main thread swapped it in
        self._lock = threading.Lock()

    def take(self) -> Prepared | None:
        """The prepared version, if one is ready (main thread; call :meth:`swapped` after loading it)."""
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def swapped(self) -> None:
        """The main thread is done with the version :meth:`take` gave: the next fetch may start."""
        self._handing = False
        self.node.call_soon(self._handed.set)

    def refuse(self, digest: bytes, version: int, why: object) -> None:
        """These signed bytes will never do: never fetch this manifest again."""
        self.refused.add(digest)
        self.last_refused = version
        held = self.held()
        self.newest = -1 if held is None else held  # a refused version is not one to be behind of
        keeping = "no checkpoint yet" if held is None else f"keeping version {held}"
        log.error("refused checkpoint version %d: %s; %s", version, why, keeping)
        self.on_change()

    def _set_newest(self, version: int) -> None:
        if version != self.newest:
            self.newest = version
            self.on_change()

    def _have(self) -> int:
        held = self.held()
        return -1 if held is None else held

    async def run(self) -> None:
        idle = fail = 0.0
        while True:
            if self._handing:  # wait for swapped(); the flag is read again after the clear: no lost wake
                self._handed.clear()
                if self._handing:
                    await self._handed.wait()
                continue
            try:
                changed = await self._once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the network or the disk: say so, try again later
                self.failures += 1
                fail = min(RETRY_MAX_S, max(RETRY_MIN_S, fail * 2))
                self.retry_at = time.monotonic() + fail
                self.on_change()
                log.warning("%s; retrying in %.0f s", e, fail)
                await asyncio.sleep(fail)
                continue
            fail = 0.0
            if changed:
                idle = 0.0
                continue
            # nothing new: back off, but not while there is nothing to generate with
            cap = self.check_max_s if self.held() is not None else self.check_every_s
            idle = min(cap, self.check_every_s if idle == 0 else idle * 2)
            await asyncio.sleep(idle)

    async def _once(self) -> bool:
        """One lookup and, for a newer version, its fetch and preparation; True if something changed."""
        s = self.settings
        have = self._have()
        try:
            found = await asyncio.wait_for(
                latest_manifest(self.node, s.run_id, s.learner_keys, have + 1), LOOKUP_TIMEOUT_S
            )
        except TimeoutError:
            raise RuntimeError(f"checkpoint lookup: no answer in {LOOKUP_TIMEOUT_S:.0f} s") from None
        except Exception as e:
            raise RuntimeError(f"checkpoint lookup failed: {type(e).__name__}: {e}") from None
        if found is None:
            self._set_newest(have)  # nothing newer than what is held
            return False
        raw, body = found
        v, digest = body["version"], hashlib.sha256(raw).digest()
        if digest in self.refused:
            self._set_newest(have)
            return False
        self.newest, self.fetching = v, v
        self.on_change()
        watch = asyncio.ensure_future(self._watch(v))
        try:
            await self._fetch(raw, body, digest)
        finally:
            watch.cancel()
            self.fetching = None
            self.on_change()
        return True

    async def _watch(self, fetching: int) -> None:
        """While a fetch runs, keep :attr:`newest` current: the stop rule needs to know how far behind we
        are now, not when the download began."""
        s, wait = self.settings, self.check_every_s
        while True:
            await asyncio.sleep(wait)
            wait = min(self.check_max_s, wait * 2)
            try:
                found = await asyncio.wait_for(
                    latest_manifest(self.node, s.run_id, s.learner_keys, fetching + 1), LOOKUP_TIMEOUT_S
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("checkpoint lookup during a fetch failed: %s", e)
                continue
            if found is not None and hashlib.sha256(found[0]).digest() not in self.refused:
                self._set_newest(max(self.newest, found[1]["version"]))

    async def _fetch(self, raw: bytes, body: dict, digest: bytes) -> None:
        s, v = self.settings, body["version"]
        held, b0, started, t0 = self.held(), self.batches(), time.time(), time.monotonic()
        level = logging.INFO if held is None or v % 10 == 0 else logging.DEBUG  # logs stay bounded
        log.log(level, "fetching checkpoint version %d (%d bytes)", v, body["total_size"])
        try:
            report = await asyncio.wait_for(
                fetch_checkpoint(
                    self.node,
                    self.store,
                    raw,
                    run_id=s.run_id,
                    learner_keys=s.learner_keys,
                    timeout=FETCH_TIMEOUT_S,
                ),
                FETCH_TIMEOUT_S + 10,
            )
            t1 = time.monotonic()
            data = await asyncio.to_thread(self.store.assemble, v)
        except TimeoutError:
            raise RuntimeError(f"could not fetch version {v}: no result in {FETCH_TIMEOUT_S:.0f} s") from None
        except Exception as e:
            raise RuntimeError(f"could not fetch version {v}: {type(e).__name__}: {e}") from None
        try:
            if v == 0 and weights_hash(data) != s.initial_checkpoint:
                raise ValueError("version 0 does not match the RunSpec's initial checkpoint hash")
            state = await asyncio.to_thread(deserialize_state_dict, data)
        except Exception as e:  # signed by an allowed learner, yet unusable: refuse this manifest for good
            self.refuse(digest, v, e)
            return
        del data
        prepared = Prepared(
            version=v,
            digest=digest,
            state=state,
            report=report,
            held=held,
            started=started,
            fetch_s=t1 - t0,
            prepare_s=time.monotonic() - t1,
            batches_during_fetch=self.batches() - b0,
        )
        with self._lock:
            self._handing = True
            self._ready = prepared
        self.on_change()
