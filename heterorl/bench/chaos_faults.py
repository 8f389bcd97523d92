"""The fault campaign's faults (``heterorl bench chaos``): a seeded schedule, and the executor applying it.

:func:`schedule` is pure: from a seed it draws, every U(MIN, MAX) seconds, the next kind of fault from a
shuffled deck of every kind that applies (so a short campaign still meets each kind), a target and a length.
The :class:`Executor` applies them to a :class:`~heterorl.testing.swarm.Swarm`'s processes, each in its own
process group (a signal to the group reaches its libp2p daemon too):

- ``kill``: SIGKILL a learner's or sampler's group, start it again 1–3 s later on the same state dir;
- ``pause``: SIGSTOP a learner's or sampler's group for 3–15 s, then SIGCONT;
- ``pause-then-kill-writer``: SIGSTOP a learner that does not write for 3 s; as it resumes, SIGKILL the
  writer (started again 1–3 s later);
- ``cut`` (network namespaces only): a host's link down for 5–15 s;
- ``commit-drop`` / ``commit-delay``: a ``chaos-fault`` file in every learner's state dir, which the writer
  acts on at its next commit (with ``HETERORL_CHAOS=1``) and deletes; the copies no one took are removed;
- ``restart-all-learners``: SIGKILL every learner at once, start them all again 1–3 s later.

A process that exits outside a fault is recorded (its exit code and the tail of its log) and started again, at
most :data:`MAX_CRASH_RESTARTS` times. Each fault's start and end (wall clock) are recorded: the checker
counts the versions published after the last one ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from heterorl.protocol.storage.jsonlog import read_rows

KILL = "kill"
PAUSE = "pause"
PAUSE_KILL_WRITER = "pause-then-kill-writer"
CUT = "cut"
COMMIT_DROP = "commit-drop"
COMMIT_DELAY = "commit-delay"
RESTART_ALL = "restart-all-learners"
KINDS = (KILL, PAUSE, PAUSE_KILL_WRITER, CUT, COMMIT_DROP, COMMIT_DELAY, RESTART_ALL)

RESTART_AFTER_S = (1.0, 3.0)  # a killed process starts again this long after
PAUSE_S = (3.0, 15.0)
CUT_S = (5.0, 15.0)
COMMIT_DELAY_S = (1.0, 5.0)  # how long the writer holds a commit back
PAUSE_BEFORE_WRITER_KILL_S = 3.0
MIN_GAP_S = 5.0  # between one fault's nominal end and the next one's start, at least
EVERY_S = (15.0, 30.0)

FAULT_FILE = "chaos-fault"  # in a learner's state dir: what its next commit suffers
COMMIT_FAULT_WAIT_S = 30.0  # a commit fault no learner took in this long is withdrawn
POLL_S = 0.5  # how often the executor looks at its processes while it waits
MAX_CRASH_RESTARTS = 3  # a process that exits on its own is started again this many times, then left down
LOG_TAIL = 2000  # characters of a crashed process's log kept in the report
WRITER_FRESH_S = 30.0  # a heartbeat older than this says nothing about who writes now
WRITER_WAIT_S = 10.0  # pause-then-kill-writer looks this long for the writer before it picks a learner
# lineage.jsonl "state" rows after which a learner no longer writes (it started again, or took another's)
STATE_ENDS_WRITING = ("start", "restore", "offer")


@dataclasses.dataclass(frozen=True)
class Fault:
    at_s: float  # after the campaign's start
    kind: str
    target: str  # "learner:I", "sampler:I", "writer" (resolved when applied) or "learners"
    arg: float  # seconds: pause or cut length, restart delay, commit delay (0: commit-drop)

    def span_s(self) -> float:
        """Its nominal length, start to end."""
        return self.arg + (PAUSE_BEFORE_WRITER_KILL_S if self.kind == PAUSE_KILL_WRITER else 0.0)


def kinds_for(learners: int, samplers: int, netns: bool) -> list[str]:
    """The kinds of fault a campaign of this shape can suffer."""
    out = [k for k in KINDS if netns or k != CUT]
    return [k for k in out if learners > 1 or k != PAUSE_KILL_WRITER]


def schedule(
    seed: int,
    duration_s: float,
    learners: int,
    samplers: int,
    netns: bool,
    every: tuple[float, float] = EVERY_S,
) -> list[Fault]:
    """The faults of a campaign of ``duration_s`` seconds, in order: one every U(``every``) seconds (and at
    least :data:`MIN_GAP_S` after the previous one's nominal end), each kind once per round of a shuffled
    deck. The same arguments give the same list."""
    if learners < 1 or samplers < 0 or not 0 < every[0] <= every[1]:
        raise ValueError("a campaign needs a learner, samplers >= 0 and 0 < MIN <= MAX")
    rng = random.Random(seed)
    kinds = kinds_for(learners, samplers, netns)
    deck: list[str] = []
    out: list[Fault] = []
    t = rng.uniform(*every)
    while t < duration_s:
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        f = _draw(rng, round(t, 3), deck.pop(), learners, samplers)
        out.append(f)
        t = max(t + rng.uniform(*every), t + f.span_s() + MIN_GAP_S)
    return out


def _draw(rng: random.Random, at: float, kind: str, learners: int, samplers: int) -> Fault:
    def one() -> str:
        i = rng.randrange(learners + samplers)
        return f"learner:{i}" if i < learners else f"sampler:{i - learners}"

    if kind in (KILL, PAUSE, CUT):
        span = {KILL: RESTART_AFTER_S, PAUSE: PAUSE_S, CUT: CUT_S}[kind]
        return Fault(at, kind, one(), round(rng.uniform(*span), 2))
    if kind in (PAUSE_KILL_WRITER, RESTART_ALL):
        target = "writer" if kind == PAUSE_KILL_WRITER else "learners"
        return Fault(at, kind, target, round(rng.uniform(*RESTART_AFTER_S), 2))
    delay = round(rng.uniform(*COMMIT_DELAY_S), 2) if kind == COMMIT_DELAY else 0.0
    return Fault(at, kind, "learners", delay)


# ---- who writes ----


def writer_index(learner_dirs: Sequence[Path], learner_keys: Sequence[str], view_path: Path) -> int | None:
    """The learner that writes now, as best the files say: the newest of the learners' own ``writer`` rows
    in ``lineage.jsonl`` not followed by a restart or a state taken from another, and the coordinator's
    saved view (``view.json``: a fresh heartbeat with ``lineage/writer`` 1). None if neither says."""
    now = time.time()
    seen: list[tuple[float, int]] = []
    for i, d in enumerate(learner_dirs):
        last = None
        for r in read_rows(Path(d) / "lineage.jsonl"):
            if r.get("event") == "writer" or (
                r.get("event") == "state" and r.get("how") in STATE_ENDS_WRITING
            ):
                last = r
        if last is not None and last["event"] == "writer" and isinstance(last.get("time"), int | float):
            seen.append((float(last["time"]), i))
    with contextlib.suppress(OSError, ValueError, AttributeError):
        peers = json.loads(view_path.read_text()).get("peers", {})
        for key, p in peers.items():
            stats, stamp = p.get("stats") or {}, float(p.get("timestamp", 0))
            if key in learner_keys and stats.get("lineage/writer") == 1 and now - stamp < WRITER_FRESH_S:
                seen.append((stamp, list(learner_keys).index(key)))
    return max(seen)[1] if seen else None


# ---- applying faults ----


@dataclasses.dataclass
class Role:
    """One peer the campaign runs: ``start`` starts it (again) on its state dir, on its host."""

    name: str
    kind: str  # "learner", "sampler", or "coordinator" (watched, never a fault's target)
    host: str  # its network namespace host (its name), or "" without namespaces
    start: Callable[[], object]  # -> a heterorl.localswarm.Proc
    state_dir: Path
    proc: object | None = None
    down: bool = False  # a fault stopped it on purpose: its exit is no crash
    crashes: int = 0


@dataclasses.dataclass
class Applied:
    """A fault as applied: when (wall clock) it started and ended, and what it did."""

    fault: Fault
    started: float
    ended: float | None = None
    note: str = ""
    skipped: bool = False


@dataclasses.dataclass
class _CommitFault:
    applied: Applied
    files: list[Path]
    written: float
    delay: float


class Executor:
    """Applies a schedule to the swarm's processes; watches them for exits between faults."""

    def __init__(
        self,
        swarm,
        roles: Sequence[Role],
        lan=None,
        seed: int = 0,
        say: Callable[[str], None] = print,
        learner_keys: Sequence[str] = (),
        view_path: Path | None = None,
    ):
        self.swarm, self.lan, self.say = swarm, lan, say
        self.roles = {r.name: r for r in roles}
        self.learners = [r for r in roles if r.kind == "learner"]
        self.samplers = [r for r in roles if r.kind == "sampler"]
        self.rng = random.Random(f"chaos-executor-{seed}")  # choices made when applied (who is paused)
        self.learner_keys = list(learner_keys)
        self.view_path = view_path or Path("/nonexistent")
        self.applied: list[Applied] = []
        self.exits: list[dict] = []  # processes that exited outside a fault
        self._commit_faults: list[_CommitFault] = []
        self.t0 = time.monotonic()

    # ---- processes ----

    def start_all(self) -> None:
        for r in self.roles.values():
            self._start(r)

    def _start(self, r: Role) -> None:
        """Start it (again); one that cannot start (a coordinator that never says it is ready) is recorded as
        an exit and left down."""
        try:
            r.proc = r.start()
        except Exception as e:  # whatever stops a start: the campaign goes on, and says so
            r.proc = None
            self.exits.append(
                {
                    "name": r.name,
                    "code": None,
                    "at_s": self.elapsed(),
                    "restarted": False,
                    "log_tail": f"could not start: {e}"[-LOG_TAIL:],
                }
            )
            self.say(f"[{self.elapsed():7.1f} s] {r.name} could not start: {str(e)[:200]}")
        r.down = False

    def _kill(self, r: Role) -> bool:
        """SIGKILL its group and reap it; False if it was not running."""
        p = r.proc
        if p is None or not p.alive():
            return False
        r.down = True
        p.kill()  # SIGKILL to the process group, wait, close its log
        self._forget(p)
        return True

    def _signal(self, r: Role, sig: int) -> bool:
        p = r.proc
        if p is None or not p.alive():
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.p.pid, sig)
        return True

    def _forget(self, p) -> None:
        with contextlib.suppress(ValueError):
            self.swarm.procs.remove(p)

    def poll(self) -> None:
        """Note and restart a process that exited on its own; settle commit faults."""
        for r in self.roles.values():
            p = r.proc
            if p is None or r.down or p.p.poll() is None:
                continue
            code = p.p.returncode
            p.kill()  # its libp2p daemon may be left in its group; the exit is reaped already
            self._forget(p)
            tail = ""
            with contextlib.suppress(OSError):
                tail = p.log_path.read_text(errors="replace")[-LOG_TAIL:]
            r.crashes += 1
            again = r.crashes <= MAX_CRASH_RESTARTS
            self.exits.append(
                {"name": r.name, "code": code, "at_s": self.elapsed(), "restarted": again, "log_tail": tail}
            )
            self.say(
                f"[{self.elapsed():7.1f} s] {r.name} EXITED on its own (code {code}); "
                + ("started again" if again else "left down")
            )
            r.proc = None
            if again:
                self._start(r)
        self._settle_commit_faults()

    def sleep(self, s: float) -> None:
        end = time.monotonic() + max(0.0, s)
        while True:
            self.poll()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(POLL_S, left))

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ---- the campaign ----

    def run(self, faults: Sequence[Fault]) -> None:
        """Apply ``faults`` in order, each at its time after now (or as soon as the one before has ended)."""
        self.t0 = time.monotonic()
        for f in faults:
            self.sleep(f.at_s - self.elapsed())
            a = Applied(f, time.time())
            self.applied.append(a)
            self.say(f"[{self.elapsed():7.1f} s] {f.kind:<22} {f.target} ({f.arg:g} s)")
            try:
                self._apply(f, a)
            finally:
                if a.ended is None and f.kind not in (COMMIT_DROP, COMMIT_DELAY):
                    a.ended = time.time()
            what = "skipped" if a.skipped else "written" if a.ended is None else "done"
            self.say(f"[{self.elapsed():7.1f} s] {'':<22} {what}: {a.note}")

    def settle(self) -> None:
        """Wait until the last commit fault was taken (or withdrawn, after :data:`COMMIT_FAULT_WAIT_S`)."""
        while self._commit_faults:
            self.sleep(POLL_S)

    def finish(self) -> None:
        """Withdraw the commit faults no learner took."""
        for c in list(self._commit_faults):
            self._withdraw(c, "not taken by the end")

    def _apply(self, f: Fault, a: Applied) -> None:
        if f.kind in (KILL, PAUSE, CUT):
            r = self._role(f.target)
            if r.proc is None or not r.proc.alive():
                a.skipped, a.note = True, f"{r.name} (not running)"
                return
            a.note = r.name
            if f.kind == KILL:
                self._kill(r)
                self.sleep(f.arg)
                self._start(r)
            elif f.kind == PAUSE:
                self._pause(r, f.arg)
            else:
                if self.lan is None:
                    a.skipped, a.note = True, f"{r.name} (no network namespaces)"
                    return
                self.lan.cut(r.host)
                try:
                    self.sleep(f.arg)
                finally:
                    self.lan.restore(r.host)
        elif f.kind == PAUSE_KILL_WRITER:
            self._pause_kill_writer(f, a)
        elif f.kind == RESTART_ALL:
            for r in self.learners:
                self._kill(r)
            a.note = f"{len(self.learners)} learners"
            self.sleep(f.arg)
            for r in self.learners:
                self._start(r)
        elif f.kind in (COMMIT_DROP, COMMIT_DELAY):
            self._commit_fault(f, a)
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")

    def _role(self, target: str) -> Role:
        kind, _, i = target.partition(":")
        return (self.learners if kind == "learner" else self.samplers)[int(i)]

    def _pause(self, r: Role, seconds: float) -> None:
        self._signal(r, signal.SIGSTOP)
        try:
            self.sleep(seconds)
        finally:
            self._signal(r, signal.SIGCONT)

    def _pause_kill_writer(self, f: Fault, a: Applied) -> None:
        live = [r for r in self.learners if r.proc is not None and r.proc.alive()]
        if not live:
            a.skipped, a.note = True, "no learner running"
            return
        writer = self._writer(live, time.monotonic() + WRITER_WAIT_S)
        how = "writer"
        if writer is None:
            writer, how = self.rng.choice(live), "writer unknown: a random learner"
        members = [r for r in live if r is not writer]
        member = self.rng.choice(members) if members else None
        a.note = f"{writer.name} ({how}), {member.name if member else 'no member'} paused first"
        if member is not None:
            self._signal(member, signal.SIGSTOP)
            try:
                self.sleep(PAUSE_BEFORE_WRITER_KILL_S)
            finally:
                self._signal(member, signal.SIGCONT)
        self._kill(writer)
        self.sleep(f.arg)
        self._start(writer)

    def _writer(self, live: list[Role], deadline: float) -> Role | None:
        """The running learner that writes, looked for until ``deadline`` (a learner that just started may
        not have said so yet); None if none does."""
        while True:
            i = writer_index([r.state_dir for r in self.learners], self.learner_keys, self.view_path)
            if i is not None and self.learners[i] in live:
                return self.learners[i]
            if time.monotonic() >= deadline:
                return None
            self.sleep(1.0)

    def _commit_fault(self, f: Fault, a: Applied) -> None:
        for c in list(self._commit_faults):  # one at a time: they share the file
            self._withdraw(c, "not taken before the next one")
        body = {"kind": "drop"} if f.kind == COMMIT_DROP else {"kind": "delay", "s": f.arg}
        files = []
        for r in self.learners:
            path = r.state_dir / FAULT_FILE
            tmp = path.with_name(FAULT_FILE + ".tmp")
            tmp.write_text(json.dumps(body) + "\n")
            os.replace(tmp, path)  # a learner never reads half of it
            files.append(path)
        a.note = f"{len(files)} learners' {FAULT_FILE}"
        self._commit_faults.append(_CommitFault(a, files, time.monotonic(), f.arg))

    def _settle_commit_faults(self) -> None:
        for c in list(self._commit_faults):
            taken = [p for p in c.files if not p.exists()]
            if taken:
                c.applied.note += f"; taken by {taken[0].parent.name}"
                self._withdraw(c, "", ended=time.time() + c.delay)
            elif time.monotonic() - c.written > COMMIT_FAULT_WAIT_S:
                self._withdraw(c, f"not taken in {COMMIT_FAULT_WAIT_S:.0f} s")

    def _withdraw(self, c: _CommitFault, why: str, ended: float | None = None) -> None:
        for p in c.files:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if why:
            c.applied.note += f"; {why}"
        c.applied.ended = ended or time.time()
        self.say(f"[{self.elapsed():7.1f} s] {c.applied.fault.kind:<22} {c.applied.note}")
        with contextlib.suppress(ValueError):
            self._commit_faults.remove(c)

    # ---- what happened ----

    def fault_ends(self) -> list[float]:
        return [a.ended or a.started for a in self.applied if not a.skipped]

    def records(self) -> list[dict]:
        return [
            {
                **dataclasses.asdict(a.fault),
                "started": a.started,
                "ended": a.ended,
                "note": a.note,
                "skipped": a.skipped,
            }
            for a in self.applied
        ]
