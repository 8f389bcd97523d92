"""A peer's Heartbeat: its state, policy version, speed and stats, re-published every few seconds.

The record lives under the run's peers key with a short TTL, so a peer that dies drops out of everyone's view
by itself. Every publish also refreshes ``known_peers.json`` with the addresses of the peers it sees.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.join import dial_addresses, known_peers, remember_peers
from heterorl.protocol.net.node import Node
from heterorl.protocol.wire.messages import pack_stats

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 30.0


@dataclasses.dataclass
class Status:
    """What the peer is doing now; the daemon updates it, the heartbeat reads it."""

    state: str = "joining"
    policy_version: int = -1
    tokens_per_s: float = 0.0
    backend: str = ""  # a sampler's rollout engine (``RolloutBackend.describe()``)
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


class Heartbeat:
    def __init__(
        self,
        node: Node,
        run_id: str,
        role: str,
        hardware: str,
        status: Callable[[], Status],
        state_dir: Path | None = None,
        interval_s: float = 2.0,
    ):
        self.node, self.run_id, self.role, self.hardware = node, run_id, role, hardware
        self.status, self.state_dir, self.interval_s = status, state_dir, interval_s
        self.published = 0
        self.failures = 0
        self._last_peers = 0.0

    def body(self, st: Status, maddrs: list[str]) -> dict:
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
        }

    async def publish_once(self) -> bool:
        st = await asyncio.to_thread(self.status)  # a sampler's status counts its outbox (sqlite)
        body = self.body(st, await self.node.addresses())
        ok = await self.node.publish("Heartbeat", body, HEARTBEAT_TTL_S)
        self.published += ok
        self.failures += not ok
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

    async def run(self) -> None:
        while True:
            try:
                await self.publish_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT can be briefly unreachable; say so and keep beating
                self.failures += 1
                log.warning("heartbeat not published: %s", e)
            await asyncio.sleep(self.interval_s)
