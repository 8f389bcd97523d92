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
may resend a batch to another learner: :meth:`~AcceptedLog.record_lineage` keeps the ids (and the sha256 of
the bytes) every Commit of the lineage trained, and drops this learner's own pending copy of any of them
with the same bytes; :meth:`~AcceptedLog.adopt_lineage` makes a joiner's ledger agree with the state it took
(what the lineage trained is never trained here again; what only an abandoned branch trained is replayed).

Pure storage: no sockets, no asyncio. Every operation holds one lock, so an ``asyncio.to_thread`` worker and
the main thread may share an instance. Not here: flow control (the receiver's ``has_room``), decoding or
verifying the batches (see :mod:`protocol.wire.messages`, :mod:`protocol.net.trajectories`).
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    # learner peers: every batch the lineage trained (any learner's, from each Commit), by id and the sha256
    # of its signed bytes, at which version; the window it covers starts at the counter 'trained_from'
    "CREATE TABLE IF NOT EXISTS trained"
    " (batch_id BLOB PRIMARY KEY, sha256 BLOB NOT NULL, version INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS trained_version ON trained (version)",
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
                "SELECT 1 FROM batches WHERE batch_id = ? UNION ALL SELECT 1 FROM trained WHERE batch_id = ?",
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

    def record_lineage(
        self, batches: Iterable[tuple[bytes, bytes]], version: int, reason: str
    ) -> list[bytes]:
        """Record that the lineage trained ``batches`` ((id, sha256 of its signed bytes) each) at ``version``.
        This learner's own pending copy of one (a sampler resent a batch whose Ack was lost to another
        learner) is dropped with ``reason`` if its bytes hash the same, never trained twice (a copy with other
        bytes stays: no one names another learner's batches away); the ids dropped are returned."""
        entries = [(bytes(b), bytes(h)) for b, h in batches]
        with self._txn() as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO trained (batch_id, sha256, version) VALUES (?, ?, ?)",
                [(b, h, int(version)) for b, h in entries],
            )
            dropped = self._drop_copies(conn, entries, reason)
        return dropped

    @staticmethod
    def _drop_copies(
        conn: sqlite3.Connection, entries: list[tuple[bytes, bytes]], reason: str
    ) -> list[bytes]:
        dropped = []
        for b, h in entries:
            row = conn.execute(
                "SELECT data FROM batches WHERE batch_id = ? AND applied_step IS NULL AND data IS NOT NULL",
                (b,),
            ).fetchone()
            if row is not None and hashlib.sha256(row[0]).digest() == h:
                conn.execute("UPDATE batches SET applied_step = ? WHERE batch_id = ?", (DROPPED, b))
                conn.execute(
                    "INSERT OR REPLACE INTO dropped (batch_id, reason, at) VALUES (?, ?, ?)",
                    (b, reason, time.time()),
                )
                dropped.append(b)
        return dropped

    def in_lineage(self, batch_ids: Iterable[bytes]) -> set[bytes]:
        """Those of ``batch_ids`` the lineage already trained."""
        with self._txn() as conn:
            return {
                b
                for b in (bytes(x) for x in batch_ids)
                if conn.execute("SELECT 1 FROM trained WHERE batch_id = ?", (b,)).fetchone()
            }

    def lineage_window(self, limit: int) -> tuple[list[tuple[bytes, bytes]], int]:
        """The newest ``limit`` batches the lineage trained ((id, sha256) each, newest first) and the version
        from which on the list names every one (the window a joiner reconciles against)."""
        with self._txn() as conn:
            rows = conn.execute(
                "SELECT batch_id, sha256, version FROM trained ORDER BY version DESC LIMIT ?",
                (int(limit) + 1,),
            ).fetchall()
            start = self._counter(conn, "trained_from")
        if len(rows) > limit:  # the window ends inside the oldest version listed: from the next one on
            start = max(start, rows[limit][2] + 1)
            rows = [r for r in rows[:limit] if r[2] >= start]
        return [(r[0], r[1]) for r in rows], start

    def adopt_lineage(
        self, batches: list[tuple[bytes, bytes]], version: int, trained_from: int, reason: str
    ) -> tuple[list[LedgerItem], list[bytes], int]:
        """This learner took a lineage's state at ``version``, which holds every batch in ``batches`` and,
        from version ``trained_from`` on, no other. The lineage table becomes that window. Then, of this
        learner's own batches: a pending copy of one the lineage trained (same bytes) is dropped with
        ``reason``; one it applied at a version the window covers that the lineage did not train (a branch
        the lineage abandoned) is pending again. Returns those (to replay), the ids dropped, and how many such
        batches cannot be replayed (their payloads pruned)."""
        entries = [(bytes(b), bytes(h)) for b, h in batches]
        names = {b for b, _ in entries}
        with self._txn() as conn:
            conn.execute("DELETE FROM trained")
            conn.executemany(
                "INSERT OR IGNORE INTO trained (batch_id, sha256, version) VALUES (?, ?, ?)",
                [(b, h, int(version)) for b, h in entries],
            )
            conn.execute(
                "INSERT OR REPLACE INTO counters (name, value) VALUES ('trained_from', ?)",
                (int(trained_from),),
            )
            dropped = self._drop_copies(conn, entries, reason)
            rows = conn.execute(
                "SELECT batch_id, data IS NULL FROM batches WHERE applied_step >= ?", (int(trained_from),)
            ).fetchall()
            abandoned = [(b, pruned) for b, pruned in rows if b not in names]
            lost = sum(1 for _, pruned in abandoned if pruned)
            again = [b for b, pruned in abandoned if not pruned]
            conn.executemany(
                "UPDATE batches SET applied_step = NULL WHERE batch_id = ?", [(b,) for b in again]
            )
            conn.executemany("INSERT OR IGNORE INTO released (batch_id) VALUES (?)", [(b,) for b in again])
            items = [
                LedgerItem(
                    *conn.execute(f"SELECT {_ITEM_COLUMNS} FROM batches WHERE batch_id = ?", (b,)).fetchone()
                )
                for b in again
            ]
        return items, dropped, lost

    def unapply_after(self, version: int) -> list[LedgerItem]:
        """Batches applied at a version > ``version`` (a state this learner resumes from does not hold them)
        are pending again, and the lineage table forgets those versions; the batches are returned (to
        replay: released, they go to training)."""
        after = int(version)
        with self._txn() as conn:
            conn.execute("DELETE FROM trained WHERE version > ?", (after,))
            ids = [
                r[0]
                for r in conn.execute(
                    "SELECT batch_id FROM batches WHERE applied_step > ? AND data IS NOT NULL", (after,)
                ).fetchall()
            ]
            conn.executemany("UPDATE batches SET applied_step = NULL WHERE batch_id = ?", [(b,) for b in ids])
            conn.executemany("INSERT OR IGNORE INTO released (batch_id) VALUES (?)", [(b,) for b in ids])
            items = [
                LedgerItem(
                    *conn.execute(f"SELECT {_ITEM_COLUMNS} FROM batches WHERE batch_id = ?", (b,)).fetchone()
                )
                for b in ids
            ]
        return items

    def prune_lineage(self, keep: int) -> None:
        """Keep the newest ``keep`` batches of the lineage table (whole versions); its window starts later."""
        with self._txn() as conn:
            row = conn.execute(
                "SELECT version FROM trained ORDER BY version DESC LIMIT 1 OFFSET ?", (int(keep),)
            ).fetchone()
            if row is None:
                return
            conn.execute("DELETE FROM trained WHERE version <= ?", (row[0],))
            start = max(self._counter(conn, "trained_from"), row[0] + 1)
            conn.execute("INSERT OR REPLACE INTO counters (name, value) VALUES ('trained_from', ?)", (start,))

    def sha256_of(self, batch_id: bytes) -> bytes | None:
        """The sha256 of a held batch's signed bytes (None if not held, or its payload pruned)."""
        with self._txn() as conn:
            row = conn.execute("SELECT data FROM batches WHERE batch_id = ?", (bytes(batch_id),)).fetchone()
        return None if row is None or row[0] is None else hashlib.sha256(row[0]).digest()

    @staticmethod
    def _counter(conn: sqlite3.Connection, name: str) -> int:
        row = conn.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return 0 if row is None else int(row[0])

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
