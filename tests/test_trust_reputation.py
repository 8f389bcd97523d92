"""What the learner knows of each author: Reputation (records, strikes, bans, rate limits, version claims),
ReplayIndex (rows replayed under another key) and the Admission chain that runs the checks."""

from __future__ import annotations

import random

import pytest

from heterorl.peer.learner.intake import Admission, Refusal
from heterorl.peer.learner.replay import ReplayIndex
from heterorl.peer.learner.reputation import NEW_AUTHOR_RETRY_S, SUSPICIOUS_Z, Z_DECAY, Reputation
from heterorl.protocol.net.trajectories import Deferral
from heterorl.protocol.settings import TrustSettings

pytestmark = pytest.mark.fast  # in `make test-fast`

A, B = b"a" * 32, b"b" * 32


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def reputation(trust: TrustSettings | None = None, **kwargs) -> Reputation:
    kwargs.setdefault("buffer_capacity", 100)
    return Reputation(trust or TrustSettings(), **kwargs)


def earn_record(rep: Reputation, author: bytes) -> None:
    for _ in range(rep.trust.record_batches):
        assert rep.should_check(author)
        rep.passed_check(author, 0.0, 1.0)
    assert rep.has_record(author)


def body(t: float = 0.0, v: int = 0, rows: list[dict] | None = None) -> dict:
    return {"batch_id": b"x" * 16, "policy_version": v, "timestamp": t, "rows": rows or []}


# ---- which batches are checked ----


def test_new_author_is_checked_densely_then_at_the_rate():
    trust = TrustSettings(check_rate=0.1, record_batches=8)
    rep = reputation(trust, rng=random.Random(0))
    for i in range(trust.record_batches):
        assert not rep.has_record(A)
        assert rep.should_check(A), i
        rep.passed_check(A, 0.0, 1.0)
    assert rep.has_record(A)
    checked = sum(rep.should_check(A) for _ in range(1000))
    assert 50 <= checked <= 200
    assert rep.should_check(B)  # another author has no record of its own


def test_a_strike_owes_dense_checks_again():
    trust = TrustSettings(check_rate=0.1, record_batches=5, ban_strikes=10)
    rep = reputation(trust, rng=random.Random(1))
    earn_record(rep, A)
    assert rep.strike(A, "bad batch") is None
    assert not rep.has_record(A)
    for i in range(trust.record_batches):
        assert rep.should_check(A), i
        rep.passed_check(A, 0.0, 1.0)
    assert rep.has_record(A)
    assert sum(rep.should_check(A) for _ in range(200)) < 60


@pytest.mark.parametrize(("rate", "low", "high"), [(0.0, 0, 0), (1.0, 300, 300)])
def test_check_rate_extremes(rate, low, high):
    rep = reputation(TrustSettings(check_rate=rate, record_batches=2), rng=random.Random(2))
    earn_record(rep, A)
    assert low <= sum(rep.should_check(A) for _ in range(300)) <= high


def test_typicality_adds_up_over_checked_batches():
    rep = reputation()
    assert rep.typicality_z(A, 3.0, 4.0) == pytest.approx(1.5)
    rep.passed_check(A, 3.0, 4.0)
    rep.passed_check(A, 1.0, 5.0)
    d = Z_DECAY  # older batches weigh less: d per batch checked since
    num, var = d * (d * 3 + 1) + 2, d * (d * 4 + 5) + 7
    assert rep.typicality_z(A, 2.0, 7.0) == pytest.approx(num / var**0.5)
    assert rep.typicality_z(B, 0.0, 0.0) == 0.0


def test_an_engines_small_bias_does_not_add_up_over_a_long_run():
    rep = reputation()
    for _ in range(5000):  # z = +0.2 every batch: over all of them z would be 0.2 * sqrt(5000) = 14
        rep.passed_check(A, 0.2 * 10.0, 100.0)
    assert rep.typicality_z(A, 0.0, 0.0) < 2.5  # the last ~100 weigh: ~0.2 * sqrt(199)
    for _ in range(40):  # a wrong temperature: z = -1.7 every batch
        rep.passed_check(B, -1.7 * 10.0, 100.0)
    assert rep.typicality_z(B, 0.0, 0.0) < -6


