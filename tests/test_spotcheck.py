"""SpotCheck on real rollouts of the tiny model, checked in a ModelReplica: honest rows pass, forged log-probs
and a wrong version claim are refused with a strike, a version no longer held is refused without one, and a
check that fails on the learner's side (an out-of-memory, any error in the model) defers the batch."""

from __future__ import annotations

import random

import pytest
import torch

from heterorl.peer.learner.budget import CheckBudget
from heterorl.peer.learner.intake import Admission, Refusal
from heterorl.peer.learner.replica import ModelReplica
from heterorl.peer.learner.reputation import Reputation
from heterorl.peer.learner.spotcheck import SpotCheck, VersionWeights
from heterorl.peer.model import load_model
from heterorl.peer.model.prompts import PromptFormat
from heterorl.peer.rollout import SamplingParams, make_backend
from heterorl.peer.tasks import get_task
from heterorl.protocol.net.trajectories import Deferral
from heterorl.protocol.settings import TrustSettings
from heterorl.protocol.wire.checkpoint import serialize_state_dict

pytestmark = pytest.mark.fast  # in `make test-fast`

TEMPERATURE, TOP_P = 1.0, 0.95
GROUP, PROMPTS = 4, 6  # rows per prompt, prompts per batch
MAX_NEW_TOKENS = 8
# version 1: every weight plus Gaussian noise of this std. (At 0.05, some seeds give a version whose 2-3 token
# arithmetic completions stay within the default thresholds: each row's median is over a few tokens, most of
# them near-certain under both versions.)
NOISE = 0.1


def batch_rows(rollouts) -> list[dict]:
    """A rollout's rows as a TrajectoryBatch holds them (as the sampler's make_batches builds them)."""
    rows = []
    for j in range(len(rollouts.texts)):
        n = int(rollouts.lengths[j])
        rows.append(
            {
                "group": j // GROUP,
                "prompt_ids": list(rollouts.prompt_ids[j]),
                "completion_ids": rollouts.completion_ids[j, :n].tolist(),
                "logprobs": [min(0.0, x) for x in rollouts.logprobs[j, :n].tolist()],
                "reward": 0.0,
            }
        )
    return rows


def batch(rows: list[dict], version: int, t: float = 1.0) -> dict:
    return {"batch_id": b"x" * 16, "policy_version": version, "timestamp": t, "rows": rows}


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    """The tiny model (version 0), a perturbed copy (version 1), and a batch of honest rows of each."""
    model, tok = load_model(str(tiny_model_dir))
    model.eval()
    perturbed, _ = load_model(str(tiny_model_dir))
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * NOISE)
    perturbed.eval()
    task = get_task("arithmetic", digits=1)
    rng = random.Random(5)
    fmt = PromptFormat(tok)
    prompts = [fmt.encode(task.sample(rng).prompt) for _ in range(PROMPTS) for _ in range(GROUP)]
    params = SamplingParams(TEMPERATURE, TOP_P, MAX_NEW_TOKENS)
    torch.manual_seed(0)
    rows = {
        0: batch_rows(make_backend("hf", tiny_model_dir, tok, model=model).generate(prompts, params)),
        1: batch_rows(make_backend("hf", tiny_model_dir, tok, model=perturbed).generate(prompts, params)),
    }
    weights = {0: serialize_state_dict(model.state_dict()), 1: serialize_state_dict(perturbed.state_dict())}
    return model, tok, weights, rows


def make_check(
    world,
    load=None,
    trust: TrustSettings | None = None,
    top_p: float = TOP_P,
    factory=None,
    budget: CheckBudget | None = None,
    held=None,
) -> SpotCheck:
    """A checker whose replica is the run's model loaded again (as the learner builds it)."""
    model, tok, weights, _ = world
    trust = trust or TrustSettings()
    return SpotCheck(
        ModelReplica(factory or (lambda: load_model(tiny_model_dir_of(world))[0])),
        VersionWeights(load or weights.get, trust.check_versions),
        Reputation(trust, buffer_capacity=64, **({"held": held} if held is not None else {})),
        trust,
        pad_id=tok.pad_token_id,
        temperature=TEMPERATURE,
        top_p=top_p,
        budget=budget,
    )


def tokens_of(rows: list[dict]) -> int:
    return sum(len(r["completion_ids"]) for r in rows)


