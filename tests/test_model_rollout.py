"""The tiny model loads through the generic HF loader; hf rollouts record learner-exact log-probs."""

import random

import pytest
import torch

from heterorl.peer.model import completion_logprobs, load_model
from heterorl.peer.model.prompts import PromptFormat
from heterorl.peer.rollout import SamplingParams, make_backend
from heterorl.peer.tasks import get_task


def test_auto_classes_load_tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "7+8=15"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert model.config.vocab_size == len(tok)


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    task = get_task("arithmetic", digits=1)
    rng = random.Random(3)
    fmt = PromptFormat(tok)
    prompts = [fmt.encode(task.sample(rng).prompt) for _ in range(24)]
    torch.manual_seed(0)
    out = {}
    backend = make_backend("hf", tiny_model_dir, tok, model=model)
    for temp in (1.0, 0.7):
        out[temp] = backend.generate(prompts, SamplingParams(temp, 0.95, 6))
    return model, tok, out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_learner_recompute(rollouts, temperature):
    model, tok, out = rollouts
    r = out[temperature]
    with torch.no_grad():
        lp = completion_logprobs(
            model, r.prompt_ids, r.completion_ids, r.completion_mask, tok.pad_token_id, temperature
        )
    assert r.completion_mask.sum() > 0
    assert (lp - r.logprobs).abs().max().item() < 1e-4
    assert bool((r.logprobs <= 0).all())


def test_mask_stops_after_first_eos(rollouts):
    _, tok, out = rollouts
    r = out[1.0]
    for ids, mask, n in zip(r.completion_ids, r.completion_mask, r.lengths, strict=True):
        n = int(n)
        assert mask[:n].all() and not mask[n:].any()
        eos = (ids[:n] == tok.eos_token_id).nonzero().flatten().tolist()
        # EOS, if present, is the last real token; otherwise the budget ran out
        assert eos in ([], [n - 1])
        assert eos or n == r.completion_ids.shape[1]


def test_unknown_backend_is_a_clear_error(rollouts):
    _, tok, _ = rollouts
    with pytest.raises(ValueError, match="available: auto, hf, vllm"):
        make_backend("vllm2", "nowhere", tok)


def test_sampling_params_are_validated():
    with pytest.raises(ValueError):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)


def test_left_pad_matches_a_row_by_row_reference():
    import random as _random

    from heterorl.peer.model.logprobs import left_pad

    rng = _random.Random(0)
    for _ in range(50):
        prompts = [
            [rng.randrange(1, 50) for _ in range(rng.randrange(0, 7))] for _ in range(rng.randrange(1, 6))
        ]
        extra = rng.randrange(0, 3)
        ids, attn, width = left_pad(prompts, 0, extra=extra)
        assert width == max(map(len, prompts))
        for i, p in enumerate(prompts):
            row = [0] * (width - len(p)) + p + [0] * extra
            assert ids[i].tolist() == row
            assert attn[i].tolist() == [0] * (width - len(p)) + [1] * len(p) + [0] * extra
