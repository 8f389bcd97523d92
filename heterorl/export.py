"""``heterorl export``: a run's trained weights as a standard Hugging Face model directory.

What a run gives its community: config.json, model.safetensors, the base model's tokenizer files (with its
chat template) and generation_config.json when the base has one, plus heterorl_export.json saying where the
weights came from. ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load it as it is.

From a peer's state directory (``heterorl peer --state-dir DIR``; ``heterorl local`` keeps the learner's in
OUT/learner):

- by default the learner's latest own state (``DIR/state/CURRENT``: its float32 master weights at step N);
- ``--version N``: version N from the peer's chunk store (``DIR/chunks``, any peer's), in the checkpoint
  dtype; the manifest's signature is checked against the run's learner keys, every chunk against the
  manifest.

The run (model, learner keys, adapter settings) is the RunSpec the peer joined (``DIR/runspec.msgpack``; its
signature is checked, and its key against the one pinned in ``DIR/run.json``), and the base model (config,
tokenizer) is that run's model, found as the peer finds it (``--model-dir`` where the peer was given one). In
an adapter run the LoRA adapters are merged into the base weights (W0 + alpha/rank · B A, as samplers merge
them). The chunk store is opened read-only and the output is written to a temp folder and renamed into place,
so an export can run beside the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from heterorl.protocol.settings import RunSettings

log = logging.getLogger("heterorl.export")

PROVENANCE_FILE = "heterorl_export.json"
DTYPES = ("float32", "bfloat16")
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.[^.]+\.weight$")  # peft's live names


class ExportError(Exception):
    """What cannot be exported, and why (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class Weights:
    """Safetensors bytes read from a state directory, and what they are."""

    data: bytes
    kind: str  # "learner-state" (the learner's own save) or "version" (a published checkpoint)
    number: int  # the step or version
    provenance: dict  # more fields for heterorl_export.json


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--state-dir", required=True, help="the peer's state directory (the learner's by default)"
    )
    ap.add_argument("--out", required=True, help="the model directory to write (must be empty or absent)")
    ap.add_argument(
        "--version",
        type=int,
        default=None,
        metavar="N",
        help="export published version N from the state dir's chunk store (default: the learner's latest "
        "own state, float32)",
    )
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the written weights (default: the weights' own: float32 for the learner's state, the "
        "checkpoint dtype for a version)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    ap.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="the base model's directory (its config and tokenizer), as the peer was given it; needed when "
        "the run's model is a directory on the host's machine",
    )


def run(args: argparse.Namespace) -> int:
    try:
        out = export(
            Path(args.state_dir).expanduser(),
            Path(args.out).expanduser(),
            version=args.version,
            dtype=args.dtype,
            overwrite=args.overwrite,
            model_dir=args.model_dir,
        )
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model written to {out} (provenance in {out}/{PROVENANCE_FILE})")
    return 0


def export(
    state_dir: Path,
    out: Path,
    *,
    version: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    model_dir: str | Path | None = None,
) -> Path:
    """Write the HF model directory ``out`` from peer state ``state_dir`` (module docstring); ExportError
    with the reason for anything that cannot be exported. ``model_dir``: the base model as the peer was given
    it (``--model-dir``); else the run's model by name (``heterorl.peer.daemon.weights.resolve_model``)."""
    from heterorl.peer.daemon.weights import resolve_model
    from heterorl.peer.model.hf_dir import check_out_dir

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    state_dir, out = state_dir.resolve(), out.resolve()
    if out == state_dir or out in state_dir.parents:
        raise ExportError(f"{out} holds the state directory {state_dir}; export to another folder")
    try:
        check_out_dir(out, overwrite)
    except ValueError as e:
        raise ExportError(str(e)) from None
    t0 = time.perf_counter()
    settings, run_key = read_run(state_dir)
    if version is None:
        weights = read_learner_state(state_dir, settings)
    else:
        weights = read_version(state_dir, settings, version)
    try:
        base_dir = resolve_model(settings.model.path, state_dir / "models", model_dir)
    except ValueError as e:
        raise ExportError(str(e)) from None
    log.info("run %s, model %s: %s", settings.run_id, settings.model.path, describe(weights))
    state = full_state(weights, settings, base_dir)
    target = dtype or own_dtype(state)
    provenance = {
        "run_id": settings.run_id,
        "run_key": run_key.hex(),
        "model": settings.model.path,
        "source": weights.kind,
        ("step" if weights.kind == "learner-state" else "version"): weights.number,
        **weights.provenance,
    }
    if settings.adapter is not None:
        provenance["adapter_merged"] = dataclasses.asdict(settings.adapter)
    write_model_dir(state, base_dir, out, target, provenance)
    log.info("exported %s to %s (%s) in %.1f s", describe(weights), out, target, time.perf_counter() - t0)
    return out


