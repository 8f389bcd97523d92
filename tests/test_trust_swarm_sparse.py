"""Hostile samplers that hide: one foreign row in each otherwise honest batch, a sleeper honest for a while
before it forges, and an attacker on probation while the learner restarts. Real peer processes in a real
swarm on 127.0.0.1 (as tests/test_trust_swarm.py): each is banned, and the learner's ledger shows that
(almost) none of the batches its attack changed were trained on; the honest samplers are never banned.
"""

from __future__ import annotations

import json
import time

import pytest

from heterorl.bench.trust import (
    RESTART_AFTER_ACCEPTED,
    hostile_figures,
    ledger_batches,
    restart_on_probation,
    run_trust,
)
from heterorl.protocol import load_or_create_identity
from heterorl.testing.attacks import PROBATION_HONEST_BATCHES
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow

MAX_TRAINED_FRAC = 0.05  # of an attacker's hostile batches, trained on


def _key(swarm: Swarm, name: str) -> str:
    return load_or_create_identity(swarm.root / name / "peer.key")[0].public_key.hex()


def _wait_key(swarm: Swarm, name: str, timeout: float = 60) -> str:
    """The key of a peer that was just started (it writes its key file as it starts: never made here)."""
    deadline = time.monotonic() + timeout
    while not (swarm.root / name / "peer.key").exists():
        assert time.monotonic() < deadline, f"{name} wrote no key\n{swarm.logs()}"
        time.sleep(0.5)
    time.sleep(0.5)  # written whole
    return _key(swarm, name)


def _wait_banned(swarm: Swarm, keys: dict[str, str], timeout: float) -> dict:
    """The coordinator's view of the learner once it shows every key banned, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            learner = swarm.view()["learner"]
        except (OSError, ValueError, KeyError):  # the dashboard busy, or no learner heartbeat yet
            learner = {}
        if all(k in learner.get("bans", {}) for k in keys.values()) or time.monotonic() > deadline:
            return learner
        time.sleep(2)


def _hostile(swarm: Swarm, name: str) -> tuple[list[str], int]:
    """The attacker's hostile batch ids and how many of them it sent (its final stats)."""
    stats = json.loads((swarm.root / name / "final_stats.json").read_text())
    return stats["hostile_batch_ids"], stats["hostile_batches_sent"]


def test_a_foreign_row_per_batch_and_a_sleeper_are_banned_and_not_trained_on(tmp_path, tiny_model_dir):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, extra_toml=run_trust(seeded=True))
    attackers = {"sparse-foreign": "sparse-foreign", "sleeper": "heterorl.testing.attacks:sleeper_short"}
    try:
        swarm.start_coordinator()
        swarm.start_learner()
        swarm.start_sampler("honest-f32", "--engine-dtype", "float32")
        swarm.start_sampler("honest-bf16", "--engine-dtype", "bfloat16")
        swarm.wait_step(3, timeout=180)
        for name, attack in attackers.items():
            swarm.start_sampler(name, "--nice", "10", "--attack", attack, module="heterorl.testing.hostile")
        keys = {name: _wait_key(swarm, name) for name in attackers}
        learner = _wait_banned(swarm, keys, timeout=150)
        bans = learner.get("bans", {})
        missed = [name for name, k in keys.items() if k not in bans]
        assert not missed, (missed, learner, swarm.logs())
        honest = {_key(swarm, n) for n in ("honest-f32", "honest-bf16")}
        assert not honest & set(bans), bans
    finally:
        swarm.close()
    stats = json.loads((swarm.learner_dir / "final_stats.json").read_text())
    assert not honest & set(stats["bans"]), stats["bans"]
    for name, key in keys.items():
        ids, sent = _hostile(swarm, name)
        assert sent > 0 and len(ids) >= sent, (name, len(ids), sent)
        trained, which = hostile_figures(
            ids, ledger_batches(swarm.learner_dir / "accepted.sqlite", bytes.fromhex(key))
        )
        assert trained <= MAX_TRAINED_FRAC * sent, (name, trained, sent, which)
    # the sleeper was honest first: those batches were its own, not marked hostile
    ids, _ = _hostile(swarm, "sleeper")
    made = json.loads((swarm.root / "sleeper" / "final_stats.json").read_text())["batches_made"]
    assert len(ids) < made


def test_an_attacker_on_probation_across_a_learner_restart_is_never_trained_on(tmp_path, tiny_model_dir):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, extra_toml=run_trust(seeded=True))
    try:
        swarm.start_coordinator()
        learner = swarm.start_learner()
        swarm.start_sampler("honest", "--engine-dtype", "float32")
        swarm.wait_step(3, timeout=180)
        swarm.start_sampler(
            "attacker", "--nice", "10", "--attack", "probation-restart", module="heterorl.testing.hostile"
        )
        key = _wait_key(swarm, "attacker")
        # restarted while the ledger holds 1-5 of its (honest, held) batches: it is on probation
        learner, held = restart_on_probation(
            swarm, learner, swarm.root / "attacker", time.time() + 120, RESTART_AFTER_ACCEPTED
        )
        assert 1 <= held <= PROBATION_HONEST_BATCHES, (held, swarm.logs())
        view = _wait_banned(swarm, {"attacker": key}, timeout=150)
        assert key in view.get("bans", {}), (view, swarm.logs())
        step = swarm.step()
        swarm.wait_step(step + 2, timeout=90)  # training goes on with the honest sampler
        assert _key(swarm, "honest") not in view.get("bans", {})
    finally:
        swarm.close()
    assert "resumed from my own state" in (swarm.learner_dir / "learner.log").read_text()
    ledger = ledger_batches(swarm.learner_dir / "accepted.sqlite", bytes.fromhex(key))
    assert len(ledger) >= held  # what it accepted before the restart is still in its ledger
    trained = {b: s for b, s in ledger.items() if s is not None and s >= 0}
    assert not trained, trained  # nothing of the attacker's, held before or after the restart, trained on
    ids, sent = _hostile(swarm, "attacker")
    assert set(ledger) <= set(ids) and sent >= len(ledger)  # all it sent was hostile
    assert not any(a == key[:16] for r in swarm.metrics() for a in r["authors"])
