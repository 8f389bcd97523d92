"""Truncated importance sampling (Yao et al. 2025) on every objective, and the mismatch diagnostics.

TIS rows use the learner's recompute as behaviour policy and multiply each token's loss by
w_t = min(exp(tis_logp − logq), C): checked against a float64 hand loop, identities over the whole zoo
(off, identity, constant and capped weights, row masks), and parameter validation.
"""

from __future__ import annotations

import math

import pytest
import reference_objectives as ref
import torch

from heterorl.peer import objectives as obj
from heterorl.peer.objectives.tis import mismatch_stats, tis_correction

pytestmark = pytest.mark.fast  # in `make test-fast`

F64 = torch.float64
B, T = 6, 5


def make(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lq = -3.0 + 2.9 * torch.rand(B, T, generator=gen, dtype=F64)
    lold = lq + 0.5 * (2 * torch.rand(B, T, generator=gen, dtype=F64) - 1)  # learner's recompute
    lp = lold + 0.3 * (2 * torch.rand(B, T, generator=gen, dtype=F64) - 1)
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0] = True
    lq, lold, lp = (x.masked_fill(~mask, 0.0) for x in (lq, lold, lp))
    adv = torch.randn(B, generator=gen, dtype=F64)
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    rows = torch.tensor([True, False, True, True, False, True])
    return lp, lq, lold, mask, adv, gids, rows


def params_for(name: str) -> dict:
    return {"max_len": T + 3} if name == "dr_grpo" else {}


def run(name, lp, lq, mask, adv, gids, **params):
    x = lp.detach().clone().requires_grad_(True)
    loss, stats = obj.compute(name, x, lq, mask, adv, gids, **params_for(name), **params)
    loss.backward()
    grad = torch.zeros_like(x) if x.grad is None else x.grad
    return loss.detach(), grad, stats


# ----------------------------------------------------------------------------- float64 hand loop


def reference(name, lp, lq, lold, mask, adv, gids, rows, cap):
    """Loss with TIS, written token by token from Yao et al.'s definition on top of each objective."""
    m = mask.tolist()
    A = adv.tolist()
    base = [[float(lold[b, t] if rows[b] else lq[b, t]) for t in range(T)] for b in range(B)]
    w = [
        [min(math.exp(float(lold[b, t] - lq[b, t])), cap) if rows[b] and m[b][t] else 1.0 for t in range(T)]
        for b in range(B)
    ]
    valid = [[t for t in range(T) if m[b][t]] for b in range(B)]
    zero = torch.zeros((), dtype=F64)
    tok = [[zero for _ in range(T)] for _ in range(B)]
    if name == "grpo":
        for b in range(B):
            for t in valid[b]:
                rho = torch.exp(lp[b, t] - base[b][t])
                tok[b][t] = -w[b][t] * ref.ppo_obj(rho, A[b], 0.2, 0.2)
    elif name == "cispo":
        for b in range(B):
            for t in valid[b]:
                rho = min(math.exp(float(lp[b, t].detach()) - base[b][t]), 1.28)
                tok[b][t] = -w[b][t] * rho * A[b] * lp[b, t]
    elif name == "gspo":
        for b in range(B):
            dbar = sum((lp[b, t] - base[b][t] for t in valid[b]), zero) / len(valid[b])
            lb = -ref.ppo_obj(torch.exp(dbar), A[b], 3e-4, 4e-4)
            for t in valid[b]:
                tok[b][t] = w[b][t] * lb
    elif name == "gepo":
        qt = [math.exp(sum(base[b][t] for t in valid[b]) / len(valid[b])) for b in range(B)]
        for b in range(B):
            grp = [i for i in range(B) if int(gids[i]) == int(gids[b])]
            e = sum(qt[i] ** 2 for i in grp) / sum(qt[i] for i in grp)
            lp_bar = sum((lp[b, t] for t in valid[b]), zero) / len(valid[b])
            lb = -ref.ppo_obj(torch.exp(lp_bar - math.log(e)), A[b], 0.2, 0.2)
            for t in valid[b]:
                tok[b][t] = w[b][t] * lb
    else:
        raise ValueError(name)
    agg = {"grpo": "seq_mean_token_mean", "cispo": "token_mean"}.get(name, "seq_mean_token_mean")
    return ref.aggregate(agg, torch.stack([torch.stack(r) for r in tok]), m)


