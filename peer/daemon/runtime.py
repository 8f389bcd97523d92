"""What every peer runs on, whatever its role: the joined node, the chunk store and its server, the heartbeat,
the JSONL and final-stats files, the stop event, and the order of leaving.

``heterorl peer`` (:mod:`.main`) joins, makes a :class:`PeerRuntime`, makes the role on it (the
:class:`~.sampler.Sampler` or the :class:`~.learner.Learner`: its own loop and stats only) and calls
:meth:`PeerRuntime.run`:

1. the chunk server starts serving the store; the role starts (``role.start()``: its own handlers and
   background tasks); the heartbeat starts, publishing ``role.refresh_status()`` every few seconds;
2. ``role.loop()`` runs until the stop event is set (Ctrl-C, SIGTERM) or the role is done;
3. leaving, in this order: ``role.leave()`` (what must still reach the network while the node's daemon is
   alive: the sampler sends what is queued, the learner announces its last version), a last heartbeat saying
   "leaving" (if the daemon is alive), the background tasks cancelled, the node closed (which ends the chunk
   server and every stream handler), then ``role.close()`` (its local files: outbox, ledger, engine), which
   nothing on the network can touch any more.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Protocol

from heterorl.protocol import Identity
from heterorl.protocol.net.chunks import ChunkServer
from heterorl.protocol.net.join import Joined
from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.files import atomic_write_json
from heterorl.protocol.storage.store import ChunkStore

from .hardware import Hardware
from .heartbeat import Heartbeat, Status

log = logging.getLogger(__name__)

LAST_HEARTBEAT_TIMEOUT_S = 10.0


class Role(Protocol):
    """A peer's role on a :class:`PeerRuntime` (the order of the calls: module docstring)."""

    def start(self) -> None: ...

    def loop(self) -> None: ...

    def refresh_status(self) -> Status: ...

    def leave(self) -> None: ...

    def close(self) -> None: ...


class PeerRuntime:
    """One peer's node, chunk store and server, status and heartbeat, state files and stop event; the roles
    use them, and :meth:`run` starts and ends them (module docstring)."""

    def __init__(
        self,
        joined: Joined,
        identity: Identity,
        state_dir: Path,
        hardware: Hardware,
        role_name: str,
        *,
        stop: threading.Event | None = None,
        store_bytes: int,
        upload_bytes_per_s: float | None = None,
    ):
        """``role_name``: "sampler" or "learner" (the heartbeat says it); ``store_bytes``: the chunk store's
        cap; ``upload_bytes_per_s``: cap on the checkpoint bytes this peer serves (None: no cap)."""
        self.joined, self.node, self.identity = joined, joined.node, identity
        self.settings = RunSettings.from_spec(joined.spec)
        self.state_dir, self.hw, self.role_name = state_dir, hardware, role_name
        self.stop = stop if stop is not None else threading.Event()
        self.status = Status()
        self.store = ChunkStore(state_dir / "chunks", max_bytes=store_bytes)
        self.server = ChunkServer(self.store, upload_bytes_per_s)
        self.heartbeat: Heartbeat | None = None
        self._tasks: list[concurrent.futures.Future] = []

    # ---- for the roles ----

    def running(self) -> bool:
        """True until the stop event is set; DaemonDied once the node's daemon is gone."""
        self.node.check_daemon()
        return not self.stop.is_set()

    def spawn(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run ``coro`` on the node's loop until the role has left (cancelled after the last heartbeat)."""
        task = self.node.spawn(coro)
        self._tasks.append(task)
        return task

    def append_jsonl(self, name: str, row: dict) -> None:
        """One line of ``STATE_DIR/name`` (``metrics.jsonl``, ``versions.jsonl``)."""
        with (self.state_dir / name).open("a") as f:
            f.write(json.dumps(row) + "\n")

    def write_final_stats(self, stats: dict) -> None:
        """``STATE_DIR/final_stats.json``: what this session did (`heterorl local`'s summary, tests)."""
        atomic_write_json(self.state_dir / "final_stats.json", stats, indent=1, newline=True)

    # ---- the life of a peer ----

    def run(self, role: Role) -> None:
        """Serve, start ``role``, beat, run its loop, then leave in order (module docstring)."""
        self.node.call(self.server.attach(self.node))
        role.start()
        self.heartbeat = Heartbeat(
            self.node,
            self.settings.run_id,
            self.role_name,
            self.hw.describe(),
            role.refresh_status,
            self.state_dir,
        )
        self.spawn(self.heartbeat.run())
        try:
            role.loop()
        finally:
            self._leave(role, self.heartbeat)

    def _leave(self, role: Role, heartbeat: Heartbeat) -> None:
        try:
            role.leave()
            if self.node.daemon_alive():  # else nothing can be sent
                self.status.state = "leaving"
                try:
                    self.node.call(heartbeat.publish_once(), timeout=LAST_HEARTBEAT_TIMEOUT_S)
                except Exception as e:
                    log.debug("last heartbeat: %s", e)
        finally:
            for task in self._tasks:
                task.cancel()
            self.close()  # nothing on the network may touch the role's files after this
            role.close()

    def close(self) -> None:
        """Close the node (and with it the chunk server and every handler). Idempotent."""
        self.node.close()
