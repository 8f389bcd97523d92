"""The supervisor on its own (no node, no network): a background task or thread that raises, or returns while
the peer runs, is logged at ERROR with its name, kept as the peer's reason and sets the stop event; a task
cancelled by its owner, or a thread that returns once the peer is stopping, ended as asked. Wake-ups: a
signal is never lost between clear() and wait(), and the stop event wakes every waiter."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading

import pytest

from heterorl.peer.daemon.supervisor import (
    RETURNED,
    BackgroundFailure,
    StopEvent,
    Supervisor,
    Wakeup,
)

pytestmark = pytest.mark.fast

DEADLINE_S = 60.0  # generous: these finish in milliseconds; the deadline only turns a hang into a failure


@pytest.fixture
def sup() -> Supervisor:
    return Supervisor(StopEvent())


def _run(sup: Supervisor, name: str, coro, **kw):
    """Run ``sup.task(name, coro)`` as its own task on a fresh loop; its result, or what it raised."""

    async def go():
        return await asyncio.create_task(sup.task(name, coro, **kw))

    return asyncio.run(asyncio.wait_for(go(), DEADLINE_S))


def test_a_task_that_raises_is_logged_with_its_name_and_traceback_and_stops_the_peer(sup, caplog):
    async def sender():
        raise sqlite3.OperationalError("disk I/O error")

    with pytest.raises(sqlite3.OperationalError):  # the task's own outcome is kept, too
        _run(sup, "trajectory sender", sender())
    reason = "background task 'trajectory sender' failed: OperationalError: disk I/O error"
    assert sup.stop.is_set() and str(sup.failure) == reason
    assert str(BackgroundFailure(sup.failure)) == reason
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage() == reason and record.exc_info is not None  # with its traceback
    assert "in sender" in caplog.text  # the traceback reaches into the failed coroutine


def test_a_task_that_returns_while_the_peer_runs_is_a_failure_unless_it_may(sup):
    async def done():
        return 7

    assert _run(sup, "one job", done(), forever=False) == 7
    assert sup.failure is None and not sup.stop.is_set()
    assert _run(sup, "heartbeat", done()) == 7
    assert str(sup.failure) == f"background task 'heartbeat' failed: {RETURNED}" and sup.stop.is_set()


def test_a_task_that_returns_once_the_peer_is_stopping_ended_as_asked(sup):
    async def done():
        return None

    sup.stop.set()
    _run(sup, "heartbeat", done())
    assert sup.failure is None


def test_a_task_cancelled_by_its_owner_is_no_failure(sup):
    async def go():
        task = asyncio.create_task(sup.task("checkpoint follower", asyncio.Event().wait()))
        await asyncio.sleep(0)  # it runs, and waits
        assert task.get_name() == "checkpoint follower"
        task.cancel()  # as the runtime does when the peer leaves
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(go(), DEADLINE_S))
    assert sup.failure is None and not sup.stop.is_set()


def test_a_cancellation_the_task_was_not_asked_for_is_a_failure(sup):
    async def victim():
        fut = asyncio.get_running_loop().create_future()
        fut.get_loop().call_soon(fut.cancel)  # something under the task is cancelled; the task is not
        await fut

    with pytest.raises(asyncio.CancelledError):
        _run(sup, "trajectory sender", victim())
    assert sup.failure is not None and "cancelled without being asked" in str(sup.failure)
    assert sup.stop.is_set()


def test_a_thread_that_raises_is_a_failure_and_the_first_is_the_peers_reason(sup, caplog):
    sup.start_thread("publisher", lambda: 1 / 0).join(DEADLINE_S)
    first = "background thread 'publisher' failed: ZeroDivisionError: division by zero"
    assert str(sup.failure) == first and sup.stop.is_set()
    sup.start_thread("batch assembler", lambda: [][0]).join(DEADLINE_S)
    assert str(sup.failure) == first  # the first failure stays the reason; the next is logged all the same
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        first,
        "background thread 'batch assembler' failed: IndexError: list index out of range",
    ]
    assert all(r.exc_info is not None for r in errors)


def test_a_thread_that_returns_while_the_peer_runs_is_a_failure_unless_it_may(sup):
    sup.start_thread("one job", lambda: None, forever=False).join(DEADLINE_S)
    assert sup.failure is None and not sup.stop.is_set()
    sup.start_thread("batch assembler", lambda: None).join(DEADLINE_S)
    assert str(sup.failure) == f"background thread 'batch assembler' failed: {RETURNED}" and sup.stop.is_set()


def test_threads_that_return_once_the_peer_stops_are_no_failure_and_are_joined(sup):
    started = [sup.start_thread(f"worker {i}", sup.stop.wait) for i in range(3)]
    assert [t.name for t in started] == ["worker 0", "worker 1", "worker 2"]
    sup.stop.set()
    assert sup.join_threads(DEADLINE_S) == [] and sup.failure is None


def test_joining_names_the_threads_that_did_not_end(sup):
    release = threading.Event()
    sup.start_thread("stuck", release.wait, forever=False)
    sup.start_thread("quick", lambda: None, forever=False)
    assert sup.join_threads(0) in (["stuck"], ["stuck", "quick"])  # "quick" may not have ended yet
    release.set()
    assert sup.join_threads(DEADLINE_S) == [] and sup.failure is None


def test_a_wakeup_keeps_a_signal_given_between_clear_and_wait():
    w = Wakeup(StopEvent())
    w.clear()
    w.set()  # a producer, after the waiter cleared and before it waits
    assert w.wait(DEADLINE_S) is True
    w.clear()
    assert w.wait(0) is False  # nothing since


def test_the_stop_event_wakes_every_waiter_and_every_later_wait():
    stop = StopEvent()
    waiters = [Wakeup(stop) for _ in range(3)]
    woken: list[bool] = []

    def wait(w: Wakeup) -> None:
        w.clear()
        woken.append(w.wait())  # no timeout: only a signal or the stop ends it

    threads = [threading.Thread(target=wait, args=(w,)) for w in waiters]
    for t in threads:
        t.start()
    stop.set()
    for t in threads:
        t.join(DEADLINE_S)
    assert woken == [True] * 3
    late = Wakeup(stop)  # made, or cleared, after the stop: returns at once
    late.clear()
    assert late.wait() is True


def test_a_wait_that_the_stop_may_not_end_waits_for_a_producer():
    stop = StopEvent()
    w = Wakeup(stop)
    stop.set()
    w.clear()  # leaving: the stop is set and stays set
    assert w.wait(0, stoppable=False) is False
    w.set()
    assert w.wait(DEADLINE_S, stoppable=False) is True


def test_the_stop_event_calls_back_when_set_and_at_once_when_already_set():
    stop, calls = StopEvent(), []
    stop.on_set(lambda: calls.append("before"))
    assert calls == []
    stop.set()
    assert calls == ["before"]
    stop.on_set(lambda: calls.append("after"))  # registered once stopped: called at once
    assert calls == ["before", "after"]