@pytest.mark.parametrize("name", ["grpo", "cispo", "gspo", "gepo"])
@pytest.mark.parametrize("cap", [1.05, 2.0, 100.0])
def test_matches_float64_hand_loop(name, cap):
    lp, lq, lold, mask, adv, gids, rows = make(1)
    loss, grad, stats = run(name, lp, lq, mask, adv, gids, tis_cap=cap, tis_logp=lold, tis_rows=rows)
    x = lp.detach().clone().requires_grad_(True)
    want = reference(name, x, lq, lold, mask, adv, gids, rows, cap)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12)
    on = rows[:, None] & mask
    raw = torch.exp(lold - lq)[on]
    assert stats["tis/tokens"] == on.sum().item()
    assert stats["tis/mean"] == pytest.approx(float(raw.clamp(max=cap).mean()), rel=1e-12)
    assert stats["tis/max"] == pytest.approx(float(raw.clamp(max=cap).max()), rel=1e-12)
    assert stats["tis/frac_capped"] == pytest.approx(float((raw > cap).double().mean()), rel=1e-12)


# ----------------------------------------------------------------------------- identities, every objective


@pytest.mark.parametrize("name", obj.names())
def test_off_is_bit_identical(name):
    lp, lq, _, mask, adv, gids, _ = make(2)
    plain = run(name, lp, lq, mask, adv, gids)
    off = run(name, lp, lq, mask, adv, gids, tis_cap=None)
    assert torch.equal(plain[0], off[0]) and torch.equal(plain[1], off[1])
    assert plain[2] == off[2]
    assert not any(k.startswith("tis/") for k in off[2])


@pytest.mark.parametrize("name", obj.names())
def test_recompute_equal_to_engine_is_the_plain_objective(name):
    lp, lq, _, mask, adv, gids, _ = make(3)
    plain = run(name, lp, lq, mask, adv, gids)
    tis = run(name, lp, lq, mask, adv, gids, tis_cap=2.0, tis_logp=lq.clone())
    assert torch.equal(plain[0], tis[0]) and torch.equal(plain[1], tis[1])
    assert {k: v for k, v in tis[2].items() if not k.startswith("tis/")} == plain[2]
    assert tis[2]["tis/mean"] == 1.0 and tis[2]["tis/frac_capped"] == 0.0


@pytest.mark.parametrize("name", obj.names())
@pytest.mark.parametrize("cap", [0.5, 1e-3])
def test_constant_and_capped_weights_scale_the_loss(name, cap):
    """w_t ≡ c (a constant ratio under the cap, or every token capped at C): loss and grad scale by c, and
    the objective itself sees the learner's recompute as behaviour policy."""
    lp, lq, lold, mask, adv, gids, _ = make(4)
    if cap == 0.5:
        lold = torch.where(mask, lq + math.log(0.25), lq)  # w = 0.25 < C everywhere
        c, capped = 0.25, 0.0
    else:
        c, capped = cap, 1.0  # exp(lold - lq) >= e^-0.5 > C: every weight capped
    base = run(name, lp, lold, mask, adv, gids)
    tis = run(name, lp, lq, mask, adv, gids, tis_cap=cap, tis_logp=lold)
    torch.testing.assert_close(tis[0], c * base[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(tis[1], c * base[1], rtol=1e-12, atol=1e-15)
    assert tis[2]["tis/frac_capped"] == capped
    assert tis[2]["tis/max"] == pytest.approx(c, rel=1e-12)
    for k in ("is/mean", "kl/k3", "clip/frac"):  # the objective's diagnostics see π_θ / π_old_learner
        assert tis[2][k] == pytest.approx(base[2][k], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", obj.names())
def test_rows_mask(name):
    lp, lq, lold, mask, adv, gids, _ = make(5)
    none = torch.zeros(B, dtype=torch.bool)
    garbage = torch.full_like(lold, float("nan"))  # never read outside TIS rows
    plain = run(name, lp, lq, mask, adv, gids)
    off_rows = run(name, lp, lq, mask, adv, gids, tis_cap=2.0, tis_logp=garbage, tis_rows=none)
    assert torch.equal(plain[0], off_rows[0]) and torch.equal(plain[1], off_rows[1])
    assert off_rows[2]["tis/tokens"] == 0.0 and off_rows[2]["tis/mean"] == 0.0

    rows = torch.tensor([True, True, False, False, True, True])  # whole groups, as fresh batches are
    mixed_lold = torch.where(rows[:, None], lold, garbage)
    part = run(name, lp, lq, mask, adv, gids, tis_cap=2.0, tis_logp=mixed_lold, tis_rows=rows)
    full = run(name, lp, lq, mask, adv, gids, tis_cap=2.0, tis_logp=torch.where(rows[:, None], lold, lq))
    torch.testing.assert_close(part[0], full[0], rtol=0, atol=0)
    torch.testing.assert_close(part[1], full[1], rtol=0, atol=0)
    assert part[2]["tis/tokens"] == float((rows[:, None] & mask).sum())


def test_works_in_float32_and_keeps_dtype():
    lp, lq, lold, mask, adv, gids, rows = make(6)
    x = lp.float().requires_grad_(True)
    loss, _ = obj.compute("gepo", x, lq.float(), mask, adv.float(), gids, tis_cap=2.0, tis_logp=lold.float())
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(x.grad).all()


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "bad",
    [
        {"tis_cap": 0.0},
        {"tis_cap": -1.0},
        {"tis_cap": float("nan")},
        {"tis_cap": True},
        {"tis_cap": "2"},
        {"tis_cap": 2.0},  # no tis_logp
        {"tis_logp": "LQ"},  # no tis_cap
        {"tis_rows": torch.ones(B, dtype=torch.bool)},  # no tis_cap
        {"tis_cap": 2.0, "tis_logp": torch.zeros(B, T + 1, dtype=F64)},
        {"tis_cap": 2.0, "tis_logp": "LQ", "tis_rows": torch.ones(B, dtype=torch.long)},
        {"tis_cap": 2.0, "tis_logp": "LQ", "tis_rows": torch.ones(B + 1, dtype=torch.bool)},
        {"tis_cap": 2.0, "tis_logp": "INF"},
        {"tis_cap": 2.0, "tis_logp": torch.zeros(B, T, dtype=torch.long)},
    ],
)
@pytest.mark.parametrize("name", ["gepo", "grpo", "cispo", "gspo", "topr"])
def test_bad_params_raise(name, bad):
    lp, lq, _, mask, adv, gids, _ = make(7)
    given = dict(bad)
    placeholder = given.get("tis_logp")
    if isinstance(placeholder, str):
        given["tis_logp"] = lq.clone() if placeholder == "LQ" else lq.masked_fill(mask, float("-inf"))
    with pytest.raises(ValueError):
        obj.compute(name, lp, lq, mask, adv, gids, **params_for(name), **given)


def test_correction_alone():
    lq = torch.log(torch.tensor([[0.5, 0.25, 1.0]], dtype=F64))
    lold = torch.log(torch.tensor([[0.25, 1.0, 1.0]], dtype=F64))
    mask = torch.tensor([[1, 1, 0]])
    c = tis_correction(lq, mask, lold, None, 2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[0.5, 2.0, 1.0]], dtype=F64))
    torch.testing.assert_close(c.logq, torch.where(mask > 0, lold, lq))
    assert float(c.stats["tis/frac_capped"]) == 0.5 and float(c.stats["tis/mean"]) == 1.25


