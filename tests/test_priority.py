"""A peer that yields the CPU: its process (and on Linux its session's autogroup, which nice alone does not
reach), or one thread below its process's others."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from heterorl.peer.daemon.priority import lower_thread_priority

pytestmark = pytest.mark.fast

CHILD = """
import os
from heterorl.peer.daemon.priority import lower_process_priority
before = os.getpriority(os.PRIO_PROCESS, 0)
after = lower_process_priority(3)
group = open("/proc/self/autogroup").read() if os.path.exists("/proc/self/autogroup") else ""
print(before, after, os.getpriority(os.PRIO_PROCESS, 0), group.strip().replace(" ", "_") or "-")
"""


def test_a_process_lowers_its_priority_and_its_sessions():
    # its own session, as `heterorl local` starts peers: the autogroup is the session's, not the test's
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, start_new_session=True
    )
    before, after, now, group = out.stdout.split(maxsplit=3)
    assert out.returncode == 0, out.stderr
    assert int(after) == int(now) == min(19, int(before) + 3)
    if group != "-":  # Linux with autogroups: "/autogroup-N nice 3"
        assert group.strip().endswith(f"nice_{now}"), group


def test_a_thread_lowers_its_own_priority_only():
    seen = {}

    def worker():
        lower_thread_priority(4)
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["thread"] == min(19, main + 4)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
