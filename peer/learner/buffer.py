"""The learner's bounded buffer of accepted batches, filled from the network thread, drained by training."""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class Buffered:
    batch_id: bytes
    author: bytes
    body: dict
    received_at: float
    sha256: bytes = b""  # of its signed bytes, as accepted (learner peers name a batch by id and this)

    @property
    def groups(self) -> int:
        return len({r["group"] for r in self.body["rows"]})

    @property
    def tokens(self) -> int:
        """Completion tokens: what the update's mask counts of it."""
        return sum(len(r["completion_ids"]) for r in self.body["rows"])


class TrajectoryBuffer:
    """FIFO of accepted batches. ``has_room`` drives the receiver's flow control ("busy, retry later")."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: collections.deque[Buffered] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def has_room(self) -> bool:
        with self._cond:
            return len(self._items) < self.capacity

    def put(self, item: Buffered) -> None:
        """Never refuses: an accepted batch is already in the ledger, so it must reach training."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def take_groups(self, groups: int, timeout: float | None = None) -> list[Buffered] | None:
        """The oldest batches holding at least ``groups`` prompt groups; None if not there in time
        (``timeout`` None: wait until they are) or once the buffer is closed."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._closed or sum(b.groups for b in self._items) >= groups, timeout
            )
            if not ready or self._closed:
                return None
            out, n = [], 0
            while n < groups:
                b = self._items.popleft()
                out.append(b)
                n += b.groups
            return out

    def groups(self) -> int:
        """Prompt groups waiting (what an update takes ``learner.prompts_per_update`` of)."""
        with self._cond:
            return sum(b.groups for b in self._items)

    def drop_author(self, author: bytes) -> list[bytes]:
        """Take every batch of ``author`` out (a banned author's): their ids."""
        with self._cond:
            gone = [b.batch_id for b in self._items if b.author == author]
            self._items = collections.deque(b for b in self._items if b.author != author)
            return gone

    def count(self, which) -> int:
        """Batches waiting for which ``which(item)`` holds."""
        with self._cond:
            items = list(self._items)
        return sum(1 for b in items if which(b))

    def close(self) -> None:
        """Wake every waiting taker with None; nothing is taken from now on (the ledger keeps the rest)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


def staleness_refusal(
    step: int, policy_version: int, published_version: int, max_staleness: int
) -> str | None:
    """Why the learner at ``step`` refuses a batch sampled with ``policy_version``, or None to admit it.

    A version newer than any published is a forgery or a bug; beyond ``max_staleness`` versions behind
    (``-1``: no limit) the run drops the batch.
    """
    if policy_version > published_version:
        return f"sampled with version {policy_version}, newer than any published"
    lag = step - policy_version
    if max_staleness >= 0 and lag > max_staleness:
        return f"{lag} versions stale, the run drops beyond {max_staleness}"
    return None
