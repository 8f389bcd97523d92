"""Writing a Hugging Face model directory whole or not at all (``heterorl model import``, ``export``).

A non-empty target is refused unless the caller says overwrite; the directory is built in a temp folder beside
it and renamed into place once complete (an old one is replaced whole), so a failure or a crash never leaves
a half-written model where ``from_pretrained`` or vLLM would pick it up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def check_out_dir(out: Path, overwrite: bool) -> None:
    """ValueError if ``out`` is a file, or a non-empty directory and not ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out}: exists and is not empty; pass overwrite=True (--overwrite) to replace it")


@contextlib.contextmanager
def staged_dir(out: Path, what: str) -> Iterator[Path]:
    """A fresh temp folder beside ``out`` to write into; renamed to ``out`` when the block ends, removed if it
    raises. ``what`` names the temp folder (``.NAME.WHAT-PID``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{what}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.replaced-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_weights(state: Mapping[str, torch.Tensor], path: Path, mode_from: Path) -> None:
    """``model.safetensors`` as ``save_pretrained`` writes it (``format: pt``), every name kept (a tied
    ``lm_head.weight`` too: a vLLM that reloads weights into a tied model saved without it keeps a stale
    head); tensors sharing storage cloned; the file gets ``mode_from``'s permissions (the config.json beside
    it: safetensors itself writes 0600)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, t in sorted(state.items()):
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    save_file(tensors, str(path), metadata={"format": "pt"})
    shutil.copymode(mode_from, path)
