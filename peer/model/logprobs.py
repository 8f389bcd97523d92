"""Per-token log-probs of completions under a model: the learner's recompute and the sampler's record.

Both sides use this one layout (left-padded prompt, completion, right padding; positions from the
attention mask) and the same temperature, so behaviour and learner log-probs agree to float error.

The learner's recompute never holds float32 log-softmax over [N,T,V] at once: the log-softmax and its
gradient are taken per chunk of tokens (a custom autograd function that saves only the model's own
logits), so a 150k-token vocabulary costs one chunk of float32 beside the logits, not a second copy of
them. Where the model's forward takes ``logits_to_keep`` (HF causal LMs), prompt-position logits are
never computed.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

LOGPROB_CHUNK_ELEMENTS = 2**25  # float32 logits per chunk (128 MiB): chunk_tokens = this // vocab size


def left_pad(prompts: list[list[int]], pad_id: int, extra: int = 0) -> tuple[Tensor, Tensor, int]:
    """Left-pad token lists into ids [N, W+extra] and attention mask; returns them and the width W."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(lengths.max()) if len(prompts) else 0
    ids = torch.full((len(prompts), width + extra), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    # one scatter instead of a tensor per row: row r's tokens go to columns width-len(r) .. width-1
    rows = torch.repeat_interleave(torch.arange(len(prompts)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = width - lengths[rows] + torch.arange(len(rows)) - starts[rows]
    ids[rows, cols] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    attn[rows, cols] = 1
    return ids, attn, width


def pack(
    prompts: list[list[int]], completions: Tensor, completion_mask: Tensor, pad_id: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Build input ids [N, P+T], attention mask and position ids; returns them and P (prompt width)."""
    ids, attn, width = left_pad(prompts, pad_id, extra=completions.shape[1])
    ids[:, width:] = torch.where(completion_mask > 0, completions, torch.full_like(completions, pad_id))
    attn[:, width:] = (completion_mask > 0).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids, attn, pos, width


def completion_logprobs(
    model,
    prompts: list[list[int]],
    completions: Tensor,
    completion_mask: Tensor,
    pad_id: int,
    temperature: float = 1.0,
    *,
    chunk_tokens: int | None = None,
) -> Tensor:
    """log softmax(logits / temperature) of each completion token -> [N, T] float32 (0 on padding).

    Runs on the model's device (inputs are moved there). ``chunk_tokens`` bounds the tokens whose
    float32 log-softmax exists at once (default: ``LOGPROB_CHUNK_ELEMENTS // V``); any value gives the
    same numbers.
    """
    step_logits = completion_logits(model, prompts, completions, completion_mask, pad_id)
    device = step_logits.device
    targets = completions.to(device)
    if chunk_tokens is None:
        chunk_tokens = max(1, LOGPROB_CHUNK_ELEMENTS // max(1, step_logits.shape[-1]))
    elif chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if torch.is_grad_enabled() and step_logits.requires_grad:
        logp = _TokenLogProb.apply(step_logits, targets, float(temperature), int(chunk_tokens))
    else:
        logp = _token_logprobs(step_logits, targets, float(temperature), int(chunk_tokens))
    valid = completion_mask.to(device) > 0
    return torch.where(valid, logp, torch.zeros_like(logp))


def completion_logits(
    model, prompts: list[list[int]], completions: Tensor, completion_mask: Tensor, pad_id: int
) -> Tensor:
    """The model's logits that predict each completion token -> [N, T, V] (its dtype, on its device): one
    forward over the packed rows, prompt-position logits skipped where the model allows."""
    ids, attn, pos, width = pack(prompts, completions, completion_mask, pad_id)
    device = model_device(model)
    t = completions.shape[1]
    kwargs = {}
    if width >= 1 and _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = t + 1  # positions width-1 .. end: the ones that predict completions
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False  # no KV cache to return: the learner only scores
    logits = model(
        input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device), **kwargs
    ).logits
    start = logits.shape[1] - (t + 1) if "logits_to_keep" in kwargs else width - 1
    return logits[:, start : start + t]


def model_device(model) -> torch.device:
    """The device of the model's parameters (CPU for a model without any)."""
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    params = model.parameters() if hasattr(model, "parameters") else iter(())
    first = next(iter(params), None)
    return first.device if first is not None else torch.device("cpu")


def _accepts(model, name: str) -> bool:
    """Whether ``model.forward`` names ``name`` as a parameter (HF causal LMs do; wrappers may not)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def _blocks(n: int, t: int, chunk_tokens: int) -> Iterator[tuple[slice, slice]]:
    """(rows, positions) slices tiling [n, t] with at most ``chunk_tokens`` tokens each."""
    if n == 0 or t == 0:
        return
    if t <= chunk_tokens:
        step = chunk_tokens // t
        for r in range(0, n, step):
            yield slice(r, r + step), slice(None)
    else:
        for r in range(n):
            for c in range(0, t, chunk_tokens):
                yield slice(r, r + 1), slice(c, c + chunk_tokens)


def _token_logprobs(logits: Tensor, targets: Tensor, temperature: float, chunk_tokens: int) -> Tensor:
    """log_softmax(logits.float() / temperature) gathered at ``targets``, chunk by chunk -> [N, T] float32.

    Each chunk is the very formula the sampler's hf backend applies to the whole tensor.
    """
    out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for rows, cols in _blocks(targets.shape[0], targets.shape[1], chunk_tokens):
        step = logits[rows, cols].float() / temperature
        picked = targets[rows, cols].unsqueeze(-1)
        out[rows, cols] = torch.log_softmax(step, -1).gather(-1, picked).squeeze(-1)
    return out


class _TokenLogProb(torch.autograd.Function):
    """:func:`_token_logprobs` with a chunked backward: d log p_y / d z = (onehot_y − softmax(z/τ)) / τ.

    Saves the logits (already held by the model's graph) instead of a float32 log-softmax of them.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_tokens: int) -> Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return _token_logprobs(logits, targets, temperature, chunk_tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, targets = ctx.saved_tensors
        temp = ctx.temperature
        grad = torch.empty_like(logits)
        for rows, cols in _blocks(targets.shape[0], targets.shape[1], ctx.chunk_tokens):
            g = grad_out[rows, cols].float().unsqueeze(-1)
            gl = torch.softmax(logits[rows, cols].float() / temp, -1).mul_(-g)
            gl.scatter_add_(-1, targets[rows, cols].unsqueeze(-1), g)
            grad[rows, cols] = gl.div_(temp)
        return grad, None, None, None
