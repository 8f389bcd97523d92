"""The sampler fetches the next checkpoint in the background while it keeps generating with the one it holds,
and switches between batches; it stops generating while it is more than ``sampler.max_lag`` versions behind
the newest or while the learner says it is busy, and says so in its state.

Real coordinator, learner and sampler processes on 127.0.0.1 (tiny model). Slow downloads are real: an upload
cap on the learner's chunk server (``--upload-mbps``), or a pause after each chunk a sampler rebuilds from a
delta (``HETERORL_TEST_SLOW_REBUILD_S``). Tests wait on conditions with generous deadlines; no timing is
asserted.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import pytest

from heterorl.protocol.settings import EXAMPLE, SamplerSettings, load_run_config, parse_run_config
from heterorl.protocol.storage.jsonlog import read_rows
from heterorl.testing.swarm import Swarm

GENERATING_WHILE_FETCHING = re.compile(r"generating with version (\d+); fetching (\d+)")
PAUSED_BEHIND = re.compile(r"paused: (\d+) versions behind")


def _versions(state_dir: Path) -> list[dict]:
    return list(read_rows(state_dir / "versions.jsonl"))  # a row the sampler is writing: not yet


def _final(swarm: Swarm, name: str) -> dict:
    return json.loads((swarm.root / name / "final_stats.json").read_text())


def _log(swarm: Swarm, name: str) -> str:
    path = swarm.root / name / "sampler.log"
    return path.read_text() if path.exists() else ""


def _states(swarm: Swarm, names: list[str], seen: dict[str, list[str]]) -> None:
    """Add the states the coordinator shows for ``names`` now (heartbeats, every 2 s) to ``seen``."""
    with contextlib.suppress(OSError, ValueError):  # the dashboard of a loaded machine may be slow
        for name, (state, _) in swarm.peer_states(names).items():
            if not seen[name] or seen[name][-1] != state:
                seen[name].append(state)


def test_max_lag_is_a_checked_runspec_setting(tmp_path):
    keys = {"learner_keys": ["00" * 32]}
    assert parse_run_config(keys).sampler.max_lag == 4
    (tmp_path / "run.toml").write_text(EXAMPLE.replace("<64 hex chars>", "00" * 32))
    example = load_run_config(tmp_path / "run.toml")
    assert example.sampler == SamplerSettings(prompts_per_batch=2, max_lag=4)  # the documented default
    assert parse_run_config({**keys, "sampler": {"max_lag": -1}}).sampler.max_lag == -1  # never pause
    assert parse_run_config({**keys, "sampler": {"max_lag": 0}}).sampler.max_lag == 0
    for bad in (-2, 1.5, "4", True):
        with pytest.raises(ValueError, match="sampler.max_lag"):
            parse_run_config({**keys, "sampler": {"max_lag": bad}})


@pytest.mark.slow
def test_sampler_generates_while_it_fetches_and_switches_between_batches(tmp_path, tiny_model_dir):
    # the learner uploads at 2 Mbit/s, so each float32 version (~0.55 MB; deltas off) takes seconds to arrive
    # while the one sampler keeps generating with the version it holds; max_lag -1 turns the stop rule off
    # (the learner here outpaces the fetches, so with the default 4 the sampler would pause now and then)
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, lr=5e-4, deltas=0, sampler={"max_lag": -1})
    seen: dict[str, list[str]] = {"s0": []}
    try:
        swarm.start_coordinator()
        swarm.start_learner("--upload-mbps", "2")
        swarm.start_sampler("s0")
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            _states(swarm, ["s0"], seen)
            overlapped = [r for r in _versions(swarm.root / "s0")[1:] if r["batches_during_fetch"] > 0]
            if len(overlapped) >= 3 and any(GENERATING_WHILE_FETCHING.match(s) for s in seen["s0"]):
                break
            time.sleep(0.5)
    finally:
        swarm.close()
    rows = _versions(swarm.root / "s0")
    assert len(rows) >= 4, swarm.logs()
    assert [r["version"] for r in rows] == sorted({r["version"] for r in rows}), rows  # forward, each once
    assert rows[0]["held"] is None  # version 0 (or the first): nothing to generate with before it
    for prev, row in zip(rows[:-1], rows[1:], strict=True):
        assert row["held"] == prev["version"], rows  # fetched while generating with the previous one
        # switched between batches: those made during the fetch come after the previous switch
        assert row["after_batch"] >= prev["after_batch"] + row["batches_during_fetch"], rows
        assert row["via"] == "full" and row["fetched_bytes"] > 0
    overlapped = [r for r in rows[1:] if r["batches_during_fetch"] > 0]
    assert len(overlapped) >= 3, rows  # batches made with version N while N+1 was downloading
    shown = [GENERATING_WHILE_FETCHING.match(s) for s in seen["s0"]]
    assert any(m and int(m[2]) > int(m[1]) for m in shown), seen  # and its state said so
    final = _final(swarm, "s0")
    assert final["batches_made"] >= sum(r["batches_during_fetch"] for r in rows), final
    assert final["fetch_failures"] == 0 and final["paused_behind_s"] == 0, final  # -1: never paused for lag
    assert "Traceback" not in _log(swarm, "s0")


@pytest.mark.slow
def test_sampler_pauses_while_too_far_behind_or_while_the_learner_is_busy(tmp_path, tiny_model_dir):
    # bf16 versions with deltas: sampler-slow rebuilds each delta slowly (a pause per rebuilt chunk), so it
    # falls more than max_lag = 1 versions behind while two quick samplers feed the learner, whose buffer
    # holds one update (4 batches): beyond that it answers "busy, retry later"
    swarm = Swarm(
        tmp_path / "swarm",
        tiny_model_dir,
        lr=5e-5,
        sampler={"max_lag": 1},
        checkpoint_dtype='"bfloat16"',
        deltas=4,
        buffer_batches=4,
    )
    names = ["sampler-a", "sampler-b", "sampler-slow"]
    seen: dict[str, list[str]] = {n: [] for n in names}
    try:
        swarm.start_coordinator()
        swarm.start_learner()
        swarm.start_sampler("sampler-a")
        swarm.start_sampler("sampler-b")
        swarm.wait_step(2, timeout=300)
        swarm.start_sampler("sampler-slow", wrap=["env", "HETERORL_TEST_SLOW_REBUILD_S=4"])
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            _states(swarm, names, seen)
            behind = any(PAUSED_BEHIND.match(s) for s in seen["sampler-slow"])
            busy = any(s.startswith("paused: learner busy") for n in names[:2] for s in seen[n])
            if behind and busy and len(_versions(swarm.root / "sampler-slow")) >= 3:
                break
            time.sleep(0.5)
    finally:
        swarm.close()
    finals = {n: _final(swarm, n) for n in names}
    slow = finals["sampler-slow"]
    assert slow["paused_behind_s"] > 0, (slow, seen, swarm.logs())  # it stopped generating while behind
    assert any(int(m[1]) > 1 for m in map(PAUSED_BEHIND.match, seen["sampler-slow"]) if m), seen
    assert "paused: " in _log(swarm, "sampler-slow") and "versions behind" in _log(swarm, "sampler-slow")
    assert len(_versions(swarm.root / "sampler-slow")) >= 3  # and went on following
    for n, f in finals.items():  # no batch began more than max_lag behind the newest version it knew of
        assert f["gen_lag_max"] <= 1, (n, f)
    quick = [finals[n] for n in names[:2]]
    assert max(f["batches_deferred"] for f in quick) >= 1, quick  # the learner did say busy
    assert max(f["paused_busy_s"] for f in quick) > 0, quick  # and they waited instead of piling up batches
    assert any(s.startswith("paused: learner busy (") for n in names[:2] for s in seen[n]), seen
    for n in names:
        assert "Traceback" not in _log(swarm, n), n
