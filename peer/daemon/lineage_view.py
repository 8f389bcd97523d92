"""A lineage learner's view of its run: the other learners' heartbeats, read by a thread of its own.

Every :data:`LOOK_S` (faster while this learner is electing, or writing without a confirmed lease), one DHT
lookup of the run's heartbeats, never on the training thread (a lookup on a loaded machine or a broken link
can take seconds). From it:

- who is live, on this learner's own clock (:class:`~heterorl.peer.learner.election.Liveness`), and whether
  the view itself is live (some other peer's heartbeat changed in this very lookup: a learner cut off from
  the swarm sees only its own stale copies, and must neither elect itself nor renew its lease);
- each other learner's term, whether it writes, the version it holds and its reservation (the heartbeat's
  ``lineage``), and its address (to join it);
- the bans each other learner signed into its heartbeat (``bans``): honoured here too (``on_bans``);
- then ``on_look(started, changed)``: the lineage role fences or confirms its writer's lease.

Also, less often, the newest checkpoint manifest any learner published (a new writer numbers above it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from heterorl.protocol.net.chunks import latest_manifest
from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.node import Node

from ..learner.election import Liveness, Seen

log = logging.getLogger(__name__)

LOOK_S = 2.0  # heartbeats come every 2 s
LOOK_FAST_S = 0.5  # while electing or waiting for a lease
LOOKUP_TIMEOUT_S = 20.0
MANIFEST_LOOK_S = 10.0  # the newest published manifest, looked up this often (it is also in heartbeats)


@dataclasses.dataclass(frozen=True)
class Address:
    peer_id: str
    maddrs: tuple[str, ...]


class LineageView:
    """See the module docstring. :meth:`run` is the thread's body; :meth:`seen`, :meth:`live`,
    :meth:`address` and :meth:`newest_published` read what the last lookup found (any thread)."""

    def __init__(
        self,
        node: Node,
        run_id: str,
        learner_keys,
        me: bytes,
        *,
        on_look: Callable[[float, bool], None] = lambda started, changed: None,
        on_bans: Callable[[bytes, dict[bytes, str]], None] = lambda learner, bans: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.node, self.run_id, self.keys, self.me = node, run_id, frozenset(learner_keys), me
        self.on_look, self.on_bans, self.clock = on_look, on_bans, clock
        self.liveness = Liveness(clock)
        self._lock = threading.Lock()
        self._seen: dict[bytes, Seen] = {}
        self._addresses: dict[bytes, Address] = {}
        self._live = False
        self._newest = -1
        self._manifest_at = -float("inf")
        self.looks = 0
        self.fast = threading.Event()  # set: look every LOOK_FAST_S
        self._wake = threading.Event()
        self.failures = 0

    # ---- the thread ----

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.look()
            except Exception as e:  # a lookup that fails is retried; the view goes stale meanwhile
                self.failures += 1
                log.warning("lineage view: the run's heartbeats not read (%s: %s)", type(e).__name__, e)
            self._wake.wait(LOOK_FAST_S if self.fast.is_set() else LOOK_S)
            self._wake.clear()

    def wake(self) -> None:
        """Look now (the training thread is about to decide)."""
        self._wake.set()

    def look(self) -> None:
        started = self.clock()
        records = self.node.call(self.node.lookup(peers_key(self.run_id)), timeout=LOOKUP_TIMEOUT_S)
        changed = False
        seen, addresses, bans = {}, {}, []
        authors = set()
        for r in records:
            if r.kind != "Heartbeat":
                continue
            authors.add(r.author)
            moved = self.liveness.observe(r.author, float(r.body["timestamp"]))
            if r.author == self.me:
                continue
            changed |= moved
            if r.author not in self.keys or r.body["role"] != "learner":
                continue
            b = r.body
            lin = b.get("lineage") or {"term": 0, "writes": False, "applied": 0, "reserved": 0}
            seen[r.author] = Seen(
                key=r.author,
                fresh=self.liveness.fresh(r.author),
                term=lin["term"],
                writes=lin["writes"],
                applied=lin["applied"],
                reserved=max(lin["applied"], lin["reserved"]),
                leaving=b["state"] == "leaving",
            )
            addresses[r.author] = Address(b["peer_id"], tuple(b["maddrs"]))
            if b.get("bans"):
                bans.append((r.author, {bytes(x["author"]): x["reason"] for x in b["bans"]}))
        if authors:  # (an empty answer says nothing about who left: keep their last changes)
            self.liveness.forget(authors)
        with self._lock:
            self._seen, self._addresses = seen, addresses
            self._live = changed or self._live and self.liveness.any_fresh(a for a in authors if a != self.me)
            self.looks += 1
        for learner, banned in bans:
            self.on_bans(learner, banned)
        if self.clock() - self._manifest_at >= MANIFEST_LOOK_S:
            self._manifest_at = self.clock()
            found = self.node.call(
                latest_manifest(self.node, self.run_id, self.keys), timeout=LOOKUP_TIMEOUT_S
            )
            if found is not None:
                with self._lock:
                    self._newest = max(self._newest, found[1]["version"])
        self.on_look(started, changed)

    # ---- reading ----

    def seen(self) -> list[Seen]:
        """The other learners of the run as the last lookup found them (freshness as of now)."""
        with self._lock:
            seen = list(self._seen.values())
        return [dataclasses.replace(x, fresh=self.liveness.fresh(x.key)) for x in seen]

    def live(self) -> bool:
        """Whether this learner sees the swarm: another peer's heartbeat changed within FRESH_S."""
        with self._lock:
            return self._live and self.looks > 0

    def address(self, key: bytes) -> Address | None:
        with self._lock:
            return self._addresses.get(key)

    def newest_published(self) -> int:
        with self._lock:
            return self._newest
