"""The sampler's stop rule as a decision table: a snapshot of the sampler and the rule's memory in, whether
to generate (and if not why, in words, and when only the clock would change that) out; and its shell's pause
accounting and logging. Pure logic: no sampler, no clock but the shell's."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from heterorl.peer.daemon import stop_rule
from heterorl.peer.daemon.stop_rule import Decision, Limits, Memory, SamplerView, StopRule, decide, lag

pytestmark = pytest.mark.fast

LIMITS = Limits(max_lag=1, publish_every=1, max_pending=4)
# holding the newest version, nothing fetched, no word from the learner, an empty outbox: generate
READY = SamplerView(
    held=5,
    newest=5,
    fetching=None,
    retry_in=0.0,
    last_refused=None,
    busy_replies=0,
    other_outcomes=0,
    busy_for=0.0,
    sender_state="idle",
    outbox=0,
)


def view(**over) -> SamplerView:
    return dataclasses.replace(READY, **over)


def test_holding_the_newest_version_with_room_in_the_outbox_it_generates():
    assert decide(READY, Memory(), LIMITS) == Decision(None, "", None, Memory())


@pytest.mark.parametrize(
    "over, state",
    [
        ({}, "waiting for a checkpoint"),
        ({"fetching": 0}, "fetching version 0"),
        ({"last_refused": 0}, "waiting for a checkpoint (refused version 0)"),
    ],
)
def test_before_the_first_checkpoint_it_waits_for_the_follower(over, state):
    d = decide(view(held=None, newest=-1, **over), Memory(), LIMITS)
    assert (d.wait, d.state, d.recheck_in, d.paused) == ("checkpoint", state, None, False)


@pytest.mark.parametrize(
    "newest, publish_every, max_lag, behind",
    [(6, 1, 1, None), (7, 1, 1, 2), (7, 2, 1, None), (9, 2, 1, 2), (100, 1, -1, None), (6, 1, 0, 1)],
)
def test_more_than_max_lag_published_versions_behind_it_pauses(newest, publish_every, max_lag, behind):
    v = view(newest=newest)
    d = decide(v, Memory(), Limits(max_lag, publish_every, 4))
    assert lag(v, publish_every) == (newest - 5) // publish_every
    if behind is None:  # -1: never
        assert d.wait is None
    else:
        assert d.wait == "behind" and d.paused and d.state.startswith(f"paused: {behind} versions behind (")


@pytest.mark.parametrize(
    "over, doing, recheck_in",
    [
        ({"fetching": 8}, "fetching 8", None),  # the follower says when it is done
        ({"retry_in": 2.5}, "retry in 3 s", 2.5),  # the clock turns it into "about to fetch"
        ({}, "about to fetch 8", None),  # the follower says when the fetch begins
    ],
)
def test_a_pause_behind_says_what_the_follower_does_and_when_only_the_clock_changes_it(
    over, doing, recheck_in
):
    d = decide(view(newest=8, **over), Memory(), LIMITS)
    assert (d.state, d.recheck_in) == (f"paused: 3 versions behind ({doing})", recheck_in)


def test_a_busy_learner_pauses_it_until_another_word_or_an_empty_outbox():
    m = Memory()
    d = decide(view(busy_replies=1, busy_for=1.5, outbox=2), m, LIMITS)  # "busy, retry in 1.5 s"
    assert (d.wait, d.state, d.recheck_in) == ("busy", "paused: learner busy (retry in 2 s)", 1.5)
    d = decide(view(busy_replies=1, busy_for=0.0, outbox=2), d.memory, LIMITS)  # the time passed, no word yet
    assert (d.wait, d.state, d.recheck_in) == ("busy", "paused: learner busy (retrying)", None)
    d = decide(view(busy_replies=1, other_outcomes=1, outbox=1), d.memory, LIMITS)  # then an Ack
    assert d.wait is None and d.memory == Memory(False, (1, 1))
    d = decide(view(busy_replies=2, other_outcomes=1, busy_for=2.0, outbox=1), d.memory, LIMITS)
    assert d.wait == "busy"
    d = decide(view(busy_replies=2, other_outcomes=1, busy_for=1.0, outbox=0), d.memory, LIMITS)
    assert d.wait is None and not d.memory.busy  # nothing of ours waits any more


def test_a_busy_word_and_a_later_ack_between_two_looks_is_no_pause():
    # both came since the last look: with the learner's wait already lifted (busy_for 0), the Ack was last
    assert decide(view(busy_replies=1, other_outcomes=1, outbox=1), Memory(), LIMITS).wait is None
    # the busy was last: its wait still runs
    assert (
        decide(view(busy_replies=1, other_outcomes=1, busy_for=1.0, outbox=1), Memory(), LIMITS).wait
        == "busy"
    )


def test_a_full_outbox_waits_for_the_learner_without_counting_a_pause():
    d = decide(view(outbox=4, sender_state="sending"), Memory(), LIMITS)
    assert (d.wait, d.state, d.recheck_in, d.paused) == (
        "outbox",
        "waiting for the learner (sending)",
        None,
        False,
    )
    assert decide(view(outbox=3), Memory(), LIMITS).wait is None


def test_the_first_reason_wins_and_the_memory_follows_the_learner_all_the_same():
    everything = view(held=None, newest=9, busy_replies=1, busy_for=1.0, outbox=4)
    d = decide(everything, Memory(), LIMITS)
    assert d.wait == "checkpoint" and d.memory == Memory(True, (1, 0))  # the busy word is not missed
    assert decide(dataclasses.replace(everything, held=5), Memory(), LIMITS).wait == "behind"
    assert decide(dataclasses.replace(everything, held=9), Memory(), LIMITS).wait == "busy"
    assert decide(view(outbox=4), Memory(), LIMITS).wait == "outbox"


def test_the_decision_is_pure():
    v, m = view(newest=8, busy_replies=3, busy_for=1.0, outbox=2), Memory(False, (1, 0))
    assert decide(v, m, LIMITS) == decide(v, m, LIMITS) and m == Memory(False, (1, 0))


def test_the_shell_counts_paused_seconds_per_kind_and_logs_each_pause_once(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(stop_rule.time, "monotonic", lambda: now[0])
    rule = StopRule(LIMITS)
    waits: list[float | None] = []

    def wait(timeout):  # the sampler's wake-up: here the clock moves 2 s per wake
        waits.append(timeout)
        now[0] += 2.0

    caplog.set_level(logging.DEBUG, "heterorl.peer.daemon.sampler")
    behind = rule.decide(view(newest=8, fetching=8))
    for _ in range(3):
        rule.wait(behind, wait)
    busy = rule.decide(view(busy_replies=1, busy_for=1.0, outbox=1))
    rule.wait(busy, wait)
    rule.wait(rule.decide(view(busy_replies=1, other_outcomes=1, outbox=4)), wait)  # an Ack; a full outbox
    assert rule.paused_s == {"behind": 6.0, "busy": 2.0} and waits == [None, None, None, 1.0, None]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.INFO, "paused: 3 versions behind (fetching 8)"),
        (logging.INFO, "resumed generating after 6.0 s paused (behind)"),
        (logging.INFO, "paused: learner busy (retry in 1 s)"),
        (logging.INFO, "resumed generating after 2.0 s paused (learner busy)"),
    ]
    caplog.clear()
    rule.wait(behind, wait)  # again within the minute: at DEBUG only
    rule.resume()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]
