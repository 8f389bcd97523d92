"""heterorl bench chaos, without processes: the seeded fault schedule, the commit-fault files, who writes, and
the invariant checker over synthetic learner and sampler files (clean lineages score 0; each kind of failure
is counted; torn, old-format and missing files are tolerated)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import types
from pathlib import Path

import pytest

from heterorl.bench import chaos, chaos_faults
from heterorl.bench.chaos_check import check, final_path, forks
from heterorl.bench.chaos_faults import (
    COMMIT_DELAY,
    CUT,
    KINDS,
    PAUSE_KILL_WRITER,
    Executor,
    Fault,
    Role,
    schedule,
    writer_index,
)
from heterorl.localswarm import Proc
from heterorl.protocol.storage.ledger import AcceptedLog

pytestmark = pytest.mark.fast

HONEST = bytes([1]) * 32
OTHER = bytes([2]) * 32


# ---- the schedule ----


def test_the_schedule_is_seeded_spaced_and_within_the_campaign():
    a = schedule(7, 600, 3, 3, netns=True, every=(15, 30))
    assert a == schedule(7, 600, 3, 3, netns=True, every=(15, 30))
    assert a != schedule(8, 600, 3, 3, netns=True, every=(15, 30))
    assert all(0 < f.at_s < 600 for f in a)
    for f, g in zip(a, a[1:], strict=False):
        assert g.at_s - f.at_s >= 15 and g.at_s >= f.at_s + f.span_s() + chaos_faults.MIN_GAP_S
    for f in a:
        if f.target.startswith(("learner:", "sampler:")):
            assert 0 <= int(f.target.split(":")[1]) < 3
        lo, hi = {
            "kill": chaos_faults.RESTART_AFTER_S,
            "pause": chaos_faults.PAUSE_S,
            "cut": chaos_faults.CUT_S,
            "pause-then-kill-writer": chaos_faults.RESTART_AFTER_S,
            "restart-all-learners": chaos_faults.RESTART_AFTER_S,
            "commit-delay": chaos_faults.COMMIT_DELAY_S,
            "commit-drop": (0, 0),
        }[f.kind]
        assert lo <= f.arg <= hi


def test_the_schedule_meets_every_kind_that_applies():
    assert {f.kind for f in schedule(1, 600, 3, 3, netns=True)} == set(KINDS)
    assert CUT not in {f.kind for f in schedule(1, 600, 3, 3, netns=False)}
    assert PAUSE_KILL_WRITER not in {f.kind for f in schedule(1, 600, 1, 3, netns=True)}
    first = schedule(3, 200, 2, 2, netns=True, every=(10, 15))[: len(KINDS)]
    assert len({f.kind for f in first}) == len(KINDS)  # no kind twice before every kind came once


@pytest.mark.parametrize("seed", [1, 2])
def test_the_acceptance_campaigns_inject_ten_faults_or_more(seed):
    assert len(schedule(seed, 600, 3, 3, netns=True)) >= 10


def test_a_campaign_with_no_learner_is_refused():
    with pytest.raises(ValueError):
        schedule(1, 60, 0, 2, netns=False)


# ---- applying: commit faults, who writes ----


def _executor(tmp_path: Path, n: int = 2) -> Executor:
    roles = []
    for i in range(n):
        d = tmp_path / f"learner-{i}"
        d.mkdir()
        roles.append(Role(d.name, "learner", "", lambda: None, d))
    return Executor(types.SimpleNamespace(procs=[]), roles, say=lambda line: None)


def test_a_commit_fault_is_written_to_every_learner_and_withdrawn_once_one_took_it(tmp_path):
    ex = _executor(tmp_path)
    ex.run([Fault(0.0, COMMIT_DELAY, "learners", 2.5)])
    files = [tmp_path / f"learner-{i}" / chaos_faults.FAULT_FILE for i in range(2)]
    assert [json.loads(f.read_text()) for f in files] == [{"kind": "delay", "s": 2.5}] * 2
    assert ex.applied[0].ended is None  # not over until a learner took it
    files[1].unlink()  # learner-1 writes: it took the fault
    ex.poll()
    assert not files[0].exists()  # the copy no one took is withdrawn
    a = ex.applied[0]
    assert "taken by learner-1" in a.note and a.ended == pytest.approx(time.time() + 2.5, abs=1)


def test_a_commit_fault_no_one_takes_is_withdrawn_by_the_next_or_in_time(tmp_path, monkeypatch):
    ex = _executor(tmp_path)
    ex.run([Fault(0.0, chaos_faults.COMMIT_DROP, "learners", 0.0), Fault(0.0, COMMIT_DELAY, "learners", 1.0)])
    assert "not taken before the next one" in ex.applied[0].note and ex.applied[1].ended is None
    assert json.loads((tmp_path / "learner-0" / chaos_faults.FAULT_FILE).read_text())["kind"] == "delay"
    monkeypatch.setattr(chaos_faults, "COMMIT_FAULT_WAIT_S", 0.0)
    ex.settle()
    assert not list(tmp_path.glob(f"*/{chaos_faults.FAULT_FILE}")) and "not taken in" in ex.applied[1].note
    assert ex.fault_ends() == [ex.applied[0].ended, ex.applied[1].ended]


def test_a_fault_on_a_process_that_is_down_is_skipped(tmp_path):
    ex = _executor(tmp_path)
    ex.run([Fault(0.0, "kill", "learner:1", 1.0)])
    assert ex.applied[0].skipped and ex.fault_ends() == []


def test_the_writer_is_the_newest_writer_row_not_followed_by_a_restart_or_a_fresh_heartbeat(tmp_path):
    dirs = [tmp_path / n for n in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    keys = ["aa" * 32, "bb" * 32, "cc" * 32]
    view = tmp_path / "view.json"
    assert writer_index(dirs, keys, view) is None
    _rows(dirs[0], [{"event": "writer", "term": 1, "first_version": 1, "time": 100.0}])
    _rows(dirs[1], [{"event": "writer", "term": 2, "first_version": 9, "time": 200.0}])
    assert writer_index(dirs, keys, view) == 1
    _rows(dirs[1], [{"event": "state", "how": "start", "term": 2, "version": 3, "state": "x", "time": 300}])
    assert writer_index(dirs, keys, view) == 0  # b restarted; a's row is the newest left
    hb = {"timestamp": time.time(), "stats": {"lineage/writer": 1.0}}
    view.write_text(json.dumps({"peers": {keys[2]: hb, keys[1]: {"timestamp": 0, "stats": {}}}}))
    assert writer_index(dirs, keys, view) == 2  # a fresh heartbeat saying it writes


class _Sleepers:
    """Real stand-in processes (``sh`` sleeping, each in its own session, as the peers are), and their roles;
    ``exit_code``: a role whose process exits at once with it instead."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.started = tmp_path, []

    def role(self, name: str, kind: str, exit_code: int | None = None) -> Role:
        d = self.tmp_path / name
        d.mkdir(exist_ok=True)
        script = "sleep 30" if exit_code is None else f"exit {exit_code}"

        def start():
            p = Proc(name, [], d / "log", wrap=["sh", "-c", script, "sh"])
            self.started.append(p)
            return p

        return Role(name, kind, "", start, d)

    def close(self) -> None:
        for p in self.started:
            p.kill()


