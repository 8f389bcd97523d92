"""Seeded sampling (Token-DiFR style): seeds derived from the batch, Gumbel-max draws that are exact samples
of the run's sampling distribution, and a verifier that reproduces them from the seeds."""

from __future__ import annotations

import random

import pytest
import torch

from heterorl.peer.learner.rollout_stats import row_stats
from heterorl.peer.model import load_model
from heterorl.peer.model.logprobs import completion_logits
from heterorl.peer.model.sampling import nucleus_logprobs, seeded_choice
from heterorl.peer.rollout import SamplingParams, make_backend
from heterorl.protocol.wire.seeds import row_seed

pytestmark = pytest.mark.fast


def test_row_seeds_depend_on_everything_that_makes_the_batch():
    base = ("run", b"k" * 32, b"b" * 16, 7, 3)
    s = row_seed(*base)
    assert s == row_seed(*base) and 0 <= s < 2**63
    variants = [
        ("run2", b"k" * 32, b"b" * 16, 7, 3),
        ("run", b"j" * 32, b"b" * 16, 7, 3),
        ("run", b"k" * 32, b"c" * 16, 7, 3),
        ("run", b"k" * 32, b"b" * 16, 8, 3),
        ("run", b"k" * 32, b"b" * 16, 7, 4),
    ]
    assert len({s, *(row_seed(*v) for v in variants)}) == 6


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_seeded_draws_are_samples_of_the_sampling_distribution(temperature, top_p):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    p = nucleus_logprobs(logits, temperature, top_p).exp()[0]
    n = 6000
    rng = random.Random(0)
    seeds = [rng.getrandbits(63) for _ in range(n)]
    draws = seeded_choice(logits.expand(n, -1), seeds, 0, temperature, top_p)
    freq = torch.bincount(draws, minlength=5).double() / n
    assert torch.allclose(freq, p.double(), atol=4 * (0.25 / n) ** 0.5)  # 4 sigma of a Bernoulli at most
    assert (freq[p == 0] == 0).all()  # nothing outside the nucleus


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = load_model(str(tiny_model_dir))
    return model, tok, make_backend("hf", tiny_model_dir, tok, device="cpu", dtype="float32")


def _rows(tok, backend, seeds, temperature=1.0):
    prompts = [tok.encode(f"{a}+{b}=", add_special_tokens=False) for a, b in [(3, 4), (5, 1), (2, 2), (9, 0)]]
    prompts = [[tok.bos_token_id, *p] for p in prompts for _ in range(4)]
    return backend.generate(prompts, SamplingParams(temperature, 1.0, 6, seeds=tuple(seeds)))


def test_the_hf_backend_draws_from_the_seeds_and_the_verifier_reproduces_them(tiny):
    model, tok, backend = tiny
    seeds = [row_seed("run", b"a" * 32, b"b" * 16, 0, r) for r in range(16)]
    one, two = _rows(tok, backend, seeds), _rows(tok, backend, seeds)
    assert torch.equal(one.completion_ids, two.completion_ids)  # the seeds decide every token

    def share(roll, verify_seeds):
        with torch.no_grad():
            logits = completion_logits(model, roll.prompt_ids, roll.completion_ids, roll.completion_mask, 0)
        ids, mask = roll.completion_ids, roll.completion_mask
        return row_stats(logits, ids, mask, roll.logprobs, 1.0, 1.0, verify_seeds).reproduced_share()

    assert share(one, seeds) == 1.0
    other_author = [row_seed("run", b"z" * 32, b"b" * 16, 0, r) for r in range(16)]
    assert share(one, other_author) < 1.0  # the same rows claimed by another key no longer reproduce
    colder = _rows(tok, backend, seeds, temperature=0.3)  # drawn at another temperature, same seeds
    assert share(colder, seeds) < 1.0
    assert share(one, None) is None
