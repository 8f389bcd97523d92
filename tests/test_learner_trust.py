"""The learner's trust gate (peer/learner/trust.py) on its own: a real ledger and buffer, a stand-in store and
spot checker; what is held, released, dropped, banned and replayed."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from heterorl.peer.learner.budget import CheckBudget
from heterorl.peer.learner.buffer import TrajectoryBuffer
from heterorl.peer.learner.spotcheck import Verdict
from heterorl.peer.learner.trust import LearnerTrust
from heterorl.protocol import encode
from heterorl.protocol.net.trajectories import Deferral
from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.identity import Identity

pytestmark = pytest.mark.fast

RUN = "trust-unit"
ALICE, BOB = Identity.generate(), Identity.generate()


def body(n: int, version: int = 0, rows: int = 2, completion: int = 3, **extra) -> dict:
    row = {
        "group": 0,
        "prompt_ids": [1, 2, 3 + n % 90],
        "completion_ids": [3] * completion,
        "logprobs": [-0.5] * completion,
    }
    return {
        "run_id": RUN,
        "batch_id": n.to_bytes(16, "big"),
        "policy_version": version,
        "timestamp": 1.7e9 + n,
        "rows": [{**row, "reward": 1.0} for _ in range(rows)],
        **extra,
    }


class Store:
    """The learner's chunk store as the trust gate reads it: the versions it published."""

    def __init__(self, versions=(0,)):
        self._versions = list(versions)

    def versions(self):
        return list(self._versions)

    def has_version(self, v):
        return v in self._versions

    def assemble(self, v):
        return b""


class FakeCheck:
    """The spot checker's interface: ``verdicts`` says each author's next verdict."""

    def __init__(self, reputation):
        self.reputation, self.verdicts, self.checked = reputation, {}, []
        self.versions = self

    def put(self, version, weights):
        self.put_version = version

    def __call__(self, body, author):
        return None  # admission: passes (the hold is what is tested here)

    def check(self, body, author):
        self.checked.append(body["batch_id"])
        v = self.verdicts.get(author, Verdict(None, stats={"z_num": 0.0, "z_var": 1.0}))
        if v.reason is None:
            self.reputation.passed_check(author, 0.0, 1.0, batch_id=body["batch_id"])
        return v

    def stats(self):
        return {"trust/checked": float(len(self.checked))}

    def reproduced_by_author(self):
        return {}


class CheckedTrust(LearnerTrust):
    def _spot_check(self, replica, pad_id):
        return FakeCheck(self.reputation)


def settings(**trust) -> RunSettings:
    s = RunSettings(run_id=RUN, learner_keys=(b"k" * 32,), vocab_size=100, initial_checkpoint=b"h" * 32)
    return dataclasses.replace(s, trust=dataclasses.replace(s.trust, **trust)) if trust else s


def make(tmp_path, checks: bool, capacity: int = 4, **trust):
    s = settings(**trust)
    learner = dataclasses.replace(s.learner, buffer_batches=capacity, prompts_per_update=1)
    s = dataclasses.replace(s, learner=learner, sampler=dataclasses.replace(s.sampler, prompts_per_batch=1))
    ledger = AcceptedLog(tmp_path / "accepted.sqlite")
    buffer = TrajectoryBuffer(capacity)
    cls = CheckedTrust if checks else LearnerTrust
    trust = cls(
        s, ledger, buffer, Store(), step=lambda: 0, published=lambda: 0, reward_check=lambda b, a: None,
        replica=object() if checks else None, pad_id=0,
    )  # fmt: skip
    return trust, ledger, buffer


def arrive(trust, ledger, identity, n, **kw):
    """What the receiver does with a batch: admission, the ledger write, then ``accepted``."""
    b = body(n, **kw)
    verdict = trust.admit(b, identity.public_key)
    if verdict is not None:
        return verdict
    ledger.accept(
        b["batch_id"], identity.public_key, b["policy_version"], encode("TrajectoryBatch", b, identity), 0.0
    )
    trust.accepted(b, identity.public_key)
    return None


