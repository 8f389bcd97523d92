"""`heterorl bench trust`'s report of a result and the figures it derives (the bench itself runs swarms: its
figures are in docs/trust.md, and tests/test_trust_swarm*.py run its attacks)."""

from __future__ import annotations

import argparse
import sqlite3

import pytest

from heterorl.bench.trust import (
    CONTROL,
    DEFAULT_ATTACKS,
    add_arguments,
    first_batch,
    held_out_evals,
    hostile_figures,
    ledger_batches,
    reached_training,
    report,
    run_trust,
)
from heterorl.protocol.storage.ledger import DROPPED, AcceptedLog
from heterorl.testing.attacks import BUILT_IN, FLOODS, RESTARTS

pytestmark = pytest.mark.fast


def test_the_report_names_every_attack_the_control_and_the_honest_figures():
    r = {
        "engines": ["hf/float32", "hf/bfloat16"],
        "seeded": True,
        "updates": 1234,
        "control": {"eval_end": 0.41, "eval_baseline": 0.3, "reward_during": 0.4, "reward_baseline": 0.3},
        "attacks": {
            "forged-shift": {
                "reached_training_frac": 0.0,
                "banned": True,
                "hostile_batches_accepted": 0,
                "hostile_batches_answered": 245,
                "hostile_batches_sent": 245,
                "hostile_batches_trained": 0,
                "reward_during": 0.2,
                "reward_baseline": 0.1,
                "eval_end": 0.39,
                "eval_baseline": 0.31,
            },
            "probation-restart": {
                "reached_training_frac": 0.0,
                "banned": True,
                "hostile_batches_accepted": 5,
                "hostile_batches_answered": 30,
                "hostile_batches_sent": 30,
                "hostile_batches_trained": 0,
                "learner_restarted": True,
                "reward_during": 0.2,
                "reward_baseline": 0.1,
                "eval_end": 0.4,
                "eval_baseline": 0.3,
            },
            "flood": {"honest_intake_kept": 0.93, "flood_batches_accepted": 12, "flood_identities_seen": 5},
            "flood-forged": {
                "honest_intake_kept": 0.97,
                "honest_intake_kept_flooding": 0.91,
                "flood_started_after_s": 12.5,
                "flood_batches_accepted": 0,
                "flood_identities_seen": 24,
            },
        },
        "honest_false_refusal": 0.0001,
        "honest_batches": 9000,
        "honest_banned": 0,
        "check_time_frac": 0.04,
    }
    text = report(r)
    assert "forged-shift" in text and "banned True" in text and "245 batches" in text
    assert "hostile batches trained 0 of 245" in text and "eval 0.39 vs 0.31 before" in text
    assert "control (no attacker)" in text and "eval 0.41 at the phase's end vs 0.3" in text
    assert "hostile batches trained 0 of 30; learner restarted" in text
    assert "honest intake kept 93%" in text and "0.01% of 9000" in text and "4.0% of learner time" in text
    assert "honest intake kept 97%, 91% from its first batch (12.5 s in)" in text
    del r["control"]  # a result written before the control run still reads
    assert "control" not in report(r)


def test_the_runs_trust_settings_ask_for_seeded_sampling_when_told():
    assert "min_reproduced = 0.9" in run_trust(seeded=True)
    assert "min_reproduced = 0.0" in run_trust(seeded=False)
    assert run_trust(seeded=True).startswith("[trust]\n")


def test_every_default_attack_is_built_in_and_the_flood_comes_last():
    assert set(DEFAULT_ATTACKS) <= set(BUILT_IN) and CONTROL not in BUILT_IN
    assert DEFAULT_ATTACKS[-1] in FLOODS and set(RESTARTS) <= set(DEFAULT_ATTACKS)
    new = ("sparse-foreign", "sleeper", "probation-restart")
    assert DEFAULT_ATTACKS[-4:-1] == new
    for name in new:
        assert BUILT_IN[name].__doc__


def test_held_out_evals_around_a_phase():
    rows = [{"time": t, "step": 10 * t} for t in range(10)]
    for t, v in ((2, 0.2), (4, 0.3), (6, 0.4), (8, 0.5)):
        rows[t]["eval/sampled"] = v
    got = held_out_evals(rows, t_join=5, t0=5, t1=8)
    assert got == {"eval_baseline": 0.3, "eval_baseline_step": 40, "eval_end": 0.4, "eval_end_step": 60}
    # no evaluation in the phase: the first one after it
    assert held_out_evals(rows, 6.5, 6.5, 7.5)["eval_end"] == 0.5
    assert held_out_evals(rows, 1, 9, 10) == {
        "eval_baseline": None,
        "eval_baseline_step": None,
        "eval_end": None,
        "eval_end_step": None,
    }