def describe(w: Weights) -> str:
    what = f"the learner's state at step {w.number}" if w.kind == "learner-state" else f"version {w.number}"
    return f"{what} ({len(w.data) / 2**20:.1f} MiB)"


def read_run(state_dir: Path) -> tuple[RunSettings, bytes]:
    """The run a peer state directory belongs to (the signed RunSpec it keeps), and the coordinator's key."""
    from heterorl.protocol import ProtocolError, decode
    from heterorl.protocol.net.join import RUNSPEC_FILE
    from heterorl.protocol.settings import RunSettings

    if not state_dir.is_dir():
        raise ExportError(f"{state_dir}: no such directory")
    path = state_dir / RUNSPEC_FILE
    if not path.is_file():
        raise ExportError(
            f"{state_dir} is not a peer's state directory: it has no {RUNSPEC_FILE} (a peer keeps the "
            "RunSpec it joined there; one that joined before this version of heterorl keeps none: start it "
            "once more)"
        )
    try:
        _, body, author = decode(path.read_bytes(), "RunSpec")
        settings = RunSettings.from_spec(body)
    except (ProtocolError, ValueError) as e:
        raise ExportError(f"{path}: not a valid RunSpec: {e}") from None
    try:
        pinned = json.loads((state_dir / "run.json").read_text()).get("run_key")
    except (OSError, ValueError, AttributeError):
        pinned = None
    if pinned and bytes.fromhex(pinned) != author:
        raise ExportError(f"{path} is signed by {author.hex()[:16]}…, not the run key pinned in run.json")
    return settings, author


def read_learner_state(state_dir: Path, settings: RunSettings, attempts: int = 3) -> Weights:
    """The learner's current save (``state/CURRENT``). A learner saving meanwhile removes the old save after
    pointing CURRENT at the new one: then CURRENT is read again."""
    root = state_dir / "state"
    for attempt in range(attempts):
        try:
            name = (root / "CURRENT").read_text().strip()
        except FileNotFoundError:
            raise ExportError(
                f"{state_dir} holds no learner state (state/CURRENT): not a learner's state directory, or "
                "its learner never saved; a version from its chunk store: --version N"
            ) from None
        try:
            log.info("reading the learner's state %s", root / name)
            data = (root / name / "model.safetensors").read_bytes()
            meta = json.loads((root / name / "meta.json").read_text())
            break
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise ExportError(f"the learner state {root / name} is incomplete") from None
    if meta.get("run_id", settings.run_id) != settings.run_id:
        raise ExportError(
            f"the learner state is of run {meta['run_id']}, the RunSpec of run {settings.run_id}"
        )
    return Weights(data, "learner-state", int(meta["step"]), {})


def read_version(state_dir: Path, settings: RunSettings, version: int) -> Weights:
    """Published version ``version`` from the chunk store, verified: a learner of the run signed its manifest,
    and every chunk hashes to it."""
    import hashlib

    from heterorl.protocol import ProtocolError
    from heterorl.protocol.net.chunks import verify_manifest
    from heterorl.protocol.storage.store import ChunkStore

    try:
        store = ChunkStore(state_dir / "chunks", max_bytes=1 << 62, read_only=True)
    except FileNotFoundError:
        raise ExportError(f"{state_dir} has no chunk store (chunks/): not a peer's state directory") from None
    raw = store.manifest(version)
    if raw is None:
        held = ", ".join(map(str, store.versions())) or "none"
        raise ExportError(f"version {version} is not in {state_dir / 'chunks'} (versions held: {held})")
    try:
        body, author = verify_manifest(raw, settings.run_id, settings.learner_keys)
        if body["version"] != version:
            raise ProtocolError(f"its manifest is of version {body['version']}")
        log.info("assembling version %d from %d chunks, each checked", version, len(body["chunk_hashes"]))
        data = store.assemble_part(body, f"version {version}")
    except ProtocolError as e:
        raise ExportError(f"version {version} does not verify: {e}") from None
    prov = {
        "learner_key": author.hex(),
        "checkpoint_sha256": hashlib.sha256(data).hexdigest(),
        "checkpoint_dtype": body["dtype"],
    }
    return Weights(data, "version", version, prov)


