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


def save_state(root: Path, model_state: dict, optimizer_state: dict, step: int, meta: dict) -> Path:
    """Write ``model_state`` (tensors) and ``optimizer_state`` (an optimizer's ``state_dict()``) as the save
    of ``step``. Takes state dicts, not the live objects, so a copy made between updates can be saved on
    another thread while training goes on."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(serialize_state_dict(model_state))
    torch.save(optimizer_state, tmp / "optimizer.pt")
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


def current_save(root: Path) -> Path | None:
    """The folder of the current save under ``root``, or None if there is none."""
    try:
        name = (root / "CURRENT").read_text().strip()
    except OSError:
        return None
    return root / name


def load_state(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore the current save into ``model`` and ``optimizer``; its meta (with "step"), or None if none."""
    d = current_save(root)
    if d is None:
        return None
    model.load_state_dict(deserialize_state_dict((d / "model.safetensors").read_bytes()))
    optimizer.load_state_dict(torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True))
    return json.loads((d / "meta.json").read_text())