def test_honest_rows_pass(world):
    _, _, _, rows = world
    assert tokens_of(rows[0]) >= 2 * len(rows[0])  # something to check
    check = make_check(world)
    author = b"h" * 32
    assert check(batch(rows[0], 0), author) is None
    v = check.last
    assert v is not None and v.reason is None
    assert v.stats["logprob_dev"] < 1e-3  # the hf engine in float32 reports what the checker recomputes
    assert abs(v.stats["z"]) < 6
    assert v.stats["tokens"] == tokens_of(rows[0])
    assert check.checked == 1 and check.refused == 0 and check.rows_checked == len(rows[0])
    record = check.reputation.record(author)
    assert record.passed == 1 and record.checked == 1
    assert record.z_var == pytest.approx(v.stats["z_var"])


def test_shifted_logprobs_are_refused_with_a_strike(world):
    _, _, _, rows = world
    forged = [{**r, "logprobs": [x - 0.3 for x in r["logprobs"]]} for r in rows[0]]
    check = make_check(world)
    author = b"f" * 32
    out = check(batch(forged, 0), author)
    assert isinstance(out, Refusal) and out.strike
    assert "log-probs disagree" in out.reason
    assert check.last.stats["logprob_dev"] == pytest.approx(torch.tensor(0.3).expm1().item(), abs=1e-3)
    assert check.refused == 1
    assert check.reputation.record(author).passed == 0


def test_a_version_no_longer_held_is_refused_without_a_strike(world):
    _, _, _, rows = world
    check = make_check(world, load=lambda version: None)
    out = check(batch(rows[0], 7), b"u" * 32)
    assert isinstance(out, Refusal) and not out.strike
    assert "7" in out.reason
    assert check.unverifiable == 1 and check.checked == 0 and check.refused == 0


def test_rows_of_another_version_are_refused(world):
    model, _, _, rows = world
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check = make_check(world)
    # version 1's own rows pass against version 1's weights
    assert check(batch(rows[1], 1), b"1" * 32) is None, check.last
    # version 0's rows claiming version 1 do not
    out = check(batch(rows[0], 1), b"2" * 32)
    assert isinstance(out, Refusal) and out.strike, check.last
    assert check.last.stats["logprob_dev"] > TrustSettings().max_logprob_dev
    # and back: version 0's rows claiming version 0 pass (the checker switches its weights)
    assert check(batch(rows[0], 0), b"3" * 32) is None, check.last
    assert check.versions.loads == 2  # each version loaded once
    assert check.replica.loads == 2 and check.replica.builds == 1  # into the replica: once per switch
    # version 1's rows claiming version 0 do not
    out = check(batch(rows[1], 0), b"4" * 32)
    assert isinstance(out, Refusal) and out.strike, check.last
    assert check.last.stats["logprob_dev"] > TrustSettings().max_logprob_dev
    assert check.replica.loads == 2  # still version 0's weights: not copied again
    # the replica took the weights: the model the rows came from is untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_honest_authors_are_checked_until_they_have_a_record(world):
    _, _, _, rows = world
    trust = TrustSettings(record_batches=3, check_rate=0.0)
    check = make_check(world, trust=trust)
    author = b"r" * 32
    per = len(rows[0]) // trust.record_batches  # distinct rows in each (the same rows again would add up)
    for b in range(trust.record_batches):
        assert check(batch(rows[0][b * per : (b + 1) * per], 0), author) is None, check.last
    assert check.checked == trust.record_batches
    record = check.reputation.record(author)
    assert record.passed == trust.record_batches
    assert check.reputation.has_record(author), record
    forged = [{**r, "logprobs": [x - 1.0 for x in r["logprobs"]]} for r in rows[0]]
    assert check(batch(forged, 0), author) is None  # check_rate 0: no longer checked
    assert check.checked == trust.record_batches
    assert check.stats()["trust/checked"] == trust.record_batches


def test_version_weights_keeps_the_most_recent():
    states = {v: serialize_state_dict({"w": torch.full((3,), float(v))}) for v in range(4)}
    asked: list[int] = []

    def load(version: int) -> bytes | None:
        asked.append(version)
        return states.get(version)

    vw = VersionWeights(load, keep=2)
    assert vw.get(0)["w"].tolist() == [0.0] * 3
    assert vw.get(1)["w"].tolist() == [1.0] * 3
    vw.get(0)  # kept; now the most recently used
    vw.get(2)  # evicts 1
    vw.get(0)
    vw.get(1)
    assert asked == [0, 1, 2, 1]
    assert vw.loads == 4
    assert vw.get(9) is None
    assert vw.loads == 4 and asked[-1] == 9