def test_an_author_whose_tokens_lean_one_way_is_checked_densely():
    trust = TrustSettings(record_batches=2, check_rate=0.0)
    rep = reputation(trust, rng=random.Random(3))
    earn_record(rep, A)  # z 0 so far (its sums: 0 over variance 2)
    # a passed batch that takes the author's z just beyond SUSPICIOUS_Z: (0 + num) / sqrt(2 + 2)
    rep.passed_check(A, 2.0 * (SUSPICIOUS_Z + 0.01), 2.0)
    assert rep.has_record(A) and rep.should_check(A)  # it keeps its record (no probation): only checks
    rep.passed_check(A, -0.1, 10.0)  # (6.02 - 0.1) / sqrt(14) < 3: cleared
    assert rep.has_record(A) and not rep.should_check(A)
    earn_record(rep, B)
    rep.passed_check(B, -4.5, 0.0)  # -4.5 / sqrt 2 < -3: leaning towards likely tokens counts the same
    assert rep.should_check(B)


# ---- strikes and bans ----


def test_strikes_ban_at_ban_strikes_and_call_on_ban_once():
    bans: list[tuple[bytes, str]] = []
    trust = TrustSettings(ban_strikes=3, ban_strike_share=0.2)
    rep = reputation(trust, on_ban=lambda author, reason: bans.append((author, reason)))
    assert rep.check_banned(body(), A) is None
    assert rep.strike(A, "first") is None
    assert rep.strike(A, "second") is None
    assert bans == [] and rep.strikes() == {A: 2}
    reason = rep.strike(A, "third")
    assert reason is not None and "third" in reason and "3 refused" in reason
    assert bans == [(A, reason)]
    assert rep.strike(A, "fourth") is None  # already banned: no second ban
    assert bans == [(A, reason)]
    refused = rep.check_banned(body(), A)
    assert refused is not None and reason in refused
    assert rep.check_banned(body(), B) is None
    assert rep.bans() == {A: reason}

    restarted = reputation(trust)
    restarted.load_bans(rep.bans())
    assert restarted.check_banned(body(), A) == refused
    assert restarted.check_banned(body(), B) is None


def test_an_honest_author_with_a_long_record_is_not_banned_for_a_few_refusals():
    bans: list[tuple[bytes, str]] = []
    trust = TrustSettings(ban_strikes=3, ban_strike_share=0.2)
    rep = reputation(trust, on_ban=lambda author, reason: bans.append((author, reason)))
    for _ in range(50):
        rep.passed_check(A, 0.0, 1.0)
    # strikes s of checked 50 + s: banned once s / (50 + s) >= 0.2, i.e. at s = 13 (12 / 62 < 0.2 <= 13 / 63)
    for s in range(1, 13):
        assert rep.strike(A, f"refusal {s}") is None, s
    assert bans == [] and rep.check_banned(body(), A) is None
    assert rep.strike(A, "refusal 13") is not None
    assert len(bans) == 1 and "13 refused batches of 63 checked" in bans[0][1]


def test_unchecked_strikes_do_not_count_as_checked_batches():
    trust = TrustSettings(ban_strikes=3, ban_strike_share=0.5)
    rep = reputation(trust)
    for _ in range(4):
        rep.passed_check(A, 0.0, 1.0)
    # 3 strikes from other checks: share 3 / 4 checked; counted as checked: 3 / 7 < 0.5
    for _ in range(2):
        assert rep.strike(A, "wrong reward", checked=False) is None
    assert rep.strike(A, "wrong reward", checked=False) is not None
    assert rep.record(A).checked == 4

    for _ in range(4):
        rep.passed_check(B, 0.0, 1.0)
    for _ in range(3):
        assert rep.strike(B, "spot check", checked=True) is None  # 3 / 7 < 0.5
    assert rep.record(B).checked == 7


def test_share_zero_bans_on_strikes_alone():
    rep = reputation(TrustSettings(ban_strikes=2, ban_strike_share=0.0))
    for _ in range(100):
        rep.passed_check(A, 0.0, 1.0)
    assert rep.strike(A, "x") is None
    assert rep.strike(A, "y") is not None


# ---- rate limits on authors without a record ----


