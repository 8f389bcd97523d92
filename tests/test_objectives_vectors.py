"""Hand-computed test vectors of spec §5 (objectives-spec.md), checked against the implementation and
against the naive float64 reference in ``reference_objectives.py``.

Every expected number below is copied from the spec (or derived by hand from it), never from the
implementation's output.
"""

from __future__ import annotations

import math

import pytest
import reference_objectives as ref
import torch

from heterorl.peer import objectives as obj

pytestmark = pytest.mark.fast  # in `make test-fast`

F64 = torch.float64
TOL = {"rtol": 1e-5, "atol": 2e-6}  # spec numbers are printed with 6 decimals

REQUIRED = ["gepo", "gepo_plus", "grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "cispo", "topr", "gmpo"]


def run(name, lp=None, lq=None, mask=None, A=None, gids=None, **params):
    """Call the implementation; return (loss float, grad [B,T] tensor, stats)."""
    c_lp, c_lq, c_mask, c_A, c_g = ref.canonical()
    lp = (c_lp if lp is None else lp).detach().clone().requires_grad_(True)
    lq = c_lq if lq is None else lq
    mask = c_mask if mask is None else mask
    A = c_A if A is None else A
    gids = c_g if gids is None else gids
    loss, stats = obj.compute(name, lp, lq, mask, A, gids, **params)
    assert loss.dim() == 0
    loss.backward()
    grad = torch.zeros_like(lp) if lp.grad is None else lp.grad.detach()
    return float(loss.detach()), grad, stats


def run_ref(name, lp=None, lq=None, mask=None, A=None, gids=None, **params):
    c_lp, c_lq, c_mask, c_A, c_g = ref.canonical()
    lp = (c_lp if lp is None else lp).detach().clone().requires_grad_(True)
    lq = c_lq if lq is None else lq
    mask = c_mask if mask is None else mask
    A = c_A if A is None else A
    gids = c_g if gids is None else gids
    loss, info = ref.compute(name, lp, lq, mask, A, gids, **params)
    loss.backward()
    return float(loss.detach()), lp.grad.detach(), info


def g(rows):
    """Gradient rows of the canonical batch (row 0 has 2 valid tokens, row 1 has 3)."""
    r0, r1 = rows
    return torch.tensor([list(r0) + [0.0] * (3 - len(r0)), list(r1)], dtype=F64)


# (id, objective, params, spec loss, spec grad)
CASES = [
    ("5.2-grpo", "grpo", {}, -0.275, g(([0, -0.25], [0.083333, 0, 0.125]))),
    (
        "5.2-grpo-explicit",
        "grpo",
        {"clip": 0.2, "aggregation": "seq_mean_token_mean"},
        -0.275,
        g(([0, -0.25], [0.083333, 0, 0.125])),
    ),
    ("5.3-dapo", "dapo", {}, -0.12, g(([-0.25, -0.2], [0.1, 0, 0.15]))),
    (
        "5.3-dapo-explicit",
        "grpo",
        {"clip": (0.2, 0.28), "aggregation": "token_mean"},
        -0.12,
        g(([-0.25, -0.2], [0.1, 0, 0.15])),
    ),
    ("5.4-dr_grpo", "dr_grpo", {"max_len": 4}, -0.06875, g(([0, -0.125], [0.0625, 0, 0.09375]))),
    (
        "5.5-delta_l-a1",
        "grpo",
        {"aggregation": "delta_l", "max_len": 4},
        -0.165,
        g(([0, -0.15], [0.05, 0, 0.075])),
    ),
    (
        "5.5-delta_l-a1-drgrpo",
        "dr_grpo",
        {"aggregation": "delta_l", "max_len": 4, "delta_l_alpha": 1.0},
        -0.165,
        g(([0, -0.15], [0.05, 0, 0.075])),
    ),
    (
        "5.5-delta_l-a075",
        "grpo",
        {"aggregation": "delta_l", "max_len": 4, "delta_l_alpha": 0.75},
        -0.141365,
        g(([0, -0.143861], [0.053069, 0, 0.079604])),
    ),
    (
        "5.5-delta_l-a0",
        "grpo",
        {"aggregation": "delta_l", "max_len": 4, "delta_l_alpha": 0.0},
        -0.06875,
        g(([0, -0.125], [0.0625, 0, 0.09375])),
    ),
    ("5.6-gspo-eps0.2", "gspo", {"clip": 0.2}, -0.304918, g(([-0.279508] * 2, [0.084700] * 3))),
    ("5.6-gspo-default", "gspo", {}, -0.246101, g(([0, 0], [0.084700] * 3))),
    ("5.6-gspo-explicit", "gspo", {"clip": (3e-4, 4e-4)}, -0.246101, g(([0, 0], [0.084700] * 3))),
    ("5.6-gspo_token-eps0.2", "gspo_token", {"clip": 0.2}, -0.304918, g(([-0.279508] * 2, [0.084700] * 3))),
    ("5.6-gspo_token-default", "gspo_token", {}, -0.246101, g(([0, 0], [0.084700] * 3))),
    ("5.7-gmpo-default", "gmpo", {}, -0.304918, g(([-0.279508] * 2, [0.084700] * 3))),
    ("5.7-gmpo-eps0.2", "gmpo", {"clip": 0.2}, -0.284863, g(([0, -0.276293], [0.089241, 0, 0.089241]))),
    ("5.8-cispo", "cispo", {"clip": (None, 0.2)}, 0.037929, g(([-0.24, -0.2], [0.1, 0.07, 0.12]))),
    ("5.9-gepo", "gepo", {}, -0.334682, g(([-0.289499] * 2, [0.081439] * 3))),
    (
        "5.9-gepo-explicit",
        "gepo",
        {"clip": 0.2, "group_scope": "prompt"},
        -0.334682,
        g(([-0.289499] * 2, [0.081439] * 3)),
    ),
    (
        "5.9-gepo-microbatch",
        "gepo",
        {"group_scope": "microbatch"},
        -0.334682,
        g(([-0.289499] * 2, [0.081439] * 3)),
    ),
    ("5.11-topr", "topr", {}, 0.018127, g(([-0.5] * 2, [0.25] * 3))),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(("name", "params", "loss", "grad"), [c[1:] for c in CASES], ids=CASE_IDS)
def test_reference_reproduces_spec(name, params, loss, grad):
    """Guards the reference itself: it must reproduce the spec's hand numbers."""
    rl, rg, _ = run_ref(name, **params)
    assert rl == pytest.approx(loss, abs=2e-6)
    torch.testing.assert_close(rg, grad, **TOL)


@pytest.mark.parametrize(("name", "params", "loss", "grad"), [c[1:] for c in CASES], ids=CASE_IDS)
def test_spec_vector(name, params, loss, grad):
    got_loss, got_grad, stats = run(name, **params)
    assert got_loss == pytest.approx(loss, abs=2e-6)
    torch.testing.assert_close(got_grad, grad, **TOL)
    assert stats["loss"] == pytest.approx(got_loss, abs=1e-9)


@pytest.mark.parametrize(("name", "params"), [c[1:3] for c in CASES], ids=CASE_IDS)
def test_spec_batch_matches_reference_tightly(name, params):
    """Same batch, float64, against the reference at near machine precision."""
    got_loss, got_grad, _ = run(name, **params)
    rl, rg, _ = run_ref(name, **params)
    assert got_loss == pytest.approx(rl, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(got_grad, rg, rtol=1e-9, atol=1e-12)


def test_gmpo_is_not_heterorl_variant():
    """§5.7: the HeteroRL GMPO (clamp σd to [0.8, 1.2]) would give -0.304918 at ε = 0.2."""
    loss, _, _ = run("gmpo", clip=0.2)
    assert abs(loss - (-0.304918)) > 1e-3


def test_delta_l_alpha0_equals_dr_grpo():
    a, ga, _ = run("dr_grpo", max_len=4)
    b, gb, _ = run("dr_grpo", aggregation="delta_l", max_len=4, delta_l_alpha=0.0)
    assert a == pytest.approx(b, abs=1e-12)
    torch.testing.assert_close(ga, gb)


def test_dr_grpo_uses_configured_constant_not_padded_length():
    """§5.4: M = 4 != T = 3; and M = 8 halves the loss."""
    a, _, _ = run("dr_grpo", max_len=4)
    b, _, _ = run("dr_grpo", max_len=8)
    assert b == pytest.approx(a / 2, abs=1e-12)
    assert a == pytest.approx(-0.06875, abs=1e-9)
    assert a != pytest.approx(-0.55 / 6, abs=1e-4)  # what M = padded T = 3 would give


# ----------------------------------------------------------------------------- diagnostics


@pytest.mark.parametrize(
    ("name", "params", "frac"),
    [
        ("grpo", {}, 0.4),  # §5.2: 2 of 5 tokens have zero gradient
        ("dapo", {}, 0.2),  # §5.3: only seq1 t1 (A<0, ρ = 0.7 < 0.8)
        ("dr_grpo", {"max_len": 4}, 0.4),
        ("gspo", {}, 0.5),  # §5.6: seq0 clipped, seq1 not
        ("gspo", {"clip": 0.2}, 0.0),
        ("gepo", {}, 0.0),  # §5.9: both weights inside [0.8, 1.2]
        ("gepo", {"clip": 0.1}, 0.5),  # w0 = 1.158 > 1.1 with A>0; w1 = 0.977 inside
        ("gepo", {"clip": (0.1, None)}, 0.0),  # the upper side open: w0 keeps its gradient
        ("cispo", {"clip": (None, 0.2)}, 0.4),  # ρ = 1.25 and 1.5 capped at 1.2
        ("cispo", {}, 0.2),  # default cap 1.28: only ρ = 1.5
        ("topr", {}, 0.5),  # seq1 negative, exp(S) = 1.05 truncated to 1
    ],
)
def test_clip_frac(name, params, frac):
    _, _, stats = run(name, **params)
    assert stats["clip/frac"] == pytest.approx(frac, abs=1e-9)


@pytest.mark.parametrize("name", REQUIRED)
def test_kl_diagnostics(name):
    """§5.13: token means over the 5 valid tokens, the same for every objective."""
    params = {"max_len": 4} if name == "dr_grpo" else {}
    _, _, stats = run(name, **params)
    assert stats["kl/k1"] == pytest.approx(-0.054387, abs=2e-6)
    assert stats["kl/k3"] == pytest.approx(0.035613, abs=2e-6)


@pytest.mark.parametrize("name", REQUIRED)
def test_stats_keys_are_floats(name):
    params = {"max_len": 4} if name == "dr_grpo" else {}
    _, _, stats = run(name, **params)
    for key in ("loss", "is/mean", "is/var", "is/max", "is/ess", "clip/frac", "kl/k3", "kl/k1"):
        assert key in stats, key
        assert isinstance(stats[key], float), (key, type(stats[key]))
        assert math.isfinite(stats[key]), key
    assert 0.0 < stats["is/ess"] <= 1.0 + 1e-12
    assert stats["is/var"] >= 0.0
    assert 0.0 <= stats["clip/frac"] <= 1.0
    assert stats["is/max"] >= stats["is/mean"] - 1e-12


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        # §5.9: token ESS_norm of ρ over the 5 tokens; ρ = [1.25, 1, 1, 0.7, 1.5]
        ("grpo", {}, {"is/ess": 0.942562, "is/mean": 1.09, "is/max": 1.5, "is/var": 0.0724}),
        ("dapo", {}, {"is/ess": 0.942562, "is/mean": 1.09, "is/max": 1.5, "is/var": 0.0724}),
        # §5.9: GSPO for comparison, s = [1.118034, 1.016396]
        ("gspo", {}, {"is/ess": 0.997738, "is/mean": 1.067215, "is/max": 1.118034, "is/var": 0.0025826}),
        # §5.9: GEPO w = [1.157995, 0.977263], ESS_norm 0.992887, population var 0.008166
        ("gepo", {}, {"is/ess": 0.992887, "is/mean": 1.067629, "is/max": 1.157995, "is/var": 0.008166}),
    ],
)
def test_weight_stats(name, params, expected):
    _, _, stats = run(name, **params)
    for k, v in expected.items():
        assert stats[k] == pytest.approx(v, abs=2e-6), k


# ----------------------------------------------------------------------------- GEPO variants


def test_gepo_on_policy_weights_not_one():
    """§5.9: with lp := lq, w = q̃/E = [1.035742, 0.961498]."""
    lp, lq, mask, A, _ = ref.canonical()
    _, grad, stats = run("gepo", lp=lq.clone(), clip=None)
    w = _weights_from_grad(grad, A, mask)
    torch.testing.assert_close(w, torch.tensor([1.035742, 0.961498], dtype=F64), **TOL)
    assert stats["is/mean"] == pytest.approx((1.035742 + 0.961498) / 2, abs=2e-6)


def test_gepo_clips_the_lower_side_only_by_default():
    """GEPO's default clip is (0.2, None) (objectives.md: the upper side stopped learning from stale
    rollouts); gepo_plus keeps the authors' symmetric 0.2. On §5.9's batch w0 = 1.158 with A > 0: a symmetric
    ε = 0.1 zeroes its gradient, the lower side alone does not."""
    from heterorl.peer.objectives._registry import get

    assert get("gepo").params().clip == (0.2, None)
    assert get("gepo_plus").params().clip == 0.2
    _, sym, _ = run("gepo", clip=0.1)
    _, low, _ = run("gepo", clip=(0.1, None))
    _, unclipped, _ = run("gepo", clip=None)
    assert bool((sym[0] == 0).all()) and bool((low[0] != 0).any())
    torch.testing.assert_close(low, unclipped)  # nothing is below 0.9 here: the lower side clips nothing
    torch.testing.assert_close(sym[1], low[1])


FIXED = {"defensive_sampling": True, "defensive_schedule": "fixed"}


def _weights_from_grad(grad, A, mask):
    # loss = mean_b(-w_b A_b) with ℓ_b on each token ⇒ Σ_t ∂loss/∂lp[b,t] = -w_b A_b / B
    B = grad.shape[0]
    return -grad.sum(-1) * B / A


@pytest.mark.parametrize(
    ("params", "w"),
    [
        ({**FIXED, "defensive_lambda": 0.5}, [1.073214, 0.988501]),
        ({**FIXED, "defensive_lambda": 0.0}, [1.157995, 0.977263]),
        ({**FIXED, "defensive_lambda": 1.0}, [1.0, 1.0]),
        # staleness schedule: λ = 1.0 · 8/(8+8) = 0.5
        ({"staleness": torch.tensor([8.0, 8.0]), "defensive_lambda": 1.0}, [1.073214, 0.988501]),
        (
            {"staleness": torch.tensor([8.0, 8.0]), "defensive_lambda": 1.0, "defensive_half_staleness": 8.0},
            [1.073214, 0.988501],
        ),
        # λ = 0.5 · 8/16 = 0.25 for both rows, compared with the reference below
        ({"staleness": torch.tensor([8.0, 8.0])}, None),
        # auto mode off: no staleness or all-zero staleness => plain GEPO
        ({}, [1.157995, 0.977263]),
        ({"staleness": torch.tensor([0.0, 0.0])}, [1.157995, 0.977263]),
        ({"staleness": torch.tensor([0.0, 0.0]), "defensive_sampling": False}, [1.157995, 0.977263]),
        ({"staleness": torch.tensor([8.0, 8.0]), "defensive_sampling": False}, [1.157995, 0.977263]),
        # mixed staleness: λ_0 = 0 (Δ=0) -> GEPO weight; λ_1 = 1·8/16 = 0.5 -> defensive weight
        ({"staleness": torch.tensor([0.0, 8.0]), "defensive_lambda": 1.0}, [1.157995, 0.988501]),
    ],
)
def test_gepo_defensive_weights(params, w):
    """§5.10: defensive mixture w = p̃/(λ sg(p̃) + (1-λ)E). Weights recovered from value stats and grads."""
    _, _, mask, A, _ = ref.canonical()
    _, grad, stats = run("gepo", clip=None, **params)
    rl, rg, info = run_ref("gepo", clip=None, **params)
    if w is not None:
        torch.testing.assert_close(
            torch.tensor(info["weights"], dtype=F64), torch.tensor(w, dtype=F64), **TOL
        )
    got_w = _weights_from_grad(grad, A, mask)
    torch.testing.assert_close(got_w, torch.tensor(info["weights"], dtype=F64), **TOL)
    torch.testing.assert_close(grad, rg, rtol=1e-9, atol=1e-12)
    assert stats["is/max"] == pytest.approx(max(info["weights"]), abs=1e-9)
    assert stats["is/mean"] == pytest.approx(sum(info["weights"]) / 2, abs=1e-9)


@pytest.mark.parametrize(("tau", "w"), [(0.002, [1.157995, 0.977263]), (0.03, [1.118034, 0.977263])])
def test_gepo_plus_kl_switch(tau, w):
    """§5.10: kl_b = [0.011572, 0.048009]; τ = 0.03 switches seq0 to its own q̃ (GSPO weight)."""
    _, _, mask, A, _ = ref.canonical()
    _, grad, stats = run("gepo_plus", clip=None, kl_threshold=tau)
    torch.testing.assert_close(_weights_from_grad(grad, A, mask), torch.tensor(w, dtype=F64), **TOL)
    assert stats["is/max"] == pytest.approx(max(w), abs=2e-6)


def test_gepo_plus_default_threshold_is_0002():
    a = run("gepo_plus")
    b = run("gepo_plus", kl_threshold=0.002)
    assert a[0] == pytest.approx(b[0], abs=1e-12)
    # ... and with the default both sequences are above τ: same as GEPO (§5.10)
    c = run("gepo")
    assert a[0] == pytest.approx(c[0], abs=1e-12)


def test_gepo_stress_far_apart_members():
    """§5.9 stress: ℓq = [-0.05, -30, -60], ℓp = [-0.06, -29, -61] (one token each).

    log E = -0.05, log w = [-0.01, -28.95, -60.95]. With the log-ratio clamp widened to 100 the weights are
    [0.990050, 2.7e-13, 3.1e-27]; with the default clamp (20) everything stays finite.
    """
    lq = torch.tensor([[-0.05], [-30.0], [-60.0]], dtype=F64)
    lp = torch.tensor([[-0.06], [-29.0], [-61.0]], dtype=F64)
    mask = torch.ones(3, 1, dtype=torch.bool)
    A = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
    gids = torch.tensor([5, 5, 5])
    loss, grad, stats = run("gepo", lp=lp, lq=lq, mask=mask, A=A, gids=gids, clip=None, logratio_clamp=100.0)
    w = _weights_from_grad(grad, A, mask)
    assert w[0].item() == pytest.approx(math.exp(-0.01), rel=1e-6)
    assert w[1].item() == pytest.approx(math.exp(-28.95), rel=1e-4)
    assert w[2].item() == pytest.approx(math.exp(-60.95), rel=1e-4)
    assert loss == pytest.approx(-w.sum().item() / 3, rel=1e-9)
    loss2, grad2, stats2 = run("gepo", lp=lp, lq=lq, mask=mask, A=A, gids=gids, clip=None)
    assert math.isfinite(loss2) and torch.isfinite(grad2).all()
    assert _weights_from_grad(grad2, A, mask)[0].item() == pytest.approx(math.exp(-0.01), rel=1e-6)
    assert all(math.isfinite(v) for v in stats2.values())


def test_topr_truncation_case():
    """§5.11: one negative sequence, S = ln 0.5, A = -1, log π(τ) = -2 -> loss -1.0, grad +0.5/token."""
    lp = torch.tensor([[-1.0, -1.0]], dtype=F64)
    lq = lp - math.log(0.5) / 2
    mask = torch.ones(1, 2, dtype=torch.bool)
    A = torch.tensor([-1.0], dtype=F64)
    loss, grad, stats = run("topr", lp=lp, lq=lq, mask=mask, A=A, gids=torch.tensor([0]))
    assert loss == pytest.approx(-1.0, abs=1e-9)
    torch.testing.assert_close(grad, torch.tensor([[0.5, 0.5]], dtype=F64))
    assert stats["clip/frac"] == pytest.approx(0.0)  # 0.5 < 1: not truncated
    # untruncated (clip=None) keeps the same weight here; at S = ln 2 truncation bites
    lq2 = lp - math.log(2.0) / 2
    loss_t, grad_t, st_t = run("topr", lp=lp, lq=lq2, mask=mask, A=A, gids=torch.tensor([0]))
    loss_u, grad_u, _ = run("topr", lp=lp, lq=lq2, mask=mask, A=A, gids=torch.tensor([0]), clip=None)
    assert loss_t == pytest.approx(-2.0, abs=1e-9)  # w = min(2, 1) = 1
    assert loss_u == pytest.approx(-4.0, abs=1e-9)  # w = 2
    torch.testing.assert_close(grad_u, torch.tensor([[2.0, 2.0]], dtype=F64))
    assert st_t["clip/frac"] == pytest.approx(1.0)


def test_cispo_clipped_tokens_keep_gradient():
    """§5.8: unlike PPO, every token with A != 0 has a non-zero gradient."""
    _, grad, _ = run("cispo", clip=(None, 0.2))
    mask = ref.canonical()[2]
    assert (grad[mask] != 0).all()
    assert (grad[~mask] == 0).all()


def test_dual_clip():
    """PPO dual clip: for A<0 the objective is floored at c·A (gradient zero there)."""
    lp = torch.log(torch.tensor([[0.5, 0.9]], dtype=F64))
    lq = torch.log(torch.tensor([[0.1, 0.9]], dtype=F64))  # ρ = [5, 1]
    mask = torch.ones(1, 2, dtype=torch.bool)
    A = torch.tensor([-1.0], dtype=F64)
    gids = torch.tensor([0])
    loss_n, grad_n, _ = run("grpo", lp=lp, lq=lq, mask=mask, A=A, gids=gids)
    loss_d, grad_d, _ = run("grpo", lp=lp, lq=lq, mask=mask, A=A, gids=gids, dual_clip=3.0)
    # no dual clip: token obj [-5, -1] -> loss 3; grad = -ρA/L = [2.5, 0.5]
    assert loss_n == pytest.approx(3.0, abs=1e-9)
    torch.testing.assert_close(grad_n, torch.tensor([[2.5, 0.5]], dtype=F64))
    # dual clip c = 3: token obj [max(-5, -3), -1] = [-3, -1] -> loss 2; grad [0, 0.5]
    assert loss_d == pytest.approx(2.0, abs=1e-9)
    torch.testing.assert_close(grad_d, torch.tensor([[0.0, 0.5]], dtype=F64))
