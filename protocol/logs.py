"""Logging for every HeteroRL process, configured in one place: one line format on stderr, and for daemons a
size-capped file in their state directory."""

from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
NOISY = ("hivemind", "urllib3", "filelock")  # kept at WARNING: their INFO lines drown ours


def configure_logging(level: str | int = "INFO", file: Path | None = None, max_bytes: int = 10 << 20) -> None:
    """Log at ``level`` to stderr (once per process) and, if given, to ``file`` (rotated at ``max_bytes``)."""
    root = logging.getLogger()
    fmt = logging.Formatter(FORMAT)
    if not any(type(h) is logging.StreamHandler for h in root.handlers):
        console = logging.StreamHandler()
        console.setFormatter(fmt)
        root.addHandler(console)
    if file is not None:
        handler = RotatingFileHandler(file, maxBytes=max_bytes, backupCount=2)
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
