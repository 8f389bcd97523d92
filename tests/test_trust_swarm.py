"""Hostile samplers against the learner's checks, each a real peer process in a real swarm on 127.0.0.1:
caught, refused, banned (and shown as banned in the coordinator's view), and nothing they sent trained on;
the honest samplers, of two engine dtypes, never banned. ``heterorl bench trust`` measures the same attacks
one after the other, with their figures; these tests run a group of them at once.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from heterorl.bench.trust import run_trust
from heterorl.protocol import load_or_create_identity
from heterorl.testing.attacks import REPLAY_FROM_ENV
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow

GROUPS = [
    # the 4-bit perturbed copy sits at the tiny run's threshold once the policy is nearly certain (some of
    # its checks pass: "bounded, not caught" in docs/trust.md; ``heterorl bench trust`` measures it), so
    # "never trained on" is asserted of the 3-bit copy, well past the threshold
    ("forged-shift", "forged-copied", "other-model", "backdoor", "stale-claim"),
    ("forged-constant", "other-model-recomputed", "wrong-temperature", "perturbed-weights-coarse", "replay"),
]


def _key(swarm: Swarm, name: str) -> str:
    return load_or_create_identity(swarm.root / name / "peer.key")[0].public_key.hex()


@pytest.mark.parametrize("attacks", GROUPS, ids=["group-1", "group-2"])
def test_hostile_samplers_are_caught_banned_shown_and_never_trained_on(tmp_path, tiny_model_dir, attacks):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, extra_toml=run_trust(seeded=True))
    os.environ[REPLAY_FROM_ENV] = str(swarm.root / "honest-f32")
    try:
        swarm.start_coordinator()
        swarm.start_learner()
        swarm.start_sampler("honest-f32", "--engine-dtype", "float32")
        swarm.start_sampler("honest-bf16", "--engine-dtype", "bfloat16")
        swarm.wait_step(3, timeout=240)
        for a in attacks:
            swarm.start_sampler(a, "--nice", "10", "--attack", a, module="heterorl.testing.hostile")
        keys = {a: _key(swarm, a) for a in attacks}
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            bans = swarm.view()["learner"].get("bans", {})
            if all(k in bans for k in keys.values()):
                break
            time.sleep(2)
        view = swarm.view()
        bans = view["learner"].get("bans", {})
        missed = [a for a, k in keys.items() if k not in bans]
        assert not missed, (missed, view["learner"], swarm.logs())
        shown = {p["key"]: p for p in view["peers"]}
        for a, k in keys.items():  # the coordinator's view shows who and why
            if k[:8] in shown:
                assert shown[k[:8]]["banned"], (a, shown[k[:8]])
        honest = {_key(swarm, n) for n in ("honest-f32", "honest-bf16")}
        assert not honest & set(bans), bans
        step = swarm.step()
        swarm.wait_step(step + 3, timeout=120)  # learning goes on with the honest samplers
    finally:
        swarm.close()
        os.environ.pop(REPLAY_FROM_ENV, None)
    trained = {a for r in swarm.metrics() for a in r["rows_by_author"]}
    assert trained <= {k[:16] for k in honest}, trained  # training used honest data only
    stats = json.loads((swarm.learner_dir / "final_stats.json").read_text())
    assert set(stats["bans"]) >= set(keys.values())
    assert not any(stats["trained_rows"].get(k) for k in keys.values())
