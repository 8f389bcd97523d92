"""The spot check's statistics (peer/learner/rollout_stats.py) and its verdict (spotcheck.judge).

The nucleus distribution is checked against a float64 reference written with plain Python loops; the
typicality z against a two-token case computed by hand; and the statistics' calibration by simulation:
honest samples from known logits must look N(0, 1), and each kind of dishonest sampling must not.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from heterorl.peer.learner.rollout_stats import NUCLEUS_SLACK, RowStats, nucleus_logprobs, row_stats
from heterorl.peer.learner.spotcheck import judge
from heterorl.protocol.settings import TrustSettings

pytestmark = pytest.mark.fast  # in `make test-fast`

N, T, V = 400, 30, 50  # rows, tokens per row, vocabulary of the simulated sampler
BATCH = 16  # rows per simulated batch


# ---- float64 references ----


def ref_nucleus(logits: list[float], temperature: float, top_p: float) -> list[float]:
    """log p of softmax(logits / T) kept on the smallest likeliest prefix holding >= top_p, renormalised."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    p = [w / total for w in weights]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    out = [-math.inf] * len(p)
    for i in kept:
        out[i] = math.log(p[i] / mass)
    return out


def near_nucleus_edge(logits: list[float], temperature: float, top_p: float, eps: float = 1e-5) -> bool:
    """Whether some prefix mass of the sorted distribution lies within ``eps`` of ``top_p`` (float32 and
    float64 may then disagree on the nucleus; at top_p 1 the whole vocabulary is kept anyway)."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = sorted((math.exp(x - top) for x in scaled), reverse=True)
    total, mass = sum(weights), 0.0
    for w in weights:
        mass += w / total
        if abs(mass - top_p) < eps:
            return True
    return False


# ---- helpers ----


def subset(stats: RowStats, rows: slice) -> RowStats:
    """The statistics of some of the rows (a batch of them)."""
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(RowStats)}
    return RowStats(**{k: None if v is None else v[rows] for k, v in fields.items()})


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Tokens drawn from softmax(logits / T) within the top-p nucleus: [..., V] -> [...]."""
    probs = nucleus_logprobs(logits, temperature, top_p).exp().reshape(-1, logits.shape[-1])
    return torch.multinomial(probs, 1, generator=gen).reshape(logits.shape[:-1])


def behaviour_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """What an honest sampler reports: log softmax(logits / T) of the drawn token (before top-p)."""
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None])[..., 0].float()


def stats_of(logits, tokens, claimed, temperature, top_p, mask=None) -> RowStats:
    mask = torch.ones(tokens.shape) if mask is None else mask
    return row_stats(logits, tokens, mask, claimed, temperature, top_p)


@pytest.fixture(scope="module")
def logits():
    """Random logits [N, T, V] (scale 2)."""
    return torch.randn(N, T, V, generator=torch.Generator().manual_seed(1234)) * 2


@pytest.fixture
def world(logits):
    """The logits and a generator seeded afresh for each test (its draws never depend on the others)."""
    return logits, torch.Generator().manual_seed(99)


# ---- nucleus_logprobs ----


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("top_p", [1.0, 0.99, 0.9, 0.5, 0.2, 1e-3])
def test_nucleus_logprobs_matches_reference(temperature, top_p):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5, 40, generator=gen, dtype=torch.float64) * 2.5
    got = nucleus_logprobs(logits, temperature, top_p)
    assert got.shape == logits.shape and got.dtype == torch.float32
    compared = 0
    for i in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            row = logits[i, j].tolist()
            if top_p < 1 and near_nucleus_edge(row, temperature, top_p):
                continue  # float32 and float64 may keep one token more or less there
            want = ref_nucleus(row, temperature, top_p)
            g = got[i, j].tolist()
            assert [math.isfinite(x) for x in g] == [math.isfinite(x) for x in want], (i, j)
            for a, b in zip(g, want, strict=True):
                if math.isfinite(b):
                    assert a == pytest.approx(b, abs=1e-5)
            compared += 1
    assert compared >= 25  # the edge rule skipped few rows, if any


