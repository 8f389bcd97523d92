"""Chunked completion log-probs: the same numbers and gradients as one log_softmax over [N,T,V]."""

from __future__ import annotations

import pytest
import torch

from heterorl.peer.model import completion_logprobs
from heterorl.peer.model.logprobs import _blocks, _TokenLogProb, pack

V = 37


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config

    torch.manual_seed(0)
    return LlamaForCausalLM(build_config(V, hidden=16, layers=1, heads=2, max_len=32))


def batch():
    gen = torch.Generator().manual_seed(1)
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11], [1]]
    comp = torch.randint(3, V, (4, 6), generator=gen)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return prompts, torch.where(mask > 0, comp, torch.zeros_like(comp)), mask


def naive(model, prompts, comp, mask, temperature):
    """The formula before chunking (and the sampler hf backend's): full logits, one log_softmax."""
    ids, attn, pos, width = pack(prompts, comp, mask, 0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    step = logits[:, width - 1 : width - 1 + comp.shape[1]].float() / temperature
    lp = torch.log_softmax(step, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask > 0, lp, torch.zeros_like(lp))


def grads(model, out, weights):
    model.zero_grad(set_to_none=True)
    (out * weights).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk_tokens", [None, 1, 4, 7, 24, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_values_and_gradients(model, chunk_tokens, temperature):
    torch.set_num_threads(1)
    prompts, comp, mask = batch()
    weights = torch.randn(comp.shape, generator=torch.Generator().manual_seed(2))
    want = naive(model, prompts, comp, mask, temperature)
    want_g = grads(model, want, weights)
    got = completion_logprobs(model, prompts, comp, mask, 0, temperature, chunk_tokens=chunk_tokens)
    got_g = grads(model, got, weights)
    assert got.dtype == torch.float32 and got.shape == comp.shape
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)
    assert bool((got[mask == 0] == 0).all())
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        nograd = completion_logprobs(model, prompts, comp, mask, 0, temperature, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(nograd, got.detach(), rtol=0, atol=0)


def test_function_gradient_matches_autograd_in_bf16_and_float32():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, 5, 11, generator=gen).to(dtype).requires_grad_(True)
        targets = torch.randint(0, 11, (3, 5), generator=gen)
        g = torch.randn(3, 5, generator=gen)
        ref = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        (want,) = torch.autograd.grad((ref * g).sum(), logits)
        out = _TokenLogProb.apply(logits, targets, 0.8, 4)
        (got,) = torch.autograd.grad((out * g).sum(), logits)
        assert got.dtype == dtype
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    "n,t,chunk", [(4, 6, 1), (4, 6, 5), (4, 6, 6), (4, 6, 13), (3, 10, 4), (0, 5, 3), (2, 0, 3)]
)
def test_blocks_tile_once_within_budget(n, t, chunk):
    seen = torch.zeros(n, t, dtype=torch.long)
    for rows, cols in _blocks(n, t, chunk):
        assert seen[rows, cols].numel() <= chunk
        seen[rows, cols] += 1
    assert bool((seen == 1).all())


def test_bad_chunk(model):
    prompts, comp, mask = batch()
    with pytest.raises(ValueError):
        completion_logprobs(model, prompts, comp, mask, 0, chunk_tokens=0)
