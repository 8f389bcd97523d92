"""The learner's announce queue: one in flight, the newest next, failures retried, never a deadlock."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from heterorl.peer.daemon.announcer import Announcer

pytestmark = pytest.mark.fast  # in `make test-fast`


def _manifest(version: int) -> tuple[bytes, dict]:
    return f"m{version}".encode(), {"version": version, "total_size": 10, "chunk_hashes": [b"h"]}


class Starts:
    """Records each started announce; its future is completed by the test (or at once, if told so)."""

    def __init__(self, finish_at_once: BaseException | bool | None = None) -> None:
        self.started: list[tuple[int, concurrent.futures.Future]] = []
        self.finish_at_once = finish_at_once

    def __call__(self, raw: bytes, body: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(self.finish_at_once, BaseException):
            fut.set_exception(self.finish_at_once)
        elif self.finish_at_once:
            fut.set_result(None)
        self.started.append((body["version"], fut))
        return fut

    @property
    def versions(self) -> list[int]:
        return [v for v, _ in self.started]


def test_one_in_flight_and_only_the_newest_waits_behind_it():
    starts = Starts()
    a = Announcer(starts)
    for v in (1, 2, 3):
        a.announce(*_manifest(v))
    assert starts.versions == [1] and not a.idle()
    starts.started[0][1].set_result(None)
    assert starts.versions == [1, 3]  # 2 was superseded by 3 while 1 was in flight
    starts.started[1][1].set_result(None)
    assert a.idle() and a.announced == 2 and a.failures == 0


def test_a_failed_announce_is_retried_for_its_version_only():
    starts = Starts()
    a = Announcer(starts)
    a.announce(*_manifest(4))
    starts.started[0][1].set_exception(TimeoutError("DHT did not answer"))
    assert a.failures == 1 and a.idle()
    assert not a.retry_failed(5)  # the learner moved on: a newer publish will supersede it
    assert a.retry_failed(4) and starts.versions == [4, 4]
    assert not a.retry_failed(4)  # in flight now; not twice
    starts.started[1][1].set_result(None)
    assert a.announced == 1 and not a.retry_failed(4)


def test_a_failure_with_a_newer_version_queued_is_not_kept_for_retry():
    starts = Starts()
    a = Announcer(starts)
    a.announce(*_manifest(1))
    a.announce(*_manifest(2))
    starts.started[0][1].cancel()
    assert starts.versions == [1, 2] and not a.retry_failed(1)
    starts.started[1][1].set_result(None)
    assert a.idle() and a.announced == 1 and a.failures == 1


@pytest.mark.parametrize("outcome", [True, RuntimeError("refused")], ids=["succeeded", "failed"])
def test_an_announce_that_finishes_before_its_callback_is_added_does_not_deadlock(outcome):
    a = Announcer(Starts(finish_at_once=outcome))  # its done callback runs at once, in the caller's thread
    done = threading.Event()

    def publish_twice() -> None:
        a.announce(*_manifest(1))
        a.announce(*_manifest(2))
        done.set()

    threading.Thread(target=publish_twice, daemon=True).start()
    assert done.wait(5), "announce() deadlocked on its own lock"
    assert a.idle() and a.wait_idle(0.1)
    assert (a.announced, a.failures) == ((2, 0) if outcome is True else (0, 2))


def test_a_closing_node_is_a_failure_not_a_crash():
    def closed(raw: bytes, body: dict) -> concurrent.futures.Future:
        raise RuntimeError("node is closed")

    a = Announcer(closed)
    a.announce(*_manifest(7))
    assert a.failures == 1 and a.idle() and a.retry_failed(7) and a.failures == 2


def test_wait_idle_times_out_while_an_announce_hangs():
    starts = Starts()
    a = Announcer(starts)
    a.announce(*_manifest(1))
    assert not a.wait_idle(0.2)
    starts.started[0][1].set_result(None)
    assert a.wait_idle(0.2)


def test_wait_idle_wakes_when_the_announce_ends_in_another_thread():
    starts = Starts()
    a = Announcer(starts)
    a.announce(*_manifest(1))
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(a.wait_idle(60)), daemon=True)
    waiter.start()
    threading.Timer(0.2, starts.started[0][1].set_result, (None,)).start()  # the network loop finishes it
    waiter.join(30)  # notified, not left to its 60 s timeout (a missed wake would still end True, late)
    assert waited == [True]