def test_nucleus_keeps_the_likeliest_token_and_sums_to_one():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 30, generator=gen) * 3
    for top_p in (1e-6, 0.3, 0.8):
        lp = nucleus_logprobs(logits, 0.9, top_p)
        assert torch.isfinite(lp.gather(-1, logits.argmax(-1, keepdim=True))).all()
        torch.testing.assert_close(lp.exp().sum(-1), torch.ones(200), atol=1e-5, rtol=0)
    single = nucleus_logprobs(logits, 0.9, 1e-6)
    assert (torch.isfinite(single).sum(-1) == 1).all()  # a tiny top_p is greedy


# ---- row_stats: hand-computed two-token vector ----


def two_token_stats(target: int, claimed: float, top_p: float = 1.0) -> RowStats:
    """One row, one token: logits [ln 3, 0] (p = [3/4, 1/4]) at T = 1."""
    logits = torch.tensor([[[math.log(3.0), 0.0]]])
    return stats_of(logits, torch.tensor([[target]]), torch.tensor([[claimed]]), 1.0, top_p)


def test_two_token_vector_by_hand():
    p0, p1 = 0.75, 0.25
    entropy = -(p0 * math.log(p0) + p1 * math.log(p1))
    second_moment = p0 * math.log(p0) ** 2 + p1 * math.log(p1) ** 2
    variance = second_moment - entropy**2
    assert variance == pytest.approx(p0 * p1 * math.log(3.0) ** 2)  # Bernoulli: p q (log p - log q)^2

    s = two_token_stats(1, math.log(p1))
    assert s.tokens.tolist() == [1.0]
    assert s.surprise.item() == pytest.approx(math.log(4.0), rel=1e-6)
    assert s.entropy.item() == pytest.approx(entropy, rel=1e-6)
    assert s.variance.item() == pytest.approx(variance, rel=1e-5)
    assert s.outside.item() == 0
    assert s.logprob_dev_median.item() == pytest.approx(0.0, abs=1e-6)
    # the less likely of two tokens: z = sqrt(p0 / p1)
    assert s.typicality_z().item() == pytest.approx(math.sqrt(3.0), rel=1e-5)
    assert s.batch_typicality_z() == pytest.approx(math.sqrt(3.0), rel=1e-5)

    s0 = two_token_stats(0, math.log(p0))
    assert s0.surprise.item() == pytest.approx(math.log(4.0 / 3.0), rel=1e-6)
    assert s0.typicality_z().item() == pytest.approx(-math.sqrt(1.0 / 3.0), rel=1e-5)


def test_two_token_logprob_deviation_by_hand():
    for shift in (0.05, 0.3, -0.7):
        s = two_token_stats(1, math.log(0.25) + shift)
        assert s.logprob_dev_median.item() == pytest.approx(math.expm1(abs(shift)), rel=1e-5)
        assert s.logprob_dev_max.item() == pytest.approx(math.expm1(abs(shift)), rel=1e-5)


def test_two_token_nucleus_of_one_token_is_deterministic():
    # top_p 0.5: the nucleus is token 0 alone (p = 1): no entropy, no variance, z = 0; token 1 lies outside
    s = two_token_stats(0, math.log(0.75), top_p=0.5)
    assert (s.surprise.item(), s.entropy.item(), s.variance.item(), s.outside.item()) == (0, 0, 0, 0)
    assert s.typicality_z().item() == 0.0
    s = two_token_stats(1, math.log(0.25), top_p=0.5)
    assert s.outside.item() == 1
    assert (s.surprise.item(), s.entropy.item(), s.variance.item()) == (0, 0, 0)  # outside: not in the sums


