"""What every peer runs on, whatever its role: the joined node, the chunk store and its server, the heartbeat,
the JSONL and final-stats files, the stop event, the supervised background work, the order of leaving, and
what the run asks of the peer as far as the volunteer allowed it (:mod:`.consent`): the RunSpec is checked
when the runtime is made, and the roles take the model directory (:meth:`PeerRuntime.model_dir`) and the
task (:meth:`PeerRuntime.task`, with the run's data set fetched from the swarm) from here.

``heterorl peer`` (:mod:`.main`) joins, makes a :class:`PeerRuntime` (which owns the joined node from then on:
use it as a context manager, and the node is closed once, whatever fails), makes the role on it (the
:class:`~.sampler.Sampler` or the :class:`~.learner.Learner`: its own loop and stats only) and calls
:meth:`PeerRuntime.run`:

1. the chunk server starts serving the store (the run's data set too: this peer announces it holds it); the
   role starts (``role.start()``: its own handlers, background tasks and threads, through
   :meth:`PeerRuntime.spawn` and :meth:`PeerRuntime.start_thread`); the heartbeat starts, publishing
   ``role.refresh_status()`` every few seconds;
2. ``role.loop()`` runs until the stop event is set (Ctrl-C, SIGTERM, a background task or thread that failed:
   :mod:`.supervisor`; the libp2p daemon exiting) or the role is done;
3. leaving, in this order: the stop event set (the role's threads end), ``role.leave()`` (what must still
   reach the network while the node's daemon is alive: the sampler sends what is queued, the learner
   announces its last version), the role's threads joined, a last heartbeat saying "leaving" (if the daemon is
   alive), the background tasks cancelled, the node closed (which ends the chunk server and every stream
   handler), then ``role.close()`` (its local files: outbox, ledger, engine), which nothing on the network can
   touch any more. If background work failed, :meth:`PeerRuntime.run` then raises
   :class:`~.supervisor.BackgroundFailure` saying which and why (``heterorl peer`` exits non-zero with it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Protocol

from heterorl.protocol import Identity
from heterorl.protocol.net.chunks import ChunkServer
from heterorl.protocol.net.datasets import fetch_dataset, keep_announced
from heterorl.protocol.net.join import Joined
from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.files import atomic_write_json
from heterorl.protocol.storage.jsonlog import append_row
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.dataset import DATASET_PARAM, dataset_id_of

from ..tasks import Task
from ..tasks.sandbox import TaskSpec, sandboxed_task
from .consent import Consent, check_runspec
from .hardware import Hardware
from .heartbeat import Heartbeat, Status
from .supervisor import BackgroundFailure, StopEvent, Supervisor, Wakeup

log = logging.getLogger(__name__)

LAST_HEARTBEAT_TIMEOUT_S = 10.0
THREADS_JOIN_TIMEOUT_S = 30.0  # the role's threads, once it left: they watch the stop event
DATASET_TIMEOUT_S = 600.0  # to fetch the run's data set before the role can start


class Role(Protocol):
    """A peer's role on a :class:`PeerRuntime` (the order of the calls: module docstring)."""

    def start(self) -> None: ...

    def loop(self) -> None: ...

    def refresh_status(self) -> Status: ...  # (optional: heartbeat_stored(started, snapshot))

    def leave(self) -> None: ...

    def close(self) -> None: ...


