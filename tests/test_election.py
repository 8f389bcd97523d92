"""Who writes a lineage, and while when (peer/learner/election.py): elect() as a pure function of one
learner's view, liveness on the receiver's own clock, and the writer's lease and reservation."""

from __future__ import annotations

import pytest

from heterorl.peer.learner.election import (
    FRESH_S,
    LEASE_S,
    MIN_LEAD,
    Lease,
    Liveness,
    Me,
    Seen,
    elect,
    lead,
)

pytestmark = pytest.mark.fast

A, B, C = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32  # A < B < C


def seen(key, *, fresh=True, term=0, writes=False, applied=0, reserved=None, leaving=False) -> Seen:
    return Seen(key, fresh, term, writes, applied, applied if reserved is None else reserved, leaving)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_learner_joins_the_live_writer_of_the_highest_term():
    view = [seen(A, term=3, writes=True, applied=40), seen(B, term=4, writes=True, applied=10)]
    d = elect(view, Me(C, applied=50, term=4, writing=False), view_live=True)
    assert (d.action, d.key) == ("join", B)  # the higher term, not the newer state
    stale = [seen(A, term=5, writes=True, fresh=False), seen(B, term=4, writes=True)]
    assert elect(stale, Me(C, 0, 5, False), True).key == B  # a writer whose heartbeat went stale is dead
    leaving = [seen(A, term=5, writes=True, leaving=True)]
    assert elect(leaving, Me(C, 0, 5, False), True).action == "write"  # it said it leaves: no wait for it


def test_with_no_live_writer_the_newest_state_writes_in_a_higher_term_above_every_reservation():
    view = [
        seen(A, applied=10),  # a lower key, an older state
        seen(B, term=7, writes=True, applied=30, reserved=52, fresh=False),  # the dead writer
    ]
    d = elect(view, Me(C, applied=30, term=6, writing=False, newest_known=31), view_live=True)
    assert d.action == "write" and d.term == 8  # above every term seen, the dead writer's too
    assert d.first_version == 53  # above what the dead writer reserved: nothing it signed is signed again
    assert elect(view, Me(A, 10, 7, False), True) == elect(view, Me(A, 10, 7, False), True)  # pure
    wait = elect([seen(A, applied=30)], Me(C, applied=30, term=0, writing=False), True)
    assert (wait.action, wait.key) == ("wait", A)  # the same state: the lower key writes
    newer = elect([seen(A, applied=29)], Me(C, applied=30, term=0, writing=False), True)
    assert newer.action == "write" and newer.first_version == 31  # the newest state writes


def test_a_learner_that_sees_no_one_change_never_elects_itself():
    view = [seen(A, term=2, writes=True, fresh=False, applied=9)]
    d = elect(view, Me(B, applied=9, term=2, writing=False), view_live=False)
    assert d.action == "wait" and "cut off" in d.reason


def test_a_writer_fenced_by_a_higher_term_or_a_lower_key_in_its_own_term_joins_it():
    me = Me(B, applied=20, term=5, writing=True)
    assert elect([seen(A, term=4, writes=True)], me, True).action == "keep"
    assert elect([seen(C, term=5, writes=True)], me, True).action == "keep"  # it wins the tie
    assert elect([seen(A, term=5, writes=True)], me, True).action == "join"
    assert elect([seen(C, term=6, writes=True)], me, True).key == C


def test_liveness_judges_by_this_learners_clock_whatever_the_senders_clock_says():
    clock = Clock()
    live = Liveness(clock)
    assert live.observe(A, stamp=5_000_000.0)  # a clock far ahead: only its changes count
    assert live.fresh(A)
    clock.t += FRESH_S - 1
    assert not live.observe(A, stamp=5_000_000.0)  # the same record again: no change
    assert live.fresh(A)
    clock.t += 2
    assert not live.fresh(A)  # unchanged for FRESH_S of our time: dead, even stamped in the future
    assert live.observe(A, stamp=5_000_000.5)
    assert live.fresh(A) and not live.fresh(B)
    live.forget([B])
    assert live.changed_at(A) is None


def test_a_lease_runs_from_a_confirmed_heartbeat_and_caps_versions_at_an_earlier_reservation():
    clock = Clock()
    lease = Lease(term=3, held=10, clock=clock)
    assert "lapsed" in lease.why_not(10)  # nothing confirmed yet
    lease.stored(started=clock.t, reserved=30)
    clock.t += 1
    lease.confirmed(looked=clock.t)  # the swarm saw it: the time lease runs
    assert lease.why_not(10) is None
    assert "reservation" in lease.why_not(11)  # ... but the reservation only from the next confirmation
    lease.stored(started=clock.t + 0.5, reserved=45)
    clock.t += 2
    lease.confirmed(looked=clock.t)
    assert lease.why_not(30) is None and "reservation" in lease.why_not(31)
    clock.t = 1000.0 + 1.5 + LEASE_S + 0.1  # the newest confirmed store began at 1001.5
    assert "lapsed" in lease.why_not(20)  # no heartbeat confirmed since: it stops
    lease.fence("a writer in term 4")
    lease.stored(clock.t, 99)
    lease.confirmed(clock.t + 1)
    assert "fenced" in lease.why_not(20)  # never again in this term


def test_the_lead_covers_a_few_heartbeats_at_the_writers_pace():
    assert lead(0.0, 2.0) == MIN_LEAD
    assert lead(10.0, 2.0) == 80  # 4 heartbeat intervals of 2 s at 10 versions/s