def test_sums_match_a_float64_loop_reference(world):
    logits, gen = world
    logits = logits[:5, :12]
    temperature, top_p = 0.8, 0.9
    tokens = sample(logits, temperature, top_p, gen)
    claimed = behaviour_logprobs(logits, tokens, temperature) - 0.01 * torch.arange(12)
    s = stats_of(logits, tokens, claimed, temperature, top_p)
    for i in range(5):
        surprise = entropy = variance = 0.0
        devs = []
        for j in range(12):
            row = logits[i, j].double().tolist()
            lp = ref_nucleus(row, temperature, top_p)
            assert math.isfinite(lp[int(tokens[i, j])])  # honest top-p sampling
            h = -sum(math.exp(x) * x for x in lp if math.isfinite(x))
            m2 = sum(math.exp(x) * x * x for x in lp if math.isfinite(x))
            x = int(tokens[i, j])
            surprise, entropy, variance = surprise - lp[x], entropy + h, variance + m2 - h * h
            full = ref_nucleus(row, temperature, 1.0)[x]
            devs.append(math.expm1(abs(float(claimed[i, j]) - full)))
        assert s.surprise[i].item() == pytest.approx(surprise, rel=1e-5)
        assert s.entropy[i].item() == pytest.approx(entropy, rel=1e-5)
        assert s.variance[i].item() == pytest.approx(variance, rel=1e-4)
        assert s.logprob_dev_max[i].item() == pytest.approx(max(devs), abs=1e-5)
        # torch's median of an even count is the lower of the two middle values
        assert s.logprob_dev_median[i].item() == pytest.approx(sorted(devs)[(len(devs) - 1) // 2], abs=1e-5)
        z = (surprise - entropy) / math.sqrt(variance)
        assert s.typicality_z()[i].item() == pytest.approx(z, rel=1e-4, abs=1e-4)


# ---- calibration on honest samples ----


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.95)])
def test_honest_sampling_is_calibrated(world, temperature, top_p):
    logits, gen = world
    tokens = sample(logits, temperature, top_p, gen)
    noise = 1e-4 * torch.randn(N, T, generator=gen)
    claimed = behaviour_logprobs(logits, tokens, temperature) + noise
    s = stats_of(logits, tokens, claimed, temperature, top_p)
    z = s.typicality_z()
    assert abs(z.mean().item()) < 0.15
    assert 0.85 < z.std().item() < 1.15
    batch_z = [subset(s, slice(b, b + BATCH)).batch_typicality_z() for b in range(0, N, BATCH)]
    assert max(abs(x) for x in batch_z) < 4
    assert s.batch_logprob_dev_median() < 1e-3
    assert s.outside.sum().item() == 0
    assert s.tokens.tolist() == [float(T)] * N
    for b in range(0, N, BATCH):
        assert judge(subset(s, slice(b, b + BATCH)), TrustSettings()) is None


# ---- attacks ----


def test_colder_sampling_is_too_likely(world):
    logits, gen = world
    rows = logits[:BATCH]
    tokens = sample(rows, 0.5, 1.0, gen)
    claimed = behaviour_logprobs(rows, tokens, 1.0)  # recomputed-honest log-probs do not hide it
    s = stats_of(rows, tokens, claimed, 1.0, 1.0)
    assert s.batch_logprob_dev_median() < 1e-4
    assert s.batch_typicality_z() < -6
    reason = judge(s, TrustSettings())
    assert reason is not None and "more likely" in reason and "z = -" in reason


def test_tokens_of_another_distribution_are_too_unlikely(world):
    logits, gen = world
    rows = logits[:BATCH]
    other = torch.randn(rows.shape, generator=gen) * 2
    tokens = sample(other, 1.0, 1.0, gen)
    claimed = behaviour_logprobs(rows, tokens, 1.0)
    s = stats_of(rows, tokens, claimed, 1.0, 1.0)
    assert s.batch_typicality_z() > 6
    reason = judge(s, TrustSettings())
    assert reason is not None and "less likely" in reason and "z = +" in reason