# ----------------------------------------------------------------------------- mismatch diagnostics


def test_mismatch_stats_hand_values():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    lq = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -0.7, -3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    s = mismatch_stats(lp, lq, mask)
    d = torch.tensor([0.5, 1.0, 0.0, 0.2, 2.5], dtype=F64)
    assert s["mismatch/tokens"] == 5.0
    assert s["mismatch/abs_mean"] == pytest.approx(float(d.mean()), rel=1e-6)
    assert s["mismatch/abs_max"] == pytest.approx(2.5, rel=1e-6)
    assert s["mismatch/abs_p99"] == pytest.approx(float(torch.quantile(d, 0.99)), rel=1e-6)
    first = mismatch_stats(lp, lq, mask, torch.tensor([True, False]))
    assert first["mismatch/tokens"] == 2.0 and first["mismatch/abs_max"] == pytest.approx(1.0)


def test_mismatch_stats_quantile_matches_torch():
    gen = torch.Generator().manual_seed(0)
    lp, lq = torch.randn(7, 13, generator=gen), torch.randn(7, 13, generator=gen)
    mask = torch.rand(7, 13, generator=gen) < 0.6
    s = mismatch_stats(lp, lq, mask)
    d = (lp.double() - lq.double()).abs()[mask]
    assert s["mismatch/abs_p99"] == pytest.approx(float(torch.quantile(d, 0.99)), rel=1e-12)


def test_mismatch_stats_empty_rows_are_zeros():
    """Decision: every key present, all 0, so a metrics row keeps its columns; mismatch/tokens says 0."""
    lp = torch.zeros(2, 3)
    s = mismatch_stats(lp, lp - 1, torch.ones(2, 3), torch.zeros(2, dtype=torch.bool))
    assert s == {
        "mismatch/abs_mean": 0.0,
        "mismatch/abs_p99": 0.0,
        "mismatch/abs_max": 0.0,
        "mismatch/tokens": 0.0,
    }
    assert mismatch_stats(lp, lp, torch.zeros(2, 3))["mismatch/tokens"] == 0.0
    with pytest.raises(ValueError):
        mismatch_stats(lp, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError):
        mismatch_stats(lp, lp, torch.ones(2, 3), torch.ones(3, dtype=torch.bool))
