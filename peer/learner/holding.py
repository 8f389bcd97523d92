"""Accepted batches held out of training, per author, until a check vouches for them.

Two kinds, one mechanism: an author without a record has every batch held (probation) until it earns one; an
author with a record has its unchecked batches held until one of its later batches passes a check
(:class:`.reputation.Reputation` decides which batches are checked). A pass releases everything the author
holds to the buffer; a strike or a ban drops it. Held batches are in the ledger (accepted, acknowledged),
never in the buffer, so a restart finds them pending and holds them again (the ledger knows which were
released).

Thread-safe: the intake pool's threads hold and release, the release sweep and the training thread read.
"""

from __future__ import annotations

import collections
import threading

from .buffer import Buffered


class HeldBatches:
    def __init__(self) -> None:
        self._held: collections.defaultdict[bytes, list[Buffered]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def hold(self, item: Buffered) -> None:
        with self._lock:
            self._held[item.author].append(item)

    def take(self, author: bytes) -> list[Buffered]:
        """Everything ``author`` holds, oldest first, no longer held (to release or to drop)."""
        with self._lock:
            return self._held.pop(author, [])

    def of(self, author: bytes) -> tuple[int, float | None]:
        """How many batches ``author`` holds and when the oldest was received (None: none)."""
        with self._lock:
            items = self._held.get(author) or []
            return len(items), (items[0].received_at if items else None)

    def groups(self, author: bytes) -> int:
        """Prompt groups in the batches ``author`` holds (what releasing them would give training)."""
        with self._lock:
            return sum(b.groups for b in self._held.get(author) or [])

    def newest(self, author: bytes) -> Buffered | None:
        with self._lock:
            items = self._held.get(author) or []
            return items[-1] if items else None

    def authors(self) -> list[bytes]:
        with self._lock:
            return [a for a, items in self._held.items() if items]

    def count(self, which=lambda author: True) -> int:
        """Batches held for authors for which ``which(author)`` holds."""
        with self._lock:
            sizes = [(a, len(items)) for a, items in self._held.items()]
        return sum(n for a, n in sizes if which(a))

    def __len__(self) -> int:
        return self.count()
