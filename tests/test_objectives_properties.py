"""Property tests of the objective zoo (hypothesis), against the naive float64 reference and against
structural identities stated in the spec (§1.2, §2.6, §2.10.3, §5.9)."""

from __future__ import annotations

import math

import pytest
import reference_objectives as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterorl.peer import objectives as obj

F64 = torch.float64
REQUIRED = ["gepo", "gepo_plus", "grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "cispo", "topr", "gmpo"]
NOT_GEPO = [n for n in REQUIRED if n != "gepo"]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant", "delta_l"]
SEQ_LEVEL_LOSS = ["gspo", "gspo_token", "gmpo", "gepo", "gepo_plus"]
PROPS = settings(max_examples=50, deadline=None)

CLIPS = {
    "grpo": [0.2, None, (0.1, 0.3), (None, 0.25), (0.15, None)],
    "dapo": [(0.2, 0.28), None, 0.1],
    "dr_grpo": [0.2, None, (0.1, 0.3)],
    "gspo": [(3e-4, 4e-4), 0.1, None, (0.05, None)],
    "gspo_token": [(3e-4, 4e-4), 0.1, None, (None, 0.05)],
    "cispo": [(None, 0.28), (None, 0.1), (0.2, 0.2), None],
    "topr": [1.0, 0.5, 2.0, None],
    "gmpo": [0.4, 0.2, (0.1, 0.3), None],
    "gepo": [0.2, 0.05, (0.1, 0.3), None],
    "gepo_plus": [0.2, 0.05, None],
}
UNSET = object()


# ----------------------------------------------------------------------------- helpers


def make_batch(seed, B, T, n_groups, gap=0.6, lq_range=(-3.0, -0.05), labels=None, min_len=1):
    gen = torch.Generator().manual_seed(seed)
    lo, hi = lq_range
    lq = lo + (hi - lo) * torch.rand(B, T, generator=gen, dtype=F64)
    d = gap * (2 * torch.rand(B, T, generator=gen, dtype=F64) - 1)
    lp = lq + d
    mask = torch.rand(B, T, generator=gen) < 0.7
    for b in range(B):
        need = min(min_len, T)
        if int(mask[b].sum()) < need:
            mask[b, torch.randperm(T, generator=gen)[:need]] = True
    lq = lq.masked_fill(~mask, 0.0)
    lp = lp.masked_fill(~mask, 0.0)
    A = torch.randn(B, generator=gen, dtype=F64)
    A = torch.where(A.abs() < 0.05, torch.full_like(A, 0.3), A)
    gids = torch.randint(0, n_groups, (B,), generator=gen)
    if labels is not None:
        gids = torch.tensor([labels[i] for i in gids.tolist()])
    return lp, lq, mask, A, gids


def call(name, lp, lq, mask, A, gids, **params):
    """Implementation: (loss tensor detached, grad wrt logp, stats)."""
    x = lp.detach().clone().requires_grad_(True)
    loss, stats = obj.compute(name, x, lq, mask, A, gids, **params)
    loss.backward()
    grad = torch.zeros_like(x) if x.grad is None else x.grad.detach()
    return loss.detach(), grad, stats


def call_ref(name, lp, lq, mask, A, gids, **params):
    x = lp.detach().clone().requires_grad_(True)
    loss, info = ref.compute(name, x, lq, mask, A, gids, **params)
    loss.backward()
    return loss.detach(), x.grad.detach(), info


def agg_params(agg, T):
    p = {} if agg is None else {"aggregation": agg}
    if agg in ("constant", "delta_l"):
        p["max_len"] = T + 3
    return p


def needs_max_len(name, params):
    return name == "dr_grpo" and params.get("aggregation") in (None, "constant", "delta_l")


def default_params(name, T):
    return {"max_len": T + 3} if name == "dr_grpo" else {}


def close(a, b, rtol=1e-8, atol=1e-10):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@st.composite
def batch_shape(draw, max_b=6, max_t=6):
    return {
        "seed": draw(st.integers(0, 2**31 - 1)),
        "B": draw(st.integers(1, max_b)),
        "T": draw(st.integers(1, max_t)),
        "n_groups": draw(st.integers(1, 3)),
    }


@st.composite
def objective_params(draw, name, T):
    p = {}
    clip = draw(st.sampled_from([UNSET, *CLIPS[name]]))
    if clip is not UNSET:
        p["clip"] = clip
    agg = draw(st.sampled_from([None, *AGGS]))
    p.update(agg_params(agg, T))
    if name == "dr_grpo" and "max_len" not in p:
        p["max_len"] = T + 3
    if agg == "delta_l":
        p["delta_l_alpha"] = draw(st.sampled_from([1.0, 0.75, 0.0]))
    if name == "grpo" and draw(st.booleans()):
        p["dual_clip"] = 3.0
    if name in ("gepo", "gepo_plus"):
        p["group_scope"] = draw(st.sampled_from(["prompt", "microbatch"]))
        # gepo_plus + defensive mixing is not pinned down by the spec: only the plain switch is compared
        modes = ["none", "fixed", "staleness", "auto_off"] if name == "gepo" else ["none", "auto_off"]
        mode = draw(st.sampled_from(modes))
        if mode == "fixed":
            p.update(
                defensive_sampling=True,
                defensive_schedule="fixed",
                defensive_lambda=draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])),
            )
        elif mode == "staleness":
            p["staleness"] = "DRAW"
            p["defensive_lambda"] = draw(st.sampled_from([0.5, 1.0]))
            p["defensive_half_staleness"] = draw(st.sampled_from([8.0, 2.0]))
        elif mode == "auto_off":
            p["staleness"] = "ZERO"
    if name == "gepo_plus":
        p["kl_threshold"] = draw(st.sampled_from([0.002, 0.02, 0.1]))
    return p