class PeerRuntime:
    """One peer's node, chunk store and server, status and heartbeat, state files, stop event and supervisor;
    the roles use them, and :meth:`run` starts and ends them (module docstring).

    Owns ``joined.node`` from construction on (a constructor that fails closes it): the one owner that closes
    it, in :meth:`run`'s order or at the end of a ``with`` block, whichever comes first.
    """

    def __init__(
        self,
        joined: Joined,
        identity: Identity,
        state_dir: Path,
        hardware: Hardware,
        role_name: str,
        *,
        stop: StopEvent | None = None,
        store_bytes: int,
        upload_bytes_per_s: float | None = None,
        consent: Consent | None = None,
    ):
        """``role_name``: "sampler" or "learner" (the heartbeat says it); ``store_bytes``: the chunk store's
        cap; ``upload_bytes_per_s``: cap on the checkpoint bytes this peer serves (None: no cap);
        ``consent``: what the volunteer allowed (``--allow-reward``, ``--model-dir``). Raises
        :class:`~.consent.RunSpecRefused` for a RunSpec that asks more."""
        self.joined, self.node, self.identity = joined, joined.node, identity
        self._closed = False
        try:
            self.settings = RunSettings.from_spec(joined.spec)
            self.consent = consent or Consent()
            check_runspec(self.settings, self.consent, self.settings.run_id)
            self.dataset_id = dataset_id_of(self.settings.task.name, self.settings.task.params)
            self.state_dir, self.hw, self.role_name = state_dir, hardware, role_name
            self.stop = stop if stop is not None else StopEvent()
            self.supervisor = Supervisor(self.stop)
            self.status = Status()
            self.store = ChunkStore(state_dir / "chunks", max_bytes=store_bytes)
            self.server = ChunkServer(self.store, upload_bytes_per_s)
        except BaseException:
            self.close()
            raise
        self.heartbeat: Heartbeat | None = None
        self._tasks: list[concurrent.futures.Future] = []
        self._task: Task | None = None

    def __enter__(self) -> PeerRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- for the roles ----

    def model_dir(self) -> str:
        """The run's model as a checked directory (:func:`~.weights.resolve_model`; "tiny" is built here)."""
        from .weights import resolve_model

        return resolve_model(self.settings.model.path, self.state_dir / "models", self.consent.model_dir)

    def task(self) -> Task:
        """The run's task (built once, shared by the role's parts), its reward as allowed by the volunteer and
        computed in a worker process (:mod:`~heterorl.peer.tasks.sandbox`); a ``jsonl`` task's data set is
        fetched from the swarm into the chunk store first (verified; held from a previous start, not fetched
        again)."""
        if self._task is None:
            self._task = self._build_task()
        return self._task

    def _build_task(self) -> Task:
        params = dict(self.settings.task.params)
        data = None
        if self.dataset_id is not None:
            del params[DATASET_PARAM]
            run_id, dataset_id = self.settings.run_id, self.dataset_id
            data = self.node.call(
                fetch_dataset(self.node, self.store, run_id, dataset_id, timeout=DATASET_TIMEOUT_S),
                timeout=DATASET_TIMEOUT_S + 60,
            )
            log.info("data set %s: %d bytes, verified", self.dataset_id.hex()[:16], len(data))
        spec = TaskSpec(self.settings.task.name, params, tuple(self.consent.rewards), data)
        return sandboxed_task(spec)

    def running(self) -> bool:
        """True until the stop event is set; DaemonDied once the node's daemon is gone."""
        self.node.check_daemon()
        return not self.stop.is_set()

    def spawn(
        self, coro: Coroutine, name: str | None = None, *, forever: bool = True
    ) -> concurrent.futures.Future:
        """Run ``coro`` on the node's loop, supervised (:mod:`.supervisor`), until the role has left (it is
        cancelled after the last heartbeat). ``name`` (default: the coroutine's): what a failure is reported
        as. ``forever``: returning before the peer leaves is a failure (False: a job that may end)."""
        name = name or getattr(coro, "__qualname__", "task")
        task = self.node.spawn(self.supervisor.task(name, coro, forever=forever))
        self._tasks.append(task)
        return task

    def start_thread(self, name: str, fn: Callable[[], object], *, forever: bool = True) -> threading.Thread:
        """Run ``fn()`` in a supervised daemon thread named ``name`` (:mod:`.supervisor`). It must watch the
        stop event (set when the peer leaves) and return once it is set: the runtime joins it after
        ``role.leave()``, before the node closes and ``role.close()`` closes the role's files. ``forever``:
        returning before the peer leaves is a failure."""
        return self.supervisor.start_thread(name, fn, forever=forever)

    def kick_heartbeat(self) -> None:
        """Publish the next heartbeat now (a lineage learner's term changed: the others must learn it)."""
        if self.heartbeat is not None:
            self.heartbeat.kick()

    def wakeup(self) -> Wakeup:
        """A wake-up for a role's thread that waits for producers' signals; the stop event sets it too."""
        return Wakeup(self.stop)

    def append_jsonl(self, name: str, row: dict) -> None:
        """One line of ``STATE_DIR/name`` (``metrics.jsonl``, ``versions.jsonl``): a log of bounded size, in
        rotated segments (:mod:`heterorl.protocol.storage.jsonlog`; read it back with its ``read_rows``)."""
        append_row(self.state_dir / name, row)

    def write_final_stats(self, stats: dict) -> None:
        """``STATE_DIR/final_stats.json``: what this session did (`heterorl local`'s summary, tests)."""
        atomic_write_json(self.state_dir / "final_stats.json", stats, indent=1, newline=True)

    # ---- the life of a peer ----

    def run(self, role: Role) -> None:
        """Serve, start ``role``, beat, run its loop, then leave in order (module docstring); raises
        BackgroundFailure after leaving if a supervised task or thread failed."""
        try:
            self.node.call(self.server.attach(self.node))
            self.spawn(self._watch_daemon(), "libp2p daemon watch", forever=False)
            if self.dataset_id is not None:  # held since the role built its task: served like any chunk
                self.spawn(
                    keep_announced(self.node, self.settings.run_id, self.dataset_id), "data set provider"
                )
            role.start()
            self.heartbeat = Heartbeat(
                self.node,
                self.settings.run_id,
                self.role_name,
                self.hw.describe(),
                role.refresh_status,
                self.state_dir,
                on_stored=getattr(role, "heartbeat_stored", None),  # a lineage writer's lease
            )
            self.spawn(self.heartbeat.run(), "heartbeat")
            role.loop()
        finally:
            self._leave(role, self.heartbeat)
        if self.supervisor.failure is not None:
            raise BackgroundFailure(self.supervisor.failure)

    async def _watch_daemon(self) -> None:
        """Set the stop event once the libp2p daemon exits, so that a role waiting on its wake-up finds out at
        once (``running()`` then raises DaemonDied)."""
        await self.node.daemon_exited()
        self.stop.set()

    def _leave(self, role: Role, heartbeat: Heartbeat | None) -> None:
        self.stop.set()  # the peer is leaving: whatever watches the stop event ends
        try:
            try:
                role.leave()
            finally:  # before the node closes and the role's files with it
                stuck = self.supervisor.join_threads(THREADS_JOIN_TIMEOUT_S)
                if stuck:
                    log.warning("leaving with thread(s) still running: %s", ", ".join(stuck))
            if heartbeat is not None and self.node.daemon_alive():  # else nothing can be sent
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
        """Close the node (and with it the chunk server and every handler), then the reward sandbox the
        handlers score incoming rows in (closed first, a batch arriving in between raised in its handler);
        the first call does it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.node.close()
        finally:
            if getattr(self, "_task", None) is not None and self._task.scorer is not None:
                self._task.scorer.close()  # type: ignore[attr-defined]
