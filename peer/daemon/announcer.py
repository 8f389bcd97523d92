"""The learner's checkpoint announcements: one DHT announce in flight, the newest one next, failures kept.

Announcing a manifest (DHT stores of the manifest and the provider record) takes a network round or more;
the learner must not wait for it between updates. Samplers only want the newest version, so a publish that
comes while one announce is in flight replaces whatever was queued behind it. An announce that fails (the
DHT refused or timed out) is kept, and :meth:`Announcer.retry_failed` tries it again while the publisher
idles, unless a newer version has been announced meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

Manifest = tuple[bytes, dict]  # the signed manifest and its body


class Announcer:
    """``start(raw, body)`` begins one announce and returns its future (e.g. ``Node.spawn`` of it)."""

    def __init__(self, start: Callable[[bytes, dict], concurrent.futures.Future]) -> None:
        self._start_fn = start
        self._lock = threading.RLock()  # the done callback of an already finished future runs at once, here
        self._changed = threading.Condition(self._lock)  # notified when an announce ends or fails to start
        self._in_flight: concurrent.futures.Future | None = None
        self._queued: Manifest | None = None
        self._failed: Manifest | None = None
        self.announced = 0
        self.failures = 0

    def announce(self, raw: bytes, body: dict) -> None:
        """Announce now, or next if one is in flight (replacing an older one queued)."""
        with self._lock:
            if self._in_flight is not None:
                self._queued = (raw, body)
                return
            self._start(raw, body)

    def retry_failed(self, version: int) -> bool:
        """Announce the failed manifest of ``version`` again if nothing is in flight; True if tried."""
        with self._lock:
            failed = self._failed
            if failed is None or failed[1]["version"] != version or self._in_flight is not None:
                return False
            self._failed = None
            self._start(*failed)
            return True

    def has_failed(self) -> bool:
        """Whether an announce failed and waits to be tried again (:meth:`retry_failed`)."""
        with self._lock:
            return self._failed is not None

    def idle(self) -> bool:
        with self._lock:
            return self._in_flight is None and self._queued is None

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is in flight or queued (before leaving); False on timeout."""
        with self._changed:
            return self._changed.wait_for(self.idle, timeout)

    def _start(self, raw: bytes, body: dict) -> None:
        try:
            fut = self._start_fn(raw, body)
        except RuntimeError as e:  # the node is closing
            self.failures += 1
            self._failed = (raw, body)
            log.debug("announce of version %d not started: %s", body["version"], e)
            self._changed.notify_all()
            return
        self._in_flight = fut  # before the callback, which may run at once and clear it
        fut.add_done_callback(lambda f: self._done(f, raw, body))

    def _done(self, fut: concurrent.futures.Future, raw: bytes, body: dict) -> None:
        with self._lock:
            self._in_flight = None
            queued, self._queued = self._queued, None
            try:
                fut.result()
            except (Exception, concurrent.futures.CancelledError) as e:
                self.failures += 1
                log.warning(
                    "checkpoint version %d not announced in the DHT (%s); will announce again",
                    body["version"],
                    e or type(e).__name__,
                )
                if queued is None:  # a newer version queued supersedes it
                    self._failed = (raw, body)
            else:
                self._failed = None
                self.announced += 1
                first_or_tenth = self.announced == 1 or body["version"] % 10 == 0  # bounded logs
                log.log(
                    logging.INFO if first_or_tenth else logging.DEBUG,
                    "published checkpoint version %d (%d bytes, %d chunks)",
                    body["version"],
                    body["total_size"],
                    len(body["chunk_hashes"]),
                )
            if queued is not None:
                self._start(*queued)
            self._changed.notify_all()
