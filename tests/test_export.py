"""``heterorl export`` on a real learner's state: a short local swarm on the tiny model (full fine-tuning
with bf16 checkpoints, and a LoRA adapter run), then its weights as a Hugging Face model directory, read back
with transformers (and once with vLLM) and compared with what the learner saved and published."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from heterorl.export import ExportError, export
from heterorl.protocol import Identity, decode, encode
from heterorl.protocol.wire.checkpoint import deserialize_state_dict
from heterorl.testing.procs import run_json_check

pytestmark = pytest.mark.slow

STEPS = 3


def _local(out: Path, model_dir: Path, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "heterorl.cli", "local", "--samplers", "1", "--steps", str(STEPS)]
    cmd += ["--out", str(out), "--model", str(model_dir), "--no-view", "--lr", "5e-3"]
    cmd += ["--prompts-per-update", "4", "--group-size", "4", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return out / "learner"


@pytest.fixture(scope="module")
def learner(tmp_path_factory, tiny_model_dir) -> Path:
    """A learner's state dir after a full fine-tuning run that publishes bf16 checkpoints."""
    return _local(tmp_path_factory.mktemp("run") / "local", tiny_model_dir, "--checkpoint-dtype", "bfloat16")


@pytest.fixture(scope="module")
def adapter_learner(tmp_path_factory, tiny_model_dir) -> Path:
    return _local(
        tmp_path_factory.mktemp("adapter-run") / "local",
        tiny_model_dir,
        "--adapter",
        "rank=4,alpha=8,targets=q_proj,v_proj",
    )


def _saved(learner: Path) -> dict[str, torch.Tensor]:
    """The learner's own save (float32 master weights)."""
    current = (learner / "state" / "CURRENT").read_text().strip()
    return deserialize_state_dict((learner / "state" / current / "model.safetensors").read_bytes())


def _exported(out: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(out).state_dict()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "heterorl.cli", "export", *args], capture_output=True, text=True, timeout=600
    )


def _generates(out: Path) -> str:
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    ids = tok("3+4=", return_tensors="pt")
    new = model.generate(**ids, max_new_tokens=4, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert len(new) >= 1
    return tok.decode(new)


def test_the_learners_state_exports_as_a_model_transformers_and_vllm_load(learner, tiny_model_dir, tmp_path):
    out = tmp_path / "hf"
    done = _cli("--state-dir", str(learner), "--out", str(out), "--model-dir", str(tiny_model_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    saved, got = _saved(learner), _exported(out)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert not all(torch.equal(base[k], saved[k]) for k in saved)  # trained: not the base model again
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    record = json.loads((out / "heterorl_export.json").read_text())
    assert (record["source"], record["step"], record["exported_dtype"]) == ("learner-state", STEPS, "float32")
    _generates(out)
    vllm = run_json_check("heterorl.testing.vllm_load_check", str(out))
    assert vllm["tokens"] > 0 and vllm["max_abs_diff"] < 1e-4, vllm  # vLLM ran these very weights


def test_a_published_version_exports_in_its_dtype_verified(learner, tiny_model_dir, tmp_path):
    out = export(learner, tmp_path / "v", version=STEPS, model_dir=tiny_model_dir)
    got, saved = _exported(out), _saved(learner)
    # the version is what samplers ran: the bf16 rounding of the learner's master at that step
    assert all(
        got[k].dtype == torch.bfloat16 and torch.equal(got[k], saved[k].to(torch.bfloat16)) for k in saved
    )
    record = json.loads((out / "heterorl_export.json").read_text())
    assert (record["version"], record["checkpoint_dtype"]) == (STEPS, "bfloat16")
    _generates(out)
    wide = _exported(
        export(learner, tmp_path / "v32", version=STEPS, dtype="float32", model_dir=tiny_model_dir)
    )
    assert all(wide[k].dtype == torch.float32 and torch.equal(wide[k], got[k].float()) for k in got)


def test_a_version_that_does_not_verify_is_refused(learner, tiny_model_dir, tmp_path):
    copy = tmp_path / "learner"
    shutil.copytree(learner, copy)
    msg = copy / "chunks" / "manifests" / f"{STEPS:012d}.msg"
    _, body, _ = decode(msg.read_bytes(), "CheckpointManifest")
    msg.write_bytes(encode("CheckpointManifest", body, Identity.generate()))  # a stranger's signature
    with pytest.raises(ExportError, match="not signed by a learner this run allows"):
        export(copy, tmp_path / "a", version=STEPS, model_dir=tiny_model_dir)
    shutil.copy(learner / msg.relative_to(copy), msg)
    chunk = body["chunk_hashes"][0].hex()
    path = copy / "chunks" / "chunks" / chunk[:2] / chunk
    path.write_bytes(b"\0" + path.read_bytes()[1:])
    with pytest.raises(ExportError, match="chunk 0 missing or corrupt"):
        export(copy, tmp_path / "b", version=STEPS, model_dir=tiny_model_dir)
    assert path.exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_what_cannot_be_exported_is_refused_with_exit_status_2(learner, tiny_model_dir, tmp_path):
    done = _cli("--state-dir", str(learner), "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "pass --model-dir DIR" in done.stderr  # the run's model is a directory
    done = _cli("--state-dir", str(learner), "--out", str(tmp_path / "x"), "--version", "999")
    assert (
        done.returncode == 2
        and "version 999 is not in" in done.stderr
        and "versions held: 0, 1" in done.stderr
    )
    sampler = learner.parent / "sampler-0"
    with pytest.raises(ExportError, match="holds no learner state"):
        export(sampler, tmp_path / "x", model_dir=tiny_model_dir)
    with pytest.raises(ExportError, match="not a peer's state directory"):
        export(tmp_path, tmp_path / "x", model_dir=tiny_model_dir)
    with pytest.raises(ExportError, match="holds the state directory"):
        export(learner, learner.parent, overwrite=True, model_dir=tiny_model_dir)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export(learner, tmp_path / "full", model_dir=tiny_model_dir)
    assert (tmp_path / "full" / "keep").read_text() == "mine"
    export(learner, tmp_path / "full", overwrite=True, model_dir=tiny_model_dir)
    assert not (tmp_path / "full" / "keep").exists() and (tmp_path / "full" / "model.safetensors").exists()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folder left


def test_an_adapter_run_exports_the_merged_model(adapter_learner, tiny_model_dir, tmp_path):
    saved = _saved(adapter_learner)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    expected = dict(base)
    for name in base:
        module = name.removesuffix(".weight")
        a = saved.get(f"base_model.model.{module}.lora_A.default.weight")
        if a is not None:  # W0 + alpha/rank · B A
            expected[name] = base[name] + 2.0 * saved[f"base_model.model.{module}.lora_B.default.weight"] @ a
    assert sum(not torch.equal(expected[k], base[k]) for k in base) == 4  # q and v of 2 layers, trained
    for out in (
        export(adapter_learner, tmp_path / "state", model_dir=tiny_model_dir),
        export(adapter_learner, tmp_path / "v", version=STEPS, model_dir=tiny_model_dir),
    ):
        got = _exported(out)
        assert got.keys() == base.keys()
        assert all(torch.allclose(got[k], expected[k], atol=1e-6, rtol=0) for k in base), out
        _generates(out)
