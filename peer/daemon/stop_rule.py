"""The sampler's stop rule: no new batch while it is more than ``sampler.max_lag`` published versions behind
the newest (it fetches in the background meanwhile; data made now would arrive stale), nor while the learner's
last word was "busy". Counts the seconds paused of each kind, logs a pause at INFO at most once a minute."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sampler import Sampler

log = logging.getLogger("heterorl.peer.daemon.sampler")

PAUSE_POLL_S = 0.2
PAUSE_LOG_EVERY_S = 60.0  # a pause of the same kind is logged at INFO at most this often (DEBUG otherwise)


class StopRule:
    """Reads the sampler's held version, follower, sender and outbox; the sampler's loop asks :meth:`reason`
    before each batch and then :meth:`pause` or :meth:`resume`."""

    def __init__(self, sampler: Sampler, max_lag: int, publish_every: int):
        self.s, self.max_lag, self.publish_every = sampler, max_lag, publish_every
        self.paused_s = {"behind": 0.0, "busy": 0.0}
        self._paused: str | None = None  # the kind of the pause in progress
        self._paused_since = 0.0
        self._pause_level = logging.DEBUG
        self._pause_logged = {"behind": -math.inf, "busy": -math.inf}
        self._busy = False  # the learner's last word on a batch was "busy", and one still waits
        self._seen = (0, 0)  # the sender's (busy replies, other outcomes) counts at the last look

    def lag(self) -> int:
        """Published versions between the one held and the newest known (versions are learner steps: with
        ``publish_every = k`` a version is published every k of them)."""
        version = self.s.version
        if version is None:
            return 0
        return max(0, self.s.follower.newest - version) // self.publish_every

    def reason(self) -> tuple[str, str] | None:
        """(kind, state in words) while generating now would only make data nobody wants, else None."""
        lag = self.lag()
        if self.max_lag >= 0 and lag > self.max_lag:
            f = self.s.follower
            doing = (
                f"fetching {f.fetching}"
                if f.fetching is not None
                else f"retry in {max(0, math.ceil(f.retry_at - time.monotonic()))} s"
                if f.retry_at > time.monotonic()
                else f"about to fetch {f.newest}"
            )
            return "behind", f"paused: {lag} versions behind ({doing})"
        # the learner's latest word on our batches: a "busy" Reject pauses us until an Ack, a final Reject
        # or no answer at all (then the outbox cap governs), or until nothing of ours waits any more
        snd = self.s.sender
        busy_for = snd.learner_busy_for()  # > 0 until the learner's retry_after_s passes; an Ack clears it
        seen = (snd.deferred, snd.acked + snd.rejected + snd.failures)
        said_busy, said_other = seen[0] > self._seen[0], seen[1] > self._seen[1]
        if said_busy and (busy_for > 0 or not said_other):
            self._busy = True
        elif said_other:
            self._busy = False
        self._seen = seen
        if self._busy and not len(self.s.outbox):
            self._busy = False
        if not self._busy:
            return None
        retry = f"retry in {math.ceil(busy_for)} s" if busy_for > 0 else "retrying"
        return "busy", f"paused: learner busy ({retry})"

    def pause(self, kind: str, state: str) -> None:
        now = time.monotonic()
        if self._paused != kind:
            self.resume()
            self._paused, self._paused_since = kind, now
            # a busy learner or a slow line may pause us often: INFO at most once a minute per kind
            self._pause_level = logging.DEBUG
            if now - self._pause_logged[kind] >= PAUSE_LOG_EVERY_S:
                self._pause_logged[kind], self._pause_level = now, logging.INFO
            log.log(self._pause_level, "%s", state)
        self.s.status.state = state
        self.s.rt.stop.wait(PAUSE_POLL_S)
        self.paused_s[kind] += time.monotonic() - now

    def resume(self) -> None:
        if self._paused is not None:
            took = time.monotonic() - self._paused_since
            why = "behind" if self._paused == "behind" else "learner busy"
            log.log(self._pause_level, "resumed generating after %.1f s paused (%s)", took, why)
            self._paused = None
