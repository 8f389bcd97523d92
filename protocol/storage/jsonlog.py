"""Append-only JSON-lines logs of bounded size: a peer's ``metrics.jsonl`` (a row per learner update) and
``versions.jsonl`` (a row per version a sampler loaded).

A log is a set of segments next to each other: the current one, ``metrics.jsonl``, which :func:`append_row`
appends to, and rotated ones, ``metrics.1.jsonl`` (the newest) to ``metrics.{keep-1}.jsonl`` (the oldest). A
row that would take the current segment past ``max_bytes`` rotates first: every segment moves one number up,
the oldest beyond ``keep`` is deleted, and the current one becomes ``.1``. So a log never holds more than
about ``keep × max_bytes`` (default :data:`DEFAULT_MAX_BYTES` × :data:`DEFAULT_KEEP`: 64 MiB × 4), and a
restart never reads more than one segment to fix its tail (:func:`drop_rows_after`).

A kill mid-append can leave a torn last line (no newline, cut JSON). :func:`read_rows` skips any line that is
not a JSON object, and the next :func:`append_row` cuts the torn tail off before it writes, so a row is never
glued onto half of another. Rows are not fsynced: these are records of what happened, not state to resume
from (the learner's state and ledger are, and are written durably).

A reader in another process that lists the segments while the writer rotates may miss a segment or see one
twice; readers that key rows by step (a replayed step replaces the lost one) are not affected.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .files import atomic_write

DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # a segment rotates past this many bytes
DEFAULT_KEEP = 4  # segments kept, the current one included

_locks: dict[str, threading.Lock] = {}
_locks_lock = threading.Lock()


def _lock(path: Path) -> threading.Lock:
    """One lock per log in this process: writers on several threads, and drop_rows_after, take turns."""
    key = os.path.abspath(path)
    with _locks_lock:
        return _locks.setdefault(key, threading.Lock())


def segment_path(path: str | os.PathLike, n: int) -> Path:
    """Segment ``n`` of the log at ``path``: 0 is ``path`` itself, ``metrics.jsonl`` → ``metrics.2.jsonl``."""
    path = Path(path)
    return path if n == 0 else path.with_name(f"{path.stem}.{n}{path.suffix}")


def _rotated(path: Path) -> list[int]:
    """The numbers of the rotated segments there are, ascending (newest first)."""
    found = []
    prefix, suffix = f"{path.stem}.", path.suffix
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(path.parent):
            if name.startswith(prefix) and name.endswith(suffix):
                middle = name[len(prefix) : len(name) - len(suffix)]
                if middle.isdigit() and int(middle) > 0 and str(int(middle)) == middle:
                    found.append(int(middle))
    return sorted(found)


def segments(path: str | os.PathLike) -> list[Path]:
    """The log's segments that exist, oldest first (the current one, if it exists, last)."""
    path = Path(path)
    out = [segment_path(path, n) for n in reversed(_rotated(path))]
    return out + [path] if path.exists() else out


def _cut_torn_tail(fd: int, size: int) -> int:
    """Drop what follows the last newline of the open file (a row a kill cut short); the new size."""
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - 65536)
        chunk = os.pread(fd, end - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            size = start + i + 1
            break
        end = start
    else:
        size = 0
    os.ftruncate(fd, size)
    return size


def _rotate(path: Path, keep: int) -> None:
    for n in reversed(_rotated(path)):
        if n >= keep - 1:
            segment_path(path, n).unlink(missing_ok=True)
        else:
            os.replace(segment_path(path, n), segment_path(path, n + 1))
    if keep > 1:
        os.replace(path, segment_path(path, 1))
    else:
        path.unlink(missing_ok=True)


def append_row(
    path: str | os.PathLike,
    row: dict[str, Any],
    *,
    max_bytes: int | None = None,
    keep: int | None = None,
) -> None:
    """Append ``row`` as one JSON line to the log at ``path``, rotating first if it would take the current
    segment past ``max_bytes`` (default :data:`DEFAULT_MAX_BYTES`) and keeping ``keep`` segments (default
    :data:`DEFAULT_KEEP`) (module docstring); thread-safe within a process (one writer process)."""
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    keep = DEFAULT_KEEP if keep is None else keep
    if max_bytes < 1 or keep < 1:
        raise ValueError(f"max_bytes and keep must be >= 1, got {max_bytes} and {keep}")
    path = Path(path)
    data = (json.dumps(row) + "\n").encode()
    with _lock(path):
        for attempt in range(2):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
            try:
                size = _cut_torn_tail(fd, os.fstat(fd).st_size)
                if attempt == 0 and size > 0 and size + len(data) > max_bytes:
                    rotate = True
                else:
                    os.write(fd, data)
                    rotate = False
            finally:
                os.close(fd)
            if not rotate:
                return
            _rotate(path, keep)


def _parse(line: bytes) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:  # a torn line (a kill mid-append), or bytes that are not UTF-8
        return None
    return row if isinstance(row, dict) else None


def read_rows(path: str | os.PathLike) -> Iterator[dict]:
    """Every row of the log at ``path``, across its kept segments, oldest first; lines that are not a JSON
    object (a torn last line) are skipped. Nothing if there is no log."""
    files = []
    for seg in segments(path):  # opened first: a rotation meanwhile moves names, not open files
        with contextlib.suppress(FileNotFoundError):
            files.append(open(seg, "rb"))  # noqa: SIM115 (closed below)
    try:
        for f in files:
            for line in f:
                if line.strip() and (row := _parse(line)) is not None:
                    yield row
    finally:
        for f in files:
            f.close()


def _value_of(line: bytes, key: str) -> float:
    row = _parse(line)
    if row is None or key not in row:
        return float("inf")
    v = row[key]
    return v if isinstance(v, int | float) and not isinstance(v, bool) else float("inf")


def drop_rows_after(path: str | os.PathLike, key: str, value: float) -> int:
    """Remove the rows whose ``row[key] > value`` from the log at ``path`` (the learner on restart: the rows
    of updates after its last save, ``drop_rows_after(STATE_DIR / "metrics.jsonl", "step", saved_step)``);
    a line that does not parse, or lacks ``key``, counts as infinitely large (a torn row goes with the lost
    updates). Rows are in ``key`` order, so only the newest segments hold any to drop: each segment is
    rewritten (atomically) from the current one back, stopping at the first whose first row stays. Returns
    how many lines went."""
    path = Path(path)
    dropped = 0
    with _lock(path):
        for seg in reversed(segments(path)):
            try:
                lines = seg.read_bytes().splitlines()
            except FileNotFoundError:
                continue
            kept = [line for line in lines if _value_of(line, key) <= value]
            if len(kept) != len(lines):
                atomic_write(seg, b"".join(line + b"\n" for line in kept))
                dropped += len(lines) - len(kept)
            if lines and _value_of(lines[0], key) <= value:
                break  # this segment's first row stays: every older row does too
    return dropped