def materialise(p, B, seed):
    p = dict(p)
    if p.get("staleness") == "DRAW":
        gen = torch.Generator().manual_seed(seed + 1)
        p["staleness"] = torch.randint(0, 20, (B,), generator=gen).double()
    elif p.get("staleness") == "ZERO":
        p["staleness"] = torch.zeros(B, dtype=F64)
    return p


# ----------------------------------------------------------------------------- API contract


def test_names_include_required():
    assert set(REQUIRED) <= set(obj.names())


def test_aggregation_names():
    assert set(AGGS) <= set(obj.aggregation_names())


@pytest.mark.parametrize(
    ("name", "adv"),
    [("gepo", "dr_grpo"), ("grpo", "grpo"), ("dr_grpo", "dr_grpo"), ("dapo", "grpo"), ("gspo", "grpo")],
)
def test_default_advantage(name, adv):
    assert obj.default_advantage(name) == adv


@pytest.mark.parametrize("name", REQUIRED)
def test_default_advantage_is_known(name):
    assert obj.default_advantage(name) in obj.advantage_names()


def test_unknown_objective_lists_valid_names():
    lp, lq, mask, A, g = ref.canonical()
    with pytest.raises(ValueError) as e:
        obj.compute("no_such_loss", lp, lq, mask, A, g)
    assert "grpo" in str(e.value) and "gepo" in str(e.value)


@pytest.mark.parametrize("name", REQUIRED)
def test_unknown_param_lists_valid_params(name):
    lp, lq, mask, A, g = ref.canonical()
    with pytest.raises(ValueError) as e:
        obj.compute(name, lp, lq, mask, A, g, bogus_param=1, **default_params(name, 3))
    msg = str(e.value)
    assert "bogus_param" in msg or "clip" in msg
    assert "clip" in msg and "aggregation" in msg


@pytest.mark.parametrize("name", REQUIRED)
@pytest.mark.parametrize("agg", ["constant", "delta_l"])
def test_max_len_required(name, agg):
    lp, lq, mask, A, g = ref.canonical()
    with pytest.raises(ValueError):
        obj.compute(name, lp, lq, mask, A, g, aggregation=agg)
    with pytest.raises(ValueError):
        obj.aggregate(agg, lq, mask)


def test_dr_grpo_default_needs_max_len():
    lp, lq, mask, A, g = ref.canonical()
    with pytest.raises(ValueError):
        obj.compute("dr_grpo", lp, lq, mask, A, g)


