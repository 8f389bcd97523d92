"""CPU priority: a peer (or one of its threads) that yields the CPU to whatever else runs on the machine.

``nice`` alone does not reach far on Linux desktops and servers: with autogroup scheduling (the default on
most distributions) the CPU is shared first between sessions, and ``nice`` only orders the processes inside
one session; a peer started in its own session (a service, a terminal, ``heterorl local``'s children) must
also lower its session's group (``/proc/self/autogroup``). Raising a priority back needs privileges, lowering
it never does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

log = logging.getLogger(__name__)

MAX_NICE = 19


def lower_process_priority(by: int) -> int:
    """Lower this process's CPU priority by ``by`` nice steps (and its autogroup's, on Linux); the new nice
    value. 0 changes nothing."""
    if by <= 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    value = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, 0) + by)
    os.setpriority(os.PRIO_PROCESS, 0, value)
    # no autogroups here (other kernels, containers): nice alone it is
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write(str(value))
    return value


def lower_thread_priority(by: int) -> None:
    """Lower the calling thread's CPU priority by ``by`` nice steps, below its process's other threads (Linux
    schedules threads as tasks of their own); elsewhere nothing happens."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError as e:
        log.debug("thread priority unchanged: %s", e)