@pytest.fixture
def sleepers(tmp_path):
    s = _Sleepers(tmp_path)
    yield s
    s.close()


def _stopped(p) -> bool:
    return Path(f"/proc/{p.p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_kills_pauses_and_restarts_act_on_the_process_groups(sleepers, tmp_path):
    roles = [sleepers.role(n, "learner") for n in ("l0", "l1")] + [sleepers.role("s0", "sampler")]
    ex = Executor(types.SimpleNamespace(procs=[]), roles, say=lambda line: None)
    ex.start_all()
    first = {r.name: r.proc for r in roles}
    _rows(roles[1].state_dir, [{"event": "writer", "term": 1, "first_version": 1, "time": time.time()}])
    ex.run([Fault(0.0, "kill", "sampler:0", 0.1)])
    assert first["s0"].p.returncode == -9 and roles[2].proc is not first["s0"] and roles[2].proc.alive()
    paused: list[bool] = []
    sleep = ex.sleep
    ex.sleep = lambda s: (sleep(s), paused.append(_stopped(roles[0].proc)))  # stopped as it ends?
    ex.run([Fault(0.0, "pause", "learner:0", 0.2)])
    assert any(paused) and not _stopped(roles[0].proc) and roles[0].proc is first["l0"]  # paused, resumed
    paused.clear()
    ex.run([Fault(0.0, PAUSE_KILL_WRITER, "writer", 0.1)])
    assert "l1 (writer), l0 paused first" in ex.applied[2].note and first["l1"].p.returncode == -9
    assert (
        any(paused) and roles[1].proc.alive() and roles[0].proc is first["l0"] and not _stopped(roles[0].proc)
    )
    ex.sleep = sleep
    ex.run([Fault(0.0, chaos_faults.RESTART_ALL, "learners", 0.1)])
    assert all(r.proc.alive() for r in roles) and roles[0].proc is not first["l0"]
    assert ex.exits == [] and len(ex.fault_ends()) == 4


def test_a_process_that_exits_on_its_own_is_recorded_and_started_again_a_few_times(sleepers):
    role = sleepers.role("l0", "learner", exit_code=3)
    ex = Executor(types.SimpleNamespace(procs=[]), [role], say=lambda line: None)
    ex.start_all()
    deadline = time.monotonic() + 20
    while role.proc is not None and time.monotonic() < deadline:
        ex.sleep(0.2)
    assert [e["code"] for e in ex.exits] == [3] * (chaos_faults.MAX_CRASH_RESTARTS + 1)
    assert [e["restarted"] for e in ex.exits][-1] is False and role.proc is None


# ---- the checker ----


def _rows(d: Path, rows: list[dict], torn: str = "") -> None:
    with (d / "lineage.jsonl").open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write(torn)


def _manifest(d: Path, version: int, body: bytes) -> str:
    m = d / "chunks" / "manifests"
    m.mkdir(parents=True, exist_ok=True)
    (m / f"{version:012d}.msg").write_bytes(body)
    return hashlib.sha256(body).hexdigest()


def _ledger(d: Path, applied: dict[str, int | None], author: bytes = HONEST, strikes: int = 0) -> None:
    log = AcceptedLog(d / "accepted.sqlite")
    for b, step in applied.items():
        log.accept(bytes.fromhex(b), author, 0, b"x", time.time())
        if step == -1:
            log.drop([bytes.fromhex(b)], "test", time.time())
        elif step is not None:
            log.mark_applied([bytes.fromhex(b)], step)
    log.save_author(author, {"strikes": strikes, "banned": None})
    log.close()


def _commit(term, version, parent, state, batches, role="writer", writer="ab") -> dict:
    return {
        "event": "commit",
        "term": term,
        "version": version,
        "parent_version": version - 1,
        "parent_state": parent,
        "state": state,
        "batches": batches,
        "writer": writer,
        "role": role,
        "time": 1000.0 + version,
    }


B = [f"{i:02x}" * 8 for i in range(10)]  # batch ids (hex)


def _clean_swarm(tmp_path: Path) -> tuple[list[Path], list[Path]]:
    """Two learners, one sampler: versions 1..3 written by learner w, checked by member m."""
    w, m, s = (tmp_path / n for n in ("learner", "learner-1", "sampler-0"))
    for d in (w, m, s):
        d.mkdir()
    digests = {v: _manifest(w, v, b"manifest %d" % v) for v in (1, 2, 3)}
    for v in (2, 3):  # the member's store and the sampler's hold the same signed bytes
        _manifest(m, v, b"manifest %d" % v)
        _manifest(s, v, b"manifest %d" % v)
    commits = [
        _commit(1, 1, "s0", "s1", B[0:2]),
        _commit(1, 2, "s1", "s2", B[2:4]),
        _commit(1, 3, "s2", "s3", []),
    ]
    _rows(
        w,
        [
            {"event": "state", "term": 0, "version": 0, "state": "s0", "how": "start", "time": 999.0},
            {"event": "writer", "term": 1, "first_version": 1, "time": 999.5},
        ]
        + [
            r
            for c in commits
            for r in (
                c,
                {
                    "event": "published",
                    "term": 1,
                    "version": c["version"],
                    "manifest": digests[c["version"]],
                    "state": c["state"],
                    "time": c["time"],
                },
            )
        ],
    )
    _rows(
        m,
        [{**c, "role": "member"} for c in commits]
        + [
            {"event": "checked", "version": v, "manifest": digests[v], "agree": True, "time": 1005.0}
            for v in (1, 2, 3)
        ],
    )
    with (s / "versions.jsonl").open("w") as f:
        for v in (1, 2, 3):
            f.write(json.dumps({"version": v, "time": 1000.0 + v, "manifest": digests[v]}) + "\n")
    _ledger(w, {B[0]: 1, B[1]: 1, B[2]: 2, B[3]: 2, B[4]: None, B[5]: -1})
    _ledger(m, {B[5]: None}, author=OTHER)
    return [w, m], [s]


def test_a_clean_lineage_breaks_no_invariant(tmp_path):
    learners, samplers = _clean_swarm(tmp_path)
    r = check(learners, samplers, [HONEST.hex()], fault_ends=[1001.5])
    assert r.invariants == {"forks": 0, "honest_strikes": 0, "trained_twice": 0, "disagreements": 0}
    assert r.versions_published == 3 and r.versions_after_last_fault == 2  # versions 2, 3
    info = r.info
    assert info["takeovers"] == 1 and info["commits_per_learner"] == {"learner": 3, "learner-1": 3}
    assert info["final_path_commits"] == 3 and info["batches_trained_on_path"] == 4
    # B[4] is pending everywhere and not on the path: lost; B[5] is dropped at one learner: not lost
    assert info["batches_accepted"] == 6 and info["batches_lost"] == 1 and info["batches_dropped"] == 1
    assert check(learners, samplers, [HONEST], fault_ends=[]).versions_after_last_fault == 3


def test_a_version_named_by_two_manifests_is_a_fork_wherever_it_is_seen(tmp_path):
    learners, samplers = _clean_swarm(tmp_path)
    _manifest(samplers[0], 2, b"another manifest 2")  # the sampler's store holds another signed v2
    with (samplers[0] / "versions.jsonl").open("a") as f:
        f.write(json.dumps({"version": 3, "time": 2000.0, "manifest": "ff" * 32}) + "\n")
    r = check(learners, samplers, [HONEST], fault_ends=[])
    assert r.invariants["forks"] == 2 and sorted(r.info["forked_versions"]) == [2, 3]
    assert forks([(1, "a"), (1, "a"), (2, "b")]) == {}


def test_strikes_and_bans_against_honest_samplers_count_others_do_not(tmp_path):
    learners, samplers = _clean_swarm(tmp_path)
    log = AcceptedLog(learners[1] / "accepted.sqlite")
    log.save_author(HONEST, {"strikes": 2, "banned": "forged"})
    log.ban(HONEST, "forged", time.time())
    log.save_author(OTHER, {"strikes": 5})
    log.ban(OTHER, "hostile", time.time())
    log.close()
    assert check(learners, samplers, [HONEST], fault_ends=[]).invariants["honest_strikes"] == 3


def test_a_batch_in_two_commits_of_the_final_lineage_is_trained_twice_a_dead_branch_is_not(tmp_path):
    learners, samplers = _clean_swarm(tmp_path)
    # version 4 trains B[0] again (on the final path); a branch from s2 that no published state leads
    # through trains B[2] again (not on it)
    _rows(learners[0], [_commit(2, 4, "s3", "s4", [B[0], B[6]]), _commit(2, 3, "s2", "s3x", [B[2]])])
    _rows(learners[0], [{"event": "published", "term": 2, "version": 4, "manifest": "", "state": "s4"}])
    r = check(learners, samplers, [HONEST], fault_ends=[])
    assert r.invariants["trained_twice"] == 1 and r.info["trained_twice_ids"] == [B[0]]
    assert r.info["final_path_commits"] == 4


def test_the_final_lineage_follows_any_learners_edges_back_to_a_state_no_commit_made():
    commits = [_commit(1, 5, "a", "b", ["1"]), _commit(1, 6, "b", "c", ["2"]), _commit(3, 7, "c", "d", ["3"])]
    published = [{"event": "published", "version": 7, "state": "d", "time": 3}]
    assert [c["version"] for c in final_path(commits, published)] == [7, 6, 5]
    unknown = {"event": "published", "version": 8, "state": "", "time": 4}  # its learner knew no state
    assert [c["version"] for c in final_path(commits, [*published, unknown])] == [7, 6, 5]
    assert final_path(commits, []) == []
    loop = [_commit(1, 1, "x", "y", []), _commit(1, 2, "y", "x", [])]  # a cycle ends the walk
    assert len(final_path(loop, [{"version": 2, "state": "x"}])) == 2


def test_disagreements_split_commits_failed_checks_and_a_published_state_not_committed(tmp_path):
    learners, samplers = _clean_swarm(tmp_path)
    _rows(
        learners[1],
        [
            {**_commit(1, 2, "s1", "s2-other", B[2:4]), "role": "member"},  # (a)
            {"event": "checked", "version": 3, "manifest": "", "agree": False},
        ],
    )  # (b)
    _rows(
        learners[0], [{"event": "published", "term": 1, "version": 1, "manifest": "", "state": "zz"}]
    )  # (c)
    _rows(learners[0], [{"event": "published", "term": 1, "version": 3, "state": ""}])  # a state not known
    r = check(learners, samplers, [HONEST], fault_ends=[])
    assert r.info["disagreement_counts"] == {
        "commit_states": 1,
        "checks_failed": 1,
        "published_unlike_commit": 2,
    }
    assert r.invariants["disagreements"] == 4  # the split (1, 2) also makes its published state unlike one


def test_torn_old_format_and_missing_files_are_tolerated(tmp_path):
    learners, samplers = _clean_swarm(tmp_path)
    _rows(
        learners[0],
        [{"version": 9, "published": True, "time": 5.0}, {"version": 9, "agree": False}],
        torn='{"event": "commit", "term": 1, "vers',
    )
    (learners[1] / "accepted.sqlite").write_bytes(b"not a database")
    empty = tmp_path / "never-started"
    r = check([*learners, empty], [*samplers, tmp_path / "gone"], [HONEST], fault_ends=[])
    assert all(v == 0 for v in r.invariants.values()) and r.versions_published == 3
    assert r.info["ledgers_unreadable"] == ["learner-1"]


def test_the_table_fails_a_campaign_on_any_invariant_or_no_version_after_the_faults():
    result = {
        "faults": 3,
        "fault_kinds": {"kill": 3},
        "versions_after_last_fault": 2,
        "versions_published": 9,
        "invariants": {"forks": 0, "crashed": 0},
        "info": {"exits": []},
    }
    lines, failed = chaos.table(result)
    assert not failed and lines[-1] == "PASS" and "faults survived: 3 (kill 3)" in lines[0]
    assert chaos.table({**result, "invariants": {"forks": 1, "crashed": 0}})[1]
    assert chaos.table({**result, "versions_after_last_fault": 0})[1]


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    chaos.add_arguments(ap)
    return ap.parse_args(list(argv))


def test_shaped_links_need_root_and_namespaces(monkeypatch, capsys):
    monkeypatch.setattr(chaos.os, "geteuid", lambda: 1000)
    assert chaos.run_from_args(_args("--link-mbit", "100")) == 2
    assert "--link-mbit needs root" in capsys.readouterr().err
    monkeypatch.setattr(chaos.os, "geteuid", lambda: 0)
    assert chaos.run_from_args(_args("--link-mbit", "100", "--no-netns")) == 2
    assert chaos.run_from_args(_args("--fault-every-s", "30", "15")) == 2
    assert chaos.run_from_args(_args("--learners", "0")) == 2
