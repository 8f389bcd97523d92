"""The peer runtime on a real node (127.0.0.1): it serves the chunk store and beats while the role runs, then
leaves in order: the role's leave, a last "leaving" heartbeat, the node closed, the role's close."""

from __future__ import annotations

import time

import msgpack
import pytest

from heterorl.peer.daemon.hardware import Hardware
from heterorl.peer.daemon.runtime import PeerRuntime
from heterorl.protocol import Identity
from heterorl.protocol.net.chunks import HELD, PROTOCOL
from heterorl.protocol.net.dht import peers_key
from heterorl.protocol.net.framing import read_frame, write_frame
from heterorl.protocol.net.join import Joined
from heterorl.protocol.net.node import NetConfig, Node
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