def test_without_spot_checks_accepted_batches_go_straight_to_training_and_flow_control_counts_them(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=False, capacity=2)
    assert arrive(trust, ledger, ALICE, 1) is None and arrive(trust, ledger, ALICE, 2) is None
    assert len(buffer) == 2 and len(trust.held) == 0
    assert not trust.has_room()  # the buffer is full
    assert trust.stats()["trust/held"] == 0


def test_the_admission_chain_refuses_with_a_strike_or_without_one(tmp_path):
    trust, ledger, _ = make(tmp_path, checks=False)
    too_long = arrive(trust, ledger, ALICE, 1, completion=10_000)
    assert "exceeds the run's" in str(too_long)
    assert trust.reputation.strikes().get(ALICE.public_key) == 1
    never = arrive(trust, ledger, BOB, 2, version=7)  # a version newer than any published: stale-side refusal
    assert never is not None and trust.reputation.strikes().get(BOB.public_key) is None
    assert trust.final()["refused_by_check"] == {"rows": 1, "staleness": 1}


def test_a_new_author_is_held_until_a_check_vouches_then_all_it_holds_is_released(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=True, capacity=8, record_batches=1)
    for n in range(2):
        assert arrive(trust, ledger, ALICE, n) is None
    assert len(trust.held) == 2 and len(buffer) == 0  # probation: no record yet
    assert "new authors" in str(arrive(trust, ledger, ALICE, 2))  # probation's own bound: deferred
    trust.reputation.passed_check(ALICE.public_key, 0.0, 1.0)  # a record earned
    trust.check_held(ALICE.public_key)
    assert len(trust.held) == 0 and len(buffer) == 2
    assert sorted(i.batch_id for i in ledger.pending()) == [body(n)["batch_id"] for n in range(2)]
    assert all(i.released for i in ledger.pending())  # a restart sends them to training again


def test_a_strike_drops_what_its_author_holds_and_a_failed_check_keeps_it_held(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=True, capacity=8, record_batches=1)
    for n in range(2):
        arrive(trust, ledger, ALICE, n)
    trust.reputation.passed_check(ALICE.public_key, 0.0, 1.0)
    check = trust.spot_check
    check.verdicts[ALICE.public_key] = Verdict(
        "could not be checked (OutOfMemoryError)", strike=False, retry=True
    )
    trust.check_held(ALICE.public_key)
    assert len(trust.held) == 2 and ledger.dropped() == {}  # the checker's own failure: tried again later
    checked = len(check.checked)
    trust.release_on_demand()  # training is short of data, but Alice's retry is not due yet
    assert len(check.checked) == checked
    trust._retry_at[ALICE.public_key] = 0.0  # due now
    check.verdicts[ALICE.public_key] = Verdict("forged log-probs", strike=True)
    trust.check_held(ALICE.public_key)
    assert len(trust.held) == 0 and len(buffer) == 0
    assert set(ledger.dropped()) == {body(0)["batch_id"], body(1)["batch_id"]}
    assert trust.reputation.strikes()[ALICE.public_key] == 1


def test_the_sweep_checks_the_author_holding_most_when_training_is_short(tmp_path):
    trust, ledger, buffer = make(
        tmp_path, checks=True, capacity=32, record_batches=1, new_author_batches_per_s=100.0
    )
    for n, who in [(1, ALICE), (2, BOB), (3, BOB)]:
        assert arrive(trust, ledger, who, n) is None
    for who in (ALICE, BOB):
        trust.reputation.passed_check(who.public_key, 0.0, 1.0)
    trust.release_on_demand()  # the buffer is empty: starving
    assert trust.spot_check.checked == [body(3)["batch_id"]]  # Bob's newest: he holds the most
    assert len(buffer) == 2 and len(trust.held) == 1


def test_a_ban_drops_pending_batches_and_banned_authors_leave_the_next_update(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=False, capacity=8, ban_strikes=1, ban_strike_share=0.0)
    arrive(trust, ledger, ALICE, 1)
    taken = buffer.take_groups(1, timeout=0)
    assert [b.batch_id for b in taken] == [body(1)["batch_id"]]
    arrive(trust, ledger, ALICE, 2)
    arrive(trust, ledger, ALICE, 3, completion=10_000)  # one strike bans (ban_strikes=1)
    assert ALICE.public_key in trust.reputation.bans() and len(buffer) == 0
    assert trust.without_banned(taken) == []  # assembled before the ban: left out, and dropped in the ledger
    assert set(ledger.dropped()) == {body(1)["batch_id"], body(2)["batch_id"]}
    assert ledger.bans()[ALICE.public_key].startswith("1 refused")


