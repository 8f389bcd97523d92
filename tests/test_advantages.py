"""Advantage estimators: spec §1.3, §2.4 and the §5.12 vectors, plus hypothesis properties."""

from __future__ import annotations

import math

import pytest
import reference_objectives as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterorl.peer import objectives as obj

pytestmark = pytest.mark.fast  # in `make test-fast`

F64 = torch.float64
TOL = {"rtol": 1e-5, "atol": 2e-6}
ADV_NAMES = ("grpo", "dr_grpo", "bnpo", "rloo")


def adv(name, rewards, gids, **kw):
    out = obj.advantages(name, torch.tensor(rewards, dtype=F64), torch.tensor(gids), **kw)
    assert out.shape == (len(rewards),)
    return out.detach().double()


def t(x):
    return torch.tensor(x, dtype=F64)


def test_advantage_names():
    names = set(obj.advantage_names())
    assert set(ADV_NAMES) <= names


# ----------------------------------------------------------------------------- §5.12 vectors


def test_grpo_unbiased_std():
    torch.testing.assert_close(adv("grpo", [1, 0, 0, 0], [0] * 4, eps=0.0), t([1.5, -0.5, -0.5, -0.5]), **TOL)


def test_grpo_unbiased_is_default():
    torch.testing.assert_close(
        adv("grpo", [1, 0, 0, 0], [0] * 4, eps=0.0, unbiased=True),
        adv("grpo", [1, 0, 0, 0], [0] * 4, eps=0.0),
    )


def test_grpo_population_std():
    torch.testing.assert_close(
        adv("grpo", [1, 0, 0, 0], [0] * 4, eps=0.0, unbiased=False),
        t([1.732051, -0.577350, -0.577350, -0.577350]),
        **TOL,
    )


def test_grpo_default_eps_is_small():
    """Default ε_A = 1e-6: std 0.5 -> 0.75/(0.5+1e-6)."""
    got = adv("grpo", [1, 0, 0, 0], [0] * 4)
    torch.testing.assert_close(got, t([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), rtol=1e-9, atol=1e-12)


def test_grpo_eps_is_added_to_std():
    got = adv("grpo", [1, 0, 0, 0], [0] * 4, eps=0.5)
    torch.testing.assert_close(got, t([0.75, -0.25, -0.25, -0.25]) / 1.0, rtol=1e-9, atol=1e-12)


def test_mean_only():
    torch.testing.assert_close(adv("dr_grpo", [1, 0, 0, 0], [0] * 4), t([0.75, -0.25, -0.25, -0.25]), **TOL)


@pytest.mark.parametrize("name", ADV_NAMES)
def test_all_equal_rewards_give_zeros(name):
    for kw in ({}, {"eps": 0.0}) if name == "grpo" else ({},):
        got = adv(name, [1, 1, 1, 0.5, 0.5], [0, 0, 0, 1, 1], **kw)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.zeros(5, dtype=F64))


@pytest.mark.parametrize("name", ADV_NAMES)
def test_group_of_one_gives_zero(name):
    got = adv(name, [1.0, 0.0, 1.0, 0.3], [0, 0, 1, 2])
    assert torch.isfinite(got).all()
    assert got[2].item() == 0.0 and got[3].item() == 0.0
    if name != "bnpo":
        assert got[0].item() > 0 > got[1].item()


def test_bnpo_symmetric():
    R = [1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0]
    gids = [0] * 4 + [1] * 4 + [2] * 4
    exp = t(
        [
            0.680175,
            -0.226725,
            -0.226725,
            -0.226725,
            0.392699,
            0.392699,
            -0.392699,
            -0.392699,
            0.226725,
            0.226725,
            0.226725,
            -0.680175,
        ]
    )
    torch.testing.assert_close(t(ref.advantages("bnpo", R, gids)), exp, **TOL)
    got = adv("bnpo", R, gids)
    torch.testing.assert_close(got, exp, **TOL)
    # = π/8 × GRPO with population std (§2.4 special case)
    grpo_pop = adv("grpo", R, gids, eps=0.0, unbiased=False)
    torch.testing.assert_close(got, math.pi / 8 * grpo_pop, **TOL)


def test_bnpo_asymmetric():
    R = [1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0]
    gids = [0] * 4 + [1] * 4 + [2] * 4
    r01 = [0.658525, -0.219508, -0.219508, -0.219508]
    exp = t(r01 + r01 + [0.246749, 0.246749, 0.246749, -0.740247])
    torch.testing.assert_close(t(ref.advantages("bnpo", R, gids)), exp, **TOL)
    torch.testing.assert_close(adv("bnpo", R, gids), exp, **TOL)