def test_new_authors_share_a_token_bucket():
    clock = FakeClock()
    trust = TrustSettings(new_author_batches_per_s=2.0, record_batches=1)
    rep = reputation(trust, clock=clock)
    burst = 4  # the bucket holds two seconds of the rate (or two records' worth, if more: 2 here)
    fresh = (bytes([i]) * 32 for i in range(256))
    for _ in range(burst):
        assert rep.check_rate(body(), next(fresh)) is None
    deferred = rep.check_rate(body(), next(fresh))
    assert isinstance(deferred, Deferral)
    assert deferred.retry_after_s == NEW_AUTHOR_RETRY_S  # told to come back later than one token's worth
    assert rep.deferred_new == 1
    assert isinstance(rep.check_rate(body(), A), Deferral)  # the same author again: the same bucket

    clock.now += 0.5  # one batch's worth
    assert rep.check_rate(body(), next(fresh)) is None
    assert isinstance(rep.check_rate(body(), next(fresh)), Deferral)

    clock.now += 1000.0  # refilled, but never beyond the burst
    for _ in range(burst):
        assert rep.check_rate(body(), next(fresh)) is None
    assert isinstance(rep.check_rate(body(), next(fresh)), Deferral)
    assert rep.deferred_new == 4


def test_an_author_with_a_record_is_never_rate_limited():
    clock = FakeClock()
    trust = TrustSettings(new_author_batches_per_s=1.0, record_batches=2)
    buffered = {"n": 0}
    rep = reputation(trust, clock=clock, buffered_new=lambda: buffered["n"])
    earn_record(rep, A)
    for i in range(20):
        rep.check_rate(body(), bytes([i]) * 32)  # new authors empty the bucket
    assert isinstance(rep.check_rate(body(), B), Deferral)
    buffered["n"] = 100
    for _ in range(50):
        assert rep.check_rate(body(), A) is None


@pytest.mark.parametrize(
    ("capacity", "record_batches", "most"),
    [(100, 8, 25), (40, 8, 16), (40, 2, 10), (3, 1, 2)],  # 0.25 of the buffer, at least 2 records' worth
)
def test_new_authors_share_of_the_buffer(capacity, record_batches, most):
    buffered = {"n": 0}
    trust = TrustSettings(
        new_author_buffer_share=0.25, new_author_batches_per_s=1000.0, record_batches=record_batches
    )
    rep = reputation(trust, buffer_capacity=capacity, clock=FakeClock(), buffered_new=lambda: buffered["n"])
    buffered["n"] = most - 1
    assert rep.check_rate(body(), A) is None
    buffered["n"] = most
    deferred = rep.check_rate(body(), A)
    assert isinstance(deferred, Deferral) and deferred.retry_after_s > 0
    assert rep.deferred_new == 1


# ---- version claims ----


def test_claims_never_go_back_in_signed_time():
    rep = reputation()
    assert rep.check_claim(body(t=10.0, v=5), A) is None
    rep.accepted(body(t=10.0, v=5), A)
    refused = rep.check_claim(body(t=20.0, v=4), A)  # stamped later, claims an older version
    assert refused is not None and "older" in refused
    assert rep.check_claim(body(t=20.0, v=5), A) is None
    assert rep.check_claim(body(t=20.0, v=7), A) is None
    # stamped earlier, delivered late: an older version is fine, a newer one is not
    assert rep.check_claim(body(t=5.0, v=4), A) is None
    rep.accepted(body(t=5.0, v=4), A)
    newer = rep.check_claim(body(t=7.0, v=6), A)
    assert newer is not None and "newer" in newer
    assert rep.check_claim(body(t=7.0, v=4), A) is None
    # another author's claims are its own
    assert rep.check_claim(body(t=20.0, v=1), B) is None
    # checking a claim records nothing: only accepted batches count
    assert rep.check_claim(body(t=40.0, v=9), A) is None
    assert rep.check_claim(body(t=50.0, v=6), A) is None
    rep.accepted(body(t=40.0, v=9), A)
    assert rep.check_claim(body(t=50.0, v=6), A) is not None


# ---- replays ----


def rows_of(seed: int, n: int = 4) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "group": i // 2,
            "prompt_ids": [rng.randrange(100) for _ in range(5)],
            "completion_ids": [rng.randrange(100) for _ in range(6)],
            "logprobs": [-rng.random() for _ in range(6)],
            "reward": 1.0,
        }
        for i in range(n)
    ]


def test_replay_of_another_authors_batch_is_refused():
    index = ReplayIndex()
    rows = rows_of(0, 8)
    assert index(body(rows=rows), A) is None
    index.add(body(rows=rows), A)
    refused = index(body(rows=rows), B)
    assert refused is not None and "a batch another author sent" in refused
    assert index(body(rows=rows[::-1]), B) is not None  # the same rows in another order
    assert index(body(rows=rows), A) is None  # its own rows again (a retry)


