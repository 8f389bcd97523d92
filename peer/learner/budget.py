"""The spot checks' share of the learner's time: token buckets whose tokens are seconds of checking.

A check costs what recomputing a batch costs, about what training on it costs on a small model, so an
unbounded stream of checks (a flood of fresh keys, all of whose batches are checked; or the release sweep
checking held batches whenever training is short of data) can take the learner's time from training. Here
each kind of check gets a share of the wall clock, as credit in seconds:

- :class:`TimeBudget`: credit accrues at ``share`` seconds per second of the clock, up to ``share ×
  window_s`` (a burst); a check may start while the credit is positive and is charged what it took once it
  is done, so one check may overdraw it (a debt the following seconds pay back first). Over any span of T
  seconds the checks charged to it took at most ``share × (T + window_s)`` plus the last check's overdraft.
- :class:`CheckBudget`: the two shares of ``[trust]``. Checks of authors without a record (probation) get
  ``probation_check_share``, with a burst of :data:`WINDOW_S` (samplers that start together earn their
  records at once); checks of authors with a record get the rest of ``check_share``, which no flood of fresh
  keys can take from them, with a burst of only :data:`RECORDED_WINDOW_S` (credit saved up while the learner
  waited would let the checks, and what they release to training, run at up to twice their share for a
  while: a learner whose checks are the bound on its intake would train faster for it, then slower). All
  checks together stay within ``check_share``.

A check the budget has no credit for is not run: the caller defers the batch (the sampler retries later,
no strike) or keeps it held (an author with a record, checked later). Pure: the clock is injected (a fake
one in tests); thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# the budgets' burst: the credit a budget holds at most is its share of this many seconds (0.5 s of checking
# at 5 %: a dozen checks of the tiny model); over a window as long, the burst at most doubles the share
WINDOW_S = 10.0
RECORDED_WINDOW_S = 2.0  # the burst of the checks of authors with a record (a few checks; one on a big model)
# when a sampler whose batch was not checked for want of time should send it again: when the budget has time,
# within these bounds; an author without a record no sooner than the new authors' rate limit says (each
# retry of a flood that never waits costs a decode and a signature check)
RETRY_MIN_S, PROBATION_RETRY_MIN_S, RETRY_MAX_S = 1.0, 5.0, 30.0


class TimeBudget:
    """``share`` of ``clock``'s seconds as credit, at most ``share × window_s`` of it; see the module
    docstring. ``share`` 0: nothing is ever allowed."""

    def __init__(self, share: float, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        if not 0 <= share <= 1:
            raise ValueError(f"a time budget's share must be in [0, 1], got {share!r}")
        if window_s <= 0:
            raise ValueError(f"a time budget's window must be positive, got {window_s!r}")
        self.share, self.capacity, self.clock = share, share * window_s, clock
        self._credit, self._at = self.capacity, clock()  # full at start
        self._lock = threading.Lock()
        self.spent_s = 0.0  # seconds charged in all
        self.refused = 0  # checks it had no credit for

    def _refill(self) -> float:
        """The credit now (called under the lock)."""
        now = self.clock()
        self._credit = min(self.capacity, self._credit + max(0.0, now - self._at) * self.share)
        self._at = now
        return self._credit

    def credit(self) -> float:
        """Seconds of checking it allows now (negative: a debt)."""
        with self._lock:
            return self._refill()

    def allows(self) -> bool:
        """Whether a check may start now (the credit is positive)."""
        with self._lock:
            return self.share > 0 and self._refill() > 0

    def refuse(self) -> None:
        """Count a check it had no credit for."""
        with self._lock:
            self.refused += 1

    def spend(self, seconds: float) -> None:
        """Charge ``seconds`` a check took (after it ran)."""
        with self._lock:
            self._refill()
            self._credit -= seconds
            self.spent_s += seconds

    def wait_s(self) -> float:
        """Seconds until it allows a check (0: now; inf: share 0)."""
        with self._lock:
            credit = self._refill()
        if credit > 0:
            return 0.0
        return float("inf") if self.share == 0 else -credit / self.share


class CheckBudget:
    """The spot checks' time: ``probation_share`` for authors without a record, ``share -
    probation_share`` for authors with one (see the module docstring)."""

    def __init__(
        self,
        share: float,
        probation_share: float,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        recorded_window_s: float = RECORDED_WINDOW_S,
    ):
        if not 0 <= probation_share < share <= 1:
            raise ValueError(
                f"check budget: need 0 <= probation share < share <= 1, got {probation_share!r} and {share!r}"
            )
        self.probation = TimeBudget(probation_share, window_s, clock)
        self.recorded = TimeBudget(share - probation_share, recorded_window_s, clock)

    def _of(self, probation: bool) -> TimeBudget:
        return self.probation if probation else self.recorded

    def allows(self, probation: bool) -> bool:
        """Whether a check of an author on probation (or with a record) may start now; one that may not
        is counted (``trust/check_busy*``)."""
        budget = self._of(probation)
        if budget.allows():
            return True
        budget.refuse()
        return False

    def spend(self, seconds: float, probation: bool) -> None:
        self._of(probation).spend(seconds)

    def wait_s(self, probation: bool) -> float:
        """Seconds until a check of that kind may start."""
        return self._of(probation).wait_s()

    def retry_after_s(self, probation: bool) -> float:
        """When a batch deferred for want of time should come back (see :data:`RETRY_MIN_S`)."""
        low = PROBATION_RETRY_MIN_S if probation else RETRY_MIN_S
        return min(max(low, self.wait_s(probation)), RETRY_MAX_S)

    def stats(self) -> dict[str, float]:
        return {
            "trust/check_probation_s": round(self.probation.spent_s, 3),
            "trust/check_busy_probation": self.probation.refused,
            "trust/check_busy_recorded": self.recorded.refused,
        }
