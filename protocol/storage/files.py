"""Atomic, durable file writes: the one way every state file (run.json, known_peers.json, runspec.msgpack, the
learner's CURRENT pointer, the coordinator's view.json, final stats, chunks, manifests) is written.

:func:`atomic_write` writes a temp file next to the target, flushes and fsyncs it, renames it over the target
with ``os.replace`` and fsyncs the folder, so a crash or a power cut (as far as the disk honours fsync)
leaves either the old file or the new one, never a torn one; readers never see a half-written file. A crash
between the write and the rename can leave the temp file (named ``<prefix><random>``) behind; the target is
untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"  # temp files start with this (the chunk store deletes such files when it opens)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike, data: bytes | str, *, mode: int = 0o666, tmp_prefix: str = TMP_PREFIX
) -> None:
    """Replace ``path`` with ``data`` (str: UTF-8) atomically and durably (module docstring).

    ``mode``: the permissions of a file this creates, less the umask (as ``open`` would; 0o600 for private
    files). The temp file is made with ``O_EXCL`` under a random name, so concurrent writers never share one.
    """
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    tmp = path.parent / f"{tmp_prefix}{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(
    path: str | os.PathLike, obj: Any, *, indent: int | None = None, newline: bool = False
) -> None:
    """:func:`atomic_write` of ``json.dumps(obj, indent=indent)`` (plus a final newline with ``newline``)."""
    atomic_write(path, json.dumps(obj, indent=indent) + ("\n" if newline else ""))
