"""TrajectoryReceiver's counters read while its intake threads write them: ``counts()`` is one moment's
counters, copied under the receiver's lock."""

from __future__ import annotations

import collections
import sys
import threading

import pytest

from heterorl.protocol import Identity
from heterorl.protocol.net.trajectories import IntakeCounts, TrajectoryReceiver
from heterorl.protocol.storage.ledger import AcceptedLog

pytestmark = pytest.mark.fast

WRITERS = 3
FRAMES = 1500  # per writer


def unlocked_counts(recv: TrajectoryReceiver) -> IntakeCounts:
    """How the learner's heartbeat read them before counts(): attribute by attribute, without the lock."""
    return IntakeCounts(
        recv.accepted, recv.duplicates, recv.deferred, dict(recv.rejected), dict(recv.strikes)
    )


def _race(recv: TrajectoryReceiver, read) -> list[str]:
    """WRITERS threads feed the receiver malformed frames from new peers (each a refusal: a category count
    and a new author's strike, written together) while this thread reads; what it saw wrong."""
    go = threading.Barrier(WRITERS + 1)
    bad: list[str] = []

    def writer(w: int) -> None:
        go.wait()
        for i in range(FRAMES):
            recv.process(f"{w}-{i}", b"\x00not a batch")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    go.wait()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race shows within the run
    try:
        last = 0
        while any(t.is_alive() for t in threads) and len(bad) < 5:
            c = read(recv)
            refused, struck = sum(c.rejected.values()), sum(c.strikes.values())
            if refused != struck:
                bad.append(f"{refused} refusals but {struck} strikes")
            if refused < last:
                bad.append(f"refusals went back from {last} to {refused}")
            last = refused
            collections.Counter(c.strikes).most_common(3)  # the heartbeat's top offenders, off the copy
    finally:
        sys.setswitchinterval(old)
        for t in threads:
            t.join()
    return bad


@pytest.fixture
def receiver(tmp_path):
    with AcceptedLog(tmp_path / "accepted.sqlite") as ledger:
        recv = TrajectoryReceiver(Identity.generate(), "counts", ledger)
        yield recv
        recv.close()


def test_counts_is_one_moment_while_intake_threads_write(receiver):
    assert _race(receiver, TrajectoryReceiver.counts) == []
    c = receiver.counts()
    assert c.rejected == {"malformed": WRITERS * FRAMES} and c.refused == WRITERS * FRAMES
    assert len(c.strikes) == WRITERS * FRAMES and set(c.strikes.values()) == {1}
    assert (c.accepted, c.duplicates, c.deferred) == (0, 0, 0)
    c.strikes.clear()  # a copy: the receiver's own counters are untouched
    assert len(receiver.counts().strikes) == WRITERS * FRAMES
    with pytest.raises(AttributeError):
        c.accepted = 1  # frozen


def test_the_old_attributes_and_stats_still_read(receiver):
    receiver.process("p", b"junk")
    assert receiver.rejected["malformed"] == 1 and receiver.strikes["peer:p"] == 1
    assert receiver.accepted == receiver.duplicates == receiver.deferred == 0
    assert receiver.stats()["net/batches_rejected"] == 1
