"""The peer runtime on a real node (127.0.0.1): it serves the chunk store and beats while the role runs, then
leaves in order: the role's leave, its threads joined, a last "leaving" heartbeat, the node closed, the role's
close. A background task or thread that fails, or the libp2p daemon exiting, wakes the role at once and ends
it; the runtime closes the node exactly once, whatever fails."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import threading
import time

import msgpack
import pytest

from heterorl.peer.daemon.hardware import Hardware
from heterorl.peer.daemon.runtime import PeerRuntime
from heterorl.peer.daemon.supervisor import BackgroundFailure
from heterorl.protocol import Identity
from heterorl.protocol.net.chunks import HELD, PROTOCOL
from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.framing import read_frame, write_frame
from heterorl.protocol.net.join import Joined
from heterorl.protocol.net.node import DaemonDied, NetConfig, Node
from heterorl.protocol.settings import RunConfig
from heterorl.protocol.wire.checkpoint import chunk_hash

CHUNK = b"a chunk this peer holds" * 10


async def _ask(asker: Node, server: Node, h: bytes) -> bytes:
    reader, writer = await asker.open_stream(server.peer_id, PROTOCOL, server.maddrs)
    try:
        await write_frame(writer, msgpack.packb({"hashes": [h]}))
        return await read_frame(reader, 1 << 20, 30)
    finally:
        writer.close()


class Recorder:
    """A role that records what the runtime asks of it, in order."""

    def __init__(self, runtime: PeerRuntime, asker: Node, fail: bool = False):
        self.rt, self.asker, self.fail = runtime, asker, fail
        self.calls: list[str] = []
        self.served: bytes | None = None
        self.alive_at_leave = self.closed_at_close = None

    def start(self) -> None:
        self.calls.append("start")
        self.rt.status.state = "working"

    def refresh_status(self):
        self.calls.append(f"status:{self.rt.status.state}")
        return self.rt.status

    def loop(self) -> None:
        self.calls.append("loop")
        self.served = self.asker.call(_ask(self.asker, self.rt.node, chunk_hash(CHUNK)), 60)
        deadline = time.monotonic() + 60
        while self.rt.heartbeat.published == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.fail:
            raise RuntimeError("the role broke")
        self.rt.stop.set()  # as SIGTERM would
        while self.rt.running():
            time.sleep(0.05)

    def leave(self) -> None:
        self.calls.append("leave")
        self.alive_at_leave = self.rt.node.daemon_alive()

    def close(self) -> None:
        self.calls.append("close")
        self.closed_at_close = self.rt.node._closed


def _runtime(tmp_path, boot: Node, run_id: str) -> PeerRuntime:
    spec = RunConfig(run_id=run_id, learner_keys=("ab" * 32,)).runspec_body(b"\x01" * 32, 40)
    node = Node.start(Identity.generate(), NetConfig(bootstrap=tuple(boot.maddrs)))
    hw = Hardware("cpu", "test CPU", 1 << 30, 1)
    rt = PeerRuntime(
        Joined(node, b"", spec, b""), node.identity, tmp_path, hw, "sampler", store_bytes=1 << 20
    )
    rt.store.put(chunk_hash(CHUNK), CHUNK)
    return rt


def test_serves_while_the_role_runs_then_leaves_in_order(tmp_path, bootstrap_node):
    rt = _runtime(tmp_path, bootstrap_node, "runtime-order")
    role = Recorder(rt, bootstrap_node)
    rt.run(role)

    assert role.served == HELD + CHUNK  # the runtime's chunk server answered while the role ran
    calls = role.calls
    assert calls[0] == "start" and "loop" in calls
    assert "status:working" in calls  # heartbeats carried the role's state
    i_leave, i_close = calls.index("leave"), calls.index("close")
    between = calls[i_leave + 1 : i_close]  # the last heartbeat (a periodic one may slip in before it)
    assert between[-1:] == ["status:leaving"] and all(c.startswith("status:") for c in between)
    assert "status:leaving" not in calls[:i_leave] and i_close == len(calls) - 1
    assert role.alive_at_leave is True and role.closed_at_close is True
    assert all(t.done() for t in rt._tasks)  # the heartbeat task among them

    # the last heartbeat reached the DHT; the closed peer serves nothing any more
    records = bootstrap_node.call(bootstrap_node.lookup(peers_key("runtime-order")), 30)
    [mine] = [r for r in records if r.author == rt.identity.public_key]
    assert mine.body["state"] == "leaving" and mine.body["role"] == "sampler"
    with pytest.raises(Exception):  # noqa: B017  (whatever libp2p raises for a gone peer)
        bootstrap_node.call(_ask(bootstrap_node, rt.node, chunk_hash(CHUNK)), 30)


def test_a_failing_role_still_leaves_in_order(tmp_path, bootstrap_node):
    rt = _runtime(tmp_path, bootstrap_node, "runtime-failing")
    role = Recorder(rt, bootstrap_node, fail=True)
    with pytest.raises(RuntimeError, match="the role broke"):
        rt.run(role)
    assert role.calls[-2:] == ["status:leaving", "close"] and "leave" in role.calls
    assert role.closed_at_close is True
    rt.close()  # idempotent


def test_the_reward_sandbox_closes_after_the_node_whose_handlers_score_in_it(tmp_path, bootstrap_node):
    """A learner's stream handlers re-score incoming rows in the task's reward sandbox: it closes only once
    the node (and every handler) has (the churn test once logged a handler's SandboxError "closed")."""
    from types import SimpleNamespace

    rt = _runtime(tmp_path, bootstrap_node, "runtime-sandbox")
    seen = []
    rt._task = SimpleNamespace(scorer=SimpleNamespace(close=lambda: seen.append(rt.node._closed)))
    rt.close()
    rt.close()  # idempotent: the sandbox closed once
    assert seen == [True]


class Waiter:
    """A role whose loop sleeps on its wake-up until the peer stops (no poll); ``start`` starts ``work``."""

    def __init__(self, runtime: PeerRuntime, work=None):
        self.rt, self.work = runtime, work
        self.calls: list[str] = []
        self.woken: list[bool] = []
        self.waiting = threading.Event()  # set once its loop waits (the wake-up is cleared by then)

    def start(self) -> None:
        self.calls.append("start")
        if self.work is not None:
            self.work(self)

    def refresh_status(self):
        return self.rt.status

    def loop(self) -> None:
        wake = self.rt.wakeup()
        while self.rt.running():
            wake.clear()
            if self.rt.running():
                self.waiting.set()
                self.woken.append(wake.wait(120))  # the deadline only turns a hang into a failure

    def leave(self) -> None:
        self.calls.append("leave")

    def close(self) -> None:
        self.calls.append(f"close (node closed: {self.rt.node._closed})")


def _count_closes(node: Node) -> list[int]:
    closes, close = [0], node.close

    def counted() -> None:
        closes[0] += 1
        close()

    node.close = counted
    return closes


def test_a_failing_background_task_stops_the_role_and_the_peer_leaves_in_order_saying_why(
    tmp_path, bootstrap_node, caplog
):
    rt = _runtime(tmp_path, bootstrap_node, "runtime-task-fails")
    closes = _count_closes(rt.node)

    async def sender():
        await asyncio.to_thread(role.waiting.wait, 60)
        raise sqlite3.OperationalError("disk I/O error")

    role = Waiter(rt, lambda r: r.rt.spawn(sender(), "trajectory sender"))
    with pytest.raises(BackgroundFailure) as failed, rt:
        rt.run(role)
    assert str(failed.value) == "background task 'trajectory sender' failed: OperationalError: disk I/O error"
    assert role.woken == [True]  # the failure woke the waiting loop: it did not poll
    assert role.calls == ["start", "leave", "close (node closed: True)"] and closes == [1]
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)


