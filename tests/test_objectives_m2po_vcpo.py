"""M2PO and VCPO: hand-computed vectors, the float64 reference (``reference_objectives.m2po`` / ``.vcpo``),
gradients, edge cases, and the trainer's one-step learning-rate scale (``step/lr_scale``)."""

from __future__ import annotations

import copy
import math

import pytest
import reference_objectives as ref
import torch

from heterorl.peer import objectives as obj
from heterorl.peer.learner.trainer import Trainer, scaled_optimizer_step
from heterorl.peer.objectives.m2po import m2_keep_mask

pytestmark = pytest.mark.fast

F64 = torch.float64
LQ = math.log(0.5)


def run(name, lp, lq, mask, A, gids, **params):
    lp = lp.detach().clone().requires_grad_(True)
    loss, stats = obj.compute(name, lp, lq, mask, A, gids, **params)
    loss.backward()
    return float(loss.detach()), lp.grad.detach(), stats


def one_row(d, pad=0):
    """One row with log-ratios ``d`` (logq = log 0.5) and ``pad`` padding tokens of garbage."""
    d = torch.tensor([list(d) + [7.0] * pad], dtype=F64)
    lq = torch.full_like(d, LQ)
    mask = torch.tensor([[1] * (d.shape[1] - pad) + [0] * pad])
    return lq + d, lq, mask


# ----------------------------------------------------------------------------- M2PO


@pytest.mark.parametrize(
    ("tau", "masked"),
    [
        (0.04, []),  # mean d² = 0.1025/4 = 0.025625 < τ
        (0.02, [0]),  # drop 0.09: 0.0125/3 = 0.00417 < τ
        (0.004, [0, 1]),  # 0.00417 ≥ τ; drop 0.01: 0.0025/2 = 0.00125 < τ
        (1e-9, [0, 1, 2]),  # only the d = 0 token's suffix (mean 0) is below τ
    ],
)
def test_m2po_four_tokens_hand_computed(tau, masked):
    d = [0.3, -0.1, 0.05, 0.0]
    lp, lq, mask = one_row(d, pad=1)
    loss, grad, stats = run(
        "m2po", lp, lq, mask, torch.tensor([1.0], dtype=F64), torch.tensor([0]), m2_threshold=tau
    )
    kept = [t for t in range(4) if t not in masked]
    # all 4 valid tokens stay in the denominator
    assert loss == pytest.approx(-sum(math.exp(d[t]) for t in kept) / 4, rel=1e-12)
    want = torch.zeros(1, 5, dtype=F64)
    for t in kept:
        want[0, t] = -math.exp(d[t]) / 4
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert stats["m2po/masked_frac"] == pytest.approx(len(masked) / 4)
    assert stats["clip/frac"] == pytest.approx(len(masked) / 4)
    assert stats["clip/frac_low"] == pytest.approx(sum(d[t] < 0 for t in masked) / 4)
    assert stats["m2po/m2"] == pytest.approx(0.1025 / 4, rel=1e-12)
    assert stats["m2po/m2_kept"] == pytest.approx(sum(d[t] ** 2 for t in kept) / len(kept), rel=1e-12)
    assert stats["m2po/m2_kept"] < tau


def test_m2po_all_masked_gives_zero_loss_and_gradient():
    lp, lq, mask = one_row([0.3, -0.1, 0.05, 0.02])
    loss, grad, stats = run(
        "m2po", lp, lq, mask, torch.tensor([1.0], dtype=F64), torch.tensor([0]), m2_threshold=1e-6
    )
    assert loss == 0.0 and torch.count_nonzero(grad) == 0
    assert stats["m2po/masked_frac"] == 1.0 and stats["m2po/m2_kept"] == 0.0 and stats["clip/frac"] == 1.0


def test_m2po_on_policy_masks_nothing_and_is_the_plain_policy_gradient():
    lp, lq, mask = one_row([0.0, 0.0, 0.0])
    A = torch.tensor([0.7], dtype=F64)
    loss, grad, stats = run("m2po", lp, lq, mask, A, torch.tensor([0]))
    assert loss == pytest.approx(-0.7) and stats["m2po/masked_frac"] == 0.0
    torch.testing.assert_close(grad, torch.full_like(lp, -0.7 / 3))


def test_m2po_ties_are_broken_in_row_major_order():
    m2 = torch.tensor([0.04, 0.04, 0.0, 0.0], dtype=F64)
    assert m2_keep_mask(m2, 0.015).tolist() == [False, True, True, True]
    assert m2_keep_mask(m2.flip(0), 0.015).tolist() == [True, True, False, True]
    assert m2_keep_mask(m2[:0], 0.04).numel() == 0


