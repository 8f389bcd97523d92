"""`heterorl bench trust`'s report of a result (the bench itself runs swarms: its figures are in
docs/trust.md, and tests/test_trust_swarm.py runs its attacks)."""

from __future__ import annotations

import pytest

from heterorl.bench.trust import report, run_trust

pytestmark = pytest.mark.fast


def test_the_report_names_every_attack_and_the_honest_figures():
    r = {
        "engines": ["hf/float32", "hf/bfloat16"],
        "seeded": True,
        "updates": 1234,
        "attacks": {
            "forged-shift": {
                "reached_training_frac": 0.0,
                "banned": True,
                "hostile_batches_accepted": 0,
                "hostile_batches_answered": 245,
                "reward_during": 0.2,
                "reward_baseline": 0.1,
            },
            "flood": {"honest_intake_kept": 0.93, "flood_batches_accepted": 12, "flood_identities_seen": 5},
        },
        "honest_false_refusal": 0.0001,
        "honest_batches": 9000,
        "honest_banned": 0,
        "check_time_frac": 0.04,
    }
    text = report(r)
    assert "forged-shift" in text and "banned True" in text and "245 batches" in text
    assert "honest intake kept 93%" in text and "0.01% of 9000" in text and "4.0% of learner time" in text


def test_the_runs_trust_settings_ask_for_seeded_sampling_when_told():
    assert "min_reproduced = 0.9" in run_trust(seeded=True)
    assert "min_reproduced = 0.0" in run_trust(seeded=False)
    assert run_trust(seeded=True).startswith("[trust]\n")
