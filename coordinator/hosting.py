"""What the host's own files become in a new RunSpec, so that no volunteer is asked to open a path:

- ``[model] path``, a directory on the host: its absolute path, which volunteers' peers see is a path (not a
  hub id) and refuse unless given their own copy (``heterorl peer --model-dir DIR``);
- ``[task] name = "jsonl:PATH"``, a file on the host: checked to parse as the task, stored as chunks in the
  coordinator's chunk store (:func:`heterorl.protocol.net.datasets.store_dataset`), and named in the RunSpec
  by its id: task ``jsonl`` with ``params.dataset`` (64 hex characters). The coordinator then serves the
  chunks and announces itself as the data set's provider; peers fetch, verify and serve it in turn.

And the version of a task library that chooses the run's prompts, where run.toml leaves it out: a
``reasoning_gym`` task's ``params.version`` is the reasoning-gym installed here (every peer must generate the
same prompts, so each refuses a run pinned to a version it does not have).

A relative path is relative to the coordinator's working directory, as everywhere in run.toml.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from heterorl.protocol.net.datasets import store_dataset
from heterorl.protocol.settings import TINY_MODEL, RunConfig
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.dataset import DATASET_PARAM, MAX_DATASET_BYTES

log = logging.getLogger("heterorl.coordinator")

JSONL_PREFIX = "jsonl:"
# a task whose prompts a library generates -> that library's distribution, pinned in params.version (the
# peer's heterorl.peer.tasks.reasoning_gym checks it; the coordinator only reads the installed metadata)
PINNED_LIBRARIES = {"reasoning_gym": "reasoning-gym"}
VERSION_PARAM = "version"

# (data set bytes, task params) -> its record count; ValueError naming a bad record or parameter. The peer
# side implements it (heterorl.peer.tasks.check_jsonl); the CLI passes it in, as it does the model loader.
CheckDataset = Callable[[bytes, Mapping[str, Any]], int]


def host_files(cfg: RunConfig, store: ChunkStore, check: CheckDataset) -> RunConfig:
    """``cfg`` as a RunSpec may carry it: its model directory by absolute path, its jsonl file by id (stored
    in ``store``), its task library's version pinned; ValueError for a data set that does not parse as the
    task or exceeds the cap, or a task library that is neither installed here nor pinned in run.toml."""
    return _pin_library(_host_dataset(_host_model(cfg), store, check))


def _pin_library(cfg: RunConfig) -> RunConfig:
    name, params = cfg.task.name, cfg.task.params
    distribution = PINNED_LIBRARIES.get(name)
    if distribution is None or params.get(VERSION_PARAM) is not None:
        return cfg
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"[task] {name}: {distribution} is not installed here, and run.toml pins no version of it "
            f"(task.params.{VERSION_PARAM}): pip install 'heterorl[tasks]' (or `make install`), or name the "
            "version every peer must have"
        ) from None
    log.info("task %s: pinned to %s %s (task.params.%s)", name, distribution, version, VERSION_PARAM)
    task = dataclasses.replace(cfg.task, params={**params, VERSION_PARAM: version})
    return dataclasses.replace(cfg, task=task)


def _host_model(cfg: RunConfig) -> RunConfig:
    path = Path(cfg.model.path).expanduser()
    if cfg.model.path == TINY_MODEL or not path.is_dir():
        return cfg  # the built-in model, or a hub id
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path.resolve())))


def _host_dataset(cfg: RunConfig, store: ChunkStore, check: CheckDataset) -> RunConfig:
    name = cfg.task.name
    if not name.startswith(JSONL_PREFIX):
        return cfg
    path = Path(name[len(JSONL_PREFIX) :]).expanduser()
    try:
        with path.open("rb") as f:
            data = f.read(MAX_DATASET_BYTES + 1)
    except OSError as e:
        raise ValueError(f"[task] {name}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_DATASET_BYTES:
        raise ValueError(f"[task] {name}: over the {MAX_DATASET_BYTES}-byte cap on a run's data set")
    try:
        records = check(data, cfg.task.params)
    except ValueError as e:
        raise ValueError(f"[task] {name}: {e}") from None
    dataset_id = store_dataset(store, data)
    log.info(
        "data set %s: %d records, %d bytes, id %s (peers fetch it from the swarm)",
        path,
        records,
        len(data),
        dataset_id.hex(),
    )
    task = dataclasses.replace(
        cfg.task, name="jsonl", params={**cfg.task.params, DATASET_PARAM: dataset_id.hex()}
    )
    return dataclasses.replace(cfg, task=task)
