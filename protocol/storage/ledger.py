"""The learner's durable ledger of accepted TrajectoryBatch messages: dedupe, replay, apply-exactly-once.

Delivery from samplers is at-least-once (their :class:`~.outbox.Outbox` resends until it sees an Ack), so the
learner must recognise a batch it already has. :meth:`AcceptedLog.accept` commits the batch (its signed wire
bytes, as received) before the receiver sends the Ack; a batch is therefore never acknowledged and lost,
and a resend after a lost Ack is answered "already have it" by :meth:`AcceptedLog.seen` / ``accept``.

One sqlite3 file in WAL mode with ``synchronous=FULL`` and its own ``application_id`` (distinct from the
outbox's, so opening the wrong file fails clearly). Each batch moves from *pending* (accepted, not yet
trained on) to *applied at learner step N* via :meth:`~AcceptedLog.mark_applied`. A learner that restarts
from a checkpoint taken at step N calls ``pending(applied_after=N)``: batches applied after its last saved
state are un-marked and handed back with the never-applied ones, so none is lost and none is applied twice.
Which accepted batches were released to training (:meth:`~AcceptedLog.mark_released`) and each author's
record (:meth:`~AcceptedLog.save_author`) are kept beside them, so a restart holds again what no check
vouched for. :meth:`~AcceptedLog.prune_applied` drops the payloads of batches no checkpoint restart can need
any more but keeps their ids, so dedupe still holds. With several learner peers, a sampler that lost an Ack
may resend a batch to another learner: :meth:`~AcceptedLog.record_lineage` keeps the ids every Commit of the
lineage trained, and drops this learner's own pending copy of any of them.

Pure storage: no sockets, no asyncio. Every operation holds one lock, so an ``asyncio.to_thread`` worker and
the main thread may share an instance. Not here: flow control (the receiver's ``has_room``), decoding or
verifying the batches (see :mod:`protocol.wire.messages`, :mod:`protocol.net.trajectories`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import time
from collections.abc import Iterable

from heterorl.protocol.storage.sqlite_util import SqliteStore

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
APPLICATION_ID = 0x48524C47  # "HRLG": tells a ledger file from an outbox ("HROB") or any other sqlite file

_SCHEMA = """
CREATE TABLE batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    batch_id BLOB NOT NULL UNIQUE,
    author BLOB NOT NULL,
    policy_version INTEGER NOT NULL,
    data BLOB,
    size INTEGER NOT NULL,
    received_at REAL NOT NULL,
    applied_step INTEGER
);
CREATE INDEX batches_applied_step ON batches (applied_step);
CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
# data is NULL (and size 0) once pruned; applied_step is NULL while the batch is pending, DROPPED if dropped.
DROPPED = -1

# added after the first schema: created where missing, so a ledger written before them opens as it was
_ADDED = (
    "CREATE TABLE IF NOT EXISTS dropped (batch_id BLOB PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS bans (author BLOB PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL)",
    # batches released to training (vouched for by a check); the others a restart holds again
    "CREATE TABLE IF NOT EXISTS released (batch_id BLOB PRIMARY KEY)",
    # what the learner knows of each author (its record, strikes, probation), as JSON
    "CREATE TABLE IF NOT EXISTS authors (author BLOB PRIMARY KEY, record TEXT NOT NULL)",
    # learner peers: every batch the lineage trained (any learner's, from each Commit), at which version
    "CREATE TABLE IF NOT EXISTS lineage (batch_id BLOB PRIMARY KEY, version INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS lineage_version ON lineage (version)",
)


@dataclasses.dataclass(frozen=True)
class LedgerItem:
    """One accepted batch; ``data`` is its signed wire bytes (``b""`` once pruned)."""

    batch_id: bytes
    author: bytes
    policy_version: int
    data: bytes
    received_at: float
    applied_step: int | None
    released: bool = False  # released to training (trained on, or vouched for by a check)


