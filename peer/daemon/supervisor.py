"""Who watches a peer's background work: every asyncio task and worker thread a role runs through its
:class:`~.runtime.PeerRuntime` is named and supervised here.

One that raises, or returns while the peer runs (background work runs until the peer leaves), is a failure:
logged at ERROR with its name (and traceback), kept as the peer's :attr:`Supervisor.failure` (the first one),
and the stop event is set, so the role's loop ends, the peer leaves in order and ``heterorl peer`` exits
non-zero saying why; a service manager (systemd, docker ``--restart``) then restarts it. A task cancelled by
its owner (the runtime when the peer leaves, a role cancelling its own task) ended as asked: no failure. A
task that ends in a CancelledError it was not asked for (an inner future cancelled under it) is a failure.

Why not an ``asyncio.TaskGroup``: its first failure cancels every sibling at once, but a peer leaving in
order still needs some of them (the sampler's sender drains its outbox while it leaves); the tasks are
started from the role's thread at different times, onto a loop the node owns; and threads are not tasks.
So each task and thread is wrapped on its own, and a failure only sets the stop event.

The stop event is a :class:`StopEvent`: setting it (a signal, a failure, the peer leaving) also sets every
:class:`Wakeup` made from it, so a thread waiting for a producer's signal is never stuck behind a stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

RETURNED = "returned while the peer was running (it is to run until the peer leaves)"


class StopEvent(threading.Event):
    """A peer's stop event: :meth:`set` also sets every :class:`Wakeup` made from it and calls every callback
    given to :meth:`on_set`."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], object]] = []
        self._link_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._link_lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` (on the setting thread; it must not block) whenever this is set (now, if it
        already is): e.g. close a queue a thread waits on."""
        with self._link_lock:
            self._callbacks.append(callback)
        if self.is_set():
            callback()

    def link(self, event: threading.Event) -> None:
        """Set ``event`` whenever this is set (now, if it already is)."""
        self.on_set(event.set)


class Wakeup:
    """One waiting thread's wake-up: producers on any thread call :meth:`set` (a version prepared, a batch
    acknowledged); the stop event sets it too. The waiter calls :meth:`clear` *before* it looks at what it
    waits for, then :meth:`wait`: a signal that comes in between is kept, none is lost."""

    def __init__(self, stop: StopEvent) -> None:
        self.stop = stop
        self._event = threading.Event()
        stop.link(self._event)

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout: float | None = None, *, stoppable: bool = True) -> bool:
        """Until :meth:`set` (True) or ``timeout`` seconds (False; None: no timeout). ``stoppable``: return
        at once while the stop event is set. False while leaving, when it stays set: then a producer's signal
        (or a spurious wake, should it be set again) or the timeout ends the wait."""
        if stoppable and self.stop.is_set():
            return True
        return self._event.wait(timeout)


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a piece of background work failed: ``kind`` task or thread, its name, the reason in words."""

    kind: str
    name: str
    reason: str

    def __str__(self) -> str:
        return f"background {self.kind} '{self.name}' failed: {self.reason}"


class BackgroundFailure(RuntimeError):
    """The peer stopped because a background task or thread failed (:class:`Failure`); it left in order."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def describe(e: BaseException) -> str:
    """``OperationalError: disk I/O error``: the exception's type and message, as a log line says it."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class Supervisor:
    """Runs a peer's background tasks (:meth:`task`, wrapping a coroutine for the node's loop) and threads
    (:meth:`start_thread`) and reports their failures (module docstring)."""

    def __init__(self, stop: StopEvent) -> None:
        self.stop = stop
        self.failure: Failure | None = None  # the first one
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def fail(self, kind: str, name: str, reason: str, exc: BaseException | None = None) -> None:
        """Record a failure (the first one is the peer's reason), log it at ERROR and set the stop event."""
        failure = Failure(kind, name, reason)
        with self._lock:
            if self.failure is None:
                self.failure = failure
        log.error("%s", failure, exc_info=exc)
        self.stop.set()

    async def task(self, name: str, coro: Coroutine[Any, Any, T], *, forever: bool = True) -> T:
        """Await ``coro`` in the current task (named ``name``), reporting a failure. ``forever``: it is to run
        until the peer leaves, so returning before the stop event is set is a failure too."""
        current = asyncio.current_task()
        if current is not None:
            current.set_name(name)
        try:
            result = await coro
        except asyncio.CancelledError:
            if current is None or not current.cancelling():  # not asked: something under it was cancelled
                self.fail("task", name, "cancelled without being asked (an awaited future was cancelled)")
            raise
        except BaseException as e:
            self.fail("task", name, describe(e), e)
            raise
        if forever and not self.stop.is_set():
            self.fail("task", name, RETURNED)
        return result

    def start_thread(self, name: str, fn: Callable[[], object], *, forever: bool = True) -> threading.Thread:
        """Run ``fn()`` in a daemon thread named ``name``, reporting a failure. ``forever``: it is to run
        until the peer leaves (watch the stop event, return once it is set); returning before is a failure."""

        def run() -> None:
            try:
                fn()
            except BaseException as e:
                self.fail("thread", name, describe(e), e)
                return
            if forever and not self.stop.is_set():
                self.fail("thread", name, RETURNED)

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()
        return thread

    def join_threads(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds in all for the threads started here to end; the names of those still
        running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]
