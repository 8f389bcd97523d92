"""Rewards on sampled text, computed in worker processes that can reach nothing (:mod:`.sandbox_worker`).

A reward is computed on text a sampler chose, and a task library's scorer is someone else's code: so every
peer that scores sampled text (a sampler for its own rows, a learner re-scoring every row it trains on, the
held-out evaluation, ``train --local``) does it through :func:`sandbox`, which hands the task a
:class:`RewardSandbox` as its scorer. The worker rebuilds the same task from the same parameters (the peer's
key, environment and open files never reach it), scores each answer under a time limit (past it the worker is
killed: the answer scores 0), a memory limit and :mod:`.confine`'s guards, and is started again the next time
it is needed. A timeout, a crash or a scorer's exception scores 0, is counted (:meth:`RewardSandbox.stats`)
and logged; it never reaches the caller as an exception.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from .base import Task
from .sandbox_worker import _HEADER

log = logging.getLogger("heterorl.rewards")

MAX_TEXT_CHARS = 1 << 20  # a prompt, completion or reference longer than this scores 0 without a worker
MAX_REPLY = 1 << 16
_WORKER_ENV_KEEP = ("LANG", "LC_ALL", "TZ")
_THREADS_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """time_s: one answer's scoring, wall clock; memory_mb: what an answer may allocate above what the built
    task holds; start_s: building the task (a data set indexed) and warming its scorer up."""

    time_s: float = 2.0
    memory_mb: int = 512
    start_s: float = 300.0

    def __post_init__(self) -> None:
        if not (self.time_s > 0 and self.memory_mb > 0 and self.start_s > 0):
            raise ValueError(f"sandbox limits must be positive, got {self}")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What a worker builds its task from: :func:`~.registry.get_task`'s arguments."""

    name: str
    params: Mapping[str, Any]
    allow_rewards: tuple[str, ...] = ()
    data: bytes | None = None


# Workers die with the thread that started them (PR_SET_PDEATHSIG follows the parent thread, not the process):
# every worker is started from this one thread, which lives as long as the process, never from the caller's
# (an intake pool's thread may be retired, and its worker would die with it mid-run).
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-spawner")


class SandboxError(RuntimeError):
    """The worker could not build the task (its reason), or could not be started."""