@pytest.mark.parametrize("shift", [-0.3, 0.3])
def test_shifted_logprobs_disagree(world, shift):
    logits, gen = world
    rows = logits[:BATCH]
    tokens = sample(rows, 1.0, 1.0, gen)
    claimed = behaviour_logprobs(rows, tokens, 1.0) + shift
    s = stats_of(rows, tokens, claimed, 1.0, 1.0)
    assert s.batch_logprob_dev_median() == pytest.approx(math.expm1(0.3), abs=1e-4)
    assert abs(s.batch_typicality_z()) < 4  # the token choices themselves are honest
    reason = judge(s, TrustSettings())
    assert reason is not None and "log-probs disagree" in reason and "a row's" not in reason


def test_one_forged_row_is_refused_on_its_own(world):
    logits, gen = world
    rows = logits[:BATCH]
    tokens = sample(rows, 1.0, 1.0, gen)
    claimed = behaviour_logprobs(rows, tokens, 1.0)
    claimed[3] -= 1.0  # expm1(1) = 1.72 > max_row_logprob_dev = 1.0
    s = stats_of(rows, tokens, claimed, 1.0, 1.0)
    assert s.batch_logprob_dev_median() < 1e-4
    assert s.logprob_dev_median[3].item() == pytest.approx(math.expm1(1.0), abs=1e-4)
    reason = judge(s, TrustSettings())
    assert reason is not None and "a row's behaviour log-probs disagree" in reason
    assert "row 3's behaviour log-probs disagree" in judge(s, TrustSettings(max_row_logprob_dev=2.0))
    assert judge(s, TrustSettings(max_row_logprob_dev=2.0, max_row_logprob_gap=1.5)) is None


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_seed_margin_is_zero_for_seeded_draws_and_the_score_gap_for_another_token(world, top_p):
    """Rows drawn by Gumbel-max from their seeds reproduce with margin 0; a token put in their place has
    margin max_y (log p(y) + g_y) - (log p(x) + g_x), computed here in float64 by hand."""
    from heterorl.peer.model.sampling import gumbel_noise, seeded_choice

    logits, _ = world
    rows, n = logits[:4, :6], 4
    seeds = [101, 202, 303, 404]
    tokens = torch.stack([seeded_choice(rows[:, t], seeds, t, 1.0, top_p) for t in range(6)], 1)
    claimed = behaviour_logprobs(rows, tokens, 1.0)
    mask = torch.ones(tokens.shape)
    s = row_stats(rows, tokens, mask, claimed, 1.0, top_p, seeds=seeds)
    assert s.reproduced.tolist() == [6.0] * n and s.seed_margin.tolist() == [0.0] * n
    swapped = tokens.clone()
    logp = nucleus_logprobs(rows[2, 4], 1.0, top_p).double()
    g = gumbel_noise(seeds[2], 4, V).double()
    other = int(torch.where(torch.isfinite(logp), logp, torch.full_like(logp, -1e9)).argsort()[-2])
    if other == int(tokens[2, 4]):
        other = int(logp.argmax())
    swapped[2, 4] = other
    s = row_stats(rows, swapped, mask, behaviour_logprobs(rows, swapped, 1.0), 1.0, top_p, seeds=seeds)
    want = float((logp + g).max() - (logp[other] + g[other]))
    assert s.reproduced.tolist() == [6.0, 6.0, 5.0, 6.0]
    assert s.seed_margin[2].item() == pytest.approx(want, abs=1e-4) and want > 0
    assert s.seed_margin[[0, 1, 3]].tolist() == [0.0] * 3
    reason = judge(s, TrustSettings(min_reproduced=0.5, max_seed_margin=want / 2))
    assert reason is not None and "row 2's seed does not reproduce" in reason
    assert judge(s, TrustSettings(min_reproduced=0.5, max_seed_margin=want * 2)) is None