def test_m2po_weight_cap_rejects_tokens_not_truncates():
    d = [math.log(6.0), math.log(2.0), 0.0]
    lp, lq, mask = one_row(d)
    A, g = torch.tensor([1.0], dtype=F64), torch.tensor([0])
    loss, grad, stats = run("m2po", lp, lq, mask, A, g, m2_threshold=100.0, weight_cap=5.0)
    assert loss == pytest.approx(-(2.0 + 1.0) / 3, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2 / 3, -1 / 3]], dtype=F64))
    assert stats["m2po/capped_frac"] == pytest.approx(1 / 3)
    assert stats["clip/frac_high"] == pytest.approx(1 / 3)


def test_m2po_padding_is_ignored():
    lp, lq, mask = one_row([0.3, -0.1, 0.05, 0.0])
    lp2, lq2, mask2 = one_row([0.3, -0.1, 0.05, 0.0], pad=3)
    lp2[0, 4:] = -50.0  # garbage on padding
    a = run("m2po", lp, lq, mask, torch.tensor([1.0], dtype=F64), torch.tensor([0]), m2_threshold=0.02)
    b = run("m2po", lp2, lq2, mask2, torch.tensor([1.0], dtype=F64), torch.tensor([0]), m2_threshold=0.02)
    assert a[0] == pytest.approx(b[0], rel=1e-15)
    torch.testing.assert_close(b[1][:, :4], a[1])
    assert torch.count_nonzero(b[1][:, 4:]) == 0
    assert a[2]["m2po/masked_frac"] == b[2]["m2po/masked_frac"]


def random_batch(seed, B=6, T=7, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lq = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    lp = lq + torch.randn(B, T, generator=g, dtype=F64) * scale
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    A = torch.randn(B, generator=g, dtype=F64)
    gids = torch.arange(B) // 2
    return lp, lq, mask, A, gids


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("cap", [None, 1.2])
def test_m2po_matches_float64_reference(seed, cap):
    lp, lq, mask, A, gids = random_batch(seed)
    loss, grad, stats = run("m2po", lp, lq, mask, A, gids, weight_cap=cap)
    leaf = lp.clone().requires_grad_(True)
    rl, info = ref.m2po(leaf, lq, mask, A, weight_cap=cap)
    rl.backward()
    assert loss == pytest.approx(float(rl.detach()), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-12, atol=1e-15)
    assert stats["m2po/masked_frac"] == pytest.approx(len(info["masked"]) / int(mask.sum()))
    assert 0 < len(info["masked"]) < int(mask.sum())  # the cases exercise the rule


def test_m2po_rejects_clip_and_bad_params():
    lp, lq, mask = one_row([0.1])
    args = (lp, lq, mask, torch.tensor([1.0], dtype=F64), torch.tensor([0]))
    for bad in ({"clip": 0.2}, {"m2_threshold": 0.0}, {"weight_cap": -1.0}, {"m2_threshold": True}):
        with pytest.raises(ValueError):
            obj.compute("m2po", *args, **bad)


# ----------------------------------------------------------------------------- VCPO


def two_rows():
    """Rows with w = 2 and w = 0.5 (one token each), A = [1, −1], one group."""
    lq = torch.full((2, 1), LQ, dtype=F64)
    lp = lq + torch.tensor([[math.log(2.0)], [math.log(0.5)]], dtype=F64)
    return lp, lq, torch.ones(2, 1), torch.tensor([1.0, -1.0], dtype=F64), torch.tensor([0, 0])


def test_vcpo_hand_computed():
    # W = w² = [4, 1/4]: b = (4 − 1/4)/(17/4) = 15/17, A' = [2/17, −32/17];
    # loss = −(1/2)(2·2/17 + 0.5·(−32/17)) = 6/17; ESS ratio = 2.5²/(2·4.25) = 25/34, scale = sqrt(25/34)
    loss, grad, stats = run("vcpo", *two_rows())
    assert loss == pytest.approx(6 / 17, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-2 / 17], [8 / 17]], dtype=F64), rtol=1e-12, atol=0)
    assert stats["vcpo/ess_ratio"] == pytest.approx(25 / 34, rel=1e-12)
    assert stats["step/lr_scale"] == pytest.approx(math.sqrt(25 / 34), rel=1e-12)
    assert stats["is/ess"] == pytest.approx(25 / 34, rel=1e-12)  # no weight above C = 8
    assert stats["clip/frac"] == 0.0


def test_vcpo_truncation_grad_norms_and_switches():
    lp, lq, mask, A, g = two_rows()
    loss, _, stats = run("vcpo", lp, lq, mask, A, g, is_cap=1.5)  # w̄ = [1.5, 0.5], A' as above
    assert loss == pytest.approx(-(1.5 * 2 / 17 - 0.5 * 32 / 17) / 2, rel=1e-12)
    assert stats["clip/frac_high"] == 0.5
    assert stats["vcpo/ess_ratio"] == pytest.approx(25 / 34, rel=1e-12)  # ESS of the untruncated weights
    loss, _, _ = run("vcpo", lp, lq, mask, A, g, grad_sq_norms=torch.tensor([1.0, 16.0]))  # W = [4, 4]: b = 0
    assert loss == pytest.approx(-(2 * 1 - 0.5 * 1) / 2, rel=1e-12)
    loss, _, stats = run("vcpo", lp, lq, mask, A, g, baseline=False, ess_scaling=False)
    assert loss == pytest.approx(-0.75, rel=1e-12) and stats["step/lr_scale"] == 1.0
    _, _, stats = run("vcpo", lp, lq, mask, A, g, ess_rule="linear", ess_base_ratio=0.5)
    assert stats["step/lr_scale"] == 1.0  # min(1, (25/34)/0.5)