@pytest.mark.parametrize("name", REQUIRED)
def test_common_params_accepted(name):
    lp, lq, mask, A, g = ref.canonical()
    loss, _ = obj.compute(
        name,
        lp,
        lq,
        mask,
        A,
        g,
        clip=None,
        aggregation="delta_l",
        max_len=5,
        delta_l_alpha=0.75,
        logratio_clamp=10.0,
        staleness=torch.tensor([0.0, 3.0]),
    )
    assert torch.isfinite(loss)


# ----------------------------------------------------------------------------- aggregation


@PROPS
@given(
    shape=batch_shape(max_b=5, max_t=7), agg=st.sampled_from(AGGS), alpha=st.sampled_from([1.0, 0.75, 0.0])
)
def test_aggregate_matches_reference(shape, agg, alpha):
    lp, lq, mask, A, g = make_batch(**shape)
    gen = torch.Generator().manual_seed(shape["seed"])
    tl = torch.randn(shape["B"], shape["T"], generator=gen, dtype=F64).masked_fill(~mask, 0.0)
    tl.requires_grad_(True)
    M = shape["T"] + 2
    got = obj.aggregate(agg, tl, mask, max_len=M, alpha=alpha)
    got.backward()
    g_got = tl.grad.clone()
    tl.grad = None
    exp = ref.aggregate(agg, tl, mask, max_len=M, alpha=alpha)
    exp.backward()
    close(got.detach(), exp.detach())
    close(g_got, tl.grad)


def test_aggregate_ignores_padding_values():
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    tl = torch.tensor([[1.0, 1e6, -1e6], [2.0, 3.0, 4.0]], dtype=F64)
    cases = [
        ("token_mean", 10 / 4),
        ("seq_mean_token_mean", (1 + 3) / 2),
        ("seq_mean_token_sum", 5.0),
        ("constant", 10 / (2 * 5)),
    ]
    for agg, exp in cases:
        assert obj.aggregate(agg, tl, mask, max_len=5).item() == pytest.approx(exp, rel=1e-12), agg
    # delta_l α = 1: x = [1, 1/3]/(5 · 4/3)
    x = [1 / (5 * 4 / 3), (1 / 3) / (5 * 4 / 3)]
    got = obj.aggregate("delta_l", tl, mask, max_len=5).item()
    assert got == pytest.approx(x[0] * 1 + x[1] * 9, rel=1e-12)


# ----------------------------------------------------------------------------- reference agreement


@pytest.mark.parametrize("name", REQUIRED)
@PROPS
@given(shape=batch_shape(), data=st.data())
def test_matches_reference(name, shape, data):
    params = materialise(data.draw(objective_params(name, shape["T"])), shape["B"], shape["seed"])
    batch = make_batch(**shape)
    loss, grad, stats = call(name, *batch, **params)
    rl, rg, info = call_ref(name, *batch, **params)
    close(loss, rl)
    close(grad, rg)
    assert stats["loss"] == pytest.approx(loss.item(), rel=1e-9, abs=1e-12)
    assert stats["kl/k1"] == pytest.approx(info["kl/k1"], rel=1e-7, abs=1e-10)
    assert stats["kl/k3"] == pytest.approx(info["kl/k3"], rel=1e-7, abs=1e-10)
    frac_names = ("grpo", "dapo", "dr_grpo", "gspo", "gepo", "gepo_plus", "cispo", "topr")
    if name in frac_names and not (name == "grpo" and params.get("dual_clip")):
        frac = sum(info["zeroed"]) / len(info["zeroed"])
        assert stats["clip/frac"] == pytest.approx(frac, abs=1e-9)
    if name in ("grpo", "dapo", "dr_grpo", "gspo", "gepo", "gepo_plus"):
        ws = ref.weight_stats(info["weights"])
        for k, v in ws.items():
            assert stats[k] == pytest.approx(v, rel=1e-7, abs=1e-10), k


# ----------------------------------------------------------------------------- numerics: extremes