def test_one_atypical_row_is_refused_on_its_own(world):
    """A row of tokens from elsewhere (uniform over the vocabulary) among sampled ones, its log-probs
    recomputed honestly: its own z is far above 0 while the batch's stays within bounds."""
    logits, gen = world
    rows = logits[:BATCH]
    tokens = sample(rows, 1.0, 1.0, gen)
    tokens[5] = torch.randint(0, V, (T,), generator=gen)
    s = stats_of(rows, tokens, behaviour_logprobs(rows, tokens, 1.0), 1.0, 1.0)
    trust = TrustSettings(max_typicality_z=20.0, max_row_typicality_z=8.0)  # the row test alone
    assert s.typicality_z()[5].item() > trust.max_row_typicality_z
    assert abs(s.batch_typicality_z()) < trust.max_typicality_z
    reason = judge(s, trust)
    assert reason is not None and "row 5's tokens are less likely" in reason, reason


def test_ignoring_top_p_leaves_the_nucleus(world):
    logits, gen = world
    rows = logits[:BATCH]
    top_p = 0.5
    honest = sample(rows, 1.0, top_p, gen)
    s = stats_of(rows, honest, behaviour_logprobs(rows, honest, 1.0), 1.0, top_p)
    assert s.outside.sum().item() == 0
    assert judge(s, TrustSettings()) is None

    full = sample(rows, 1.0, 1.0, gen)
    s = stats_of(rows, full, behaviour_logprobs(rows, full, 1.0), 1.0, top_p)
    share = s.outside.sum().item() / s.tokens.sum().item()
    # the mass outside the slackened nucleus, averaged over positions, is what full sampling lands in
    slack = nucleus_logprobs(rows, 1.0, top_p + NUCLEUS_SLACK)
    expected = 1 - torch.where(torch.isfinite(slack), torch.softmax(rows, -1), 0).sum(-1).mean().item()
    assert expected > 0.3
    assert share == pytest.approx(expected, abs=0.05)
    reason = judge(s, TrustSettings())
    assert reason is not None and "outside the run's top-p nucleus" in reason


def test_author_z_refuses_an_otherwise_passing_batch(world):
    logits, gen = world
    rows = logits[:BATCH]
    tokens = sample(rows, 1.0, 1.0, gen)
    s = stats_of(rows, tokens, behaviour_logprobs(rows, tokens, 1.0), 1.0, 1.0)
    trust = TrustSettings()
    assert judge(s, trust) is None
    assert judge(s, trust, author_z=trust.max_typicality_z - 0.5) is None
    high = judge(s, trust, author_z=trust.max_typicality_z + 0.5)
    assert high is not None and "checked tokens together" in high and "less likely" in high
    low = judge(s, trust, author_z=-trust.max_typicality_z - 0.5)
    assert low is not None and "checked tokens together" in low and "more likely" in low


def test_thresholds_come_from_the_settings(world):
    logits, gen = world
    rows = logits[:BATCH]
    tokens = sample(rows, 1.0, 1.0, gen)
    claimed = behaviour_logprobs(rows, tokens, 1.0) - 0.3
    s = stats_of(rows, tokens, claimed, 1.0, 1.0)
    lax = {"max_logprob_gap": 0.31, "max_row_logprob_gap": 0.31}  # the mean |Δ| is 0.3 exactly
    assert judge(s, TrustSettings(max_logprob_dev=0.34, **lax)) is not None  # expm1(0.3) = 0.3499
    assert judge(s, TrustSettings(max_logprob_dev=0.36, **lax)) is None
    assert s.batch_logprob_gap_mean() == pytest.approx(0.3, abs=1e-5)
    assert judge(s, TrustSettings(max_logprob_dev=0.36, max_logprob_gap=0.29)) is not None


