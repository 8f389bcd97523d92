"""Adapter runs (LoRA on a frozen base): settings, the adapter state, merging, and refusing adapters for
another base. The tiny model, real peft, no mocks."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from heterorl.peer.daemon.weights import weights_bytes, weights_hash
from heterorl.peer.model import adapter as lora
from heterorl.peer.model import completion_logprobs, load_model
from heterorl.peer.model.prompts import PromptFormat
from heterorl.peer.rollout import SamplingParams, make_backend
from heterorl.peer.rollout.adapter import AdapterBackend
from heterorl.peer.tasks import get_task
from heterorl.protocol.settings import (
    AdapterSettings,
    RunSettings,
    parse_adapter_flag,
    parse_run_config,
)

KEY = "ab" * 32
QV = AdapterSettings(rank=8, alpha=16, target_modules=("q_proj", "v_proj"))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _trained(model, adapter: AdapterSettings = QV, seed: int = 1):
    """The model wrapped, its adapters moved away from the initial B = 0 (as training would)."""
    pm = lora.wrap(model, adapter)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return pm


# ---- settings ----


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": True}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": "q_proj"}, "target_modules"),
        ({"target_modules": ["q_proj", ""]}, "target_modules"),
        ({"target_modules": ["q_proj", 3]}, "target_modules"),
        ({"dropout": 0.1}, "unknown setting"),
        ({"base_hash": "00" * 32}, "computed by the coordinator"),
    ],
)
def test_bad_adapter_settings_are_refused_with_the_setting_named(section, match):
    with pytest.raises(ValueError, match=match):
        parse_run_config({"learner_keys": [KEY], "adapter": section})


def test_adapter_settings_travel_in_the_runspec_with_the_base_hash():
    cfg = parse_run_config(
        {"learner_keys": [KEY], "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "o_proj"]}}
    )
    assert cfg.adapter == AdapterSettings(4, 8.0, ("q_proj", "o_proj"))
    assert parse_run_config({"learner_keys": [KEY]}).adapter is None  # absent: full fine-tuning
    with pytest.raises(ValueError, match="base_hash"):
        cfg.runspec_body(b"\0" * 32, 100)  # an adapter run must name its base
    base = bytes(range(32))
    body = cfg.runspec_body(b"\1" * 32, 100, base_hash=base)
    assert json.loads(body["hyperparameters"])["adapter"]["base_hash"] == base.hex()
    s = RunSettings.from_spec(body)
    assert s.adapter == dataclasses.replace(cfg.adapter, base_hash=base.hex()) and s.adapter.scale == 2.0
    full = parse_run_config({"learner_keys": [KEY]}).runspec_body(b"\1" * 32, 100)
    assert RunSettings.from_spec(full).adapter is None
    hp = json.loads(body["hyperparameters"])
    hp["adapter"]["base_hash"] = ""
    with pytest.raises(ValueError, match="base"):
        RunSettings.from_spec({**body, "hyperparameters": json.dumps(hp)})
    hp["adapter"] = {"rank": -1, "base_hash": base.hex()}
    with pytest.raises(ValueError, match="rank"):
        RunSettings.from_spec({**body, "hyperparameters": json.dumps(hp)})


def test_the_adapter_flag():
    a = parse_adapter_flag("rank=8,alpha=16,targets=q_proj,v_proj")
    assert a == AdapterSettings(8, 16.0, ("q_proj", "v_proj"))
    assert parse_adapter_flag("rank=4").target_modules == AdapterSettings().target_modules
    for bad in ("rank=x", "rank=0", "q_proj", "rank=8,rank=4", "size=3", "targets="):
        with pytest.raises(ValueError):
            parse_adapter_flag(bad)


# ---- the adapter state ----


def test_targets_must_be_linear_layers_of_the_model(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    assert lora.target_modules(model, ("q_proj",)) == [f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)]
    with pytest.raises(ValueError, match="'qkv_proj' matches no module"):
        lora.target_modules(model, ("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="not a Linear"):
        lora.target_modules(model, ("embed_tokens",))
    with pytest.raises(ValueError, match="tied"):
        lora.target_modules(model, ("lm_head",))


def test_only_adapters_train_and_version_0_is_the_base_itself(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    base = lora.base_state(model)
    assert lora.state_hash(base) == weights_hash(weights_bytes(model))  # the same hash as a full run's v0
    pm = lora.wrap(model, QV)
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    state = lora.adapter_state(pm)
    assert sorted(state) == sorted(
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight"
        for i in (0, 1)
        for m in ("q_proj", "v_proj")
        for ab in "AB"
    )
    assert all(not v.any() for k, v in state.items() if "lora_B" in k)
    again, _ = load_model(str(tiny_model_dir))
    assert lora.adapter_bytes(lora.wrap(again, QV)) == lora.adapter_bytes(pm)  # v0 is reproducible
    merged = lora.merge(base, state, QV)
    assert all(torch.equal(merged[k], base[k]) for k in base)
    # bytes per version: the adapters are a few percent of the weights
    assert len(lora.adapter_bytes(pm)) < 0.05 * len(weights_bytes(again))
    bf16 = lora.adapter_bytes(pm, "bfloat16")
    assert len(bf16) < 0.6 * len(lora.adapter_bytes(pm))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_weights_compute_what_the_peft_model_computes(tiny_model_dir, dtype):
    model, _ = load_model(str(tiny_model_dir))
    base = lora.base_state(model, dtype)
    pm = _trained(model)
    state = {k: v.to(getattr(torch, dtype)) for k, v in lora.adapter_state(pm).items()}
    merged, _ = load_model(str(tiny_model_dir))
    merged.load_state_dict(lora.merge(base, state, QV))
    ids = torch.randint(4, 60, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (pm(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max()
    assert diff < (1e-4 if dtype == "float32" else 0.2), diff
    moved = sum(not torch.equal(merged.state_dict()[k], base[k].float()) for k in base)
    assert moved == 4  # q and v of both layers


# ---- another base ----


@pytest.fixture(scope="module")
def other_base(tmp_path_factory):
    """A model of another shape (hidden 32): adapters made for the tiny model do not fit it."""
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config, build_tokenizer

    out = tmp_path_factory.mktemp("other")
    tok = build_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(build_config(len(tok), hidden=32, heads=1)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_an_adapter_for_another_base_is_refused_with_the_reason(tiny_model_dir, other_base):
    model, _ = load_model(str(tiny_model_dir))
    state = lora.adapter_state(_trained(model))
    other, _ = load_model(str(other_base))
    with pytest.raises(ValueError, match="another base"):
        lora.merge(lora.base_state(other), state, QV)
    base = lora.base_state(load_model(str(tiny_model_dir))[0])
    with pytest.raises(ValueError, match="rank 4"):  # the run's rank is not this adapter's
        lora.merge(base, state, dataclasses.replace(QV, rank=4))
    renamed = {k.replace("layers.1", "layers.7"): v for k, v in state.items()}
    with pytest.raises(ValueError, match="layers.7.*another base"):
        lora.merge(base, renamed, QV)
    for bad, why in (
        ({**state, "model.norm.weight": torch.ones(64)}, "not a LoRA"),
        ({k: v for k, v in state.items() if "layers.0.self_attn.q_proj.lora_B" not in k}, "without its"),
        ({k: v for k, v in state.items() if "layers.0.self_attn.q_proj.lora_A" not in k}, "without their"),
        ({}, "no LoRA"),
    ):
        with pytest.raises(ValueError, match=why):
            lora.merge(base, bad, QV)


def test_a_base_that_is_not_the_runs_is_refused_by_its_hash(tiny_model_dir, other_base):
    model, _ = load_model(str(tiny_model_dir))
    v0, base_hash = lora.initial_hashes(model, QV, "float32")
    run = dataclasses.replace(QV, base_hash=base_hash.hex())
    assert lora.state_hash(lora.load_base(str(tiny_model_dir), run, "float32")) == base_hash
    with pytest.raises(ValueError, match="not the run's base"):
        lora.load_base(str(other_base), run, "float32")
    with pytest.raises(ValueError, match="not the run's base"):  # same model, published in another dtype
        lora.load_base(str(tiny_model_dir), run, "bfloat16")
    fresh, _ = load_model(str(tiny_model_dir))
    with pytest.raises(ValueError, match="not the run's base"):
        lora.for_training(_trained(fresh).merge_and_unload(), run, "float32")


# ---- the hf backend applies adapters ----


def test_hf_backend_applies_adapters_and_keeps_its_weights_when_one_does_not_fit(tiny_model_dir, tmp_path):
    model, tok = load_model(str(tiny_model_dir))
    base = lora.base_state(model)
    backend = AdapterBackend(make_backend("hf", tiny_model_dir, tok), base, QV, tmp_path)
    assert not backend.native and "merged" in backend.describe()
    pm = _trained(model)
    backend.load_weights(lora.adapter_state(pm))
    fmt, task, rng = PromptFormat(tok), get_task("arithmetic", digits=1), random.Random(0)
    prompts = [fmt.encode(task.sample(rng).prompt) for _ in range(8)]
    torch.manual_seed(0)
    r = backend.generate(prompts, SamplingParams(1.0, 1.0, 6))
    lp = completion_logprobs(pm, r.prompt_ids, r.completion_ids, r.completion_mask, tok.pad_token_id, 1.0)
    assert (lp - r.logprobs).abs().max() < 1e-4  # the learner's peft model and the sampler agree
    bad = {k.replace("layers.0", "layers.9"): v for k, v in lora.adapter_state(pm).items()}
    with pytest.raises(ValueError, match="another base"):
        backend.load_weights(bad)
    r2 = backend.generate(prompts, SamplingParams(1.0, 1.0, 6))
    lp2 = completion_logprobs(pm, r2.prompt_ids, r2.completion_ids, r2.completion_mask, tok.pad_token_id, 1.0)
    assert (lp2 - r2.logprobs).abs().max() < 1e-4  # still the adapter it held
