"""A peer's Heartbeat: its state, policy version, speed and stats, re-published every few seconds.

The record lives under the run's peers key with a short TTL, so a peer that dies drops out of everyone's view
by itself. Every publish also refreshes ``known_peers.json`` with the addresses of the peers it sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.join import dial_addresses, known_peers, remember_peers
from heterorl.protocol.net.node import Node
from heterorl.protocol.wire.messages import pack_bans, pack_stats

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 30.0


class _Locked:
    """A :class:`Status` field read and written under the status's lock (``copy``: a dict, copied both ways,
    so no caller holds the status's own dict)."""

    def __init__(self, copy: bool = False) -> None:
        self.copy = copy

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Status | None, objtype: type | None = None):
        if obj is None:
            return self
        with obj._lock:
            value = getattr(obj, self.attr)
        return dict(value) if self.copy else value

    def __set__(self, obj: Status, value) -> None:
        value = dict(value) if self.copy else value
        with obj._lock:
            setattr(obj, self.attr, value)


@dataclasses.dataclass(frozen=True)
class StatusSnapshot:
    """A :class:`Status` at one instant: what one heartbeat publishes."""

    state: str
    policy_version: int
    tokens_per_s: float
    backend: str
    stats: dict[str, float]
    bans: dict[bytes, str] = dataclasses.field(default_factory=dict)  # a learner's banned authors and why
    lineage: dict | None = None  # a lineage learner's term, whether it writes, applied and reserved versions


class Status:
    """What the peer is doing now. Several threads write it (the role's loop its state, the heartbeat's
    refresh its stats, the runtime "leaving"), so each field is read and written under one lock
    (``status.state = x`` as ever); :meth:`update` sets several at once, :meth:`snapshot` copies all."""

    state = _Locked()
    policy_version = _Locked()
    tokens_per_s = _Locked()
    backend = _Locked()  # a sampler's rollout engine (``RolloutBackend.describe()``)
    stats = _Locked(copy=True)
    bans = _Locked(copy=True)
    lineage = _Locked()

    def __init__(
        self,
        state: str = "joining",
        policy_version: int = -1,
        tokens_per_s: float = 0.0,
        backend: str = "",
        stats: dict[str, float] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.update(
            state=state,
            policy_version=policy_version,
            tokens_per_s=tokens_per_s,
            backend=backend,
            stats=stats or {},
            bans={},
            lineage=None,
        )

    def update(self, **fields) -> None:
        """Set these fields together (a snapshot sees all of them or none)."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(StatusSnapshot)}
        if unknown:
            raise TypeError(f"Status has no field(s) {sorted(unknown)}")
        for name in ("stats", "bans"):
            if name in fields:
                fields[name] = dict(fields[name])
        with self._lock:
            for k, v in fields.items():
                setattr(self, f"_{k}", v)

    def snapshot(self) -> StatusSnapshot:
        with self._lock:
            return StatusSnapshot(
                self._state,
                self._policy_version,
                self._tokens_per_s,
                self._backend,
                dict(self._stats),
                dict(self._bans),
                None if self._lineage is None else dict(self._lineage),
            )


class Heartbeat:
    """Publishes ``status()`` every ``interval_s`` (sooner after :meth:`kick`). ``on_stored(started, st)``
    hears each heartbeat the DHT stored, with the monotonic time its store began (a lineage writer's lease
    counts from there)."""

    def __init__(
        self,
        node: Node,
        run_id: str,
        role: str,
        hardware: str,
        status: Callable[[], Status],
        state_dir: Path | None = None,
        interval_s: float = 2.0,
        on_stored: Callable[[float, StatusSnapshot], None] | None = None,
    ):
        self.node, self.run_id, self.role, self.hardware = node, run_id, role, hardware
        self.status, self.state_dir, self.interval_s = status, state_dir, interval_s
        self.on_stored = on_stored
        self.published = 0
        self.failures = 0
        self._last_peers = 0.0
        self._kicked: asyncio.Event | None = None  # made on the loop, by run()

    def body(self, st: StatusSnapshot, maddrs: list[str]) -> dict:
        return {
            "run_id": self.run_id,
            "role": self.role,
            "state": st.state[:64],
            "policy_version": st.policy_version,
            "tokens_per_s": max(0.0, st.tokens_per_s),
            "timestamp": time.time(),
            "peer_id": self.node.peer_id,
            "maddrs": maddrs[:16],
            "hardware": self.hardware[:256],
            "stats": pack_stats(st.stats),
            **({"backend": st.backend[:64]} if st.backend else {}),
            **({"bans": pack_bans(st.bans)} if st.bans else {}),
            **({"lineage": st.lineage} if st.lineage is not None else {}),
        }

    async def publish_once(self) -> bool:
        # off the loop: a sampler's refresh counts its outbox (sqlite); then one consistent copy of it
        st = await asyncio.to_thread(lambda: self.status().snapshot())
        body = self.body(st, await self.node.addresses())
        started = time.monotonic()
        ok = await self.node.publish("Heartbeat", body, HEARTBEAT_TTL_S)
        self.published += ok
        self.failures += not ok
        if ok and self.on_stored is not None:
            self.on_stored(started, st)
        if not ok or self.node.known_dht_peers() == 0:
            known = await asyncio.to_thread(known_peers, self.state_dir) if self.state_dir is not None else []
            answered = await self.node.rejoin(known)
            if answered:
                log.warning("lost the DHT; rejoined through %d peer(s)", answered)
            else:
                log.warning("cannot reach any DHT peer (bootstrap or seen before); retrying")
        if self.state_dir is not None and time.monotonic() - self._last_peers > 30:
            self._last_peers = time.monotonic()
            records = await self.node.lookup(peers_key(self.run_id))
            seen = dial_addresses(records, self.node.identity.public_key)
            if seen:
                await asyncio.to_thread(remember_peers, self.state_dir, seen)
        return ok

    def kick(self) -> None:
        """Publish the next heartbeat now (any thread): what it says changed; others must learn it soon."""
        if self._kicked is not None:
            self.node.call_soon(self._kicked.set)

    async def run(self) -> None:
        self._kicked = asyncio.Event()
        while True:
            self._kicked.clear()
            try:
                await self.publish_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT can be briefly unreachable; say so and keep beating
                self.failures += 1
                log.warning("heartbeat not published: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kicked.wait(), self.interval_s)