def test_rows_another_author_drew_too_are_not_a_replay():
    # two honest samplers of one engine and version draw bit-identical rows of a near-certain prompt
    index = ReplayIndex()
    rows = rows_of(0, 8)
    index.add(body(rows=rows), A)
    assert index(body(rows=rows[:4] + rows_of(1, 4)), B) is None
    assert index(body(rows=rows[:7]), B) is None


def test_replay_index_keeps_the_newest_fingerprints():
    index = ReplayIndex(capacity=1)
    old, new = rows_of(0), rows_of(1)
    index.add(body(rows=old), A)
    index.add(body(rows=new), A)
    assert len(index) == 1
    assert index(body(rows=old), B) is None  # evicted
    assert index(body(rows=new), B) is not None


def test_replay_first_sender_keeps_the_rows():
    index = ReplayIndex()
    rows = rows_of(2)
    index.add(body(rows=rows), A)
    index.add(body(rows=rows), B)  # (accepted anyway, e.g. before the index knew): A stays the owner
    assert index(body(rows=rows), A) is None
    assert index(body(rows=rows), B) is not None


# ---- the admission chain ----


class Recorder:
    def __init__(self, outcome=None):
        self.outcome, self.calls = outcome, 0

    def __call__(self, _body: dict, _author: bytes):
        self.calls += 1
        return self.outcome


def test_admission_first_refusal_wins():
    strikes: list[tuple[bytes, str, str]] = []
    a, b, c = Recorder(), Recorder("bad b"), Recorder("bad c")
    adm = Admission([("a", a), ("b", b), ("c", c)], on_strike=lambda *s: strikes.append(s))
    assert adm(body(), A) == "bad b"
    assert (a.calls, b.calls, c.calls) == (1, 1, 0)
    assert strikes == [(A, "b", "bad b")]
    assert adm.refused == {"b": 1} and not adm.deferred


def test_admission_passes_when_every_check_passes():
    strikes: list = []
    checks = [("a", Recorder()), ("b", Recorder())]
    adm = Admission(checks, on_strike=lambda *s: strikes.append(s))
    assert adm(body(), A) is None
    assert all(c.calls == 1 for _, c in checks)
    assert strikes == [] and not adm.refused and not adm.deferred


def test_admission_refusals_that_are_not_strikes():
    strikes: list = []
    adm = Admission(
        [("banned", Recorder("banned: x")), ("rest", Recorder())],
        on_strike=lambda *s: strikes.append(s),
        no_strike=("banned",),
    )
    assert adm(body(), A) == "banned: x"
    assert strikes == [] and adm.refused == {"banned": 1}

    adm = Admission(
        [("spot", Recorder(Refusal("version gone", strike=False)))], on_strike=lambda *s: strikes.append(s)
    )
    assert adm(body(), A) == "version gone"  # the reason, not the Refusal, goes to the receiver
    assert strikes == [] and adm.refused == {"spot": 1}

    adm = Admission([("spot", Recorder(Refusal("forged")))], on_strike=lambda *s: strikes.append(s))
    assert adm(body(), A) == "forged"
    assert strikes == [(A, "spot", "forged")]

    adm = Admission(
        [("spot", Recorder(Refusal("forged")))], on_strike=lambda *s: strikes.append(s), no_strike=["spot"]
    )
    assert adm(body(), B) == "forged"
    assert strikes == [(A, "spot", "forged")]  # unchanged


def test_admission_passes_a_deferral_through():
    strikes: list = []
    later = Recorder("never reached")
    deferral = Deferral("busy", 1.5)
    adm = Admission([("rate", Recorder(deferral)), ("later", later)], on_strike=lambda *s: strikes.append(s))
    assert adm(body(), A) is deferral
    assert adm(body(), B) is deferral
    assert adm.deferred == {"rate": 2}
    assert later.calls == 0 and strikes == [] and not adm.refused


def test_admission_without_on_strike():
    adm = Admission([("a", Recorder("no"))])
    assert adm(body(), A) == "no"
    assert adm.refused == {"a": 1}