def test_the_role_threads_end_when_it_leaves_before_the_node_closes_and_a_failing_one_stops_it(
    tmp_path, bootstrap_node
):
    rt = _runtime(tmp_path, bootstrap_node, "runtime-threads")
    ended: list[str] = []

    def worker() -> None:
        rt.stop.wait()  # as a learner's publisher would: until the peer leaves
        ended.append(f"worker ended (node closed: {rt.node._closed})")

    def broken() -> None:
        raise ValueError("no room for the batch")

    def work(role: Waiter) -> None:
        rt.start_thread("worker", worker)
        rt.start_thread("batch assembler", broken)

    role = Waiter(rt, work)
    with pytest.raises(BackgroundFailure, match="background thread 'batch assembler' failed: ValueError"), rt:
        rt.run(role)
    assert ended == ["worker ended (node closed: False)"]
    assert role.calls == ["start", "leave", "close (node closed: True)"]


def test_the_runtime_closes_the_node_once_whatever_fails(tmp_path, bootstrap_node):
    rt = _runtime(tmp_path / "a", bootstrap_node, "runtime-close-once")
    closes = _count_closes(rt.node)
    with pytest.raises(ValueError, match="the role's constructor failed"), rt:
        raise ValueError("the role's constructor failed")  # as Sampler(runtime, options) may
    assert closes == [1] and rt.node._closed
    rt.close()
    assert closes == [1]

    rt = _runtime(
        tmp_path / "b", bootstrap_node, "runtime-close-once"
    )  # leaving closes it, the block does not
    closes = _count_closes(rt.node)
    with rt:
        rt.run(Recorder(rt, bootstrap_node))
        assert closes == [1]
    assert closes == [1]

    (tmp_path / "c").write_text("not a directory")  # the runtime's own constructor fails: it closes the node
    node = Node.start(Identity.generate(), NetConfig(bootstrap=tuple(bootstrap_node.maddrs)))
    spec = RunConfig(run_id="runtime-close-once", learner_keys=("ab" * 32,)).runspec_body(b"\x01" * 32, 40)
    with pytest.raises(OSError):
        PeerRuntime(
            Joined(node, b"", spec, b""),
            node.identity,
            tmp_path / "c",
            Hardware("cpu", "test CPU", 1 << 30, 1),
            "sampler",
            store_bytes=1 << 20,
        )
    assert node._closed


def test_a_role_waiting_on_its_wakeup_learns_at_once_that_the_daemon_died(tmp_path, bootstrap_node):
    rt = _runtime(tmp_path, bootstrap_node, "runtime-daemon-dies")

    def kill_the_daemon_once_waiting(role: Waiter) -> None:
        def kill() -> None:
            role.waiting.wait(60)
            os.kill(rt.node.p2p._child.pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    role = Waiter(rt, kill_the_daemon_once_waiting)
    with pytest.raises(DaemonDied), rt:
        rt.run(role)
    assert role.woken == [True] and rt.supervisor.failure is None  # woken by the watch, not by a timeout
    assert role.calls == ["start", "leave", "close (node closed: True)"]
