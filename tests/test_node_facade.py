"""The Node's two halves: an async core that runs on the node's loop only, and a thin synchronous facade whose
blocking entries refuse the loop's own thread (instead of deadlocking). Addresses are cached at start and read
without the loop; the services' storage work (chunk store, ledger, outbox, a peer's status) runs off the loop.

Real nodes on 127.0.0.1 in this process; every wait has a generous deadline, no timing is asserted.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import msgpack
import pytest

from heterorl.peer.daemon.heartbeat import Heartbeat, Status
from heterorl.protocol import Identity, encode
from heterorl.protocol.net import chunks
from heterorl.protocol.net import fetch as fetching
from heterorl.protocol.net.framing import read_frame, write_frame
from heterorl.protocol.net.join import find_spec
from heterorl.protocol.net.node import NetConfig, Node
from heterorl.protocol.net.trajectories import (
    LearnerAddress,
    TrajectoryReceiver,
    TrajectorySender,
    new_batch_id,
)
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.outbox import Outbox
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import chunk_hash, manifest_body


async def _thread_ident() -> int:
    return threading.get_ident()


def loop_thread(node: Node) -> int:
    return node.call(_thread_ident(), timeout=10)


class Threads:
    """Which threads each recorded call ran on."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = collections.defaultdict(set)

    def note(self, what: str) -> None:
        self.seen[what].add(threading.get_ident())


@pytest.fixture(scope="module")
def second(bootstrap_node):
    """A second node in the swarm, so that streams have somewhere to go."""
    node = Node.start(Identity.generate(), NetConfig(bootstrap=tuple(bootstrap_node.maddrs)))
    yield node
    node.close()


# ---- the facade ----


def test_the_blocking_facade_called_from_the_loop_thread_raises_instead_of_deadlocking(bootstrap_node):
    node = bootstrap_node

    async def misuse() -> list[str]:
        said = []
        for attempt in (
            lambda: node.call(node.lookup("heterorl/x/peers"), 5),
            node.close,
            lambda: find_spec(node, [], "some-run", None, 1.0),  # a sync helper built on call()
        ):
            try:
                attempt()
                said.append("returned")
            except RuntimeError as e:
                said.append(str(e))
        return said

    said = node.call(misuse(), timeout=30)  # a deadlock would end here in TimeoutError, not hang the suite
    assert len(said) == 3 and all("own thread" in s for s in said), said
    assert node.call(node.lookup("heterorl/x/peers"), 30) == []  # the node is unharmed, and not closed
    assert not node.on_loop_thread() and node.call(_on_loop(node), 10)


async def _on_loop(node: Node) -> bool:
    return node.on_loop_thread()


def test_the_async_core_refuses_any_other_loop(bootstrap_node):
    with pytest.raises(RuntimeError, match="node's own loop"):
        asyncio.run(bootstrap_node.lookup("heterorl/x/peers"))
    with pytest.raises(RuntimeError, match="node's own loop"):
        asyncio.run(bootstrap_node.open_stream(bootstrap_node.peer_id, chunks.PROTOCOL))


def test_addresses_are_cached_at_start_and_read_while_the_loop_is_busy(bootstrap_node):
    node = bootstrap_node
    busy, release = threading.Event(), threading.Event()

    async def hog_the_loop() -> None:
        busy.set()
        release.wait(30)  # blocks the loop thread on purpose

    fut = node.spawn(hog_the_loop())
    try:
        assert busy.wait(10)
        maddrs, plain = node.maddrs, node.plain_maddrs()  # the old property waited for the loop (30 s)
    finally:
        release.set()
    fut.result(10)
    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs)
    assert all(m.endswith(f"/p2p/{node.peer_id}") for m in maddrs)
    assert plain == [m.split("/p2p/")[0] for m in maddrs]
    assert node.call(node.refresh_addresses(), 30) == plain  # asking the daemon again agrees
    assert node.call(node.addresses(), 10) == plain
    assert node.call(_maddrs_on_loop(node), 10) == maddrs  # readable from the loop thread too


async def _maddrs_on_loop(node: Node) -> list[str]:
    return node.maddrs


def test_call_soon_runs_a_plain_callback_on_the_loop_thread(bootstrap_node):
    ran = threading.Event()
    where: list[int] = []

    def callback(tag: str) -> None:
        where.append(threading.get_ident())
        assert tag == "tag"
        ran.set()

    bootstrap_node.call_soon(callback, "tag")
    assert ran.wait(10) and where == [loop_thread(bootstrap_node)]


def test_a_closed_node_refuses_calls_and_spawns_and_drops_callbacks():
    node = Node(Identity.generate(), NetConfig())  # never started: closing it is immediate
    node.close()
    node.close()  # idempotent
    for use in (node.call, node.spawn):
        coro = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="closed"):
            use(coro)
        assert coro.cr_frame is None  # closed, not left to warn "never awaited"
    node.call_soon(pytest.fail, "a callback ran on a closed node")  # dropped, not raised


# ---- storage off the loop ----


