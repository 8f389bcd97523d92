"""Child processes for tests: :mod:`heterorl.testing.netpeers` roles with their JSON events, and one-shot
check modules that print their results as one JSON line."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class PeerProcess:
    """One peer process; stdout JSON lines become events, stderr goes to ``log_path``."""

    def __init__(self, role: str, *args: str, log_path: str | Path, env: dict | None = None):
        self.role = role
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "heterorl.testing.netpeers", role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: kill() takes the libp2p daemon down with it
        )
        self.events: queue.Queue[dict] = queue.Queue()
        self.history: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.put(event)

    def wait_event(self, name: str, timeout: float = 60.0) -> dict:
        """The next event called ``name`` (earlier other events are kept in ``history``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.role}: no {name!r} event in {timeout} s; log: {self.tail()}")
            try:
                event = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    code = self.proc.returncode
                    raise RuntimeError(f"{self.role} exited ({code}); log: {self.tail()}") from None
                continue
            self.history.append(event)
            if event.get("event") == name:
                return event

    def send(self, line: str = "go") -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def tail(self, n: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash or power cut would leave it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 20.0) -> int:
        """Close stdin (the serving roles' signal to finish), wait, kill if it hangs."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # what it left in its group (a libp2p daemon)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._log.closed:
            self.kill()


def run_json_check(module: str, *args: str, timeout: float = 600) -> dict:
    """``python -m module args`` in a child process (one thread per op), its last stdout line as JSON.

    For checks that must not run in the test process (vLLM's engine changes process-wide torch settings);
    AssertionError with the end of its stderr if it fails."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"OMP_NUM_THREADS": "1", **os.environ},
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
