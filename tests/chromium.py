"""Test helpers for browser checks: find headless Chromium, run it, read its PNG screenshots.

Only what the dashboard tests need; no WebDriver/CDP, just the ``--headless`` command-line modes. The browser
comes from the install step (``make install`` apt-installs Debian's ``chromium`` where it can), never from a
test.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")  # as in the Makefile
HEADLESS_TIMEOUT_S = 90


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def headless(browser: str, url: str, *mode: str, window: tuple[int, int] = (1400, 1800)) -> str:
    """Run ``browser --headless`` on ``url`` with ``mode`` flags (e.g. ``--dump-dom``); returns its stdout.

    A fresh profile each run, so runs can go in parallel; virtual time lets the page's timers and fetches
    settle (5 s of page time) without waiting for them in real time.
    """
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
            "--virtual-time-budget=5000",
            *mode,
            url,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=HEADLESS_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def read_png(path: Path, max_rows: int | None = None) -> tuple[int, int, int, list[bytes]]:
    """Decode an 8-bit, non-interlaced grey/RGB/RGBA PNG: ``(width, height, channels, rows)``.

    ``max_rows`` stops after that many rows (filters chain row to row, so earlier rows are always decoded).
    """
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if ihdr is None:
        raise ValueError("PNG without IHDR")
    width, height, depth, ctype, _, _, interlace = ihdr
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(ctype)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {ctype}, interlace {interlace}")
    raw = zlib.decompress(b"".join(idat))
    stride, bpp = width * channels, channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height if max_rows is None else min(height, max_rows)):
        start = y * (stride + 1)
        ftype, cur = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        if ftype == 1:
            for i in range(bpp, stride):
                cur[i] = (cur[i] + cur[i - bpp]) & 0xFF
        elif ftype == 2:
            cur = bytearray((a + b) & 0xFF for a, b in zip(cur, prev, strict=True))
        elif ftype == 3:
            for i in range(stride):
                left = cur[i - bpp] if i >= bpp else 0
                cur[i] = (cur[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif ftype == 4:
            for i in range(stride):
                left, upleft = (cur[i - bpp], prev[i - bpp]) if i >= bpp else (0, 0)
                cur[i] = (cur[i] + _paeth(left, prev[i], upleft)) & 0xFF
        elif ftype != 0:
            raise ValueError(f"bad PNG filter {ftype} in row {y}")
        rows.append(bytes(cur))
        prev = cur
    return width, height, channels, rows
