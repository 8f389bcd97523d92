"""SIGTERM/SIGINT handling of the daemons (protocol/signals.py): the handler takes no lock, so a signal that
comes while the main thread holds the stop event's lock (or logging's) cannot deadlock the process; a second
signal still leaves at once with status 130."""

from __future__ import annotations

import ast
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]

# The main thread holds the stop event's own lock (threading.Event's condition) while SIGTERM arrives and
# its Python handler runs (at the sleep's next bytecode); then it lets go and waits for the stop.
HOLDING = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from heterorl.peer.daemon.supervisor import StopEvent
    from heterorl.protocol.signals import install_stop_signals

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    log = logging.getLogger("t")
    stop = StopEvent()
    if sys.argv[1] == "old":  # what peer/daemon/main.py's handler did: log and set the event, in the handler
        def on_signal(signum, _frame):
            log.info("%s: finishing and leaving", signal.Signals(signum).name)
            stop.set()
        signal.signal(signal.SIGTERM, on_signal)
    else:
        install_stop_signals(stop.set, log)
    with stop._cond:  # the lock Event.set takes
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)  # the handler runs here, in this thread, with the lock held
        print("handler returned", stop.is_set(), flush=True)
    print("released", flush=True)
    print("stopped" if stop.wait(10) else "not stopped", flush=True)
    """
)


def _lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line.strip())
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _expect(q: queue.Queue, want: str, timeout: float) -> bool:
    """True once line ``want`` comes within ``timeout`` s (after any lines before it); False if not."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = q.get(timeout=left)
        except queue.Empty:
            return False
        if line is None:
            return False
        if line == want:
            return True
    return False


def _holding(mode: str) -> tuple[subprocess.Popen, queue.Queue]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDING, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    q = _lines(proc)
    assert _expect(q, "holding", 120), proc.stderr.read() if proc.poll() is not None else "no start"
    return proc, q


def test_a_signal_while_the_stop_lock_is_held_sets_the_stop_once_it_is_released():
    proc, q = _holding("new")
    try:
        assert _expect(q, "handler returned False", 30)  # not set while the lock is held: no deadlock either
        assert _expect(q, "released", 30)
        assert _expect(q, "stopped", 30)
        assert proc.wait(30) == 0
        assert "SIGTERM: finishing and leaving" in proc.stderr.read()  # logged by the reading thread
    finally:
        proc.kill()
        proc.wait()


def test_the_old_handler_that_sets_the_event_itself_deadlocks_there():
    """The control: the scenario above is real. A handler calling ``stop.set()`` waits for the lock its own
    thread holds, and the process never gets past the sleep."""
    proc, q = _holding("old")
    try:
        assert not _expect(q, "handler returned False", 5) and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


SECOND = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from heterorl.protocol.signals import install_stop_signals
    import threading

    stop = threading.Event()
    install_stop_signals(stop.set, logging.getLogger("t"))
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.wait(30), "first signal did not set the stop"
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("still here", flush=True)
    """
)


def test_a_second_signal_leaves_at_once_with_status_130():
    done = subprocess.run([sys.executable, "-c", SECOND], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stdout.splitlines() == ["stopping"] and "second signal: leaving now" in done.stderr


def _python_handlers(path: Path) -> list[int]:
    """Lines of ``signal.signal(SIG, handler)`` calls with a Python handler (not SIG_IGN or SIG_DFL)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "signal" or not isinstance(node.func.value, ast.Name):
            continue
        if node.func.value.id != "signal" or len(node.args) < 2:
            continue
        handler = node.args[1]
        if isinstance(handler, ast.Attribute) and handler.attr in ("SIG_IGN", "SIG_DFL"):
            continue  # no Python code runs: nothing to deadlock
        lines.append(node.lineno)
    return lines


def test_only_protocol_signals_installs_python_signal_handlers():
    """The daemons go through install_stop_signals; no other Python handler below the tools (which could take
    a lock in the main thread) is installed."""
    found = {}
    for folder in ("peer", "protocol", "coordinator"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ROOT / "protocol" / "signals.py" and (lines := _python_handlers(path)):
                found[str(path.relative_to(ROOT))] = lines
    uses = [
        p
        for p in ("peer/daemon/main.py", "coordinator/daemon.py")
        if "install_stop_signals(" in (ROOT / p).read_text()
    ]
    assert uses == ["peer/daemon/main.py", "coordinator/daemon.py"]
    assert not found, f"Python signal handlers outside protocol/signals.py: {found}"
