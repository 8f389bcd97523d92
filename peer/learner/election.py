"""Who writes a lineage, and while when: pure functions and small state machines, no I/O.

Several learner peers train one lineage of versions; one of them writes (it combines the parts, commits each
step and signs each published version) in a numbered **term**. What this module decides, from what one
learner sees:

- :func:`elect` — what this learner should do now: keep writing, join a writer, write (a new term, and the
  first version number it may use), or wait. A higher term fences a lower one; among live learners with no
  writer, the one holding the newest state writes (the lowest key on a tie).
- :class:`Liveness` — which peers are live, judged on *this* learner's clock: a heartbeat is live while its
  own timestamp keeps changing, and dead once it has not changed for :data:`FRESH_S` of our time. A sender's
  timestamp is only ever compared with its own earlier ones, so a clock minutes ahead or behind changes
  nothing (the DHT accepts records with 300 s of skew).
- :class:`Lease` — when a writer may commit and sign, and up to which version. Its lease runs from the start
  of its last heartbeat store that a later look at the swarm confirmed live, for :data:`LEASE_S` (less than
  the :data:`FRESH_S` another learner waits before it calls the writer dead); its **reservation** caps the
  versions it may commit at what an earlier heartbeat announced (``reserved``). A new writer numbers its
  versions above every reservation it saw, so even a writer paused between its last check and its
  signature (SIGSTOP, a swap storm) signs nothing a successor also signs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

FRESH_S = (
    10.0  # a heartbeat unchanged this long on the receiver's clock: its sender is dead (beats every 2 s)
)
LEASE_S = 7.0  # a writer commits and signs this long after its last confirmed heartbeat store (< FRESH_S)
MIN_LEAD = 8  # the fewest versions a writer reserves beyond the state it holds
LEAD_HEARTBEATS = 4.0  # ... and enough for this many heartbeat intervals at its recent pace


@dataclasses.dataclass(frozen=True)
class Seen:
    """One other learner of the run as this learner sees it (its newest heartbeat)."""

    key: bytes
    fresh: bool  # its heartbeat changed within FRESH_S of this learner's clock
    term: int  # the highest term it knows
    writes: bool  # it writes in that term
    applied: int  # the version of the state it holds
    reserved: int  # a writer: the highest version it may commit; else its applied version
    leaving: bool = False  # its last heartbeat said it leaves


@dataclasses.dataclass(frozen=True)
class Me:
    key: bytes
    applied: int  # the version of the state this learner holds
    term: int  # the highest term this learner knows
    writing: bool  # it writes in ``term``
    newest_known: int = -1  # the newest version it knows was published (DHT, its store)


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Literal["keep", "join", "write", "wait"]
    key: bytes | None = None  # join: the writer to join; wait: the learner expected to write
    term: int = 0  # write: the new term
    first_version: int = 0  # write: the number of its first commit (the state held is numbered one less)
    reason: str = ""


def _writer_order(x: Seen) -> tuple[int, int]:
    """A higher term first; in one term (two learners elected at once) the lower key."""
    return (x.term, -int.from_bytes(x.key, "big"))


def elect(view: Sequence[Seen], me: Me, view_live: bool) -> Decision:
    """What ``me`` does now, given the other learners it sees (``view``: stale ones too; only their terms and
    reservations count) and whether its view of the swarm is live (some other peer's heartbeat changed lately:
    a learner cut off from everyone sees every heartbeat stale and must not conclude that they died)."""
    others = [x for x in view if x.key != me.key]
    writers = sorted((x for x in others if x.fresh and x.writes and not x.leaving), key=_writer_order)
    top = writers[-1] if writers else None
    if me.writing:
        if top is not None and _writer_order(top) > (me.term, -int.from_bytes(me.key, "big")):
            return Decision("join", top.key, reason=f"a writer in term {top.term} fences term {me.term}")
        return Decision("keep")
    if top is not None:
        return Decision("join", top.key, reason=f"it writes in term {top.term}")
    if not view_live:
        return Decision("wait", reason="no other peer's heartbeat changed lately: this learner is cut off")
    live = [x for x in others if x.fresh and not x.leaving]
    best = max(live, key=lambda x: (x.applied, -int.from_bytes(x.key, "big")), default=None)
    if best is not None and (best.applied, -int.from_bytes(best.key, "big")) > (
        me.applied,
        -int.from_bytes(me.key, "big"),
    ):
        return Decision(
            "wait", best.key, reason=f"it holds version {best.applied}, this learner {me.applied}"
        )
    term = max([me.term, *(x.term for x in others)]) + 1
    floor = max([me.applied, me.newest_known, *(max(x.applied, x.reserved) for x in others)])
    return Decision("write", term=term, first_version=floor + 1, reason="no live writer; the newest state")


class Liveness:
    """Peers whose heartbeat changed lately, on this learner's own clock (see the module docstring).

    :meth:`observe` each heartbeat a lookup returns (its author and its own timestamp); a peer first seen
    counts as changed then (a dead peer's leftover record is live for FRESH_S at most)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, fresh_s: float = FRESH_S):
        self.clock, self.fresh_s = clock, fresh_s
        self._last: dict[
            bytes, tuple[float, float]
        ] = {}  # key -> (its newest timestamp, our time it changed)

    def observe(self, key: bytes, stamp: float) -> bool:
        """Record ``key``'s heartbeat stamped ``stamp`` (by its clock); True if it changed."""
        last = self._last.get(key)
        if last is not None and stamp <= last[0]:
            return False
        self._last[key] = (stamp, self.clock())
        return True

    def fresh(self, key: bytes) -> bool:
        last = self._last.get(key)
        return last is not None and self.clock() - last[1] < self.fresh_s

    def changed_at(self, key: bytes) -> float | None:
        last = self._last.get(key)
        return None if last is None else last[1]

    def any_fresh(self, keys: Iterable[bytes]) -> bool:
        return any(self.fresh(k) for k in keys)

    def forget(self, keep: Iterable[bytes]) -> None:
        """Drop peers not in ``keep`` (gone from the DHT): the table stays the size of the swarm."""
        keep = set(keep)
        for k in [k for k in self._last if k not in keep]:
            del self._last[k]


def lead(versions_per_s: float, heartbeat_s: float) -> int:
    """Versions a writer reserves beyond its state: enough for :data:`LEAD_HEARTBEATS` heartbeat intervals at
    its recent pace, at least :data:`MIN_LEAD` (a successor numbers above the reservation)."""
    return max(MIN_LEAD, math.ceil(LEAD_HEARTBEATS * max(0.0, versions_per_s) * heartbeat_s))


class Lease:
    """A writer's right to commit and sign in its term (see the module docstring); thread-safe enough for one
    writer thread and one view thread (plain assignments of immutable values).

    - :meth:`stored` — a heartbeat of this writer's was stored, its store having begun at ``started`` and
      announcing ``reserved``;
    - :meth:`confirmed` — a look at the swarm that began at ``looked`` saw other peers' heartbeats change:
      every heartbeat stored before then was visible to them. The time lease then runs from the newest such
      store; the version cap becomes what the heartbeats visible at the *previous* confirmation reserved (a
      successor may have looked just before the newest one landed);
    - :meth:`fence` — a higher term exists: never again in this term.
    """

    def __init__(
        self, term: int, held: int, clock: Callable[[], float] = time.monotonic, lease_s: float = LEASE_S
    ):
        self.term, self.clock, self.lease_s = term, clock, lease_s
        self.cap = held  # nothing above the state it held when it was elected until a heartbeat reserves more
        self.expires = -math.inf
        self.fenced: str | None = None
        self._stored: list[tuple[float, int]] = []  # (store began, reserved), not yet confirmed visible
        self._visible_reserved = held  # reserved by heartbeats visible at the last confirmation

    def stored(self, started: float, reserved: int) -> None:
        self._stored = [*self._stored[-15:], (started, reserved)]

    def confirmed(self, looked: float) -> None:
        if self.fenced is not None:
            return
        visible = [(t, r) for t, r in self._stored if t < looked]
        self._stored = [(t, r) for t, r in self._stored if t >= looked]
        self.cap = max(self.cap, self._visible_reserved)
        if visible:
            newest = max(t for t, _ in visible)
            self.expires = max(self.expires, newest + self.lease_s)
            self._visible_reserved = max(self._visible_reserved, *(r for _, r in visible))

    def fence(self, why: str) -> None:
        if self.fenced is None:
            self.fenced = why

    def why_not(self, version: int) -> str | None:
        """None if this writer may commit or sign ``version`` now; else why not."""
        if self.fenced is not None:
            return f"term {self.term} is fenced: {self.fenced}"
        if self.clock() >= self.expires:
            return f"term {self.term}'s lease lapsed (no heartbeat of this writer confirmed visible lately)"
        if version > self.cap:
            return f"version {version} is beyond this writer's reservation ({self.cap})"
        return None