def test_a_restart_replays_what_the_ledger_holds_as_it_was(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=True, capacity=8, record_batches=1)
    arrive(trust, ledger, ALICE, 1)
    trust.reputation.passed_check(ALICE.public_key, 0.0, 1.0)
    trust.check_held(ALICE.public_key)  # released
    arrive(trust, ledger, ALICE, 2)  # held: no check vouched for it
    assert len(buffer) == 1 and len(trust.held) == 1
    trust.save()
    ledger.close()
    again, ledger2, buffer2 = make(tmp_path, checks=True, capacity=8, record_batches=1)
    assert again.replay(applied_after=0) == 2
    assert [b.batch_id for b in buffer2.take_groups(1, timeout=0)] == [body(1)["batch_id"]]
    assert len(again.held) == 1 and again.reputation.has_record(ALICE.public_key)


def test_a_lineage_joiner_does_not_call_the_versions_published_while_it_was_away_never_published(tmp_path):
    """A learner that took the lineage's state at version 10 holds versions 0-2 (its own, before it was
    killed) and 10 on; 3-9 were published by another learner while it was away. Claims of them are not
    "never published" once it knows; a gap it saw (11, which the writer skipped) still is."""
    s = settings()
    ledger = AcceptedLog(tmp_path / "accepted.sqlite")
    trust = LearnerTrust(
        s, ledger, TrajectoryBuffer(8), Store((0, 1, 2, 10, 12)), step=lambda: 12, published=lambda: 12,
        reward_check=lambda b, a: None, replica=None, pad_id=0,
    )  # fmt: skip
    before = trust.admit(body(1, version=5), ALICE.public_key)
    assert "claims version 5, which was never published" in str(before)
    trust.saw_versions_from(10)
    assert trust.admit(body(2, version=5), BOB.public_key) is None
    assert trust.admit(body(3, version=10), BOB.public_key) is None
    skipped = trust.admit(body(4, version=11), BOB.public_key)
    assert "claims version 11, which was never published" in str(skipped)


class ManifestStore(Store):
    """A store holding signed manifests (stand-in bytes: their sha256 is what a batch names)."""

    def manifest(self, v):
        return b"manifest of version %d" % v if v in self._versions else None


def manifest_sha(v: int) -> bytes:
    return hashlib.sha256(b"manifest of version %d" % v).digest()


def test_a_batch_is_checked_against_the_exact_weights_it_names(tmp_path):
    """A batch names the signed manifest it was sampled on: one this learner holds under the version it
    claims passes; one held under another version is a lie (a strike); one this learner does not hold (a
    version the lineage abandoned, pruned, or forged) is dropped without a strike and counted; one of a
    version this learner has not reached yet waits."""
    s = settings()
    trust = LearnerTrust(
        s, AcceptedLog(tmp_path / "accepted.sqlite"), TrajectoryBuffer(8), ManifestStore((0, 1, 2, 3)),
        step=lambda: 3, published=lambda: 3, reward_check=lambda b, a: None, replica=None, pad_id=0,
    )  # fmt: skip
    assert trust.admit(body(1, version=2, manifest_sha256=manifest_sha(2)), ALICE.public_key) is None
    lie = trust.admit(body(2, version=1, manifest_sha256=manifest_sha(3)), BOB.public_key)
    assert "names the manifest of version 3" in str(lie) and trust.reputation.strikes()[BOB.public_key] == 1
    abandoned = trust.admit(body(3, version=3, manifest_sha256=b"\x07" * 32), ALICE.public_key)
    assert "does not hold" in str(abandoned) and ALICE.public_key not in trust.reputation.strikes()
    ahead = trust.admit(body(4, version=5, manifest_sha256=b"\x08" * 32), ALICE.public_key)
    assert isinstance(ahead, Deferral)  # it may get there: the sampler retries
    far = trust.admit(body(5, version=500, manifest_sha256=b"\x09" * 32), ALICE.public_key)
    assert "does not hold" in str(far) and ALICE.public_key not in trust.reputation.strikes()
    assert trust.stats()["trust/abandoned_weights"] == 2


