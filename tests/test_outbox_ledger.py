"""The sampler's Outbox and the learner's AcceptedLog: queueing, backoff, caps, persistence, kill safety."""

import hashlib
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from heterorl.protocol.storage import ledger as ledger_mod
from heterorl.protocol.storage import outbox as outbox_mod
from heterorl.protocol.storage.ledger import AcceptedLog, LedgerItem
from heterorl.protocol.storage.outbox import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    MAX_RETRY_AFTER_S,
    Outbox,
    backoff_ceiling,
)

pytestmark = pytest.mark.fast  # in `make test-fast`


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class MaxRng:
    """Stands in for random.Random: always the top of the range, and remembers the ranges asked for."""

    def __init__(self) -> None:
        self.ranges: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.ranges.append((a, b))
        return b


def bid(i: int) -> bytes:
    return b"batch-%04d" % i


# -- outbox ------------------------------------------------------------------------------------------------


def test_put_due_ack_reject_roundtrip(tmp_path):
    clock = Clock()
    with Outbox(tmp_path / "o.db", clock=clock) as ob:
        assert ob.next_due_in() is None
        for i in range(4):
            assert ob.put(bid(i), b"x" * (i + 1), policy_version=i) == []
        assert ob.put(bid(0), b"other", 99) == []  # already queued: no-op
        assert len(ob) == 4 and ob.bytes() == 1 + 2 + 3 + 4
        due = ob.due(16)
        assert [it.batch_id for it in due] == [bid(i) for i in range(4)]
        assert due[0].data == b"x" and due[0].policy_version == 0 and due[0].attempts == 0
        assert due[3].created_at == clock.t == due[3].next_attempt_at
        assert [it.batch_id for it in ob.due(2)] == [bid(0), bid(1)]
        assert ob.due(-1) == []  # a negative limit is not "unlimited"
        assert ob.next_due_in() == 0.0

        assert ob.ack(bid(1)) is True
        assert ob.ack(bid(1)) is False
        assert ob.reject(bid(2), "bad reward " + "!" * 5000) is True
        assert ob.reject(bid(2), "again") is False
        assert [it.batch_id for it in ob.due()] == [bid(0), bid(3)]
        (rej,) = ob.rejections()
        assert rej.batch_id == bid(2) and rej.reason.startswith("bad reward") and rej.at == clock.t
        assert len(rej.reason) == outbox_mod.MAX_REASON_CHARS
        stats = ob.stats()
        assert stats["outbox/items"] == 2 and stats["outbox/bytes"] == 1 + 4
        assert stats["outbox/acked"] == 1 and stats["outbox/rejected"] == 1 and stats["outbox/dropped"] == 0
        with pytest.raises(ValueError):
            ob.put(b"", b"data", 0)


def test_retry_backoff_full_jitter_bounds(tmp_path):
    clock, rng = Clock(), MaxRng()
    with Outbox(tmp_path / "o.db", clock=clock, rng=rng) as ob:
        ob.put(bid(0), b"data", 0)
        for attempt in range(12):
            ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)
            delay = ob.retry(bid(0))
            assert rng.ranges[-1] == (0.0, ceiling)
            assert delay == ceiling
            assert ob.due() == []  # not due until the delay has passed
            assert ob.next_due_in() == pytest.approx(ceiling)
            clock.t += ceiling - 1e-3
            assert ob.due() == []
            clock.t += 1e-3
            (item,) = ob.due()
            assert item.attempts == attempt + 1
        assert rng.ranges[-1][1] == BACKOFF_CAP_S  # capped
        assert ob.stats()["outbox/retries"] == 12
    assert backoff_ceiling(10**9) == BACKOFF_CAP_S  # huge attempt counts neither overflow nor exceed the cap

    # a real rng: every delay lies in [0, ceiling] and they are not all the same (jitter)
    with Outbox(tmp_path / "r.db", clock=clock, rng=random.Random(7)) as ob:
        ob.put(bid(1), b"data", 0)
        delays = []
        for attempt in range(1, 30):
            delay = ob.retry(bid(1))
            assert 0.0 <= delay <= backoff_ceiling(attempt)
            delays.append(delay)
        assert len(set(delays)) == len(delays)
        assert ob.retry(b"not-queued") == 0.0