# ---- row by row: one foreign row in a seeded batch ----

SEEDED_TRUST = TrustSettings(min_reproduced=0.8)  # the batch-level share lets one foreign row of 24 by


def seeded_batch(world, dtype: str, author: bytes, bid: bytes) -> dict:
    """Honest seeded rows of version 0 from an hf engine of ``dtype``, as a sampler signs them."""
    from heterorl.protocol.wire.seeds import row_seed

    model, tok, weights, _ = world
    task = get_task("arithmetic", digits=1)
    rng = random.Random(11)
    fmt = PromptFormat(tok)
    prompts = [fmt.encode(task.sample(rng).prompt) for _ in range(PROMPTS) for _ in range(GROUP)]
    seeds = tuple(row_seed("", author, bid, 0, r) for r in range(len(prompts)))
    backend = make_backend("hf", tiny_model_dir_of(world), tok, dtype=dtype)
    from heterorl.protocol.wire.checkpoint import deserialize_state_dict

    backend.load_weights(deserialize_state_dict(weights[0]))
    params = SamplingParams(TEMPERATURE, 1.0, MAX_NEW_TOKENS, seeds=seeds)  # top-p 1: no nucleus check
    rows = batch_rows(backend.generate(prompts, params))
    return {**batch(rows, 0), "batch_id": bid, "seeded": True}


def tiny_model_dir_of(world) -> str:
    model = world[0]
    return model.name_or_path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_seeded_rows_pass_row_by_row(world, dtype):
    author = b"s" * 32
    body = seeded_batch(world, dtype, author, b"q" * 16)
    check = make_check(world, trust=SEEDED_TRUST, top_p=1.0)
    assert check(body, author) is None, check.last
    s = check.last.stats
    assert s["reproduced"] >= 0.9 and s["seed_margin_max"] <= SEEDED_TRUST.max_seed_margin


def test_one_foreign_row_among_honest_seeded_ones_is_refused(world):
    """Another model's text in one row, its behaviour log-probs and reward recomputed honestly: the batch's
    figures pass, the row's seed does not reproduce it."""
    from heterorl.peer.model import completion_logprobs

    model, tok, _, rows = world
    author = b"c" * 32
    body = seeded_batch(world, "float32", author, b"w" * 16)
    check = make_check(world, trust=SEEDED_TRUST, top_p=1.0)
    assert check(body, author) is None, check.last  # all honest: passes
    # a row replaced by version 1's completion of the same prompt (the perturbed model: another model)
    k = next(i for i, r in enumerate(rows[1]) if r["completion_ids"] != body["rows"][i]["completion_ids"])
    foreign = dict(rows[1][k])
    comp = torch.tensor([foreign["completion_ids"]])
    with torch.no_grad():
        lp = completion_logprobs(
            model, [foreign["prompt_ids"]], comp, torch.ones_like(comp), tok.pad_token_id
        )
    foreign["logprobs"] = [min(0.0, x) for x in lp[0].tolist()]
    body["rows"][k] = {**foreign, "group": body["rows"][k]["group"]}
    out = check(body, author)
    s = check.last.stats
    assert isinstance(out, Refusal) and out.strike, s
    assert f"row {k}'s seed does not reproduce" in out.reason, out.reason
    assert (
        s["reproduced"] >= SEEDED_TRUST.min_reproduced
    )  # the batch as a whole passes: only the row check sees it
    assert s["logprob_gap"] < SEEDED_TRUST.max_logprob_gap and abs(s["z"]) < SEEDED_TRUST.max_typicality_z


# ---- a check that fails on this side: no verdict, the batch deferred and retried ----


def failing_factory(world, errors: list[Exception]):
    """The run's model, whose forward raises each of ``errors`` in turn before it works again."""

    def factory():
        model = load_model(tiny_model_dir_of(world))[0]
        forward = model.forward

        def failing(*args, **kwargs):
            if errors:
                raise errors.pop(0)
            return forward(*args, **kwargs)

        model.forward = failing
        return model

    return factory


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("CUBLAS failed")],
    ids=["oom", "runtime"],
)
def test_a_failure_inside_the_checker_defers_an_honest_batch_and_its_retry_passes(world, error):
    _, _, _, rows = world
    check = make_check(world, factory=failing_factory(world, [error]))
    strikes: list[tuple] = []
    admission = Admission([("spot check", check)], on_strike=lambda *a: strikes.append(a))
    author, body = b"o" * 32, batch(rows[0], 0)
    out = admission(body, author)
    assert isinstance(out, Deferral), out  # not accepted, not refused: the sampler keeps it and retries
    assert type(error).__name__ in out.reason and out.retry_after_s > 0
    assert check.last.retry and not check.last.strike
    assert admission.deferred["spot check"] == 1 and not admission.refused and not strikes
    assert check.failed == 1 and check.refused == 0 and check.checked == 0 and check.unverifiable == 0
    assert check.stats()["trust/check_failed"] == 1
    assert check.reputation.record(author).passed == 0
    # the sampler's retry: the checker works again, the batch passes and counts for its author
    assert admission(body, author) is None, check.last
    assert check.last.reason is None and not check.last.retry
    assert check.checked == 1 and check.reputation.record(author).passed == 1