def test_a_ban_another_learner_signed_is_honoured(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=False)
    assert arrive(trust, ledger, ALICE, 1) is None and len(buffer) == 1
    trust.honour_ban(ALICE.public_key, "behaviour log-probs disagree", by=b"\x05" * 32)
    assert "banned by learner 0505" in trust.reputation.bans()[ALICE.public_key]
    assert len(buffer) == 0 and ledger.bans()  # its batches not trained on are gone, and the ban is durable
    assert "banned" in str(arrive(trust, ledger, ALICE, 2))


def test_past_probations_share_of_check_time_a_new_author_is_deferred_without_a_strike(tmp_path):
    """All of a new author's batches are checked: while probation's share of the learner's time is spent,
    its batch is deferred ("busy") before the intake checks and the new authors' rate are spent on it."""
    trust, ledger, _ = make(tmp_path, checks=True, capacity=8, record_batches=1)
    bucket = trust.reputation._bucket
    trust.budget.spend(10.0, probation=True)  # a flood's checks took probation's share
    out = arrive(trust, ledger, ALICE, 1)
    assert isinstance(out, Deferral) and "busy" in out.reason and out.retry_after_s >= 5.0
    assert trust.final()["deferred_by_check"] == {"busy": 1} and trust.reputation.strikes() == {}
    assert len(trust.held) == 0 and ledger.pending() == []
    assert trust.reputation._bucket == bucket  # the new authors' rate was not spent on it
    assert trust.stats()["trust/check_busy_probation"] == 1
    trust.reputation.passed_check(BOB.public_key, 0.0, 1.0)  # an author with a record is not deferred
    assert arrive(trust, ledger, BOB, 2) is None


def test_past_the_check_share_held_batches_of_authors_with_a_record_stay_held(tmp_path):
    trust, ledger, buffer = make(tmp_path, checks=True, capacity=8, record_batches=1)
    arrive(trust, ledger, ALICE, 1)
    trust.reputation.passed_check(ALICE.public_key, 0.0, 1.0)  # a record; its batch still held
    clock = [1000.0]
    trust.budget = CheckBudget(0.10, 0.05, clock=lambda: clock[0])
    trust.budget.spend(10.0, probation=False)  # the checks of authors with a record took their share
    trust.release_on_demand()  # training is short of data, but there is no time to check
    assert trust.spot_check.checked == [] and len(trust.held) == 1 and len(buffer) == 0
    trust.spot_check.verdicts[ALICE.public_key] = Verdict("busy", strike=False, busy=True)
    trust.check_held(ALICE.public_key)  # the checker itself says busy: the same
    assert len(trust.held) == 1 and ledger.dropped() == {} and trust.reputation.strikes() == {}
    clock[0] += 10.0 / 0.05  # their share of the clock paid it back
    del trust.spot_check.verdicts[ALICE.public_key]
    trust.release_on_demand()
    assert len(trust.held) == 0 and len(buffer) == 1


def test_short_of_data_the_sweep_checks_once_what_is_held_completes_the_next_update(tmp_path):
    """One check releases all its author holds: while what is held would not complete the next update, the
    sweep waits for more (a check per update, not one per batch as batches trickle in)."""
    trust, ledger, buffer = make(
        tmp_path, checks=True, capacity=32, record_batches=1, new_author_batches_per_s=100.0
    )
    trust.settings = dataclasses.replace(
        trust.settings, learner=dataclasses.replace(trust.settings.learner, prompts_per_update=3)
    )
    for n in (1, 2):
        assert arrive(trust, ledger, BOB, n) is None
    trust.reputation.passed_check(BOB.public_key, 0.0, 1.0)
    trust.release_on_demand()  # 2 groups held, the update wants 3: not yet
    assert trust.spot_check.checked == [] and len(trust.held) == 2
    assert arrive(trust, ledger, BOB, 3) is None
    trust.release_on_demand()
    assert trust.spot_check.checked == [body(3)["batch_id"]] and len(buffer) == 3