class _Timeout(Exception):
    pass


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, spec: TaskSpec, limits: SandboxLimits) -> None:
        self.dir = tempfile.mkdtemp(prefix="heterorl-reward-")
        env = {"PATH": os.defpath, "HOME": self.dir, "TMPDIR": self.dir}
        env.update({k: os.environ[k] for k in _WORKER_ENV_KEEP if k in os.environ})
        env.update({k: "1" for k in _THREADS_ENV})
        boot = (
            "import sys; sys.path[:0] = __import__('json').loads(sys.argv[1]); "
            "from heterorl.peer.tasks.sandbox_worker import main; main()"
        )
        paths = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
        self.stderr_path = os.path.join(self.dir, "stderr.log")
        with open(self.stderr_path, "wb") as err:
            self.proc = _SPAWNER.submit(
                subprocess.Popen,
                [sys.executable, "-I", "-c", boot, json.dumps(paths)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=self.dir,
                env=env,
                close_fds=True,
            ).result()
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()  # type: ignore[union-attr]
        try:
            self.send(
                {
                    "name": spec.name,
                    "params": dict(spec.params),
                    "allow_rewards": list(spec.allow_rewards),
                    "data": spec.data,
                    "memory_mb": limits.memory_mb,
                }
            )
            hello = self.recv(time.monotonic() + limits.start_s)
        except (_Timeout, OSError, ValueError) as e:
            self.kill()
            raise SandboxError(
                f"the reward worker did not start ({e or type(e).__name__}){self.tail()}"
            ) from e
        if not hello.get("ok"):
            self.kill()
            raise SandboxError(f"the reward worker could not build task {spec.name!r}: {hello.get('error')}")
        self.isolation: list[str] = list(hello.get("isolation") or [])

    def send(self, obj: dict) -> None:
        body = msgpack.packb(obj, use_bin_type=True)
        data = _HEADER.pack(len(body)) + body
        while data:
            data = data[os.write(self._in, data) :]

    def _read(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                raise _Timeout()
            chunk = os.read(self._out, n - len(buf))
            if not chunk:
                raise EOFError("the reward worker exited")
            buf += chunk
        return bytes(buf)

    def recv(self, deadline: float) -> dict:
        (n,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if n > MAX_REPLY:
            raise ValueError(f"a reply of {n} bytes from the reward worker")
        reply = msgpack.unpackb(self._read(n, deadline), raw=False)
        if not isinstance(reply, dict):
            raise ValueError("a reply that is not a map from the reward worker")
        return reply

    def tail(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2000))
                text = f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""
        return f": {text}" if text else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()  # type: ignore[union-attr]
        shutil.rmtree(self.dir, ignore_errors=True)


class RewardSandbox:
    """A reward function ``(prompt, completion, reference) -> float`` whose every call runs in a worker
    process (``workers`` of them, for callers on several threads). Builds one worker at once, so a task the
    worker cannot build fails here (SandboxError) rather than on the first answer."""

    def __init__(self, spec: TaskSpec, limits: SandboxLimits | None = None, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.spec, self.limits = spec, limits or SandboxLimits()
        self._counts = dict.fromkeys(
            ("answers", "timeouts", "crashes", "errors", "oversize", "blocked", "restarts"), 0
        )
        self._slowest = 0.0
        self._local = threading.local()  # the calling thread's last incident
        self._lock = threading.Lock()
        self._closed = False
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        first = _Worker(spec, self.limits)
        self.isolation = first.isolation
        log.info(
            "reward worker for task %s: %s; %.1f s and %d MiB an answer",
            spec.name,
            ", ".join(first.isolation) or "no kernel isolation (guards only)",
            self.limits.time_s,
            self.limits.memory_mb,
        )
        self._idle.put(first)
        for _ in range(workers - 1):
            self._idle.put(None)  # started when first needed
        self._all: list[_Worker] = [first]
        atexit.register(self.close)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def stats(self) -> dict[str, float]:
        """answers scored, timeouts, crashes (the worker died), errors (the scorer raised), oversize (text
        past MAX_TEXT_CHARS), blocked (what the guards refused), restarts, and the slowest answer's seconds.
        """
        with self._lock:
            return {**self._counts, "slowest_s": round(self._slowest, 4)}

    @property
    def incident(self) -> str | None:
        """What went wrong in this thread's last call (timeout, crash, blocked, oversize), or None: the
        answer's 0 was not its scorer's verdict."""
        return getattr(self._local, "incident", None)

    def __call__(self, prompt: str, completion: str, reference: str) -> float:
        texts = [_clean(t) for t in (prompt, completion, reference)]
        self._count("answers")
        self._local.incident = None
        if any(len(t) > MAX_TEXT_CHARS for t in texts):
            self._count("oversize")
            self._local.incident = "oversize"
            return 0.0
        worker = self._idle.get()
        try:
            if self._closed:
                raise SandboxError("the reward sandbox is closed")
            if worker is None:
                try:
                    worker = _Worker(self.spec, self.limits)
                except SandboxError as e:  # the caller gets a 0, never the exception
                    self._count("crashes")
                    self._local.incident = "crash"
                    log.error("%s: the answer scores 0", e)
                    return 0.0
                self._count("restarts")
                with self._lock:
                    self._all.append(worker)
            value, worker = self._score(worker, texts)
            return value
        finally:
            self._idle.put(worker)

    def _score(self, worker: _Worker, texts: list[str]) -> tuple[float, _Worker | None]:
        t0 = time.monotonic()
        try:
            worker.send({"p": texts[0], "c": texts[1], "r": texts[2]})
            reply = worker.recv(t0 + self.limits.time_s)
        except _Timeout:
            self._count("timeouts")
            self._local.incident = "timeout"
            log.warning(
                "a reward ran past %.1f s: it scores 0 and its worker is restarted (answer %r...)",
                self.limits.time_s,
                texts[1][:80],
            )
            return 0.0, self._retire(worker)
        except Exception as e:  # EOF, a broken pipe, a reply that does not decode: the worker is gone or bad
            self._count("crashes")
            self._local.incident = "crash"
            log.warning("the reward worker died scoring an answer (%s%s): it scores 0", e, worker.tail())
            return 0.0, self._retire(worker)
        seconds = time.monotonic() - t0
        with self._lock:
            self._slowest = max(self._slowest, seconds)
        blocked = int(reply.get("blocked") or 0)
        if blocked:
            self._count("blocked", blocked)
            self._local.incident = "blocked"
            log.warning(
                "the reward sandbox refused %d thing(s) an answer tried: the worker is restarted", blocked
            )
        value = reply.get("v")
        if not isinstance(value, float) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            self._count("errors")
            log.info("a reward failed (it scores 0): %s", str(reply.get("e"))[:200])
            value = 0.0
        return value, (self._retire(worker) if blocked else worker)

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        return None

    def close(self) -> None:
        """Stop every worker (idempotent; also run at exit)."""
        self._closed = True
        with self._lock:
            workers, self._all = self._all, []
        for w in workers:
            w.kill()


def _clean(text: object) -> str:
    """``text`` as a string msgpack can carry (lone surrogates replaced), the same on every peer."""
    s = text if isinstance(text, str) else str(text)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = s.encode("utf-8", "replace").decode("utf-8")
    return s


def sandbox(
    task: Task, spec: TaskSpec, limits: SandboxLimits | None = None, workers: int = 1
) -> RewardSandbox:
    """Give ``task`` (built from ``spec`` in this process) a worker-process scorer; returns it (its stats, its
    close)."""
    box = RewardSandbox(spec, limits, workers)
    task.scorer = box
    return box


def sandboxed_task(spec: TaskSpec, limits: SandboxLimits | None = None, workers: int = 1) -> Task:
    """The task ``spec`` names, built here (prompts, references) with its rewards computed in a worker
    (:func:`sandbox`; the worker is ``task.scorer``, closed at exit or by ``task.scorer.close()``)."""
    from .registry import get_task

    task = get_task(spec.name, allow_rewards=spec.allow_rewards, data=spec.data, **spec.params)
    sandbox(task, spec, limits, workers)
    return task