def full_state(weights: Weights, settings: RunSettings, base_dir: str) -> dict[str, torch.Tensor]:
    """The model's full state from ``weights``; in an adapter run the adapters merged into their base (the
    learner's frozen copy in its own state; the run's base model, checked against its hash, for a version)."""
    import torch

    from heterorl.peer.model import adapter
    from heterorl.protocol.wire.checkpoint import deserialize_state_dict

    state = deserialize_state_dict(weights.data)
    if settings.adapter is None:
        return state
    try:
        if weights.kind == "learner-state":
            base, lora = split_peft_state(state)
            published = getattr(torch, settings.learner.checkpoint_dtype)  # what the run's base hash is of
            adapter.check_base(
                {k: v.to(published) if v.is_floating_point() else v for k, v in base.items()},
                settings.adapter,
            )
        else:
            dtype = weights.provenance["checkpoint_dtype"]
            base, lora = adapter.load_base(base_dir, settings.adapter, dtype), state
        log.info("merging %d LoRA adapters (rank %d) into the base", len(lora) // 2, settings.adapter.rank)
        return adapter.merge(base, lora, settings.adapter)
    except ValueError as e:
        raise ExportError(f"the adapters do not merge: {e}") from None


def split_peft_state(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A peft LoRA model's state (the learner's save in an adapter run) as (base state in the model's own
    names, adapters in peft's saved names: ``base_model.model.<module>.lora_A.weight``)."""
    from heterorl.peer.model.adapter import PREFIX

    base, lora = {}, {}
    for name, t in state.items():
        if not name.startswith(PREFIX):
            raise ExportError(f"the learner state of an adapter run has {name!r}, not a peft model's name")
        m = _LORA.match(name)
        if m:  # <module>.lora_A.<adapter name>.weight -> <module>.lora_A.weight
            lora[f"{m['module']}.lora_{m['ab']}.weight"] = t
        else:
            base[name.removeprefix(PREFIX).replace(".base_layer.", ".")] = t
    return base, lora


def own_dtype(state: dict[str, torch.Tensor]) -> str:
    """The dtype of the state's floating tensors (float32 or bfloat16)."""
    found = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    if len(found) != 1 or not found <= set(DTYPES):
        raise ExportError(f"the weights are of dtypes {sorted(found)}; choose one with --dtype")
    return found.pop()


def write_model_dir(state: dict, base_dir: str, out: Path, dtype: str, provenance: dict) -> None:
    """config.json (dtype set), model.safetensors (every name, lm_head too), tokenizer and generation config
    from ``base_dir``, heterorl_export.json; ExportError if the state does not fit the base's architecture."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from heterorl.peer.model.hf_dir import staged_dir, write_weights

    try:
        config = AutoConfig.from_pretrained(base_dir)
    except (OSError, ValueError) as e:
        raise ExportError(f"the run's model {base_dir} does not load here: {e}") from None
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    if have != want:
        missing, extra = sorted(set(want) - set(have))[:3], sorted(set(have) - set(want))[:3]
        shapes = sorted(k for k in set(have) & set(want) if have[k] != want[k])[:3]
        raise ExportError(
            f"the weights do not fit {base_dir}'s architecture: missing {missing}, unexpected {extra}, "
            f"other shapes {shapes}"
        )
    target = getattr(torch, dtype)
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    config.dtype = target
    with staged_dir(out, "exporting") as tmp:
        log.info("writing %s (%d tensors, %s)", out, len(state), dtype)
        config.save_pretrained(tmp)
        write_weights(state, tmp / "model.safetensors", mode_from=tmp / "config.json")
        with contextlib.suppress(OSError):  # the base has none: neither has the export
            GenerationConfig.from_pretrained(base_dir).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(tmp)
        params = sum(v.numel() for v in state.values())
        if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in state:
            params -= state["lm_head.weight"].numel()  # written twice, one parameter
        record = {
            **provenance,
            "exported_dtype": dtype,
            "parameters": params,
            "base_model_dir": str(base_dir),
            "exported_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "transformers_version": transformers.__version__,
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