def test_bnpo_single_prompt_falls_back_to_baseline():
    """σ² undefined / 0 -> a = b = 0 -> α = β = 1 -> weight 1: A = R̃ - p̂."""
    torch.testing.assert_close(adv("bnpo", [1, 0, 0, 0], [0] * 4), t([0.75, -0.25, -0.25, -0.25]), **TOL)
    # two prompts, equal success rates -> σ² = 0 -> weight 1
    torch.testing.assert_close(adv("bnpo", [1, 0, 0, 1], [0, 0, 1, 1]), t([0.5, -0.5, -0.5, 0.5]), **TOL)


def test_bnpo_reward_range_mapping():
    """R̃ = (R - r_min)/(r_max - r_min): rewards in {-1, +1} with r_min=-1 equal {0, 1} with defaults."""
    R01 = [1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0]
    Rpm = [2 * r - 1 for r in R01]
    gids = [0] * 4 + [1] * 4 + [2] * 4
    torch.testing.assert_close(adv("bnpo", Rpm, gids, r_min=-1.0, r_max=1.0), adv("bnpo", R01, gids), **TOL)


def test_rloo_formula():
    R = [1.0, 0.0, 0.5, 2.0, 3.0]
    gids = [0, 0, 0, 1, 1]
    exp = t([1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2 - 3, 3 - 2])
    torch.testing.assert_close(adv("rloo", R, gids), exp, rtol=1e-9, atol=1e-12)


def test_rloo_is_scaled_mean_only():
    """RLOO = G/(G-1) × (R - mean) within a group of size G."""
    R = [1.0, 0.0, 0.0, 0.0]
    exp = 4 / 3 * adv("dr_grpo", R, [0] * 4)
    torch.testing.assert_close(adv("rloo", R, [0] * 4), exp, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- properties


@st.composite
def reward_batch(draw, binary=False):
    P = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 5)) for _ in range(P)]
    labels = draw(st.lists(st.integers(-50, 50), min_size=P, max_size=P, unique=True))
    if binary:
        rew = st.sampled_from([0.0, 1.0])
    else:
        rew = st.floats(-3, 3, allow_nan=False).map(lambda x: round(x, 3))
    R, gids = [], []
    for p in range(P):
        for _ in range(sizes[p]):
            R.append(draw(rew))
            gids.append(labels[p])
    perm = draw(st.permutations(range(len(R))))
    return [R[i] for i in perm], [gids[i] for i in perm]


@settings(max_examples=60, deadline=None)
@given(data=reward_batch(), name=st.sampled_from(["grpo", "dr_grpo", "rloo"]), unbiased=st.booleans())
def test_matches_reference(data, name, unbiased):
    R, gids = data
    kw = {"unbiased": unbiased, "eps": 1e-6} if name == "grpo" else {}
    exp = t(ref.advantages(name, R, gids, **kw))
    torch.testing.assert_close(adv(name, R, gids, **kw), exp, rtol=1e-7, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(data=reward_batch(binary=True))
def test_bnpo_matches_reference(data):
    R, gids = data
    got = adv("bnpo", R, gids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, t(ref.advantages("bnpo", R, gids)), rtol=1e-7, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(data=reward_batch(), name=st.sampled_from(ADV_NAMES), seed=st.integers(0, 2**16))
def test_group_label_and_row_permutation_invariance(data, name, seed):
    """Relabelling groups (any ints) and permuting rows permutes the advantages accordingly."""
    R, gids = data
    if name == "bnpo":
        R = [float(r > 0) for r in R]
    base = adv(name, R, gids)
    gen = torch.Generator().manual_seed(seed)
    uniq = sorted(set(gids))
    new_labels = (torch.randperm(1000, generator=gen)[: len(uniq)] - 500).tolist()
    relabel = dict(zip(uniq, new_labels, strict=True))
    perm = torch.randperm(len(R), generator=gen).tolist()
    R2 = [R[i] for i in perm]
    g2 = [relabel[gids[i]] for i in perm]
    torch.testing.assert_close(adv(name, R2, g2), base[perm], rtol=1e-9, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(data=reward_batch(), name=st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_centred_per_group(data, name):
    """Group baselines: advantages sum to zero within each group, and shifting a group's rewards
    by a constant changes nothing."""
    R, gids = data
    a = adv(name, R, gids)
    for g in set(gids):
        idx = [i for i, x in enumerate(gids) if x == g]
        assert abs(a[idx].sum().item()) < 1e-6
    shift = {g: 7.0 * k for k, g in enumerate(sorted(set(gids)))}
    R2 = [r + shift[gg] for r, gg in zip(R, gids, strict=True)]
    torch.testing.assert_close(adv(name, R2, gids), a, rtol=1e-6, atol=1e-6)