def test_a_held_batch_whose_check_fails_gets_a_verdict_to_retry(world):
    """The learner's sweep calls check() on held batches: a failure says retry, not refuse."""
    _, _, _, rows = world
    check = make_check(world, factory=failing_factory(world, [torch.OutOfMemoryError("CUDA out of memory")]))
    author, body = b"h" * 32, batch(rows[0], 0)
    verdict = check.check(body, author)
    assert verdict.reason is not None and verdict.retry and not verdict.strike
    assert check.reputation.record(author).passed == 0
    verdict = check.check(body, author)
    assert verdict.reason is None and not verdict.retry
    assert check.reputation.record(author).passed == 1


def test_a_version_no_longer_held_is_not_retried(world):
    _, _, _, rows = world
    check = make_check(world, load=lambda version: None)
    verdict = check.check(batch(rows[0], 7), b"u" * 32)
    assert verdict.reason is not None and not verdict.retry and not verdict.strike


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_checks_of_authors_without_a_record_past_their_budget_defer_and_never_strike(world):
    """A forged batch of an author on probation: checked (a strike) while probation's share of time has
    credit; past it, deferred (busy, no strike, not checked); checked again once the clock gave it back."""
    _, _, _, rows = world
    clock = FakeClock()
    budget = CheckBudget(0.10, 0.05, window_s=1e-4, clock=clock)  # a burst of 5 µs: one check overdraws it
    check = make_check(world, budget=budget)
    strikes: list[tuple] = []
    admission = Admission([("spot check", check)], on_strike=lambda *a: strikes.append(a))
    author = b"p" * 32
    forged = [{**r, "logprobs": [x - 0.5 for x in r["logprobs"]]} for r in rows[0]]
    assert "log-probs disagree" in str(admission(batch(forged, 0), author))
    assert len(strikes) == 1 and check.checked == 1
    took = check.seconds
    assert took > 0 and budget.probation.spent_s == pytest.approx(took)
    for _ in range(3):  # the flood goes on: deferred, not struck, not checked
        out = admission(batch(forged, 0), author)
        assert isinstance(out, Deferral) and "busy" in out.reason, out
        assert 5.0 <= out.retry_after_s <= 30.0  # a new author: no sooner than the rate limit says
    assert check.last.busy and not check.last.strike
    assert len(strikes) == 1 and check.checked == 1 and admission.deferred["spot check"] == 3
    assert budget.stats()["trust/check_busy_probation"] == 3
    assert budget.recorded.spent_s == 0.0  # probation's time only
    clock.now += took / 0.05 + 1.0  # its share of the clock paid the check back
    assert "log-probs disagree" in str(admission(batch(forged, 0), author))
    assert len(strikes) == 2 and check.checked == 2


def test_past_the_budget_a_batch_of_an_author_with_a_record_is_held_unchecked_or_deferred_if_it_holds_enough(
    world,
):
    _, _, _, rows = world
    trust = TrustSettings(record_batches=1, check_rate=1.0, hold_batches=4)
    held = {"n": 0}
    budget = CheckBudget(0.10, 0.05, clock=FakeClock())
    check = make_check(world, trust=trust, budget=budget, held=lambda author: (held["n"], None))
    author = b"r" * 32
    check.reputation.passed_check(author, 0.0, 1.0)  # a record
    budget.spend(10.0, probation=False)  # the checks of authors with a record spent their share
    assert check(batch(rows[0], 0), author) is None  # accepted unchecked: the learner holds it
    assert check.checked == 0 and check.last.busy
    held["n"] = trust.hold_batches  # it holds all it may
    out = check(batch(rows[0], 0), author)
    assert isinstance(out, Deferral) and "busy" in out.reason and check.checked == 0
    assert check.reputation.strikes() == {}