def test_retry_after_honoured_and_clamped(tmp_path):
    clock, rng = Clock(), MaxRng()
    with Outbox(tmp_path / "o.db", clock=clock, rng=rng) as ob:
        ob.put(bid(0), b"data", 0)
        assert ob.retry(bid(0), retry_after_s=7.5) == 7.5
        assert rng.ranges == []  # the learner's hint is used exactly, no jitter
        clock.t += 7.4
        assert ob.due() == [] and ob.next_due_in() == pytest.approx(0.1)
        clock.t += 0.1
        assert [it.batch_id for it in ob.due()] == [bid(0)]
        assert ob.retry(bid(0), retry_after_s=-5.0) == 0.0
        assert ob.retry(bid(0), retry_after_s=1e12) == MAX_RETRY_AFTER_S
        assert ob.retry(bid(0), retry_after_s=float("inf")) == MAX_RETRY_AFTER_S
        with pytest.raises(ValueError):
            ob.retry(bid(0), retry_after_s=float("nan"))
        clock.t += MAX_RETRY_AFTER_S
        (item,) = ob.due()
        assert item.attempts == 4  # the NaN call changed nothing


def test_retry_all_now_cuts_the_backoff_short(tmp_path):
    clock, rng = Clock(), MaxRng()
    with Outbox(tmp_path / "o.db", clock=clock, rng=rng) as ob:
        for i in range(3):
            ob.put(bid(i), b"data", 0)
        for _ in range(5):
            ob.retry(bid(0))
        ob.retry(bid(1), retry_after_s=30.0)
        assert [it.batch_id for it in ob.due()] == [bid(2)]
        assert ob.retry_all_now() == 2
        due = ob.due()
        assert [it.batch_id for it in due] == [bid(0), bid(1), bid(2)] and ob.next_due_in() == 0.0
        assert due[0].attempts == 5  # the backoff resumes where it was if this attempt fails too


def test_caps_drop_oldest_and_return_ids(tmp_path):
    with Outbox(tmp_path / "o.db", max_items=3, max_bytes=100, clock=Clock()) as ob:
        assert [ob.put(bid(i), b"x" * 10, 0) for i in range(3)] == [[], [], []]
        assert ob.put(bid(3), b"x" * 10, 0) == [bid(0)]
        assert ob.put(bid(4), b"x" * 10, 0) == [bid(1)]
        assert [it.batch_id for it in ob.due()] == [bid(2), bid(3), bid(4)]
        # bytes cap: 30 queued + 90 > 100, so the two oldest go
        assert ob.put(bid(5), b"y" * 90, 0) == [bid(2), bid(3)]
        assert [it.batch_id for it in ob.due()] == [bid(4), bid(5)] and ob.bytes() == 100
        assert ob.stats()["outbox/dropped"] == 4
        with pytest.raises(ValueError):
            ob.put(bid(6), b"z" * 101, 0)
        assert len(ob) == 2
    # reopening with smaller caps drops the oldest too
    with Outbox(tmp_path / "o.db", max_items=1, clock=Clock()) as ob:
        assert [it.batch_id for it in ob.due()] == [bid(5)]
        assert ob.stats()["outbox/dropped"] == 5


def test_outbox_reopen_keeps_everything(tmp_path):
    clock = Clock()
    path = tmp_path / "sub" / "o.db"  # parent directories are created
    ob = Outbox(path, clock=clock, rng=MaxRng())
    for i in range(5):
        ob.put(bid(i), b"payload-%d" % i, policy_version=10 + i)
    ob.retry(bid(1))
    ob.retry(bid(2), retry_after_s=30.0)
    ob.ack(bid(3))
    ob.reject(bid(4), "stale")
    before = ob.stats()
    ob.close()
    ob.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        len(ob)

    with Outbox(path, clock=clock) as ob2:
        assert ob2.stats() == before
        clock.t += 3600
        items = {it.batch_id: it for it in ob2.due()}
        assert sorted(items) == [bid(0), bid(1), bid(2)]
        assert items[bid(1)].attempts == 1 and items[bid(1)].next_attempt_at == 1000.0 + BACKOFF_BASE_S
        assert items[bid(2)].next_attempt_at == 1030.0 and items[bid(2)].policy_version == 12
        assert items[bid(0)].data == b"payload-0"
        assert [r.reason for r in ob2.rejections()] == ["stale"]


