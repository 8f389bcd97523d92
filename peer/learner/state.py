"""The learner's own durable state: model weights, optimizer state and step, saved atomically.

Each save writes ``state/step-NNNNNNNN/`` completely (every file fsynced), renames it into place, then points
``state/CURRENT`` at it (:func:`heterorl.protocol.storage.files.atomic_write`), then removes older saves; a
crash mid-save leaves the previous one current. This is local data the learner wrote itself (never from the
network), so the optimizer state may use ``torch.save``; it is loaded with ``weights_only=True`` all the same.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from heterorl.protocol.storage.files import atomic_write, fsync_dir
from heterorl.protocol.wire.checkpoint import deserialize_state_dict, serialize_state_dict


def save_state(
    root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, meta: dict
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(serialize_state_dict(model.state_dict()))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(root / "CURRENT", name)  # also makes the rename above durable (same folder)
    for old in root.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore the current save into ``model`` and ``optimizer``; its meta (with "step"), or None if none."""
    try:
        name = (root / "CURRENT").read_text().strip()
    except OSError:
        return None
    d = root / name
    model.load_state_dict(deserialize_state_dict((d / "model.safetensors").read_bytes()))
    optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
    return json.loads((d / "meta.json").read_text())
