"""The tiny offline model: a character tokenizer and a small LLaMA, briefly pre-trained on a task.

Nothing is downloaded. ``build_tiny_model`` writes an HF-format directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load. Pre-training is
short on purpose: the model learns the task *format* and part of the skill, leaving room for RL.
"""

from __future__ import annotations

import logging
import random
import string
from pathlib import Path

import torch

from ..tasks import Task, get_task, named_reward

log = logging.getLogger(__name__)

SPECIALS = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "unk": "<unk>"}
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "  # printable ASCII, no newline


def build_tokenizer(alphabet: str = ALPHABET):
    """Character-level fast tokenizer (``tokenizers`` WordLevel over single characters)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIALS.values())}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # newlines too
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIALS["pad"],
        bos_token=SPECIALS["bos"],
        eos_token=SPECIALS["eos"],
        unk_token=SPECIALS["unk"],
    )


def build_config(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 2, max_len: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _encode(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [
        [tokenizer.bos_token_id, *tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id]
        for t in texts
    ]
    width = max(map(len, ids))
    out = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(out)
    for i, row in enumerate(ids):
        out[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return out, mask


def pretrain(
    model,
    tokenizer,
    task: Task,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """Teacher-forced next-token training on ``prompt + solution`` strings; returns the loss curve."""
    from tqdm import tqdm

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    bar = tqdm(range(steps), desc="pretrain", disable=not progress, leave=False)
    for _ in bar:
        examples = [task.sample(rng) for _ in range(batch_size)]
        ids, mask = _encode(tokenizer, [e.prompt + e.solution for e in examples])
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


SHORT = 64  # the context of a model for short prompts (the built-in tasks')


def fit_to_task(task: Task, seed: int = 0, probe: int = 256) -> tuple[str, int]:
    """The characters and context a tiny model for ``task`` needs: :data:`ALPHABET` plus any other
    character of the task's prompts and solutions (a reasoning-gym question's newlines, say), and
    :data:`SHORT` positions, or a power of two with room for 64 new tokens after the longest of ``probe``
    drawn prompts and solutions."""
    extra = set(task.alphabet()) - set(ALPHABET)
    rng = random.Random(seed)
    longest = max(len(ex.prompt) + len(ex.solution) for ex in (task.sample(rng) for _ in range(probe)))
    max_len = SHORT if longest + 16 <= SHORT else 1 << (longest + 64 - 1).bit_length()
    return ALPHABET + "".join(sorted(extra)), max_len


DEFAULT_TASK = "arithmetic"
DEFAULT_TASK_PARAMS = {"digits": 1}  # one-digit sums: the tiny model reaches ~30-40% before RL
DEFAULT_PRETRAIN_STEPS = 120


def build_tiny_model(
    out: str | Path,
    task: str = DEFAULT_TASK,
    task_params: dict | None = None,
    steps: int = DEFAULT_PRETRAIN_STEPS,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    progress: bool = True,
) -> Path:
    """Build, pre-train briefly and save a tiny causal LM + tokenizer to ``out``; returns the path."""
    from transformers import LlamaForCausalLM

    params = DEFAULT_TASK_PARAMS if task_params is None else task_params  # the caller's own
    task_obj = get_task(task, allow_rewards=named_reward(params), **params)
    alphabet, max_len = fit_to_task(task_obj, seed)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(alphabet)
    model = LlamaForCausalLM(build_config(len(tokenizer), hidden=hidden, layers=layers, max_len=max_len))
    losses = pretrain(model, tokenizer, task_obj, steps=steps, seed=seed, progress=progress)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log.info(
        "tiny model: %d parameters, pre-train loss %.3f -> %.3f, saved to %s",
        sum(p.numel() for p in model.parameters()),
        losses[0],
        losses[-1],
        out,
    )
    return out


TINY_MODEL_DIR = "runs/tiny-model"  # where the CLI tools keep the tiny model when no --model is given


def ensure_model(path: str, seed: int = 0) -> str:
    """``path`` if it holds a model (or is a hub id); the tiny model is built at :data:`TINY_MODEL_DIR` when
    that is what is asked for and it is missing."""
    p = Path(path)
    if p.exists() or path != TINY_MODEL_DIR:
        return path
    log.info("no model at %s: building the tiny offline model", path)
    build_tiny_model(p, seed=seed)
    return path
