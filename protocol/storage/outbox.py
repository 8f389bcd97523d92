"""The sampler's durable, bounded queue of signed TrajectoryBatch messages a learner has not yet acknowledged.

One sqlite3 file in WAL mode with ``synchronous=FULL``: :meth:`Outbox.put` commits before it returns, so a
sampler restart (or SIGKILL) loses nothing that was put, and a learner outage loses nothing that fits the
caps. When a cap (items or bytes) is exceeded the OLDEST items are dropped — they are the stalest, least
useful for on-policy training — and their ids are returned and counted.

The sender loop is: ``due()`` → send each item → ``ack`` (learner accepted or already had it), ``reject``
(learner refused it for good; the reason is kept in a bounded ``rejections`` table), or ``retry``
(exponential backoff with full jitter, or exactly the learner's ``retry_after_s``). ``next_due_in()``
says how long to sleep instead of polling. Items are not marked in flight: one sender loop owns
``due``/``ack``/``retry``.

Pure storage: no sockets, no asyncio. Every operation holds one lock, so a network thread and the main thread
may share an instance. Not here: sending, message encoding or signing (see :mod:`protocol.wire.messages`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from heterorl.protocol.storage.sqlite_util import SqliteStore

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
APPLICATION_ID = 0x48524F42  # "HROB": tells an outbox file from a ledger or any other sqlite file
BACKOFF_BASE_S = 0.5
BACKOFF_FACTOR = 2.0
BACKOFF_CAP_S = 60.0
MAX_RETRY_AFTER_S = 3600.0  # a learner's flow-control hint is clamped to this: it is peer-supplied
MAX_REJECTIONS = 1000
MAX_REASON_CHARS = 1024
_MAX_EXPONENT = 64  # attempts beyond this cannot raise the (already capped) backoff; avoids float overflow
_COUNTERS = ("dropped", "acked", "rejected", "retries")

_SCHEMA = """
CREATE TABLE items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    batch_id BLOB NOT NULL UNIQUE,
    data BLOB NOT NULL,
    size INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    next_attempt_at REAL NOT NULL
);
CREATE INDEX items_next_attempt ON items (next_attempt_at);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE rejections (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    batch_id BLOB NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
"""


@dataclasses.dataclass(frozen=True)
class OutboxItem:
    """One queued message; ``data`` is the signed wire bytes, sent as is."""

    batch_id: bytes
    data: bytes
    policy_version: int
    attempts: int
    created_at: float
    next_attempt_at: float


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why a learner refused a batch for good (diagnostics only)."""

    batch_id: bytes
    reason: str
    at: float


class Outbox(SqliteStore):
    """Bounded on-disk queue of signed batches awaiting a learner's Ack; drops the oldest when full.

    ``max_items`` and ``max_bytes`` (sum of ``len(data)``) are the caps; ``clock`` gives seconds (injectable
    for tests, as is ``rng`` for the backoff jitter). Caps are re-applied on open, so reopening with smaller
    caps drops the oldest items (logged, counted).
    """

    KIND, APPLICATION_ID, SCHEMA_VERSION, SCHEMA = "outbox", APPLICATION_ID, SCHEMA_VERSION, _SCHEMA

    def __init__(
        self,
        path: Path | str,
        max_items: int = 1024,
        max_bytes: int = 256 << 20,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError(f"max_items and max_bytes must be >= 1, got {max_items} and {max_bytes}")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        super().__init__(path)
        try:
            with self._txn() as conn:
                dropped = self._enforce_caps(conn)
        except BaseException:
            self.close()
            raise
        if dropped:
            log.warning("outbox %s: dropped %d oldest items on open to fit the caps", self.path, len(dropped))

    # -- queue operations --------------------------------------------------------------------------------

    def put(self, batch_id: bytes, data: bytes, policy_version: int) -> list[bytes]:
        """Durably enqueue a signed batch (committed before return); a batch_id already queued is a no-op.

        Returns the ids of the oldest items dropped to fit the caps (empty when none). Raises ``ValueError``
        for an item larger than ``max_bytes`` on its own.
        """
        batch_id, data = bytes(batch_id), bytes(data)
        if not batch_id:
            raise ValueError("batch_id must be non-empty")
        if len(data) > self.max_bytes:
            raise ValueError(f"item of {len(data)} bytes exceeds the outbox cap of {self.max_bytes} bytes")
        now = float(self._clock())
        with self._txn() as conn:
            cur = conn.execute(
                "INSERT OR IGNORE INTO items (batch_id, data, size, policy_version, created_at,"
                " next_attempt_at) VALUES (?, ?, ?, ?, ?, ?)",
                (batch_id, data, len(data), int(policy_version), now, now),
            )
            if cur.rowcount == 0:
                return []
            return self._enforce_caps(conn)

    def _enforce_caps(self, conn: sqlite3.Connection) -> list[bytes]:
        """Delete the oldest items until both caps hold; count and return their ids (inside a transaction)."""
        count, total = conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM items").fetchone()
        if count <= self.max_items and total <= self.max_bytes:
            return []
        dropped: list[bytes] = []
        last_seq = -1
        for seq, batch_id, size in conn.execute("SELECT seq, batch_id, size FROM items ORDER BY seq"):
            if count <= self.max_items and total <= self.max_bytes:
                break
            dropped.append(batch_id)
            count -= 1
            total -= size
            last_seq = seq
        conn.execute("DELETE FROM items WHERE seq <= ?", (last_seq,))
        self._bump(conn, "dropped", len(dropped))
        return dropped

    def due(self, limit: int = 16) -> list[OutboxItem]:
        """Up to ``limit`` items whose next attempt time has come, oldest (first put) first."""
        now = float(self._clock())
        with self._txn() as conn:
            rows = conn.execute(
                "SELECT batch_id, data, policy_version, attempts, created_at, next_attempt_at FROM items"
                " WHERE next_attempt_at <= ? ORDER BY seq LIMIT ?",
                (now, max(0, int(limit))),  # a negative LIMIT would mean "no limit" to sqlite
            ).fetchall()
        return [OutboxItem(*row) for row in rows]

    def ack(self, batch_id: bytes) -> bool:
        """The learner has it (accepted now or before): remove it. True if it was queued."""
        with self._txn() as conn:
            removed = conn.execute("DELETE FROM items WHERE batch_id = ?", (bytes(batch_id),)).rowcount > 0
            if removed:
                self._bump(conn, "acked")
        return removed

    def reject(self, batch_id: bytes, reason: str) -> bool:
        """The learner refused it for good: remove it; keep ``reason`` (truncated) among recent rejections."""
        batch_id = bytes(batch_id)
        now = float(self._clock())
        with self._txn() as conn:
            removed = conn.execute("DELETE FROM items WHERE batch_id = ?", (batch_id,)).rowcount > 0
            if removed:
                self._bump(conn, "rejected")
                conn.execute(
                    "INSERT INTO rejections (batch_id, reason, at) VALUES (?, ?, ?)",
                    (batch_id, str(reason)[:MAX_REASON_CHARS], now),
                )
                conn.execute(
                    "DELETE FROM rejections WHERE seq <= (SELECT max(seq) FROM rejections) - ?",
                    (MAX_REJECTIONS,),
                )
        return removed

    def retry(self, batch_id: bytes, *, retry_after_s: float | None = None) -> float:
        """Schedule another attempt; returns the delay in seconds.

        The delay is ``retry_after_s`` when the learner gave one (clamped to ``[0, MAX_RETRY_AFTER_S]``),
        else full-jitter exponential backoff: uniform in ``[0, min(BACKOFF_CAP_S, BACKOFF_BASE_S *
        BACKOFF_FACTOR ** (attempts - 1))]`` with ``attempts`` counting this retry. An item no longer queued
        (acked, or dropped by a concurrent put) is left alone and 0.0 is returned.
        """
        if retry_after_s is not None:
            if math.isnan(retry_after_s):
                raise ValueError("retry_after_s is NaN")
            retry_after_s = min(max(float(retry_after_s), 0.0), MAX_RETRY_AFTER_S)
        now = float(self._clock())
        with self._txn() as conn:
            row = conn.execute("SELECT attempts FROM items WHERE batch_id = ?", (bytes(batch_id),)).fetchone()
            if row is None:
                return 0.0
            attempts = row[0] + 1
            if retry_after_s is not None:
                delay = retry_after_s
            else:
                delay = self._rng.uniform(0.0, backoff_ceiling(attempts))
            conn.execute(
                "UPDATE items SET attempts = ?, next_attempt_at = ? WHERE batch_id = ?",
                (attempts, now + delay, bytes(batch_id)),
            )
            self._bump(conn, "retries")
        return delay

    def retry_all_now(self) -> int:
        """Make every queued item due now (a learner came back: no point waiting out the backoff)."""
        now = float(self._clock())
        with self._txn() as conn:
            return conn.execute(
                "UPDATE items SET next_attempt_at = ? WHERE next_attempt_at > ?", (now, now)
            ).rowcount

    def next_due_in(self) -> float | None:
        """Seconds until the earliest item is due: 0.0 if one is due now, None if the outbox is empty."""
        now = float(self._clock())
        with self._txn() as conn:
            earliest = conn.execute("SELECT min(next_attempt_at) FROM items").fetchone()[0]
        return None if earliest is None else max(0.0, earliest - now)

    # -- introspection -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._txn() as conn:
            return conn.execute("SELECT count(*) FROM items").fetchone()[0]

    def bytes(self) -> int:
        """Total ``len(data)`` of the queued items."""
        with self._txn() as conn:
            return conn.execute("SELECT coalesce(sum(size), 0) FROM items").fetchone()[0]

    def rejections(self, limit: int = 100) -> list[Rejection]:
        """The most recent rejections, newest first (at most ``MAX_REJECTIONS`` are kept)."""
        with self._txn() as conn:
            rows = conn.execute(
                "SELECT batch_id, reason, at FROM rejections ORDER BY seq DESC LIMIT ?", (max(0, int(limit)),)
            ).fetchall()
        return [Rejection(*row) for row in rows]

    def stats(self) -> dict[str, int]:
        """Queue size and the persisted lifetime counters, under ``outbox/…`` keys."""
        with self._txn() as conn:
            count, total = conn.execute("SELECT count(*), coalesce(sum(size), 0) FROM items").fetchone()
            counters = dict(conn.execute("SELECT name, value FROM counters").fetchall())
        out = {"outbox/items": count, "outbox/bytes": total}
        out.update({f"outbox/{name}": counters.get(name, 0) for name in _COUNTERS})
        return out

    @staticmethod
    def _bump(conn: sqlite3.Connection, name: str, by: int = 1) -> None:
        conn.execute(
            "INSERT INTO counters (name, value) VALUES (?, ?)"
            " ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, by),
        )


def backoff_ceiling(attempts: int) -> float:
    """Upper bound of the full-jitter delay before attempt ``attempts + 1`` (``attempts >= 1``)."""
    exponent = min(max(attempts - 1, 0), _MAX_EXPONENT)
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * BACKOFF_FACTOR**exponent)
