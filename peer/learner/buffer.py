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

    @property
    def groups(self) -> int:
        return len({r["group"] for r in self.body["rows"]})


def check_update_fits(prompts_per_update: int, prompts_per_batch: int, buffer_batches: int) -> None:
    """ValueError unless a full buffer holds one update's prompt groups.

    The receiver says "busy" once ``buffer_batches`` batches wait, so with fewer than ``prompts_per_update``
    groups in them the learner would wait for an update that can never fill (found by ``heterorl simulate``).
    """
    if buffer_batches * prompts_per_batch < prompts_per_update:
        need = -(-prompts_per_update // prompts_per_batch)
        raise ValueError(
            f"learner.buffer_batches ({buffer_batches}) × sampler.prompts_per_batch ({prompts_per_batch}) = "
            f"{buffer_batches * prompts_per_batch} prompt groups, fewer than learner.prompts_per_update "
            f"({prompts_per_update}): the learner could never fill an update; set buffer_batches >= {need}"
        )


class TrajectoryBuffer:
    """FIFO of accepted batches. ``has_room`` drives the receiver's flow control ("busy, retry later")."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items: collections.deque[Buffered] = collections.deque()
        self._cond = threading.Condition()

    def has_room(self) -> bool:
        with self._cond:
            return len(self._items) < self.capacity

    def put(self, item: Buffered) -> None:
        """Never refuses: an accepted batch is already in the ledger, so it must reach training."""
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def take_groups(self, groups: int, timeout: float) -> list[Buffered] | None:
        """The oldest batches holding at least ``groups`` prompt groups, or None if not there in time."""
        with self._cond:
            if not self._cond.wait_for(lambda: sum(b.groups for b in self._items) >= groups, timeout):
                return None
            out, n = [], 0
            while n < groups:
                b = self._items.popleft()
                out.append(b)
                n += b.groups
            return out

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
