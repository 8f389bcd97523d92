"""The small single-file sqlite3 stores (sampler outbox, learner ledger): opening, transactions, a base class.

Each kind of store stamps its file with its own ``PRAGMA application_id`` and a ``user_version`` schema
number, so pointing one at the other's file (or at any other file) fails at open with a clear error instead of
a confusing SQL error later. Files are WAL mode with ``synchronous=FULL``: a committed transaction survives
a process kill and, as far as the disk honours fsync, a power cut.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def open_store(path: Path | str, application_id: int, schema_version: int, schema: str) -> sqlite3.Connection:
    """Open (creating parent dirs and the schema if new) a WAL-mode sqlite file of one known kind and version.

    Raises ``RuntimeError`` if the file is not sqlite, belongs to something else, or has a schema version we
    do not know. A foreign file is refused before anything is written to it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        try:
            # Check the kind before switching the journal mode: never convert someone else's file to WAL.
            _check_kind(conn, path, application_id, schema_version)
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.DatabaseError as e:  # "file is not a database", corrupt header, ...
            raise RuntimeError(f"{path}: not a usable sqlite file ({e})") from e
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{path}: could not enable WAL mode (got {mode!r})")
        conn.execute("PRAGMA synchronous=FULL")
        with transaction(conn):
            # Re-check under the write lock: another process may have created the schema meanwhile.
            if _check_kind(conn, path, application_id, schema_version):
                # executescript() would COMMIT mid-transaction, so run the statements one by one
                for stmt in filter(str.strip, schema.split(";")):
                    conn.execute(stmt)
                conn.execute(f"PRAGMA application_id={int(application_id)}")
                conn.execute(f"PRAGMA user_version={int(schema_version)}")
    except BaseException:
        conn.close()
        raise
    return conn


def _check_kind(conn: sqlite3.Connection, path: Path, application_id: int, schema_version: int) -> bool:
    """True if the file is new (no schema yet), False if it is ours at our version; else ``RuntimeError``."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    if version == 0 and app_id == 0 and tables == 0:
        return True
    if app_id != application_id:
        raise RuntimeError(
            f"{path}: not this kind of store (application_id {app_id:#x}, expected {application_id:#x})"
        )
    if version != schema_version:
        raise RuntimeError(
            f"{path}: unknown schema version {version} (this code reads version {schema_version})"
        )
    return False


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One ``BEGIN IMMEDIATE`` transaction on an autocommit connection: commit on success, else roll back.

    A failed COMMIT (busy, disk full) is rolled back too, so the connection is never left inside a
    transaction; a rollback sqlite already did itself (it does on some errors) is not repeated.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


class SqliteStore:
    """One single-file sqlite3 store behind one lock: the sampler's outbox and the learner's ledger.

    Subclasses name their ``KIND`` (for messages), ``APPLICATION_ID``, ``SCHEMA_VERSION`` and ``SCHEMA``, and
    do every read and write inside :meth:`_txn`: a network thread and the main thread may share an instance.
    """

    KIND = "store"
    APPLICATION_ID = 0
    SCHEMA_VERSION = 1
    SCHEMA = ""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = open_store(
            self.path, self.APPLICATION_ID, self.SCHEMA_VERSION, self.SCHEMA
        )

    def close(self) -> None:
        """Close the file; idempotent. Every committed write is already on disk."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        """Hold the lock and one ``BEGIN IMMEDIATE`` transaction; commit on success, roll back on error."""
        with self._lock:
            if self._conn is None:
                raise RuntimeError(f"{self.KIND} {self.path} is closed")
            with transaction(self._conn) as conn:
                yield conn
