"""The sampler's stop rule: whether it may generate a batch now, as a pure decision over a snapshot.

No new batch before the first checkpoint; none while the sampler is more than ``sampler.max_lag`` published
versions behind the newest (it fetches in the background meanwhile; data made now would arrive stale); none
while the learner's last word was "busy"; none while the outbox holds ``max_pending`` batches. :func:`decide`
is that table: a :class:`SamplerView` (what the sampler, its follower and sender are at one instant) and the
rule's own :class:`Memory` in, a :class:`Decision` out. The sampler builds the view and waits on its wake-up
while the decision says to (its producers, the follower and sender, signal every change the decision reads;
``recheck_in`` is when only the clock changes it). :class:`StopRule` carries the memory and does what is not
pure: the seconds paused of each kind, and logging a pause at INFO at most once a minute.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger("heterorl.peer.daemon.sampler")

PAUSE_LOG_EVERY_S = 60.0  # a pause of the same kind is logged at INFO at most this often (DEBUG otherwise)
PAUSES = ("behind", "busy")  # the waits counted as paused (paused_behind_s, paused_busy_s)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The run's and the sampler's settings the rule applies."""

    max_lag: int  # published versions behind the newest before pausing (-1: never)
    publish_every: int  # learner steps per published version
    max_pending: int  # batches in the outbox before waiting for the learner


@dataclasses.dataclass(frozen=True)
class SamplerView:
    """The sampler at one instant, as the rule reads it."""

    held: int | None  # the version generated with (None: none yet)
    newest: int  # the newest version known (-1: none)
    fetching: int | None  # the version being fetched
    retry_in: float  # seconds until the follower tries again after a failure (0: no retry pending)
    last_refused: int | None  # the last version whose weights were refused
    busy_replies: int  # the sender's "busy" Rejects so far
    other_outcomes: int  # its Acks, final Rejects and failed sends so far
    busy_for: float  # seconds the learner last asked us to wait (0 once acknowledged or passed)
    sender_state: str  # the sender in words
    outbox: int  # batches queued


@dataclasses.dataclass(frozen=True)
class Memory:
    """What the rule carries from one decision to the next."""

    busy: bool = False  # the learner's last word on a batch was "busy", and one still waits
    seen: tuple[int, int] = (0, 0)  # (busy replies, other outcomes) at the last look


@dataclasses.dataclass(frozen=True)
class Decision:
    """``wait``: None to generate now, else why not ("checkpoint", "behind", "busy", "outbox"); ``state``: the
    peer's state in words while waiting; ``recheck_in``: seconds after which the clock alone changes the
    decision or its words (None: only a producer's signal does); ``memory``: for the next decision."""

    wait: str | None
    state: str
    recheck_in: float | None
    memory: Memory

    @property
    def paused(self) -> bool:
        """A wait counted as paused (behind or busy)."""
        return self.wait in PAUSES


def lag(view: SamplerView, publish_every: int) -> int:
    """Published versions between the one held and the newest known (versions are learner steps: with
    ``publish_every = k`` a version is published every k of them)."""
    if view.held is None:
        return 0
    return max(0, view.newest - view.held) // publish_every


def remember(view: SamplerView, memory: Memory) -> Memory:
    """The learner's latest word on our batches: a "busy" Reject pauses us until an Ack, a final Reject or no
    answer at all (then the outbox cap governs), or until nothing of ours waits any more."""
    seen = (view.busy_replies, view.other_outcomes)
    said_busy, said_other = seen[0] > memory.seen[0], seen[1] > memory.seen[1]
    busy = memory.busy
    if said_busy and (view.busy_for > 0 or not said_other):  # busy_for > 0: no Ack came after it
        busy = True
    elif said_other:
        busy = False
    if busy and not view.outbox:
        busy = False
    return Memory(busy, seen)


def decide(view: SamplerView, memory: Memory, limits: Limits) -> Decision:
    """May the sampler generate now? (module docstring). Pure: the same view and memory, the same decision."""
    memory = remember(view, memory)
    if view.held is None:
        state = (
            f"fetching version {view.fetching}"
            if view.fetching is not None
            else f"waiting for a checkpoint (refused version {view.last_refused})"
            if view.last_refused is not None
            else "waiting for a checkpoint"
        )
        return Decision("checkpoint", state, None, memory)
    behind = lag(view, limits.publish_every)
    if limits.max_lag >= 0 and behind > limits.max_lag:
        if view.fetching is not None:
            doing, recheck = f"fetching {view.fetching}", None
        elif view.retry_in > 0:
            doing, recheck = f"retry in {math.ceil(view.retry_in)} s", view.retry_in
        else:
            doing, recheck = f"about to fetch {view.newest}", None
        return Decision("behind", f"paused: {behind} versions behind ({doing})", recheck, memory)
    if memory.busy:
        if view.busy_for > 0:
            return Decision(
                "busy", f"paused: learner busy (retry in {math.ceil(view.busy_for)} s)", view.busy_for, memory
            )
        return Decision("busy", "paused: learner busy (retrying)", None, memory)
    if view.outbox >= limits.max_pending:
        return Decision("outbox", f"waiting for the learner ({view.sender_state})", None, memory)
    return Decision(None, "", None, memory)


class StopRule:
    """Carries :func:`decide`'s memory; counts the seconds paused of each kind and logs pauses (at INFO at
    most once a minute per kind: a busy learner or a slow line may pause us often)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.memory = Memory()
        self.paused_s = {kind: 0.0 for kind in PAUSES}
        self._paused: str | None = None  # the kind of the pause in progress
        self._paused_since = 0.0
        self._pause_level = logging.DEBUG
        self._pause_logged = {kind: -math.inf for kind in PAUSES}

    def decide(self, view: SamplerView) -> Decision:
        d = decide(view, self.memory, self.limits)
        self.memory = d.memory
        return d

    def wait(self, d: Decision, wait: Callable[[float | None], object]) -> None:
        """Wait out decision ``d`` with ``wait(timeout)`` (the sampler's wake-up): one wake, counted as paused
        for behind or busy (a pause that begins is logged), ending a pause in progress otherwise."""
        now = time.monotonic()
        if not d.paused:
            self.resume()
            wait(d.recheck_in)
            return
        kind = d.wait
        if self._paused != kind:
            self.resume()
            self._paused, self._paused_since = kind, now
            self._pause_level = logging.DEBUG
            if now - self._pause_logged[kind] >= PAUSE_LOG_EVERY_S:
                self._pause_logged[kind], self._pause_level = now, logging.INFO
            log.log(self._pause_level, "%s", d.state)
        wait(d.recheck_in)
        self.paused_s[kind] += time.monotonic() - now

    def resume(self) -> None:
        """No pause any more: log how long the one in progress took."""
        if self._paused is not None:
            took = time.monotonic() - self._paused_since
            why = "behind" if self._paused == "behind" else "learner busy"
            log.log(self._pause_level, "resumed generating after %.1f s paused (%s)", took, why)
            self._paused = None