def test_admission_with_reputation_bans_after_strikes():
    """The chain as the learner wires it: strikes from a check go to Reputation.strike, which bans."""
    bans: list = []
    rep = reputation(TrustSettings(ban_strikes=2, ban_strike_share=0.2), on_ban=lambda a, r: bans.append(a))
    adm = Admission(
        [("banned", rep.check_banned), ("reward", Recorder("wrong reward"))],
        on_strike=lambda author, check, reason: rep.strike(author, f"{check}: {reason}", checked=False),
        no_strike=("banned",),
    )
    assert adm(body(), A) == "wrong reward"
    assert adm(body(), A) == "wrong reward"
    assert bans == [A]
    refused = adm(body(), A)
    assert refused is not None and refused.startswith("author banned")
    assert adm.refused == {"reward": 2, "banned": 1}
    assert rep.strikes() == {A: 2}


def test_samplers_starting_together_earn_their_records_without_waiting():
    clock = FakeClock()
    trust = TrustSettings(new_author_batches_per_s=1.0, record_batches=8)
    rep = reputation(trust, clock=clock)
    for i in range(2 * trust.record_batches):  # two samplers' first batches, at once
        assert rep.check_rate(body(), A if i % 2 else B) is None, i
    assert isinstance(rep.check_rate(body(), bytes([9]) * 32), Deferral)  # then the rate


def test_without_spot_checks_every_author_has_a_record():
    # an adapter run is not spot-checked: no author could ever earn a record, so none is needed
    rep = Reputation(TrustSettings(), buffer_capacity=16, checks=False)
    assert rep.has_record(A) and rep.check_rate(body(), A) is None


# ---- holding: which batches vouch for the held ones ----


def test_a_recorded_authors_batch_is_checked_when_it_holds_many_or_old_ones():
    trust = TrustSettings(check_rate=0.0, record_batches=1, hold_batches=4, hold_s=20.0)
    held = {"n": 0, "oldest": None}
    now = {"t": 5000.0}
    rep = reputation(trust, held=lambda a: (held["n"], held["oldest"]), wall=lambda: now["t"])
    earn_record(rep, A)
    assert not rep.should_check(A)  # rate 0, nothing held
    held.update(n=2, oldest=now["t"] - 1)
    assert not rep.should_check(A)
    held.update(n=3)  # this batch would be the 4th held: it is checked
    assert rep.should_check(A)
    held.update(n=1, oldest=now["t"] - 20.0)  # the oldest waited hold_s
    assert rep.should_check(A)


def test_a_pass_vouches_for_its_batch_once():
    rep = reputation()
    rep.passed_check(A, 0.0, 1.0, batch_id=b"1" * 16)
    assert rep.take_vouched(b"1" * 16)
    assert not rep.take_vouched(b"1" * 16)  # taken
    assert not rep.take_vouched(b"2" * 16)  # never checked
    assert reputation(checks=False).take_vouched(b"3" * 16)  # no checks at all: everything is vouched


def test_records_are_saved_on_every_check_and_strike_and_come_back():
    saved: dict[bytes, dict | None] = {}
    rep = reputation(TrustSettings(record_batches=2), save=lambda a, r: saved.__setitem__(a, r))
    rep.accepted(body(t=1.0, v=3), A)
    rep.passed_check(A, 1.0, 2.0)
    assert saved[A]["passed"] == 1 and saved[A]["claims"] == [(1.0, 3)]
    rep.strike(A, "bad")
    assert saved[A]["strikes"] == 1 and saved[A]["dense_left"] == 2
    back = reputation(TrustSettings(record_batches=2))
    back.load_records({a: r for a, r in saved.items() if r is not None})
    assert back.record(A) == rep.record(A)
    assert not back.has_record(A)  # still owes its dense checks: still on probation after the restart
    assert back.check_claim(body(t=2.0, v=2), A) is not None  # its claims came back too


def test_records_never_earned_expire_and_earned_ones_stay():
    saved: dict[bytes, dict | None] = {}
    now = {"t": 1000.0}
    trust = TrustSettings(record_batches=1, record_expiry_s=100.0)
    rep = reputation(trust, save=lambda a, r: saved.__setitem__(a, r), wall=lambda: now["t"])
    rep.passed_check(A, 0.0, 1.0)  # A earns a record
    rep.accepted(body(), B)
    rep.strike(B, "bad")  # B never does: a throw-away key with a strike
    now["t"] += 50
    assert rep.expire() == []
    now["t"] += 60
    assert rep.expire() == [B]
    assert saved[B] is None and rep.record(B).strikes == 0 and rep.record(A).passed == 1
    now["t"] += 1000
    assert rep.expire() == []  # an earned record never expires
