"""The learner update sized for real models: micro-batches with the exact full-batch gradient (two-pass
cotangent method), gradient checkpointing, TIS and mismatch diagnostics of fresh rows, and its settings."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch

from heterorl.peer.learner.rows import Rows
from heterorl.peer.learner.trainer import Trainer
from heterorl.peer.learner.update import (
    StepOptions,
    accumulate_gradients,
    activation_checkpointing,
    autocast_for,
    peak_memory_mib,
    plan_micro_batches,
)
from heterorl.peer.model import completion_logprobs
from heterorl.protocol.settings import EXAMPLE, LearnerSettings, RunSettings, parse_run_config

V, N, T, VERSION = 41, 8, 5, 3


@pytest.fixture(scope="module")
def base():
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    return LlamaForCausalLM(build_config(V, hidden=32, layers=2, heads=4, max_len=64)).eval()


@pytest.fixture(scope="module")
def rows(base):
    """Two prompt groups of 4 with prompts of 2-6 tokens and ragged completions; the first group fresh
    (sampled with the learner's version), the second 2 versions stale; log q near the model's own."""
    gen = torch.Generator().manual_seed(1)
    prompts = [[1, *torch.randint(3, V, (1 + i % 5,), generator=gen).tolist()] for i in range(N)]
    comp = torch.randint(3, V, (N, T), generator=gen)
    mask = torch.ones(N, T, dtype=torch.long)
    for i, n in enumerate([5, 3, 1, 4, 2, 5, 5, 3]):
        mask[i, n:] = 0
    comp = torch.where(mask > 0, comp, torch.zeros_like(comp))
    with torch.no_grad():
        lp = completion_logprobs(base, prompts, comp, mask, 0)
    logq = torch.where(mask > 0, lp + 0.15 * torch.randn(N, T, generator=gen), torch.zeros_like(lp))
    return Rows(
        prompts=prompts,
        completions=comp,
        mask=mask,
        logq=logq,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]),
        group_ids=torch.arange(N) // 4,
        versions=torch.tensor([VERSION] * 4 + [VERSION - 2] * 4),
    )


def options(objective="gepo", objective_params=None, lr=0.5, grad_clip=1e9, **kw) -> StepOptions:
    """grad_clip 1e9: no clipping, so raw gradients are compared."""
    return StepOptions(
        objective=objective,
        advantage=None,
        objective_params=objective_params or {},
        temperature=1.0,
        max_new_tokens=T,
        lr=lr,
        grad_clip=grad_clip,
        **kw,
    )


def sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def run(base, rows, objective="gepo", objective_params=None, **kw):
    """One Trainer step (SGD at lr 0.5) on a copy of ``base`` at version VERSION: (model, stats)."""
    model = copy.deepcopy(base)
    trainer = Trainer(model, options(objective, objective_params, **kw), 0, optimizer=sgd, version=VERSION)
    stats = trainer.step(rows)
    assert trainer.version == VERSION + 1
    return model, stats


def assert_same_update(a, b):
    (ma, sa), (mb, sb) = a, b
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters(), strict=True):
        scale = float(pa.grad.abs().max()) + 1e-12
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6, msg=name)
    assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-5, abs=1e-7)
    assert sb["grad_norm"] == pytest.approx(sa["grad_norm"], rel=1e-4)


CASES = [
    ("gepo", {}),  # group-coupled denominator, defensive sampling on the stale group
    ("grpo", {}),
    ("grpo", {"aggregation": "token_mean"}),  # normaliser over the whole batch
    ("dapo", {}),
    ("cispo", {}),
]


@pytest.mark.parametrize("objective,params", CASES)
@pytest.mark.parametrize("budget", [1, 24, 40])
def test_micro_batches_give_the_full_batch_gradient(base, rows, objective, params, budget):
    full = run(base, rows, objective, params)
    micro = run(base, rows, objective, params, micro_batch_tokens=budget)
    assert full[1]["learner/micro_batches"] == 1.0
    assert micro[1]["learner/micro_batches"] == len(
        plan_micro_batches([len(p) for p in rows.prompts], T, budget)
    )
    assert micro[1]["learner/micro_batches"] > 1
    assert_same_update(full, micro)


@pytest.mark.parametrize("objective", ["gepo", "grpo", "gspo"])
def test_tis_and_mismatch_on_fresh_rows(base, rows, objective):
    full = run(base, rows, objective, tis_cap=1.1)
    micro = run(base, rows, objective, tis_cap=1.1, micro_batch_tokens=30)
    assert_same_update(full, micro)
    fresh_tokens = float(rows.mask[:4].sum())
    for _, stats in (full, micro):
        assert stats["tis/tokens"] == fresh_tokens
        assert stats["mismatch/tokens"] == fresh_tokens
        assert 0 < stats["tis/mean"] <= stats["tis/max"] <= 1.1 + 1e-6  # C in float32
        assert 0 < stats["mismatch/abs_mean"] <= stats["mismatch/abs_p99"] <= stats["mismatch/abs_max"]
    for key in ("tis/mean", "tis/frac_capped", "mismatch/abs_mean", "mismatch/abs_max"):
        assert micro[1][key] == pytest.approx(full[1][key], rel=1e-4, abs=1e-6)
    # TIS changes the step: the fresh rows' log q is replaced and their losses reweighted
    plain = run(base, rows, objective)
    assert not torch.allclose(next(plain[0].parameters()), next(full[0].parameters()))
    assert not any(k.startswith("tis/") for k in plain[1])


def test_mismatch_values_are_the_learner_logprobs_before_the_step(base, rows):
    _, stats = run(base, rows)
    with torch.no_grad():
        lp = completion_logprobs(base, rows.prompts[:4], rows.completions[:4], rows.mask[:4], 0)
    d = (lp - rows.logq[:4]).abs()[rows.mask[:4] > 0]
    assert stats["mismatch/abs_max"] == pytest.approx(float(d.max()), rel=1e-5)
    assert stats["mismatch/abs_mean"] == pytest.approx(float(d.mean()), rel=1e-5)
    off = accumulate_gradients(
        copy.deepcopy(base), rows, options(), version=VERSION, pad_id=0, diagnose_mismatch=False
    )
    assert not any(k.startswith("mismatch/") for k in off)


def count_forwards(model):
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return calls, handle


def test_default_path_is_one_forward_and_reports_floats(base, rows):
    model = copy.deepcopy(base)
    calls, handle = count_forwards(model)

    def step(**kw):
        return Trainer(model, options(lr=0.1, grad_clip=1.0, **kw), 0, optimizer=sgd, version=VERSION).step(
            rows
        )

    stats = step()
    assert calls == [True]  # diagnostics and (below) TIS reuse the one grad forward
    assert all(type(v) is float for v in stats.values())
    assert stats["learner/micro_batches"] == 1.0 and stats["mem/peak_mib"] > 0
    calls.clear()
    step(tis_cap=2.0)
    assert calls == [True]
    calls.clear()
    spans = plan_micro_batches([len(p) for p in rows.prompts], T, 30)
    step(micro_batch_tokens=30)
    assert calls == [False] * len(spans) + [True] * len(spans)  # pass 1 no grad, pass 2 with grad
    handle.remove()
    assert not model.training


def test_default_update_is_the_plain_single_pass(base, rows):
    """Today's update, written out: one forward, the objective, backward, clip, step."""
    from heterorl.peer import objectives

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    logp = completion_logprobs(model, rows.prompts, rows.completions, rows.mask, 0, 1.0)
    adv = objectives.advantages("dr_grpo", rows.rewards, rows.group_ids)
    staleness = (VERSION - rows.versions).clamp_min(0).float()
    loss, _ = objectives.compute(
        "gepo", logp, rows.logq, rows.mask, adv, rows.group_ids, staleness=staleness, max_len=T
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    new = run(base, rows)
    for pa, pb in zip(model.parameters(), new[0].parameters(), strict=True):
        assert torch.equal(pa.grad, pb.grad) and torch.equal(pa, pb)
    assert new[1]["loss"] == float(loss.detach())


@pytest.mark.parametrize("budget", [None, 24])
def test_gradient_checkpointing_same_gradient(base, rows, budget):
    plain = run(base, rows, micro_batch_tokens=budget)
    ckpt = run(base, rows, micro_batch_tokens=budget, gradient_checkpointing=True)
    assert_same_update(plain, ckpt)
    assert not ckpt[0].is_gradient_checkpointing  # restored after the update


def test_checkpointing_refuses_models_without_it():
    with (
        pytest.raises(ValueError, match="gradient checkpointing"),
        activation_checkpointing(torch.nn.Linear(2, 2), True),
    ):
        pass
    with activation_checkpointing(torch.nn.Linear(2, 2), False):
        pass


def test_plan_micro_batches():
    lengths = [2, 3, 1, 6, 2]
    assert plan_micro_batches(lengths, 4, None) == [(0, 5)]
    assert plan_micro_batches(lengths, 4, 1) == [(i, i + 1) for i in range(5)]  # below one row: one row each
    assert plan_micro_batches(lengths, 4, 10**6) == [(0, 5)]
    # rows × (widest prompt + completion width) <= budget
    assert plan_micro_batches(lengths, 4, 21) == [(0, 3), (3, 5)]  # 3 × 7, 2 × 10
    assert plan_micro_batches(lengths, 4, 20) == [(0, 2), (2, 4), (4, 5)]  # 2 × 7, 2 × 10, 1 × 6
    assert plan_micro_batches([], 4, 8) == [(0, 0)]
    with pytest.raises(ValueError):
        plan_micro_batches(lengths, 4, 0)


def test_objective_params_cannot_set_tis(base, rows):
    with pytest.raises(ValueError, match="tis_cap"):
        run(base, rows, objective_params={"tis_cap": 2.0})


def test_cpu_helpers():
    assert isinstance(autocast_for(torch.device("cpu")), contextlib.nullcontext)
    assert peak_memory_mib(torch.device("cpu")) > 0


# ----------------------------------------------------------------------------- run settings


def test_learner_settings_defaults_and_validation():
    s = LearnerSettings()
    assert (s.micro_batch_tokens, s.gradient_checkpointing, s.tis_cap) == (None, False, None)
    LearnerSettings(micro_batch_tokens=4096, gradient_checkpointing=True, tis_cap=2)
    for bad in (
        {"micro_batch_tokens": 0},
        {"micro_batch_tokens": 1.5},
        {"micro_batch_tokens": True},
        {"gradient_checkpointing": "yes"},
        {"tis_cap": 0.0},
        {"tis_cap": -2.0},
        {"tis_cap": float("nan")},
        {"tis_cap": True},
    ):
        with pytest.raises(ValueError):
            LearnerSettings(**bad)


def test_learner_settings_travel_in_the_runspec():
    import tomllib

    data = tomllib.loads(EXAMPLE)
    data["learner_keys"] = ["ab" * 32]
    assert parse_run_config(data).learner == LearnerSettings()
    data["learner"] = {
        **data["learner"],
        "micro_batch_tokens": 2048,
        "gradient_checkpointing": True,
        "tis_cap": 2.0,
    }
    cfg = parse_run_config(data)
    back = RunSettings.from_spec(cfg.runspec_body(b"\0" * 32, V))
    assert dataclasses.asdict(back.learner) == dataclasses.asdict(cfg.learner)
    assert back.learner.tis_cap == 2.0 and back.learner.micro_batch_tokens == 2048
    with pytest.raises(ValueError, match="tis_cap"):
        parse_run_config({**data, "learner": {"tis_cap": -1}})
    with pytest.raises(ValueError, match="tis_cap"):
        parse_run_config({**data, "objective": {"name": "gepo", "params": {"tis_cap": 2.0}}})