@st.composite
def extreme_batch(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.sampled_from([1, 3, 17, 300, 2048]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    scale_q = draw(st.sampled_from([1.0, 100.0, 1e4]))
    scale_d = draw(st.sampled_from([1.0, 50.0, 1e3]))
    lq = -scale_q * torch.rand(B, T, generator=gen, dtype=F64)
    d = scale_d * (2 * torch.rand(B, T, generator=gen, dtype=F64) - 1)
    if draw(st.booleans()):  # same-sign gaps so that sequence sums/means are extreme too
        d = d.abs() * (1 if draw(st.booleans()) else -1)
    lp = torch.clamp(lq + d, max=0.0)
    full = draw(st.booleans())
    mask = torch.ones(B, T, dtype=torch.bool) if full else torch.rand(B, T, generator=gen) < 0.5
    mask[:, 0] = True
    lq = lq.masked_fill(~mask, 0.0)
    lp = lp.masked_fill(~mask, 0.0)
    A = 5 * torch.randn(B, generator=gen, dtype=F64)
    gids = torch.randint(0, 2, (B,), generator=gen)
    dtype = draw(st.sampled_from([F64, torch.float32]))
    return lp.to(dtype), lq.to(dtype), mask, A.to(dtype), gids


@pytest.mark.parametrize("name", REQUIRED)
@settings(max_examples=40, deadline=None)
@given(batch=extreme_batch(), data=st.data())
def test_finite_for_extreme_logprob_gaps(name, batch, data):
    lp, lq, mask, A, gids = batch
    T = lp.shape[1]
    params = data.draw(objective_params(name, T))
    params = materialise(params, lp.shape[0], 0)
    if isinstance(params.get("staleness"), torch.Tensor):
        params["staleness"] = params["staleness"].to(lp.dtype)
    loss, grad, stats = call(name, lp, lq, mask, A, gids, **params)
    assert torch.isfinite(loss), loss
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()
    for k, v in stats.items():
        assert math.isfinite(v), (k, v)


@pytest.mark.parametrize("name", REQUIRED)
def test_empty_row_is_finite(name):
    """A row without response tokens (L_b = 0) must not produce NaN (divisors use max(L_b, 1))."""
    lp, lq, mask, A, gids = make_batch(3, 3, 4, 1)
    mask[1] = False
    lp, lq = lp.masked_fill(~mask, 0.0), lq.masked_fill(~mask, 0.0)
    loss, grad, stats = call(name, lp, lq, mask, A, gids, **default_params(name, 4))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[1] == 0).all()


# ----------------------------------------------------------------------------- on-policy identities


@pytest.mark.parametrize("name", NOT_GEPO)
@PROPS
@given(shape=batch_shape(), agg=st.sampled_from([None, *AGGS]))
def test_on_policy_gradient_is_policy_gradient(name, shape, agg):
    """p == q: gradient equals that of aggregate(-A·logp) under the objective's own aggregation."""
    _, lq, mask, A, gids = make_batch(**shape)
    params = agg_params(agg, shape["T"])
    if needs_max_len(name, params):
        params["max_len"] = shape["T"] + 3
    agg_name = agg or ref.DEFAULTS[name][1]
    loss, grad, stats = call(name, lq, lq, mask, A, gids, **params)
    x = lq.clone().requires_grad_(True)
    pg = ref.aggregate(agg_name, -A[:, None] * x, mask, max_len=params.get("max_len"))
    pg.backward()
    close(grad, x.grad)
    if name in ("cispo", "topr"):  # loss value contains logp (§2.8, §5.8)
        close(loss, pg.detach())
    else:  # all weights are exactly 1
        ones = ref.aggregate(agg_name, -A[:, None] * torch.ones_like(lq), mask, max_len=params.get("max_len"))
        close(loss, ones)
    assert stats["clip/frac"] == 0.0
    assert stats["is/mean"] == pytest.approx(1.0, abs=1e-12)
    assert stats["is/ess"] == pytest.approx(1.0, abs=1e-12)
    assert stats["kl/k1"] == pytest.approx(0.0, abs=1e-12)
    assert stats["kl/k3"] == pytest.approx(0.0, abs=1e-12)


def _seq_weights_from_grad(grad, A):
    """loss = mean_b(-w_b A_b) (clip=None, seq_mean_token_mean) => Σ_t ∂loss/∂lp[b,t] = -w_b A_b / B."""
    return -grad.sum(-1) * grad.shape[0] / A


@PROPS
@given(shape=batch_shape(max_b=8), scope=st.sampled_from(["prompt", "microbatch"]))
def test_gepo_on_policy_weight_is_qtilde_over_group_expectation(shape, scope):
    _, lq, mask, A, gids = make_batch(**shape)
    _, grad, stats = call("gepo", lq, lq, mask, A, gids, clip=None, group_scope=scope)
    w = _seq_weights_from_grad(grad, A)
    L = mask.sum(-1).double()
    qt = torch.exp(lq.sum(-1) / L)
    scope_ids = gids if scope == "prompt" else torch.zeros_like(gids)
    for g in scope_ids.unique():
        rows = scope_ids == g
        E = (qt[rows] ** 2).sum() / qt[rows].sum()
        close(w[rows], qt[rows] / E, rtol=1e-7, atol=1e-9)
        assert w[rows].min() <= 1 + 1e-9 and w[rows].max() >= 1 - 1e-9
    assert stats["is/mean"] == pytest.approx(w.mean().item(), rel=1e-7)


@PROPS
@given(shape=batch_shape(max_b=8), gap=st.sampled_from([0.1, 1.0, 3.0]))
def test_gepo_denominator_between_group_min_and_max(shape, gap):
    """E = Σq̃²/Σq̃ ∈ [min q̃, max q̃]: recovered as p̃_b / w_b from the gradient (clip=None)."""
    lp, lq, mask, A, gids = make_batch(**shape, gap=gap)
    _, grad, _ = call("gepo", lp, lq, mask, A, gids, clip=None)
    w = _seq_weights_from_grad(grad, A)
    L = mask.sum(-1).double()
    pt, qt = torch.exp(lp.sum(-1) / L), torch.exp(lq.sum(-1) / L)
    E = pt / w
    for g in gids.unique():
        rows = gids == g
        assert (E[rows] >= qt[rows].min() * (1 - 1e-9)).all()
        assert (E[rows] <= qt[rows].max() * (1 + 1e-9)).all()
        close(E[rows], E[rows][:1].expand(int(rows.sum())), rtol=1e-8, atol=0)  # shared within a group


# ----------------------------------------------------------------------------- GEPO structure


@PROPS
@given(shape=batch_shape(max_b=8), logk=st.floats(-2.0, 2.0))
def test_gepo_scaling_all_qtilde_rescales_weights(shape, logk):
    """§2.10.3: multiplying every q̃ of the batch by k multiplies E by k and divides every weight by k."""
    lp, lq, mask, A, gids = make_batch(**shape)
    a = call("gepo", lp, lq, mask, A, gids, clip=None)
    b = call("gepo", lp, (lq + logk) * mask, mask, A, gids, clip=None)
    close(b[1], a[1] * math.exp(-logk))
    close(b[0], a[0] * math.exp(-logk))


@PROPS
@given(shape=batch_shape(), clip=st.sampled_from([0.2, (0.1, 0.3), 1e-3, None]))
def test_gepo_group_of_one_equals_gspo(shape, clip):
    lp, lq, mask, A, _ = make_batch(**shape)
    gids = torch.arange(shape["B"]) * 7 - 3
    a = call("gepo", lp, lq, mask, A, gids, clip=clip)
    b = call("gspo", lp, lq, mask, A, gids, clip=clip)
    close(a[0], b[0])
    close(a[1], b[1])


@PROPS
@given(shape=batch_shape(), clip=st.sampled_from([0.2, (0.1, 0.3), 1e-3, None]))
def test_gepo_equal_qtilde_equals_gspo(shape, clip):
    """All q̃ equal within each group (token values differ, masked means equal) => GEPO == GSPO."""
    lp, lq, mask, A, gids = make_batch(**shape)
    m = mask.double()
    L = m.sum(-1, keepdim=True)
    centred = (lq - (lq * m).sum(-1, keepdim=True) / L) * m
    level = -0.3 - 0.5 * gids.double()[:, None]
    lq2 = (centred + level) * m
    lp2 = (lq2 + (lp - lq)) * m
    a = call("gepo", lp2, lq2, mask, A, gids, clip=clip)
    b = call("gspo", lp2, lq2, mask, A, gids, clip=clip)
    close(a[0], b[0])
    close(a[1], b[1])


@PROPS
@given(s1=batch_shape(max_b=4, max_t=5), s2=batch_shape(max_b=4, max_t=5), data=st.data())
def test_gepo_two_groups_jointly_equal_separately(s1, s2, data):
    name = data.draw(st.sampled_from(["gepo", "gepo_plus"]))
    clip = data.draw(st.sampled_from([0.2, None, (0.05, 0.1)]))
    T = max(s1["T"], s2["T"])
    s1 = {**s1, "T": T, "n_groups": 1}
    s2 = {**s2, "T": T, "n_groups": 1}
    b1 = make_batch(**s1, labels=[11])
    b2 = make_batch(**s2, labels=[-4])
    joint = [torch.cat([x, y]) for x, y in zip(b1, b2, strict=True)]
    B1, B2 = s1["B"], s2["B"]
    l1, g1, _ = call(name, *b1, clip=clip)
    l2, g2, _ = call(name, *b2, clip=clip)
    lj, gj, _ = call(name, *joint, clip=clip)
    close(lj, (B1 * l1 + B2 * l2) / (B1 + B2))
    close(gj[:B1], g1 * B1 / (B1 + B2))
    close(gj[B1:], g2 * B2 / (B1 + B2))


@PROPS
@given(shape=batch_shape(max_b=8))
def test_gepo_microbatch_scope_on_one_group_equals_prompt_scope(shape):
    lp, lq, mask, A, _ = make_batch(**shape)
    one = torch.full((shape["B"],), 5)
    a = call("gepo", lp, lq, mask, A, one, group_scope="microbatch")
    b = call("gepo", lp, lq, mask, A, one, group_scope="prompt")
    b_default = call("gepo", lp, lq, mask, A, one)
    close(a[0], b[0])
    close(a[1], b[1])
    close(b[1], b_default[1])
    # microbatch scope ignores the labels: equal to prompt scope with all rows in one group
    lp, lq, mask, A, gids = make_batch(**{**shape, "n_groups": 3})
    c = call("gepo", lp, lq, mask, A, gids, group_scope="microbatch")
    d = call("gepo", lp, lq, mask, A, torch.zeros_like(gids), group_scope="prompt")
    close(c[0], d[0])
    close(c[1], d[1])


@PROPS
@given(shape=batch_shape())
def test_gspo_token_equals_gspo(shape):
    """§2.6 / §5.6: identical in value and gradient when A is broadcast to tokens."""
    batch = make_batch(**shape)
    for clip in [(3e-4, 4e-4), 0.1, None]:
        a = call("gspo_token", *batch, clip=clip)
        b = call("gspo", *batch, clip=clip)
        close(a[0], b[0])
        close(a[1], b[1])


# ----------------------------------------------------------------------------- invariances


@pytest.mark.parametrize("name", REQUIRED)
@PROPS
@given(shape=batch_shape(), data=st.data())
def test_row_permutation_and_relabel_invariance(name, shape, data):
    params = materialise(data.draw(objective_params(name, shape["T"])), shape["B"], shape["seed"])
    lp, lq, mask, A, gids = make_batch(**shape)
    perm = torch.tensor(data.draw(st.permutations(range(shape["B"]))))
    relabel = {int(g): 1000 - 37 * k for k, g in enumerate(gids.unique())}
    gids2 = torch.tensor([relabel[int(g)] for g in gids[perm]])
    p2 = dict(params)
    if isinstance(p2.get("staleness"), torch.Tensor):
        p2["staleness"] = p2["staleness"][perm]
    a = call(name, lp, lq, mask, A, gids, **params)
    b = call(name, lp[perm], lq[perm], mask[perm], A[perm], gids2, **p2)
    close(a[0], b[0])
    close(a[1][perm], b[1])
    for k in ("is/mean", "is/var", "is/max", "is/ess", "clip/frac", "kl/k1", "kl/k3"):
        assert a[2][k] == pytest.approx(b[2][k], rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("name", REQUIRED)
@PROPS
@given(shape=batch_shape(), extra=st.integers(1, 4), data=st.data())
def test_padding_invariance(name, shape, extra, data):
    """Extra columns with mask = 0 and garbage log-probs change nothing (M stays the configured constant)."""
    params = materialise(data.draw(objective_params(name, shape["T"])), shape["B"], shape["seed"])
    lp, lq, mask, A, gids = make_batch(**shape)
    gen = torch.Generator().manual_seed(shape["seed"] + 7)
    B = shape["B"]
    junk_p = 1e4 * (2 * torch.rand(B, extra, generator=gen, dtype=F64) - 1)
    junk_q = -1e4 * torch.rand(B, extra, generator=gen, dtype=F64)
    # also scramble existing padded positions
    lp_g = torch.where(mask, lp, 50.0 * torch.randn(lp.shape, generator=gen, dtype=F64))
    lq_g = torch.where(mask, lq, -300.0 * torch.rand(lq.shape, generator=gen, dtype=F64))
    lp2 = torch.cat([lp_g, junk_p], 1)
    lq2 = torch.cat([lq_g, junk_q], 1)
    mask2 = torch.cat([mask, torch.zeros(B, extra, dtype=torch.bool)], 1)
    a = call(name, lp, lq, mask, A, gids, **params)
    b = call(name, lp2, lq2, mask2, A, gids, **params)
    close(a[0], b[0])
    close(a[1], b[1][:, : shape["T"]] * mask)
    assert (b[1][~mask2] == 0).all()
    for k in ("is/mean", "is/var", "is/max", "is/ess", "clip/frac", "kl/k1", "kl/k3"):
        assert a[2][k] == pytest.approx(b[2][k], rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("name", REQUIRED)
def test_padding_nonfinite_garbage(name):
    """§4.2 step 1 zero-fills padded log-probs: ±inf / NaN under mask = 0 must not leak."""
    lp, lq, mask, A, gids = make_batch(5, 4, 5, 2)
    a = call(name, lp, lq, mask, A, gids, **default_params(name, 5))
    lp2 = lp.masked_fill(~mask, float("nan"))
    lq2 = lq.masked_fill(~mask, float("-inf"))
    b = call(name, lp2, lq2, mask, A, gids, **default_params(name, 5))
    close(a[0], b[0])
    close(a[1], b[1])


@pytest.mark.parametrize("name", REQUIRED)
def test_float_mask_equals_bool_mask(name):
    lp, lq, mask, A, gids = make_batch(9, 4, 5, 2)
    a = call(name, lp, lq, mask, A, gids, **default_params(name, 5))
    b = call(name, lp, lq, mask.double(), A, gids, **default_params(name, 5))
    c = call(name, lp, lq, mask.long(), A, gids, **default_params(name, 5))
    close(a[0], b[0])
    close(a[1], b[1])
    close(a[0], c[0])


# ----------------------------------------------------------------------------- gradcheck


def _gradcheck_case(name):
    lp, lq, mask, A, gids = make_batch(21, 3, 3, 2, gap=0.4)
    params = {"clip": None, **default_params(name, 3)}
    if name == "cispo":
        # stop-gradient weight: only checkable where the weight is constant (every ratio above the cap)
        lp = lq + 0.5 + 0.1 * torch.rand(lq.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        lp = lp.masked_fill(~mask, 0.0)
        params["clip"] = (None, 0.2)
    if name == "topr":
        # positives have w = 1; make negatives truncated (S > 0 -> w = 1): weights constant
        lp = (lq + 0.3).masked_fill(~mask, 0.0)
        params["clip"] = 1.0
    return lp, lq, mask, A, gids, params


@pytest.mark.parametrize("name", REQUIRED)
def test_gradcheck(name):
    lp, lq, mask, A, gids, params = _gradcheck_case(name)

    def f(x):
        return obj.compute(name, x, lq, mask, A, gids, **params)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(True),), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "gmpo", "gepo"])
def test_gradcheck_with_default_clip_away_from_kinks(name):
    lp, lq, mask, A, gids = make_batch(33, 4, 4, 2, gap=0.5)
    params = default_params(name, 4)

    def f(x):
        return obj.compute(name, x, lq, mask, A, gids, **params)[0]

    assert torch.autograd.gradcheck(f, (lp.clone().requires_grad_(True),), eps=1e-7, atol=1e-6, rtol=1e-4)
