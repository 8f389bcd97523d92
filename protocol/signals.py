"""SIGTERM/SIGINT for the daemons (``heterorl peer``, ``heterorl coordinator``): no lock in the handler.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread is: inside
``threading.Event.set`` (which holds the event's lock), inside a logging call (which holds the handler's
lock). A handler that took either lock itself would wait forever for its own thread. So the handler here
does only lock-free work: it writes the signal's number to a self-pipe (``os.write`` on a non-blocking
pipe), and on a second signal it writes one line to stderr and calls ``os._exit(130)`` ("leave now", as
before). A daemon thread reads the pipe, logs the signal and calls ``on_stop`` (the stop event's ``set``),
taking whatever locks those need like any other thread.

No signal mask is touched: child processes (the libp2p daemon, vLLM's workers) inherit the mask of the
thread that starts them, and must still die on SIGTERM. The pipe's ends are not inherited by them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

SECOND_SIGNAL_EXIT = 130  # the exit status when a second signal says "leave now"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The installed handlers (:func:`install_stop_signals`); :meth:`close` puts the previous ones back."""

    def __init__(
        self,
        on_stop: Callable[[], object],
        log: logging.Logger,
        signals: Iterable[signal.Signals] = STOP_SIGNALS,
        kill_groups: list[int] | None = None,
    ) -> None:
        self.on_stop, self.log, self.kill_groups = on_stop, log, kill_groups
        self.received = 0  # signals seen by the handler (main thread only): a second one leaves at once
        self._read_fd, self._write_fd = os.pipe()  # not inheritable (PEP 446)
        os.set_blocking(self._write_fd, False)  # a full pipe drops the byte, never blocks the handler
        self._previous = {}
        self._reader = threading.Thread(target=self._read, name="signals", daemon=True)
        self._reader.start()
        try:
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self.close()
            raise

    def _handle(self, signum: int, _frame) -> None:
        """The Python-level handler: counts, writes a byte, or leaves at once. No lock, no logging."""
        self.received += 1
        if self.received > 1:
            with contextlib.suppress(OSError):
                os.write(2, b"second signal: leaving now\n")
            for group in self.kill_groups or ():  # children in sessions of their own leave with us
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
            os._exit(SECOND_SIGNAL_EXIT)
        with contextlib.suppress(OSError):  # BlockingIOError: the pipe is full, a stop is on its way anyway
            os.write(self._write_fd, bytes([signum & 0xFF]))

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:  # closed
                return
            if not data:
                return
            for signum in data:
                try:
                    name = signal.Signals(signum).name
                except ValueError:
                    name = f"signal {signum}"
                self.log.info("%s: finishing and leaving", name)
                try:
                    self.on_stop()
                except Exception:
                    self.log.exception("setting the stop on %s failed", name)

    def close(self) -> None:
        """Put back the handlers that were there before and stop the reading thread (tests)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        with contextlib.suppress(OSError):
            os.close(self._write_fd)  # the reader sees end of file
        self._reader.join(timeout=5)
        with contextlib.suppress(OSError):
            os.close(self._read_fd)


def install_stop_signals(
    on_stop: Callable[[], object],
    log: logging.Logger,
    signals: Iterable[signal.Signals] = STOP_SIGNALS,
    kill_groups: list[int] | None = None,
) -> StopSignals:
    """On the first SIGTERM or SIGINT, log it and call ``on_stop()`` (from a daemon thread, so the handler
    takes no lock: module docstring); on a second, exit at once with status 130, SIGKILLing the process
    groups in ``kill_groups`` first (children in sessions of their own; the list may grow after the call).
    Call from the main thread."""
    return StopSignals(on_stop, log, signals, kill_groups)