def test_a_constant_forgery_right_on_most_tokens_is_refused_by_the_mean_gap():
    # 9 near-certain tokens (log p = -0.05) claimed exactly, 3 of p = 0.25 claimed as -0.05 too: the median
    # sees no disagreement, the mean |Δ| (3 × 1.336 / 12 = 0.334) does
    probs = torch.tensor([[0.951, 0.049], [0.25, 0.75]])
    choose = [0] * 9 + [0] * 3
    logits = torch.stack([probs[0].log()] * 9 + [probs[1].log()] * 3)[None]
    claimed = torch.full((1, 12), math.log(0.951))
    s = stats_of(logits, torch.tensor([choose]), claimed, 1.0, 1.0)
    assert s.batch_logprob_dev_median() < 1e-6
    assert s.batch_logprob_gap_mean() == pytest.approx(3 * (math.log(0.951) - math.log(0.25)) / 12, rel=1e-4)
    reason = judge(s, TrustSettings())
    assert reason is not None and "mean |Δ|" in reason


# ---- padding ----


def test_padding_contributes_nothing(world):
    logits, gen = world
    n, temperature, top_p = 12, 0.8, 0.9
    rows = logits[:n]
    tokens = sample(rows, temperature, top_p, gen)
    claimed = behaviour_logprobs(rows, tokens, temperature) + 0.02 * torch.randn(n, T, generator=gen)
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    lengths[0], lengths[1] = T, 0  # a full row and an empty one
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    # padding: garbage tokens and claims (as a forger would leave there), must not count
    garbage_tokens = torch.where(mask > 0, tokens, torch.randint(0, V, (n, T), generator=gen))
    garbage_claims = torch.where(mask > 0, claimed, torch.full((n, T), -50.0))
    padded = stats_of(rows, garbage_tokens, garbage_claims, temperature, top_p, mask)
    assert padded.tokens.tolist() == lengths.double().tolist()
    for i in range(n):
        k = int(lengths[i])
        if k == 0:
            for f in ("surprise", "entropy", "variance", "outside", "logprob_dev_median", "logprob_dev_max"):
                assert getattr(padded, f)[i].item() == 0, f
            assert padded.typicality_z()[i].item() == 0
            continue
        alone = stats_of(
            rows[i : i + 1, :k], tokens[i : i + 1, :k], claimed[i : i + 1, :k], temperature, top_p
        )
        for f in dataclasses.fields(RowStats):
            if getattr(alone, f.name) is None:  # not seeded
                continue
            torch.testing.assert_close(getattr(padded, f.name)[i : i + 1], getattr(alone, f.name), msg=f.name)
    # the batch's z is the token-level sum over real tokens only
    whole = subset(padded, slice(0, n))
    num = sum(float((padded.surprise - padded.entropy)[i]) for i in range(n))
    assert whole.batch_typicality_z() == pytest.approx(num / math.sqrt(float(padded.variance.sum())))


def test_no_rows():
    s = row_stats(
        torch.zeros(0, 4, V),
        torch.zeros(0, 4, dtype=torch.long),
        torch.zeros(0, 4),
        torch.zeros(0, 4),
        1.0,
        1.0,
    )
    assert len(s.tokens) == 0
    assert s.batch_logprob_dev_median() == 0.0
    assert s.batch_typicality_z() == 0.0
    assert judge(s, TrustSettings()) is None


def test_a_token_in_the_slack_band_is_neither_typical_nor_outside():
    # p = [0.5, 0.26, 0.24], top_p 0.75: the nucleus is tokens 0 and 1; token 2 is in the float-noise slack
    logits = torch.log(torch.tensor([[[0.5, 0.26, 0.24]]]))
    claimed = torch.log(torch.tensor([[0.24]]))
    s = row_stats(logits, torch.tensor([[2]]), torch.ones(1, 1), claimed, 1.0, 0.75)
    assert (s.surprise.item(), s.entropy.item(), s.variance.item(), s.outside.item()) == (0, 0, 0, 0)
    s = row_stats(logits, torch.tensor([[2]]), torch.ones(1, 1), claimed, 1.0, 0.7)
    assert s.outside.item() == 1  # beyond the slack too (0.7 + 0.02 < 0.76): never emitted
