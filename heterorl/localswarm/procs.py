"""The swarm's processes: each in its own session (a kill reaches its libp2p daemon too), stopped together."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("heterorl.localswarm")


class Proc:
    """A child process in its own session (so a kill reaches its libp2p daemon too), stderr to a file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        stdout=subprocess.DEVNULL,
        module: str = "heterorl.cli",
        wrap: list[str] | None = None,
    ):
        self.name = name
        self.log_path = log_path
        self._signalled = False
        self._log = open(log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen(
            [*(wrap or []), sys.executable, "-m", module, *argv],
            stdout=stdout,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal_stop(self) -> None:
        """Ask it to leave (SIGTERM to its process group), without waiting."""
        if self.alive() and not self._signalled:  # a second SIGTERM means "leave now" to the peers
            self._signalled = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.p.pid, signal.SIGTERM)

    def terminate(self, timeout: float = 30) -> int | None:
        if self.alive():
            self.signal_stop()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not leave in %.0f s; killing it", self.name, timeout)
        self.kill()
        return self.p.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()
        self._log.close()


def stop_all(procs: list[Proc], timeout: float = 30) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after ``timeout``)."""
    for p in procs:
        p.signal_stop()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.terminate(max(1.0, deadline - time.monotonic()))


def ready_line(proc: Proc, timeout: float) -> dict:
    """The coordinator's one JSON "ready" line on stdout."""
    result: dict = {}

    def read() -> None:
        for line in proc.p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "ready":
                result.update(msg)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise RuntimeError(f"the coordinator did not start; see {proc.log_path}")
    return result
