"""The swarm as users run it: real coordinator, learner and sampler processes on 127.0.0.1.

Each process has its own go-libp2p daemon, DHT node and state directory; nothing is mocked. These runs take
tens of seconds each on 2 CPU cores (marked slow).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import psutil
import pytest

from heterorl.bench.throughput import swarm_window
from heterorl.localswarm import stop_all
from heterorl.protocol import load_or_create_identity
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.testing.hostile import BROKEN_SENDER_ERROR
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


@pytest.fixture
def swarm(tmp_path, tiny_model_dir):
    s = Swarm(tmp_path / "swarm", tiny_model_dir, eval_every=5)
    yield s
    s.close()


def _mean(xs):
    return sum(xs) / len(xs)


def _applied_once(swarm: Swarm) -> tuple[set[bytes], list[bytes]]:
    """Batch ids in the learner's final lineage, and any id that appears in two of its steps."""
    seen, twice = set(), []
    for row in swarm.metrics():
        for b in row["batches"]:
            bid = bytes.fromhex(b)
            if bid in seen:
                twice.append(bid)
            seen.add(bid)
    return seen, twice


def test_heterorl_local_learns_and_every_sampler_follows_the_checkpoints(tmp_path, tiny_model_dir):
    out = tmp_path / "local"
    steps = 90
    cmd = [sys.executable, "-m", "heterorl.cli", "local", "--samplers", "3", "--steps", str(steps)]
    cmd += ["--out", str(out), "--model", str(tiny_model_dir), "--no-view", "--lr", "5e-4"]
    cmd += ["--sampler-slowdown", "1", "1", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    curve = summary["reward_curve"]
    assert len(curve) == steps
    assert _mean(curve[-15:]) > _mean(curve[:15]) + 0.04, curve  # it learns (lr 5e-4: no early knock-back)
    assert summary["batches_rejected"] == 0 and summary["batches_accepted"] >= steps * 8 // 2
    assert sum(summary["staleness"].values()) == summary["batches_applied"]
    assert summary["staleness"]["0"] + summary["staleness"]["1"] < summary["batches_applied"]  # some stale
    assert set(summary["samplers"]) == {"sampler-0", "sampler-1", "sampler-2"}
    loaded = {name: s["versions_loaded"] for name, s in summary["samplers"].items()}
    # v1 needs batches sampled with v0, so some sampler began with v0; one whose start was slower may join at
    # whatever version is newest by then (as a volunteer joining mid-run does)
    assert min(v[0] for v in loaded.values() if v) == 0, loaded
    for name, versions in loaded.items():
        assert versions == sorted(set(versions)), (name, versions)  # only ever forward, each version once
        assert versions[-1] >= steps // 2, (name, versions)  # checkpoints reached every sampler, late too
    assert "learner updates" in done.stdout and "held-out eval of the current policy" in done.stdout
    assert [e[0] for e in summary["eval_curve"]] == [25, 50, 75]
    # a clean stop saves the last step, whatever learner.save_every_s: a restart redoes nothing
    assert (out / "learner" / "state" / "CURRENT").read_text().strip() == f"step-{steps:08d}"
    # the learner's per-step time accounting, which `heterorl bench throughput` reads
    rows = [json.loads(line) for line in (out / "learner" / "metrics.jsonl").read_text().splitlines()]
    waits, trains = [r["wait_s"] for r in rows], [r["train_s"] for r in rows]
    assert waits == sorted(waits) and trains == sorted(trains) and trains[-1] > 0
    # the held-out evaluation of the current policy, every learner.eval_every (25) updates
    evals = [r for r in rows if "eval/step" in r]
    assert [r["eval/step"] for r in evals] == [25, 50, 75] == [r["step"] for r in evals]
    assert all(0 < r["eval/sampled"] < 1 and 0 <= r["eval/greedy"] <= 1 for r in evals)
    window = swarm_window(rows, warmup=5)
    assert window["trajectories_per_s"] > 0 and 0 <= window["wait_frac"] <= 1
    assert 0 < window["train_frac"] <= 1 and window["wait_frac"] + window["train_frac"] <= 1.01


def test_churn_samplers_learner_and_coordinator_come_and_go(swarm):
    swarm.start_coordinator()
    run_id = swarm.ready["run_id"]
    learner = swarm.start_learner()
    s0, s1 = swarm.start_sampler("s0"), swarm.start_sampler("s1")
    swarm.wait_step(4)
    s0.kill()  # a volunteer vanishes without a goodbye; another one joins
    s2 = swarm.start_sampler("s2")
    swarm.wait_step(10)
    learner.kill()  # SIGKILL mid-run: it must resume from its own state
    at_kill = swarm.step()
    learner = swarm.start_learner()
    swarm.wait_step(at_kill + 5)
    swarm.coord.terminate()  # the run goes on without the coordinator
    t_stop, step_at_stop = time.time(), swarm.step()
    assert swarm.coord.p.wait(30) == 0
    saved = json.loads((swarm.root / "coordinator" / "view.json").read_text())
    swarm.wait_step(step_at_stop + 4)
    assert max(r["time"] for r in swarm.metrics()) > t_stop
    # a restarted coordinator (on another port: nobody can call it) resumes its view with the history kept,
    # rejoins through the peers it saw before and shows the run live again
    swarm.start_coordinator()
    assert swarm.ready["run_id"] == run_id
    view = swarm.view()
    kept = saved["reward_curve"]
    assert view["learner"]["reward_curve"][: len(kept)] == kept and len(view["peers"]) >= len(saved["peers"])
    deadline = time.time() + 90
    while time.time() < deadline and view["learner"].get("step", 0) <= step_at_stop:
        time.sleep(1)
        view = swarm.view()
    assert view["learner"]["step"] > step_at_stop, swarm.logs()  # fresh heartbeats, not the saved view
    assert view["learner"]["reward_curve"] and view["latest_version"] > step_at_stop
    # the learner's held-out evaluations reach the view through its heartbeats (eval_every = 5)
    evals = view["learner"]["eval_curve"]
    assert evals and all(e[0] % 5 == 0 and 0 < e[1] < 1 for e in evals), evals
    assert "rejoined the swarm through" in (swarm.root / "coordinator" / "coordinator.log").read_text()
    stop_all([learner, s1, s2])
    # exactly once: no batch applied twice in the final lineage, every applied id is in the ledger
    applied, twice = _applied_once(swarm)
    assert not twice
    with AcceptedLog(swarm.learner_dir / "accepted.sqlite") as ledger:
        ids = {i for i in ledger.applied_ids()}
        assert applied <= ids
        assert ledger.count() >= len(applied)
    authors = {a for r in swarm.metrics() for a in r["authors"]}
    s2_key = load_or_create_identity(swarm.root / "s2" / "peer.key")[0].public_key.hex()[:16]
    assert s2_key in authors  # the newcomer's data was used
    log = (swarm.learner_dir / "learner.log").read_text()
    assert "resumed from my own state" in log and "Traceback" not in log
    # its state is saved with the first version it publishes, then every save_every_s (300 s): killed ~10
    # versions later, it redoes those updates from the ledger as new versions, never signing a number twice
    assert "were published after my last save" in log
    steps = [r["step"] for r in swarm.metrics()]
    assert steps == sorted(set(steps))


def test_a_version_0_other_than_the_runspecs_initial_checkpoint_is_refused_once(swarm):
    swarm.start_coordinator()
    swarm.start_learner("--mode", "wrong-initial", module="heterorl.testing.hostile")  # signs a wrong v0
    swarm.start_sampler("s0")
    log = swarm.root / "s0" / "sampler.log"
    deadline = time.time() + 120
    while time.time() < deadline and "refused checkpoint version 0" not in _text(log):
        time.sleep(0.5)
    assert "version 0 does not match the RunSpec's initial checkpoint hash" in _text(log), swarm.logs()
    time.sleep(3)  # it checks for checkpoints every 0.5 s: the refused manifest is not fetched again
    assert _text(log).count("refused checkpoint version 0") == 1
    assert not (swarm.root / "s0" / "versions.jsonl").exists()  # never loaded: nothing sampled with it
    assert swarm.step() == 0


def test_a_peer_whose_libp2p_daemon_dies_exits_so_that_its_supervisor_restarts_it(swarm):
    swarm.start_coordinator()
    learner, sampler = swarm.start_learner(), swarm.start_sampler("s0")
    swarm.wait_step(2)
    logs = (swarm.root / "s0" / "sampler.log", swarm.learner_dir / "learner.log")
    for proc, log in zip((sampler, learner), logs, strict=True):
        daemons = [c for c in psutil.Process(proc.p.pid).children() if c.name() == "p2pd"]
        assert len(daemons) == 1, daemons
        daemons[0].kill()
        assert proc.p.wait(60) == 1  # not a hang, not a clean exit: a supervisor restarts it
        assert "ERROR heterorl.peer: the libp2p daemon died" in _text(log) and "Traceback" not in _text(log)


def test_a_sampler_whose_sender_dies_leaves_and_exits_non_zero_saying_why(swarm):
    # its sender raises a disk error after its first acknowledged batch: the sampler must not go on
    # generating (and heartbeating "waiting for the learner") forever, but leave and exit for its supervisor
    swarm.start_coordinator()
    swarm.start_learner()
    sampler = swarm.start_sampler("s0", "--mode", "broken-sender", module="heterorl.testing.hostile")
    assert sampler.p.wait(240) == 1, swarm.logs()
    log = _text(swarm.root / "s0" / "sampler.log")
    reason = f"background task 'trajectory sender' failed: OperationalError: {BROKEN_SENDER_ERROR}"
    assert f"ERROR heterorl.peer.daemon.supervisor: {reason}\nTraceback" in log, log[-3000:]
    assert "left: " in log  # it left in order: the role closed its outbox
    last = log.strip().splitlines()[-1]
    assert last.endswith(f"ERROR heterorl.peer: the sampler stopped: {reason}"), log[-3000:]
    final = json.loads((swarm.root / "s0" / "final_stats.json").read_text())
    assert final["batches_acked"] >= 1 and "before leaving" not in log  # no drain waiting on a dead sender


def test_a_restarted_coordinator_whose_known_peers_are_gone_says_so_once_and_serves(swarm):
    run_id = swarm.start_coordinator()["run_id"]
    assert swarm.coord.terminate() == 0
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = f"/ip4/127.0.0.1/tcp/{port}/p2p/QmYyhP8MhkfDABcNSjeiQjXcrUGJ5vYaKdQL94zvEq98YM"
    (swarm.root / "coordinator" / "known_peers.json").write_text(json.dumps([gone]))
    swarm.start_coordinator()
    time.sleep(12)  # it tries again every 5 s while it knows nobody
    log = _text(swarm.root / "coordinator" / "coordinator.log")
    assert log.count("none of the 1 peer(s) seen before answers") == 1, log[-2000:]
    assert swarm.coord.alive() and swarm.view()["run_id"] == run_id


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("modes", [("wrong-reward", "forged", "other-run", "foreign-prompt")])
def test_hostile_samplers_are_rejected_shown_and_do_not_stop_learning(swarm, modes):
    swarm.start_coordinator()
    swarm.start_learner()
    swarm.start_sampler("honest")
    keys = {}
    for m in modes:
        keys[m] = load_or_create_identity(swarm.root / m / "peer.key")[0].public_key.hex()
        swarm.start_sampler(m, "--mode", m, module="heterorl.testing.hostile")
    swarm.wait_step(12, timeout=240)
    deadline = time.time() + 60
    while time.time() < deadline:
        view = swarm.view()
        shown = {p["key"]: p for p in view["peers"]}
        if all(shown.get(k[:8], {}).get("rejected", 0) > 0 for k in keys.values()):
            break
        time.sleep(1)
    for m, k in keys.items():
        assert shown[k[:8]]["rejected"] > 0, (m, view["peers"], view["learner"])
    honest = load_or_create_identity(swarm.root / "honest" / "peer.key")[0].public_key.hex()
    assert shown[honest[:8]]["rejected"] == 0
    authors = {a for r in swarm.metrics() for a in r["authors"]}
    assert authors == {honest[:16]}  # nothing hostile entered training
    assert view["learner"]["rejected"] > 0