_ITEM_COLUMNS = (
    "batch_id, author, policy_version, coalesce(data, x''), received_at, applied_step,"
    " EXISTS (SELECT 1 FROM released r WHERE r.batch_id = batches.batch_id)"
)


class AcceptedLog(SqliteStore):
    """Append-only on-disk record of accepted batches, keyed by batch id, with their applied/pending state."""

    KIND, APPLICATION_ID, SCHEMA_VERSION, SCHEMA = "ledger", APPLICATION_ID, SCHEMA_VERSION, _SCHEMA

    def __init__(self, path) -> None:
        super().__init__(path)
        with self._txn() as conn:
            for statement in _ADDED:
                conn.execute(statement)

    # -- dropping: a banned author's batches not yet trained on --------------------------------------------

    def drop(self, batch_ids: Iterable[bytes], reason: str, at: float) -> int:
        """Mark pending batches dropped, with the reason: never handed back by :meth:`pending` (a restart
        does not replay them). Returns how many were pending."""
        with self._txn() as conn:
            n = 0
            for b in batch_ids:
                b = bytes(b)
                n += conn.execute(
                    "UPDATE batches SET applied_step = ? WHERE batch_id = ? AND applied_step IS NULL",
                    (DROPPED, b),
                ).rowcount
                conn.execute(
                    "INSERT OR REPLACE INTO dropped (batch_id, reason, at) VALUES (?, ?, ?)", (b, reason, at)
                )
        return n

    def pending_of(self, author: bytes) -> list[bytes]:
        """Ids of ``author``'s batches accepted and not yet applied."""
        with self._txn() as conn:
            rows = conn.execute(
                "SELECT batch_id FROM batches WHERE author = ? AND applied_step IS NULL ORDER BY seq",
                (bytes(author),),
            ).fetchall()
        return [r[0] for r in rows]

    def dropped(self) -> dict[bytes, str]:
        """Dropped batch ids and why."""
        with self._txn() as conn:
            return dict(conn.execute("SELECT batch_id, reason FROM dropped").fetchall())

    def ban(self, author: bytes, reason: str, at: float) -> None:
        with self._txn() as conn:
            row = (bytes(author), reason, at)
            conn.execute("INSERT OR IGNORE INTO bans (author, reason, at) VALUES (?, ?, ?)", row)

    def bans(self) -> dict[bytes, str]:
        """Authors banned for the run, and why (they stay banned across restarts)."""
        with self._txn() as conn:
            return dict(conn.execute("SELECT author, reason FROM bans").fetchall())

    # -- releasing and authors' records -------------------------------------------------------------------

    def mark_released(self, batch_ids: Iterable[bytes]) -> None:
        """These batches go to training: a restart replays them to the buffer, not to the held ones."""
        with self._txn() as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO released (batch_id) VALUES (?)", [(bytes(b),) for b in batch_ids]
            )

    def save_author(self, author: bytes, record: dict | None) -> None:
        """Persist an author's record (JSON-able), or forget it (None)."""
        with self._txn() as conn:
            if record is None:
                conn.execute("DELETE FROM authors WHERE author = ?", (bytes(author),))
            else:
                conn.execute(
                    "INSERT OR REPLACE INTO authors (author, record) VALUES (?, ?)",
                    (bytes(author), json.dumps(record)),
                )

    def authors(self) -> dict[bytes, dict]:
        with self._txn() as conn:
            rows = conn.execute("SELECT author, record FROM authors").fetchall()
        return {a: json.loads(r) for a, r in rows}

    # -- receiving -----------------------------------------------------------------------------------------

    def accept(
        self, batch_id: bytes, author: bytes, policy_version: int, data: bytes, received_at: float
    ) -> bool:
        """Durably record a batch (committed before return). True if new, False if ``batch_id`` was present.

        A duplicate leaves the stored batch as it was (first copy wins) and is counted.
        """
        batch_id, author, data = bytes(batch_id), bytes(author), bytes(data)
        if not batch_id:
            raise ValueError("batch_id must be non-empty")
        with self._txn() as conn:
            fresh = (
                conn.execute(
                    "INSERT OR IGNORE INTO batches"
                    " (batch_id, author, policy_version, data, size, received_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (batch_id, author, int(policy_version), data, len(data), float(received_at)),
                ).rowcount
                > 0
            )
            if not fresh:
                self._bump(conn, "duplicates")
        return fresh

    def seen(self, batch_id: bytes) -> bool:
        """Whether ``batch_id`` was ever accepted (pruned batches included), or trained by another learner
        of the lineage (a sampler resent it here after losing that learner's Ack)."""
        b = bytes(batch_id)
        with self._txn() as conn:
            row = conn.execute(
                "SELECT 1 FROM batches WHERE batch_id = ? UNION ALL SELECT 1 FROM lineage WHERE batch_id = ?",
                (b, b),
            ).fetchone()
        return row is not None

    def get(self, batch_id: bytes) -> LedgerItem | None:
        """The stored batch, or None if never accepted."""
        with self._txn() as conn:
            row = conn.execute(
                f"SELECT {_ITEM_COLUMNS} FROM batches WHERE batch_id = ?", (bytes(batch_id),)
            ).fetchone()
        return None if row is None else LedgerItem(*row)

    # -- applying ------------------------------------------------------------------------------------------

    def mark_applied(self, batch_ids: Iterable[bytes], step: int) -> int:
        """Mark pending batches as applied at learner step ``step``, all in one transaction.

        Returns how many were marked; ids unknown or already applied are left alone (not counted).
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        ids = [(step, bytes(b)) for b in batch_ids]
        with self._txn() as conn:
            marked = 0
            for params in ids:
                marked += conn.execute(
                    "UPDATE batches SET applied_step = ? WHERE batch_id = ? AND applied_step IS NULL", params
                ).rowcount
        return marked

    def pending(self, applied_after: int | None = None) -> list[LedgerItem]:
        """Accepted but not applied batches, oldest (first accepted) first.

        With ``applied_after=N`` (a learner resuming from its checkpoint at step N), every batch applied at a
        step > N is first un-marked, in the same transaction, so it is returned for replay. A batch whose
        payload was already pruned cannot be replayed: it stays marked, and a warning is logged (prune only
        below the oldest checkpoint a restart may use).
        """
        with self._txn() as conn:
            if applied_after is not None:
                after = int(applied_after)
                conn.execute(  # trained on, so released: replayed to training again
                    "INSERT OR IGNORE INTO released (batch_id)"
                    " SELECT batch_id FROM batches WHERE applied_step > ? AND data IS NOT NULL",
                    (after,),
                )
                conn.execute(
                    "UPDATE batches SET applied_step = NULL WHERE applied_step > ? AND data IS NOT NULL",
                    (after,),
                )
                lost = conn.execute(
                    "SELECT count(*) FROM batches WHERE applied_step > ? AND data IS NULL", (after,)
                ).fetchone()[0]
                if lost:
                    log.warning(
                        "ledger %s: %d batches applied after step %d were pruned and cannot be replayed",
                        self.path,
                        lost,
                        after,
                    )
            rows = conn.execute(
                f"SELECT {_ITEM_COLUMNS} FROM batches WHERE applied_step IS NULL ORDER BY seq"
            ).fetchall()
        return [LedgerItem(*row) for row in rows]

    def prune_applied(self, before_step: int) -> int:
        """Drop the payloads of batches applied at a step < ``before_step``; keep their ids for dedupe.

        Returns how many payloads were dropped. The file's freed pages are reused by later batches.
        """
        with self._txn() as conn:
            conn.execute(  # never replayed again: whether it was released no longer matters
                "DELETE FROM released WHERE batch_id IN"
                " (SELECT batch_id FROM batches WHERE applied_step < ? AND data IS NOT NULL)",
                (int(before_step),),
            )
            return conn.execute(
                "UPDATE batches SET data = NULL, size = 0 WHERE applied_step < ? AND data IS NOT NULL",
                (int(before_step),),
            ).rowcount

    # -- learner peers: what the whole lineage trained -----------------------------------------------------

    def record_lineage(self, batch_ids: Iterable[bytes], version: int, reason: str) -> list[bytes]:
        """Record that the lineage trained ``batch_ids`` at (or, from a state offer, by) ``version``. This
        learner's own pending copies of them (a sampler resent a batch whose Ack was lost to another
        learner) are dropped with ``reason``, never trained twice; their ids are returned."""
        ids = [bytes(b) for b in batch_ids]
        with self._txn() as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO lineage (batch_id, version) VALUES (?, ?)",
                [(b, int(version)) for b in ids],
            )
            dropped = [
                b
                for b in ids
                if conn.execute(
                    "UPDATE batches SET applied_step = ? WHERE batch_id = ? AND applied_step IS NULL",
                    (DROPPED, b),
                ).rowcount
            ]
            conn.executemany(
                "INSERT OR REPLACE INTO dropped (batch_id, reason, at) VALUES (?, ?, ?)",
                [(b, reason, time.time()) for b in dropped],
            )
        return dropped

    def in_lineage(self, batch_ids: Iterable[bytes]) -> set[bytes]:
        """Those of ``batch_ids`` the lineage already trained."""
        with self._txn() as conn:
            return {
                b
                for b in (bytes(x) for x in batch_ids)
                if conn.execute("SELECT 1 FROM lineage WHERE batch_id = ?", (b,)).fetchone()
            }

    def lineage_since(self, version: int, limit: int) -> list[bytes]:
        """Ids of the batches the lineage trained after ``version``: the newest ``limit`` of them."""
        with self._txn() as conn:
            rows = conn.execute(
                "SELECT batch_id FROM lineage WHERE version > ? ORDER BY version DESC LIMIT ?",
                (int(version), int(limit)),
            ).fetchall()
        return [r[0] for r in rows]

    # -- introspection -----------------------------------------------------------------------------------

    def count(self) -> int:
        """Batches ever accepted (pruned ones included)."""
        with self._txn() as conn:
            return conn.execute("SELECT count(*) FROM batches").fetchone()[0]

    def __len__(self) -> int:
        return self.count()

    def applied_count(self) -> int:
        """Batches marked applied (pruned ones included)."""
        with self._txn() as conn:
            return conn.execute("SELECT count(*) FROM batches WHERE applied_step >= 0").fetchone()[0]

    def applied_ids(self, step: int | None = None) -> list[bytes]:
        """Ids of the applied batches (only those applied at ``step`` if given), oldest first."""
        with self._txn() as conn:
            if step is None:
                rows = conn.execute(
                    "SELECT batch_id FROM batches WHERE applied_step >= 0 ORDER BY seq"
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT batch_id FROM batches WHERE applied_step = ? ORDER BY seq", (int(step),)
                ).fetchall()
        return [row[0] for row in rows]

    def stats(self) -> dict[str, int]:
        """Counts under ``ledger/…`` keys; ``duplicates`` is a persisted lifetime counter."""
        with self._txn() as conn:
            accepted, applied, dropped, stored = conn.execute(
                "SELECT count(*), count(applied_step >= 0 OR NULL), count(applied_step < 0 OR NULL),"
                " coalesce(sum(size), 0) FROM batches"
            ).fetchone()
            row = conn.execute("SELECT value FROM counters WHERE name = 'duplicates'").fetchone()
        return {
            "ledger/accepted": accepted,
            "ledger/duplicates": 0 if row is None else row[0],
            "ledger/applied": applied,
            "ledger/pending": accepted - applied - dropped,
            "ledger/dropped": dropped,
            "ledger/bytes": stored,
        }

    @staticmethod
    def _bump(conn: sqlite3.Connection, name: str, by: int = 1) -> None:
        conn.execute(
            "INSERT INTO counters (name, value) VALUES (?, ?)"
            " ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, by),
        )