def test_wrong_file_type_is_refused(tmp_path):
    AcceptedLog(tmp_path / "ledger.db").close()
    Outbox(tmp_path / "outbox.db").close()
    with pytest.raises(RuntimeError, match="not this kind of store"):
        Outbox(tmp_path / "ledger.db")
    with pytest.raises(RuntimeError, match="not this kind of store"):
        AcceptedLog(tmp_path / "outbox.db")

    (tmp_path / "junk.db").write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(RuntimeError, match="not a usable sqlite file"):
        Outbox(tmp_path / "junk.db")

    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(RuntimeError, match="not this kind of store"):
        AcceptedLog(foreign)
    conn = sqlite3.connect(foreign)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # left untouched, not made WAL
    conn.close()

    conn = sqlite3.connect(tmp_path / "outbox.db")
    conn.execute(f"PRAGMA user_version={outbox_mod.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="unknown schema version"):
        Outbox(tmp_path / "outbox.db")
    assert outbox_mod.APPLICATION_ID != ledger_mod.APPLICATION_ID


def test_stores_use_wal_and_full_sync(tmp_path):
    for store in (Outbox(tmp_path / "o.db"), AcceptedLog(tmp_path / "l.db")):
        with store:
            assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


# -- ledger ------------------------------------------------------------------------------------------------


def test_ledger_accept_and_duplicates(tmp_path):
    with AcceptedLog(tmp_path / "l.db") as lg:
        assert not lg.seen(bid(0))
        assert lg.accept(bid(0), b"alice", 3, b"frame-0", 12.5) is True
        assert lg.accept(bid(0), b"mallory", 9, b"other", 99.0) is False  # first copy wins
        assert lg.seen(bid(0)) and not lg.seen(bid(1))
        assert lg.get(bid(0)) == LedgerItem(bid(0), b"alice", 3, b"frame-0", 12.5, None)
        assert lg.get(bid(1)) is None
        assert lg.count() == 1 and lg.applied_count() == 0
        assert lg.stats() == {
            "ledger/accepted": 1,
            "ledger/duplicates": 1,
            "ledger/applied": 0,
            "ledger/pending": 1,
            "ledger/dropped": 0,
            "ledger/bytes": 7,
        }
        with pytest.raises(ValueError):
            lg.accept(b"", b"alice", 0, b"x", 0.0)


def test_ledger_mark_applied_and_pending(tmp_path):
    with AcceptedLog(tmp_path / "l.db") as lg:
        for i in range(6):
            lg.accept(bid(i), b"a", i, b"d%d" % i, float(i))
        assert [it.batch_id for it in lg.pending()] == [bid(i) for i in range(6)]
        # unknown and repeated ids are not counted
        assert lg.mark_applied([bid(0), bid(1), b"unknown", bid(1)], step=1) == 2
        assert lg.mark_applied([bid(1)], step=5) == 0  # already applied: step unchanged
        assert lg.mark_applied(iter([bid(2), bid(3)]), step=2) == 2
        assert lg.mark_applied([bid(4)], step=3) == 1
        assert [it.batch_id for it in lg.pending()] == [bid(5)]
        assert lg.applied_ids() == [bid(i) for i in range(5)]
        assert lg.applied_ids(step=1) == [bid(0), bid(1)] and lg.applied_ids(step=5) == []
        assert lg.applied_count() == 5
        with pytest.raises(ValueError):
            lg.mark_applied([bid(5)], step=-1)

        # learner restarts from its checkpoint at step 1: work of steps 2 and 3 must be replayed
        replay = lg.pending(applied_after=1)
        assert [it.batch_id for it in replay] == [bid(2), bid(3), bid(4), bid(5)]  # oldest first
        assert all(it.applied_step is None for it in replay) and replay[0].data == b"d2"
        assert lg.applied_ids() == [bid(0), bid(1)]
        assert lg.stats()["ledger/pending"] == 4 and lg.stats()["ledger/applied"] == 2
        assert lg.pending(applied_after=1) == replay  # idempotent
        assert lg.mark_applied([it.batch_id for it in replay], step=2) == 4
        assert lg.pending() == [] and lg.pending(applied_after=2) == []
        assert [it.batch_id for it in lg.pending(applied_after=0)] == [bid(i) for i in range(6)]


def test_ledger_prune_keeps_dedupe(tmp_path):
    path = tmp_path / "l.db"
    with AcceptedLog(path) as lg:
        for i in range(4):
            lg.accept(bid(i), b"a", 0, b"x" * 100, 0.0)
        lg.mark_applied([bid(0), bid(1)], step=1)
        lg.mark_applied([bid(2)], step=2)
        assert lg.prune_applied(before_step=2) == 2
        assert lg.prune_applied(before_step=2) == 0
        assert lg.stats()["ledger/bytes"] == 200
        assert lg.get(bid(0)).data == b"" and lg.get(bid(2)).data == b"x" * 100
        assert lg.seen(bid(0)) and lg.accept(bid(0), b"a", 0, b"x" * 100, 0.0) is False
        assert lg.count() == 4 and lg.applied_count() == 3
    with AcceptedLog(path) as lg:  # and after a reopen
        assert lg.seen(bid(1)) and lg.accept(bid(1), b"a", 0, b"y", 0.0) is False
        assert lg.stats()["ledger/duplicates"] == 2
        # a pruned batch cannot be replayed: it stays applied instead of coming back empty
        assert [it.batch_id for it in lg.pending(applied_after=0)] == [bid(2), bid(3)]
        assert lg.applied_ids() == [bid(0), bid(1)]


def test_ledger_knows_which_pending_batches_were_released_and_keeps_authors(tmp_path):
    """A restart holds again what no check vouched for: the ledger says which batches were released (or
    trained on, which implies it), and keeps each author's record."""
    path = tmp_path / "l.db"
    with AcceptedLog(path) as lg:
        for i in range(5):
            lg.accept(bid(i), b"a", 0, b"d", float(i))
        lg.mark_released([bid(0), bid(1), bid(0)])  # a repeat is harmless
        lg.mark_applied([bid(0)], step=3)
        lg.save_author(b"a", {"passed": 3, "strikes": 1})
        lg.save_author(b"b", {"passed": 0})
        lg.save_author(b"b", None)  # forgotten
    with AcceptedLog(path) as lg:
        flags = {it.batch_id: it.released for it in lg.pending(applied_after=1)}
        assert flags == {bid(0): True, bid(1): True, bid(2): False, bid(3): False, bid(4): False}
        assert lg.authors() == {b"a": {"passed": 3, "strikes": 1}}
        lg.mark_applied([bid(0), bid(1), bid(2)], step=2)
        lg.prune_applied(before_step=3)  # never replayed again: their released marks go
        assert {it.batch_id: it.released for it in lg.pending(applied_after=0)} == {
            bid(3): False,
            bid(4): False,
        }


def test_ledger_reopen_keeps_everything(tmp_path):
    path = tmp_path / "l.db"
    with AcceptedLog(path) as lg:
        for i in range(3):
            lg.accept(bid(i), b"author-%d" % i, i, b"frame-%d" % i, 100.0 + i)
        lg.mark_applied([bid(0)], step=7)
        lg.accept(bid(0), b"x", 0, b"", 0.0)
        before, pend = lg.stats(), lg.pending()
    with pytest.raises(RuntimeError, match="closed"):
        lg.seen(bid(0))
    with AcceptedLog(path) as lg:
        assert lg.stats() == before and lg.pending() == pend
        assert pend[0] == LedgerItem(bid(1), b"author-1", 1, b"frame-1", 101.0, None, False)
        assert lg.applied_ids(step=7) == [bid(0)]


def test_ledger_shared_between_threads(tmp_path):
    with AcceptedLog(tmp_path / "l.db") as lg:
        fresh: list[bool] = []
        errors: list[BaseException] = []

        def worker(offset: int) -> None:
            try:
                for i in range(15):  # overlapping ranges: ids 0..29, most offered twice
                    fresh.append(lg.accept(bid(offset + i), b"a", 0, b"d", 0.0))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k * 5,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum(fresh) == lg.count() == 30
        assert lg.stats()["ledger/duplicates"] == len(fresh) - 30


# -- durability under SIGKILL ------------------------------------------------------------------------------

_CHILD = r"""
import sys
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.outbox import Outbox

kind, path = sys.argv[1], sys.argv[2]
store = Outbox(path, max_items=10**9, max_bytes=1 << 40) if kind == "outbox" else AcceptedLog(path)
i = 0
while True:
    batch_id = b"batch-%08d" % i
    if kind == "outbox":
        store.put(batch_id, batch_id * 50, i)
    else:
        store.accept(batch_id, b"author", i, batch_id * 50, float(i))
    print(i, flush=True)  # only after the commit returned
    i += 1
"""


def _read_until(proc: subprocess.Popen, n_lines: int, timeout_s: float) -> bytes:
    buf = b""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    while buf.count(b"\n") < n_lines:
        left = deadline - time.monotonic()
        if left <= 0:
            lines = buf.count(b"\n")
            raise AssertionError(f"child printed only {lines} lines in {timeout_s}s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"child exited early: {proc.wait()} {proc.stderr.read().decode()}")
            buf += chunk
    return buf


@pytest.mark.parametrize("kind", ["outbox", "ledger"])
def test_sigkill_mid_way_loses_nothing_committed(tmp_path, kind):
    path = tmp_path / f"{kind}.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, kind, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out = _read_until(proc, 40, timeout_s=30.0)
        proc.send_signal(signal.SIGKILL)
        out += proc.stdout.read()  # lines printed between our last read and the kill
        assert proc.wait(timeout=10) == -signal.SIGKILL  # killed mid-way, not finished
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    printed = [int(line) for line in out.split(b"\n")[:-1]]  # complete lines only
    assert printed == list(range(len(printed))) and len(printed) >= 40

    ids = [b"batch-%08d" % i for i in printed]
    if kind == "outbox":
        with Outbox(path, max_items=10**9, max_bytes=1 << 40) as ob:
            items = {it.batch_id: it for it in ob.due(10**9)}
        assert len(items) in (len(ids), len(ids) + 1)  # at most the one whose line was not yet printed
        for b in ids:
            assert items[b].data == b * 50
    else:
        with AcceptedLog(path) as lg:
            assert lg.count() in (len(ids), len(ids) + 1)
            for i, b in zip(printed, ids, strict=True):
                assert lg.seen(b)
                assert lg.get(b) == LedgerItem(b, b"author", i, b * 50, float(i), None)


def test_ledger_drop_and_bans_survive_a_reopen(tmp_path):
    path = tmp_path / "accepted.sqlite"
    with AcceptedLog(path) as lg:
        for i in range(4):
            lg.accept(bid(i), b"mallory" if i % 2 else b"alice", 1, b"x", 1.0)
        lg.mark_applied([bid(1)], 1)  # already trained on: stays applied, not dropped
        assert lg.pending_of(b"mallory") == [bid(3)]
        assert lg.drop([bid(1), bid(3)], "author banned", 2.0) == 1
        lg.ban(b"mallory", "3 refused batches", 2.0)
        assert [it.batch_id for it in lg.pending()] == [bid(0), bid(2)]
    with AcceptedLog(path) as lg:  # a restart: the dropped batch is not replayed, the ban holds
        assert [it.batch_id for it in lg.pending(applied_after=0)] == [bid(0), bid(1), bid(2)]
        assert lg.bans() == {b"mallory": "3 refused batches"}
        assert lg.dropped()[bid(3)] == "author banned"
        assert lg.applied_count() == 0 and lg.stats()["ledger/dropped"] == 1


def test_a_batch_the_lineage_trained_elsewhere_is_dropped_here_and_never_replayed(tmp_path):
    """Several learner peers: a sampler whose Ack was lost resends a batch to another learner. Once this
    learner hears the lineage trained it (a Commit, or a state offer's window) with the same bytes, its own
    pending copy is dropped, and survives a restart dropped; its own applied batches stay applied. A commit
    naming one of its batches with other bytes drops nothing (no member names others' batches away)."""
    path = tmp_path / "accepted.sqlite"
    sha = lambda i: hashlib.sha256(b"x%d" % i).digest()  # noqa: E731
    with AcceptedLog(path) as lg:
        for i in range(4):
            lg.accept(bid(i), b"alice", 1, b"x%d" % i, 1.0)
        lg.mark_applied([bid(0)], 3)  # this learner's own part of version 3
        assert lg.record_lineage([(bid(0), sha(0)), (bid(5), sha(5))], 3, "trained at version 3") == []
        assert lg.record_lineage([(bid(1), sha(1)), (bid(6), sha(6))], 4, "trained at version 4") == [bid(1)]
        assert lg.record_lineage([(bid(1), sha(1))], 5, "again") == []  # heard twice: dropped once
        assert lg.record_lineage([(bid(2), b"\x00" * 32)], 5, "censored") == []  # other bytes: kept
        assert lg.in_lineage([bid(i) for i in range(7)]) == {bid(0), bid(1), bid(2), bid(5), bid(6)}
        window, start = lg.lineage_window(10)
        assert set(window) == {(bid(0), sha(0)), (bid(1), sha(1)), (bid(2), b"\x00" * 32), (bid(5), sha(5)),
                               (bid(6), sha(6))} and start == 0  # fmt: skip
        window, start = lg.lineage_window(2)  # the newest, whole versions: from version 5 on
        assert start == 5 and {b for b, _ in window} == {bid(2)}
    with AcceptedLog(path) as lg:  # a restart replays neither the applied nor the trained-elsewhere batch
        assert [it.batch_id for it in lg.pending()] == [bid(2), bid(3)]
        assert lg.dropped()[bid(1)] == "trained at version 4"
        assert lg.in_lineage([bid(1)]) == {bid(1)}
        # a resent copy that arrives after the lineage trained it is a duplicate: acked, never stored
        assert lg.seen(bid(6)) and not lg.seen(bid(7))


def test_a_joiner_keeps_what_the_lineage_trained_and_replays_what_only_an_abandoned_branch_trained(tmp_path):
    """adopt_lineage: the state taken holds the window's batches (from ``trained_from`` on) and no other.
    This learner's own: a pending copy of a trained batch is dropped; one it applied that the lineage also
    trained stays applied; one it applied at a version the window covers that the lineage did not train (a
    branch abandoned) is pending again and returned for replay; one applied before the window stays; one
    whose payload was pruned is counted lost. unapply_after: a learner resuming from its own save."""
    sha = lambda i: hashlib.sha256(b"x%d" % i).digest()  # noqa: E731
    with AcceptedLog(tmp_path / "accepted.sqlite") as lg:
        for i in range(6):
            lg.accept(bid(i), b"alice", 1, b"x%d" % i, 1.0)
        lg.mark_applied([bid(0)], 8)  # trained here and in the lineage
        lg.mark_applied([bid(1)], 9)  # trained here only: an abandoned branch
        lg.mark_applied([bid(2)], 3)  # before the window: assumed in the state
        lg.mark_applied([bid(4)], 9)  # trained here only, and pruned below
        lg.prune_applied(10)  # (as a save at 10 would: its payload is gone)
        lg.record_lineage([(bid(9), sha(9))], 9, "old table")  # forgotten: the window replaces it
        items, dropped, lost = lg.adopt_lineage(
            [(bid(0), sha(0)), (bid(3), sha(3)), (bid(7), sha(7))], 20, trained_from=5, reason="trained there"
        )
        assert dropped == [bid(3)] and lost == 2  # bid(1) and bid(4) were pruned by the save at 10
        assert items == []
        assert lg.in_lineage([bid(i) for i in range(10)]) == {bid(0), bid(3), bid(7)}
        window, start = lg.lineage_window(100)
        assert sorted(window) == [(bid(0), sha(0)), (bid(3), sha(3)), (bid(7), sha(7))] and start == 5
    with AcceptedLog(tmp_path / "b.sqlite") as lg:  # the same without pruning: replayed, not lost
        for i in range(3):
            lg.accept(bid(i), b"alice", 1, b"x%d" % i, 1.0)
        lg.mark_applied([bid(0)], 8)
        lg.mark_applied([bid(1)], 9)
        items, dropped, lost = lg.adopt_lineage([(bid(0), sha(0))], 20, trained_from=5, reason="there")
        assert [it.batch_id for it in items] == [bid(1)] and lost == 0 and dropped == []
        assert [it.batch_id for it in lg.pending()] == [bid(1), bid(2)]
        lg.mark_applied([bid(1)], 21)
        lg.record_lineage([(bid(1), sha(1))], 21, "trained")
        again = lg.unapply_after(20)  # resumed from a save at 20: version 21 is not in that state
        assert [it.batch_id for it in again] == [bid(1)] and lg.in_lineage([bid(1)]) == set()
