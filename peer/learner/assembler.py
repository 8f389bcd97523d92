"""The next update's batch, assembled while the current one trains.

A thread takes the oldest buffered batches holding one update's prompt groups and turns them into padded
:class:`~.rows.Rows` (on a GPU learner, already copied to the device), then waits until the training thread
has taken them. So the training thread finds its next batch ready instead of building it between steps.

Exactly once still holds: the taken batches stay pending in the ledger until the update that used them is
marked applied, so a batch assembled but never trained on (a crash, a stop) is replayed on restart.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from .buffer import Buffered, TrajectoryBuffer
from .rows import Rows, rows_from_batches


@dataclasses.dataclass(frozen=True)
class Assembled:
    batches: list[Buffered]
    rows: Rows


class BatchAssembler:
    """One assembled batch ahead of training. :meth:`run` is the thread's body; :meth:`take` hands the
    batch over; :meth:`close` ends both (the buffer is closed too, which wakes a waiting take)."""

    def __init__(
        self,
        buffer: TrajectoryBuffer,
        groups: Callable[[], int],
        pad_id: int,
        device: torch.device | str = "cpu",
    ):
        """``groups()``: prompt groups of one update (asked before each assembly)."""
        self.buffer, self.groups, self.pad_id = buffer, groups, pad_id
        self.device = torch.device(device)
        self._cond = threading.Condition()
        self._ready: Assembled | None = None
        self._closed = False
        self.assembled = 0

    def run(self) -> None:
        """Assemble until closed (the thread's body)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ready is None or self._closed)
                if self._closed:
                    return
            batches = self.buffer.take_groups(self.groups())  # blocks until there, or None once closed
            if batches is None:
                return
            rows = self.rows(batches)
            with self._cond:
                self._ready = Assembled(batches, rows)
                self.assembled += 1
                self._cond.notify_all()

    def rows(self, batches: list[Buffered]) -> Rows:
        """``batches`` as one update's rows on the trainer's device."""
        return rows_to(rows_from_batches(batches, self.pad_id), self.device)

    def take(self, timeout: float | None = None) -> Assembled | None:
        """The next assembled batch, waiting up to ``timeout`` (None: until there or closed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready is not None or self._closed, timeout)
            out, self._ready = self._ready, None
            self._cond.notify_all()
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.buffer.close()


def rows_to(rows: Rows, device: torch.device) -> Rows:
    """``rows``' float and id tensors on ``device`` (pinned, copied without blocking on a GPU); as is on the
    CPU. Completions and mask stay on the CPU, where the prompts are packed around them."""
    if device.type == "cpu":
        return rows

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True)

    moved = dataclasses.replace(
        rows,
        logq=move(rows.logq),
        rewards=move(rows.rewards),
        group_ids=move(rows.group_ids),
        versions=move(rows.versions),
    )
    torch.cuda.current_stream(device).synchronize()  # the copies are done before training reads them
    return moved