class RecordingStore(ChunkStore):
    def __init__(self, *args, threads: Threads, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads = threads

    def get(self, h: bytes) -> bytes | None:
        self.threads.note("store.get")
        return super().get(h)


def test_the_chunk_server_reads_its_store_off_the_loop(bootstrap_node, second, tmp_path):
    threads = Threads()
    store = RecordingStore(tmp_path / "store", 1 << 20, threads=threads)
    data = b"chunk bytes " * 100
    store.put(chunk_hash(data), data)
    server = chunks.ChunkServer(store)
    bootstrap_node.call(server.attach(bootstrap_node), 30)

    async def ask() -> list[bytes]:
        reader, writer = await asyncio.wait_for(
            second.open_stream(bootstrap_node.peer_id, chunks.PROTOCOL, bootstrap_node.plain_maddrs()), 30
        )
        try:
            await write_frame(writer, msgpack.packb({"hashes": [chunk_hash(data), chunk_hash(b"other")]}))
            return [await read_frame(reader, len(data) + 1, 30) for _ in range(2)]
        finally:
            writer.close()

    assert second.call(ask(), 60) == [chunks.HELD + data, chunks.NOT_HELD]
    assert threads.seen["store.get"] and loop_thread(bootstrap_node) not in threads.seen["store.get"]


class RecordingLedger(AcceptedLog):
    def __init__(self, path, threads: Threads):
        super().__init__(path)
        self.threads = threads

    def seen(self, batch_id: bytes) -> bool:
        self.threads.note("ledger.seen")
        return super().seen(batch_id)

    def accept(self, *args, **kwargs) -> bool:
        self.threads.note("ledger.accept")
        return super().accept(*args, **kwargs)


class RecordingOutbox(Outbox):
    def __init__(self, path, threads: Threads):
        super().__init__(path)
        self.threads = threads

    def due(self, limit: int = 16):
        self.threads.note("outbox.due")
        return super().due(limit)

    def ack(self, batch_id: bytes) -> bool:
        self.threads.note("outbox.ack")
        return super().ack(batch_id)


def test_trajectory_delivery_keeps_the_ledger_and_outbox_off_the_loop(bootstrap_node, second, tmp_path):
    run, threads = "facade-run", Threads()
    learner_id = second.identity
    ledger = RecordingLedger(tmp_path / "ledger.sqlite", threads)
    outbox = RecordingOutbox(tmp_path / "outbox.sqlite", threads)
    try:
        receiver = TrajectoryReceiver(learner_id, run, ledger, vocab_size=16)
        second.call(receiver.attach(second), 30)
        learner = LearnerAddress(learner_id.public_key, second.peer_id, tuple(second.plain_maddrs()))
        sender = TrajectorySender(bootstrap_node, outbox, run, [learner_id.public_key], learners=[learner])
        bid = new_batch_id()
        row = {"group": 0, "prompt_ids": [1], "completion_ids": [2, 3], "logprobs": [-0.5] * 2, "reward": 1.0}
        body = {"run_id": run, "batch_id": bid, "policy_version": 0, "timestamp": time.time(), "rows": [row]}
        outbox.put(bid, encode("TrajectoryBatch", body, bootstrap_node.identity), 0)
        assert bootstrap_node.call(sender.send_due(), 60) == 1
        assert receiver.accepted == 1 and len(outbox) == 0
    finally:
        ledger.close()
        outbox.close()
    assert set(threads.seen) == {"ledger.seen", "ledger.accept", "outbox.due", "outbox.ack"}
    loops = {loop_thread(bootstrap_node), loop_thread(second)}
    assert not any(t in loops for ids in threads.seen.values() for t in ids), threads.seen


def test_the_heartbeat_reads_the_peer_status_off_the_loop(bootstrap_node):
    threads = Threads()

    def status() -> Status:  # a sampler's counts its sqlite outbox
        threads.note("status")
        return Status(state="testing")

    hb = Heartbeat(bootstrap_node, "facade-run", "sampler", "cpu", status)
    bootstrap_node.call(hb.publish_once(), 60)
    assert threads.seen["status"] and loop_thread(bootstrap_node) not in threads.seen["status"]


# ---- waits ----


def test_a_download_waits_for_its_last_workers_without_spinning(monkeypatch):
    """Once every chunk is handed out, the download waits for its workers (waking each refresh_s), instead of
    looping on an expired lookup time until the last one finishes."""
    body, _ = manifest_body("r", 1, 0, b"x" * (16 << 10), "float32", chunk_bytes=4 << 10)
    fetch = fetching.CheckpointFetch(
        None,  # type: ignore[arg-type]  # no lookups (providers given), no stores (workers faked)
        None,  # type: ignore[arg-type]
        body,
        run_id="r",
        providers=[chunks.Provider("provider")],
        streams_per_provider=1,
        chunks_per_request=4,
        deadline=time.monotonic() + 60,
        request_timeout=10,
        progress=None,
        refresh_s=0.1,
    )

    class SlowWorker(fetching.Download):
        async def _worker(self, p: chunks.Provider) -> None:
            self.todo.clear()  # takes every chunk, then takes its time
            await asyncio.sleep(1.0)

    waits = 0
    real_wait = asyncio.wait

    async def counting_wait(*args, **kwargs):
        nonlocal waits
        waits += 1
        return await real_wait(*args, **kwargs)

    monkeypatch.setattr(asyncio, "wait", counting_wait)
    asyncio.run(SlowWorker(fetch, body, list(range(4))).run())
    assert waits < 60, f"{waits} wakeups in one second: the download loop spins"


def test_the_loop_logs_a_stream_its_peer_closed_early_as_debug_and_anything_else_as_an_error(caplog):
    """hivemind's control handler reading a stream whose remote peer left before its header (an incomplete
    read) is no error; any other failure on the loop still goes to asyncio's default handler (a traceback)."""
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("DEBUG"):
            for benign in (asyncio.IncompleteReadError(b"", 1), ConnectionResetError(), BrokenPipeError()):
                Node._on_loop_exception(None, loop, {"message": "client_connected_cb", "exception": benign})
            Node._on_loop_exception(None, loop, {"message": "boom", "exception": ValueError("boom")})
    finally:
        loop.close()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "boom" in errors[0].getMessage(), [r.getMessage() for r in caplog.records]
    quiet = [r for r in caplog.records if r.levelname == "DEBUG" and "client_connected_cb" in r.getMessage()]
    assert len(quiet) == 3
