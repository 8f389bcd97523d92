"""protocol/storage/files.py: every state file is replaced atomically and durably, or not at all."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from heterorl.protocol.storage import files
from heterorl.protocol.storage.files import TMP_PREFIX, atomic_write, atomic_write_json

pytestmark = pytest.mark.fast


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(TMP_PREFIX))


def test_writes_bytes_and_text_and_replaces(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(path, "héllo")
    assert path.read_bytes() == "héllo".encode()
    atomic_write_json(tmp_path / "run.json", {"run_id": "r"}, indent=1, newline=True)
    text = (tmp_path / "run.json").read_text()
    assert json.loads(text) == {"run_id": "r"} and text.endswith("}\n")
    assert _leftovers(tmp_path) == []


def test_the_file_and_then_its_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(a, b):
        calls.append("replace")
        real_replace(a, b)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    atomic_write(tmp_path / "x", b"data")
    assert calls == ["fsync-file", "replace", "fsync-dir"]


def test_a_failure_before_the_rename_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "known_peers.json"
    atomic_write(path, b"old")

    def broken(a, b):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_a_crash_between_write_and_rename_leaves_the_old_file_intact(tmp_path):
    """A real process death after the temp file is written and fsynced, before ``os.replace``."""
    path = tmp_path / "CURRENT"
    path.write_text("step-00000001")
    code = (
        "import os, sys\n"
        "from heterorl.protocol.storage import files\n"
        "files.os.replace = lambda a, b: os._exit(3)\n"
        "files.atomic_write(sys.argv[1], 'step-00000002')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], timeout=60)
    assert done.returncode == 3
    assert path.read_text() == "step-00000001"
    [tmp] = _leftovers(tmp_path)  # the new bytes, complete, never renamed into place
    assert (tmp_path / tmp).read_text() == "step-00000002"


def test_modes_follow_the_umask_or_the_given_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "public", b"x")
        atomic_write(tmp_path / "private", b"x", mode=0o600)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "public").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600