def test_hostile_batches_trained_are_read_from_the_learners_ledger(tmp_path):
    path = tmp_path / "accepted.sqlite"
    attacker, honest = b"a" * 32, b"h" * 32
    ids = [bytes([i]) * 16 for i in range(5)]
    assert ledger_batches(path, attacker) == {}  # no ledger yet
    with AcceptedLog(path) as ledger:
        for i, bid in enumerate(ids):
            ledger.accept(bid, attacker if i < 4 else honest, 0, b"x", 0.0)
        ledger.mark_applied([ids[0], ids[4]], 3)  # trained
        ledger.drop([ids[1]], "banned", 0.0)  # dropped; ids[2], ids[3] still held
        got = ledger_batches(path, attacker)  # read-only, while the learner holds it open
    assert got == {ids[0].hex(): 3, ids[1].hex(): DROPPED, ids[2].hex(): None, ids[3].hex(): None}
    hostile = [ids[0].hex(), ids[1].hex(), ids[2].hex(), (b"z" * 16).hex()]  # one never accepted
    assert hostile_figures(hostile, got) == (1, [ids[0].hex()])
    with sqlite3.connect(path) as conn:  # the reader left the file as it was
        assert conn.execute("SELECT count(*) FROM batches").fetchone()[0] == 5


def test_reached_training_is_never_less_than_the_hostile_batches_share():
    # all the attacker sent was hostile: its rows trained over its rows answered
    assert reached_training(16, 100, 16, True, 0.0) == 0.01
    assert reached_training(32, 100, 16, True, 0.05) == 0.05
    # a sleeper: its honest batches' rows trained are its own business; the hostile batches' share counts
    assert reached_training(40 * 16, 60, 16, False, 0.1) == 0.1
    assert reached_training(0, 0, 16, True, 0.0) == 0.0


def test_flood_forged_is_a_built_in_flood_and_several_attacks_can_be_named_at_once():
    assert "flood-forged" in FLOODS and BUILT_IN["flood-forged"].__doc__
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args(["--attacks", "flood", "flood-forged"]).attack == ["flood", "flood-forged"]
    assert ap.parse_args(["--attack", "flood", "--attacks", "replay"]).attack == ["flood", "replay"]
    assert ap.parse_args([]).attack is None  # every default attack


def test_the_report_says_how_long_checks_waited_for_the_checkers_model_when_measured():
    r = {
        "engines": ["hf/float32"],
        "seeded": True,
        "updates": 10,
        "attacks": {},
        "honest_false_refusal": 0.0,
        "honest_batches": 100,
        "honest_banned": 0,
        "check_time_frac": 0.05,
        "check_wait_frac": 0.02,
    }
    assert "checks 5.0% of learner time (and 2.0% waiting for the checker's model)" in report(r)


def test_flood_forged_signs_two_forged_batches_with_each_of_60_throw_away_keys_then_stops(monkeypatch):
    import dataclasses

    from heterorl.testing import attacks

    @dataclasses.dataclass(frozen=True)
    class Options:
        max_pending: int = 4

    class Sender:
        def learner_busy_for(self) -> float:
            return 3.0

    class FakeSampler:
        """What the attack changes of a sampler: make_batches signs each batch with the identity held."""

        def __init__(self):
            self.identity, self.opt, self.sender, self.signed = "honest key", Options(), Sender(), []

        def make_batches(self, n):
            first = len(self.signed)
            ids = [(first + i).to_bytes(16, "big") for i in range(n)]
            return [self.sign_batch([{"logprobs": [-1.0, -2.0]}], batch_id=bid) for bid in ids]

        def sign_batch(self, rows, batch_id=None):
            self.signed.append((self.identity, rows[0]["logprobs"]))
            return batch_id, b"signed", 2

    monkeypatch.setattr(attacks, "FLOOD_FORGED_IDLE_S", 0.0)
    sampler = FakeSampler()
    attacks.BUILT_IN["flood-forged"](sampler)
    assert sampler.opt.max_pending == 64 and sampler.sender.learner_busy_for() == 0.0  # never waits
    made = [len(sampler.make_batches(4)) for _ in range(9)]
    assert made == [16] * 7 + [8, 0]  # 120 forged batches, then nothing more
    keys = [k for k, _ in sampler.signed]
    assert len(keys) == 120 and len(set(keys)) == 60 and "honest key" not in keys
    assert all(keys[i] == keys[i + 1] for i in range(0, 120, 2))  # two batches per key, one after the other
    assert all(lp == [-1.5, -2.5] for _, lp in sampler.signed)  # every log-prob shifted by -0.5
    assert len(sampler.hostile_batch_ids) == 120  # each one hostile


def test_when_a_flood_queued_its_first_batch(tmp_path):
    import time

    from heterorl.protocol.storage.outbox import Outbox

    assert first_batch(tmp_path, deadline=time.time() + 1) is None  # none made by the deadline
    with Outbox(tmp_path / "outbox.sqlite") as outbox:
        assert first_batch(tmp_path, deadline=time.time() + 1) is None  # the outbox, but nothing made yet
        outbox.put(b"b" * 16, b"signed", 0)
        outbox.ack(b"b" * 16)  # delivered already: it was made all the same
        t = time.time()
        assert t <= first_batch(tmp_path, deadline=t + 30) < t + 5
