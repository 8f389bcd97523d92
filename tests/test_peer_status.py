"""A peer's Status has several writers (the role's loop, the heartbeat's refresh in another thread, the
runtime): fields read and write as attributes under one lock, a snapshot is one instant, and no caller holds
the status's own stats dict."""

from __future__ import annotations

import sys
import threading

import pytest

from heterorl.peer.daemon.heartbeat import Status, StatusSnapshot

pytestmark = pytest.mark.fast


def test_fields_read_and_write_as_attributes_and_snapshot_together():
    st = Status()
    assert st.snapshot() == StatusSnapshot("joining", -1, 0.0, "", {})
    st.state = "generating with version 3"
    st.policy_version = 3
    st.update(tokens_per_s=12.5, backend="hf generate")
    assert st.state == "generating with version 3" and st.tokens_per_s == 12.5
    assert st.snapshot() == StatusSnapshot("generating with version 3", 3, 12.5, "hf generate", {})
    with pytest.raises(TypeError, match="no field"):
        st.update(sate="typo")


def test_no_caller_holds_the_status_own_stats():
    given = {"batches_made": 1.0}
    st = Status(stats=given)
    given["batches_made"] = 99.0  # the writer's dict, changed after
    read = st.stats
    read["outbox"] = 5.0  # a reader's copy, changed
    snap = st.snapshot()
    snap.stats["lag"] = 2.0
    assert st.stats == {"batches_made": 1.0} and st.snapshot().stats == {"batches_made": 1.0}


@pytest.fixture
def switch_often():
    """Threads switch every microsecond, not every 5 ms: an update without the lock is then seen torn
    thousands of times in this test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_a_snapshot_never_sees_half_an_update(switch_often):
    st = Status(state="v0", policy_version=0, stats={"step": 0})
    done = threading.Event()

    def writer() -> None:
        for i in range(1, 50_000):
            st.update(state=f"v{i}", policy_version=i, stats={"step": i})
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    torn = []
    while not done.is_set():
        s = st.snapshot()
        if not (s.state == f"v{s.policy_version}" and s.stats == {"step": s.policy_version}):
            torn.append(s)
    t.join()
    assert torn == [] and st.snapshot().policy_version == 49_999