def test_vcpo_on_policy_is_plain_reinforce_with_group_mean_baseline():
    lp, lq, mask, A, g = two_rows()
    loss, grad, stats = run("vcpo", lq.clone(), lq, mask, torch.tensor([1.0, 0.0], dtype=F64), g)
    assert stats["step/lr_scale"] == pytest.approx(1.0) and loss == pytest.approx(0.0, abs=1e-15)
    torch.testing.assert_close(grad, torch.tensor([[-0.25], [0.25]], dtype=F64))  # A' = ±0.5, /B


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norms", [False, True])
def test_vcpo_matches_float64_reference(seed, norms):
    lp, lq, mask, A, gids = random_batch(seed, scale=0.15)
    gsq = torch.rand(len(A), generator=torch.Generator().manual_seed(seed), dtype=F64) * 3 if norms else None
    loss, grad, stats = run("vcpo", lp, lq, mask, A, gids, grad_sq_norms=gsq, is_cap=1.1)
    leaf = lp.clone().requires_grad_(True)
    rl, info = ref.vcpo(leaf, lq, mask, A, gids, is_cap=1.1, grad_sq_norms=gsq)
    rl.backward()
    assert loss == pytest.approx(float(rl.detach()), rel=1e-10, abs=1e-14)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-14)
    assert stats["vcpo/ess_ratio"] == pytest.approx(info["ess_ratio"], rel=1e-10)


def test_vcpo_extreme_log_ratios_stay_finite():
    lp, lq, mask, A, gids = random_batch(0, scale=30.0)
    loss, grad, stats = run("vcpo", lp, lq, mask, A, gids)
    assert math.isfinite(loss) and bool(torch.isfinite(grad).all())
    assert 0.0 < stats["step/lr_scale"] <= 1.0 and math.isfinite(stats["vcpo/ess_ratio"])


def test_vcpo_rejects_bad_params():
    lp, lq, mask, A, g = two_rows()
    for bad in (
        {"clip": 0.2},
        {"is_cap": 0.0},
        {"ess_rule": "cube"},
        {"ess_base_ratio": 0.0},
        {"grad_sq_norms": torch.tensor([1.0, -1.0])},
        {"grad_sq_norms": torch.tensor([1.0, 1.0, 1.0])},
    ):
        with pytest.raises(ValueError):
            obj.compute("vcpo", lp, lq, mask, A, g, **bad)


def test_vcpo_rejects_token_advantages():
    lp, lq, mask, _, g = two_rows()
    with pytest.raises(ValueError):
        obj.compute("vcpo", lp, lq, mask, torch.ones(2, 1, dtype=F64), g)


# ----------------------------------------------------------------------------- the trainer's lr scale


def test_scaled_optimizer_step_takes_the_lr_times_scale_step_and_restores_lr():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    other = copy.deepcopy(net)
    a = torch.optim.AdamW(net.parameters(), lr=1e-2)
    b = torch.optim.AdamW(other.parameters(), lr=1e-2 * 0.3)
    x = torch.randn(8, 5)
    for _ in range(3):  # a few steps: Adam's state evolves identically, only the step size is scaled
        for m, opt, scale in ((net, a, 0.3), (other, b, None)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            if scale is None:
                opt.step()
            else:
                scaled_optimizer_step(opt, scale)
        assert a.param_groups[0]["lr"] == 1e-2
    for p, q in zip(net.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError):
            scaled_optimizer_step(a, bad)


def test_trainer_step_applies_the_objectives_lr_scale_once():
    from test_trainer import buffered, options, tiny_model

    from heterorl.peer.learner.rows import rows_from_batches

    rows = rows_from_batches(buffered(2), pad_id=0)  # behaviour log-probs −3.0: off-policy, ESS < 1
    lr = 1e-2
    scaled = Trainer(tiny_model(), options(objective="vcpo", lr=lr), pad_id=0)
    stats = scaled.step(rows)
    scale = stats["step/lr_scale"]
    assert 0.0 < scale < 0.99
    assert scaled.optimizer.param_groups[0]["lr"] == lr  # restored after the step
    plain = Trainer(
        tiny_model(),
        options(objective="vcpo", objective_params={"ess_scaling": False}, lr=lr * scale),
        pad_id=0,
    )
    plain_stats = plain.step(rows)
    assert plain_stats["step/lr_scale"] == 1.0
    for p, q in zip(scaled.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    moved = [
        (p - q).abs().max() for p, q in zip(scaled.model.parameters(), tiny_model().parameters(), strict=True)
    ]
    assert max(moved) > 0
