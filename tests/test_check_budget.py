"""The spot checks' share of the learner's time (peer/learner/budget.py) on its own, with a fake clock."""

from __future__ import annotations

import pytest

from heterorl.peer.learner.budget import (
    PROBATION_RETRY_MIN_S,
    RECORDED_WINDOW_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    WINDOW_S,
    CheckBudget,
    TimeBudget,
)

pytestmark = pytest.mark.fast


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_budget_starts_with_its_burst_and_accrues_its_share_of_the_clock():
    clock = FakeClock()
    b = TimeBudget(0.1, window_s=10.0, clock=clock)
    assert b.credit() == pytest.approx(1.0) and b.allows()  # 10 % of 10 s
    b.spend(1.5)  # one check overdraws it: a debt
    assert b.credit() == pytest.approx(-0.5) and not b.allows()
    assert b.wait_s() == pytest.approx(5.0)  # 0.5 s of debt at 0.1 s per second
    clock.now += 4.0
    assert not b.allows() and b.wait_s() == pytest.approx(1.0)
    clock.now += 1.5
    assert b.allows() and b.credit() == pytest.approx(0.05) and b.wait_s() == 0.0
    clock.now += 1000.0  # idle: the credit stops at the burst
    assert b.credit() == pytest.approx(1.0)
    assert b.spent_s == pytest.approx(1.5)


def test_over_any_span_the_checks_take_at_most_the_share_plus_the_burst_and_one_overdraft():
    clock = FakeClock()
    b = TimeBudget(0.05, window_s=WINDOW_S, clock=clock)
    check_s, span = 0.3, 600.0
    start = clock.now
    while clock.now - start < span:  # a check whenever it may start: a flood that never waits
        if b.allows():
            b.spend(check_s)
        clock.now += 0.01
    assert b.spent_s <= 0.05 * (span + WINDOW_S) + check_s
    assert b.spent_s >= 0.05 * span - check_s  # and it is not starved either


def test_the_clock_going_back_adds_no_credit():
    clock = FakeClock()
    b = TimeBudget(0.1, window_s=10.0, clock=clock)
    b.spend(1.0)
    clock.now -= 100.0
    assert b.credit() == pytest.approx(0.0) and not b.allows()


def test_a_share_of_zero_never_allows_and_bad_shares_are_refused():
    b = TimeBudget(0.0, clock=FakeClock())
    assert not b.allows() and b.wait_s() == float("inf")
    with pytest.raises(ValueError):
        TimeBudget(1.5)
    with pytest.raises(ValueError):
        TimeBudget(0.1, window_s=0)
    with pytest.raises(ValueError, match="probation share < share"):
        CheckBudget(0.05, 0.05)


def test_probation_has_its_own_share_and_a_flood_of_it_leaves_authors_with_a_record_theirs():
    clock = FakeClock()
    budget = CheckBudget(0.10, 0.04, window_s=10.0, clock=clock, recorded_window_s=10.0)
    # a flood of checks of authors without a record spends probation's credit (0.4 s) and no more
    ran = 0
    while budget.allows(probation=True):
        budget.spend(0.15, probation=True)
        ran += 1
    assert ran == 3 and budget.wait_s(probation=True) == pytest.approx(0.05 / 0.04)
    # authors with a record keep theirs: 0.06 of the clock, 0.6 s of burst
    assert budget.allows(probation=False)
    budget.spend(0.7, probation=False)
    assert not budget.allows(probation=False)
    clock.now += 1.0  # each gets its own share of the second back
    assert budget.probation.credit() == pytest.approx(-0.05 + 0.04)
    assert budget.recorded.credit() == pytest.approx(-0.1 + 0.06)
    stats = budget.stats()
    assert stats["trust/check_busy_probation"] == 1 and stats["trust/check_busy_recorded"] == 1
    assert stats["trust/check_probation_s"] == pytest.approx(0.45)


def test_all_checks_together_stay_within_the_check_share():
    clock = FakeClock()
    budget = CheckBudget(0.10, 0.05, window_s=WINDOW_S, clock=clock)
    span, spent = 300.0, 0.0
    start = clock.now
    while clock.now - start < span:  # both kinds wanted all the time
        for probation in (True, False):
            if budget.allows(probation):
                budget.spend(0.2, probation)
                spent += 0.2
        clock.now += 0.05
    assert spent <= 0.10 * (span + WINDOW_S) + 2 * 0.2


def test_a_batch_deferred_for_want_of_time_is_told_to_come_back_when_there_is_time_within_bounds():
    clock = FakeClock()
    budget = CheckBudget(0.10, 0.05, window_s=10.0, clock=clock, recorded_window_s=10.0)
    assert budget.retry_after_s(probation=False) == RETRY_MIN_S  # time now
    budget.spend(0.5 + 0.1, probation=True)  # 0.1 s of debt: 2 s at 5 %, but no sooner than the rate says
    assert budget.retry_after_s(probation=True) == PROBATION_RETRY_MIN_S
    budget.spend(0.5 + 0.4, probation=False)  # 0.4 s of debt at 5 %
    assert budget.retry_after_s(probation=False) == pytest.approx(8.0)
    budget.spend(100.0, probation=False)
    assert budget.retry_after_s(probation=False) == RETRY_MAX_S


def test_the_checks_of_authors_with_a_record_save_up_little_probations_enough_for_a_start():
    """Probation's burst lets samplers that start together earn their records at once; the other's is small:
    credit saved up while the learner waited would let its checks (and what they release to training) run
    at twice their share for a while."""
    clock = FakeClock()
    budget = CheckBudget(0.10, 0.05, clock=clock)
    clock.now += 3600.0
    assert budget.probation.credit() == pytest.approx(0.05 * WINDOW_S)
    assert budget.recorded.credit() == pytest.approx(0.05 * RECORDED_WINDOW_S)
    assert RECORDED_WINDOW_S < WINDOW_S
