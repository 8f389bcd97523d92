"""The protocol services over in-memory fakes (heterorl.testing.fakes): framing over duplex streams, DHT
records through the real validator, trajectory delivery and checkpoint fetching between fake peers.

The same services over real libp2p daemons and processes: test_net_trajectories.py, test_net_checkpoints.py,
test_dht_records.py.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgpack
import pytest

from heterorl.protocol import Identity, encode
from heterorl.protocol.net import chunks
from heterorl.protocol.net import fetch as fetching
from heterorl.protocol.net.dht import MAX_TTL_S, checkpoints_key, peers_key, providers_key, spec_key
from heterorl.protocol.net.framing import FrameError, read_frame, write_frame
from heterorl.protocol.net.trajectories import (
    LearnerAddress,
    TrajectoryReceiver,
    TrajectorySender,
    find_learners,
    new_batch_id,
)
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.outbox import Outbox
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import manifest_body
from heterorl.testing.fakes import FakeDHT, FakeNetwork, stream_pair

pytestmark = pytest.mark.fast  # in `make test-fast`

ALICE, BOB, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()
RUN = "fake-run"
DEADLINE_S = 60.0  # generous: these finish in milliseconds; the deadline only turns a hang into a failure


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


async def until(cond, what: str, timeout: float = DEADLINE_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# ---- framing over fake duplex streams ----


def test_frames_cross_a_fake_stream_both_ways_then_eof():
    async def go():
        (ar, aw), (br, bw) = stream_pair()
        for payload in (b"", b"x", bytes(range(256)) * 40):
            await write_frame(aw, payload)
            got = await read_frame(br, 1 << 20, 5)
            assert got == payload
            await write_frame(bw, got[::-1])
            assert await read_frame(ar, 1 << 20, 5) == payload[::-1]
        aw.close()
        with pytest.raises(EOFError):
            await read_frame(br, 10, 5)
        with pytest.raises(EOFError):
            await read_frame(ar, 10, 5)

    run(go())


def test_a_frame_larger_than_the_buffer_waits_for_the_reader():
    async def go():
        (_, aw), (br, _) = stream_pair(limit=1 << 12)
        payload = random.Random(0).randbytes(1 << 20)
        writing = asyncio.ensure_future(write_frame(aw, payload))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not writing.done(), "drain() returned with a MiB unread: no back-pressure"
        assert await read_frame(br, len(payload), 5) == payload
        await writing
        assert aw.bytes_written == 4 + len(payload)

    run(go())


def test_a_stream_closed_mid_frame_reads_as_truncated_and_writes_fail():
    async def go():
        (_, aw), (br, bw) = stream_pair()
        aw.write((10).to_bytes(4, "big") + b"abc")
        aw.close()
        with pytest.raises(FrameError, match="truncated") as e:
            await read_frame(br, 100, 5)
        assert e.value.kind == "truncated"
        with pytest.raises(ConnectionResetError):
            await write_frame(bw, b"reply to nobody")

    run(go())


def test_an_oversized_header_is_refused_before_the_payload_arrives():
    async def go():
        (_, aw), (br, _) = stream_pair()
        aw.write((1 << 30).to_bytes(4, "big") + b"abc")  # announces 1 GiB, sends 3 bytes, stays open
        with pytest.raises(FrameError, match="announced") as e:
            await read_frame(br, 1 << 20, 5)
        assert e.value.kind == "oversized"

    run(go())


def test_a_silent_peer_times_out():
    async def go():
        (_, aw), (br, _) = stream_pair()
        aw.write(b"\x00\x00\x00\x05ab")
        with pytest.raises(FrameError, match="no complete frame") as e:
            await read_frame(br, 100, 0.05)
        assert e.value.kind == "timeout"

    run(go())


# ---- DHT records through the validator ----


def heartbeat(node, role="sampler", **over):
    body = {
        "run_id": RUN,
        "role": role,
        "state": "generating",
        "policy_version": 1,
        "tokens_per_s": 1.0,
        "timestamp": 1.7e9,
        "peer_id": node.peer_id,
        "maddrs": node.plain_maddrs(),
        "hardware": "cpu",
        "stats": [],
    }
    body.update(over)
    return body


def test_records_publish_and_merge_by_author():
    async def go():
        net = FakeNetwork()
        a, b, reader = net.node(ALICE), net.node(BOB), net.node()
        assert await a.publish("Heartbeat", heartbeat(a), ttl_s=60)
        assert await b.publish("Heartbeat", heartbeat(b, role="learner"))
        records = await reader.lookup(peers_key(RUN))
        assert sorted((r.author, r.body["peer_id"]) for r in records) == sorted(
            [(ALICE.public_key, a.peer_id), (BOB.public_key, b.peer_id)]
        )
        assert all(r.kind == "Heartbeat" and r.raw for r in records)
        # a newer record of the same author replaces its older one, an older one does not
        assert await a.publish("Heartbeat", heartbeat(a, state="paused"), ttl_s=300)
        assert not await a.publish("Heartbeat", heartbeat(a, state="stale"), ttl_s=10)
        mine = [r for r in await reader.lookup(peers_key(RUN)) if r.author == ALICE.public_key]
        assert [r.body["state"] for r in mine] == ["paused"]
        assert net.dht.validator.accepted >= 3 and reader.validator.accepted >= 4
        found = await find_learners(reader, RUN, [BOB.public_key, MALLORY.public_key])
        assert found == [LearnerAddress(BOB.public_key, b.peer_id, (f"/fake/{b.peer_id}",))]
        assert await find_learners(reader, RUN, [ALICE.public_key]) == []  # a sampler is no learner
        assert await reader.lookup(spec_key(RUN)) == []

    run(go())


def test_nobody_writes_another_authors_subkey_or_a_key_its_kind_does_not_belong_to():
    async def go():
        net = FakeNetwork()
        a, m = net.node(ALICE), net.node(MALLORY)
        assert await a.publish("Heartbeat", heartbeat(a))
        forged = encode("Heartbeat", heartbeat(m, peer_id="12D3KooWForged"), MALLORY)
        exp = net.dht.now() + 60
        assert not await m.dht.store(peers_key(RUN), forged, exp, subkey=ALICE.public_key)
        alices = encode("Heartbeat", heartbeat(a), ALICE)  # replaying Alice's message under his own subkey
        assert not await m.dht.store(peers_key(RUN), alices, exp, subkey=MALLORY.public_key)
        assert not await m.dht.store(checkpoints_key(RUN), forged, exp, subkey=MALLORY.public_key)
        assert not await m.dht.store(spec_key(RUN), b"garbage", exp, subkey=MALLORY.public_key)
        refused = net.dht.validator.refused
        assert refused["record value not a signed pair"] == 1  # his node signs only his own subkey
        assert refused["message author differs from the record owner"] == 1
        assert refused["Heartbeat stored under a key it does not belong to"] == 1
        assert sum(refused.values()) == 4
        records = await m.lookup(peers_key(RUN))
        assert [(r.author, r.body["peer_id"]) for r in records] == [(ALICE.public_key, a.peer_id)]

    run(go())


def test_records_expire_and_expirations_are_bounded_per_kind():
    async def go():
        dht = FakeDHT()
        net = FakeNetwork(dht)
        a, reader = net.node(ALICE), net.node()
        assert await a.publish("Heartbeat", heartbeat(a), ttl_s=60)
        msg = encode("Heartbeat", heartbeat(a), ALICE)
        too_far = dht.now() + MAX_TTL_S["Heartbeat"] + 3600
        assert not await a.dht.store(peers_key(RUN), msg, too_far, subkey=ALICE.public_key)
        assert not await a.dht.store(peers_key(RUN), msg, dht.now() - 1, subkey=ALICE.public_key)
        dht.advance(30)
        assert len(await reader.lookup(peers_key(RUN))) == 1
        dht.advance(31)
        assert await reader.lookup(peers_key(RUN)) == []
        assert await a.publish("Heartbeat", heartbeat(a))  # a fresh one after expiry is welcome again
        assert len(await reader.lookup(peers_key(RUN))) == 1

    run(go())


def test_a_replica_that_returns_a_forged_record_is_not_believed():
    """hivemind drops a replica's whole reply when one record in it fails validation; the fake does too."""

    async def go():
        net = FakeNetwork()
        a, reader = net.node(ALICE), net.node()
        assert await a.publish("Heartbeat", heartbeat(a))
        forged = encode("Heartbeat", heartbeat(a, peer_id="12D3KooWForged"), MALLORY)
        packed = msgpack.packb([msgpack.packb(forged, use_bin_type=True), b"\x00" * 64], use_bin_type=True)
        net.dht.put_raw(
            peers_key(RUN), msgpack.packb(MALLORY.public_key, use_bin_type=True), packed, net.dht.now() + 60
        )
        assert await reader.dht.get(peers_key(RUN), latest=True) is None
        assert await reader.lookup(peers_key(RUN)) == []
        assert reader.validator.refused["record signature does not match its subkey's owner"] >= 1

    run(go())


# ---- trajectory delivery between fake peers ----


def _batch(identity: Identity, *, run_id: str = RUN, tokens: int = 4) -> tuple[bytes, bytes]:
    bid = new_batch_id()
    body = {
        "run_id": run_id,
        "batch_id": bid,
        "policy_version": 3,
        "timestamp": time.time(),
        "rows": [
            {
                "group": 0,
                "prompt_ids": [1, 2],
                "completion_ids": [3] * tokens,
                "logprobs": [-0.5] * tokens,
                "reward": 1.0,
            }
        ],
    }
    return bid, encode("TrajectoryBatch", body, identity)


class Swarm:
    """A learner peer (receiver, ledger, Heartbeat in the DHT) and a sampler peer (outbox, sender)."""

    def __init__(self, tmp_path, **receiver_kw):
        self.net = FakeNetwork()
        self.lid, self.sid = Identity.generate(), Identity.generate()
        self.ledger, self.outbox = AcceptedLog(tmp_path / "l.sqlite"), Outbox(tmp_path / "o.sqlite")
        self.room = {"open": True}
        self.accepted: list[bytes] = []
        self.receiver_kw = receiver_kw
        self.sn = self.net.node(self.sid)
        self.changes: list[tuple[int, int, int, int, int]] = []  # what a waiting sampler sees when woken
        self.sender = TrajectorySender(
            self.sn, self.outbox, RUN, [self.lid.public_key], on_change=self._changed
        )

    def _changed(self) -> None:
        snd = self.sender
        self.changes.append((snd.acked, snd.deferred, snd.rejected, snd.failures, len(self.outbox)))

    async def start_learner(self, **over):
        self.ln = self.net.node(self.lid)
        kw = {
            "vocab_size": 16,
            "has_room": lambda: self.room["open"],
            "retry_after_s": 0.7,
            "on_accept": lambda body, author, raw: self.accepted.append(body["batch_id"]),
            **self.receiver_kw,
            **over,
        }
        self.receiver = TrajectoryReceiver(self.lid, RUN, self.ledger, **kw)
        await self.receiver.attach(self.ln)
        assert await self.ln.publish("Heartbeat", heartbeat(self.ln, role="learner"))

    async def send(self, raw_and_id) -> int:
        bid, raw = raw_and_id
        await asyncio.to_thread(self.outbox.put, bid, raw, 3)
        return await self.sender.send_due()

    def close(self):
        self.ledger.close()
        self.outbox.close()


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.close()


def test_batches_are_acked_and_a_duplicate_is_logged_once(swarm):
    async def go():
        await swarm.start_learner()
        item = _batch(swarm.sid)
        for _ in range(2):
            assert await swarm.send(item) == 1
            assert len(swarm.outbox) == 0
        assert swarm.ledger.count() == 1 and swarm.accepted == [item[0]]
        assert swarm.receiver.accepted == 1 and swarm.receiver.duplicates == 1
        assert swarm.sender.acked == 2 and swarm.net.streams_opened == 1  # one long-lived stream
        await swarm.net.aclose()

    run(go())


def test_a_full_learner_defers_and_the_sampler_waits_as_told(swarm):
    async def go():
        await swarm.start_learner()
        swarm.room["open"] = False
        bid, raw = _batch(swarm.sid)
        assert await swarm.send((bid, raw)) == 0
        assert swarm.sender.deferred == 1 and swarm.receiver.deferred == 1 and len(swarm.outbox) == 1
        assert 0.5 < swarm.outbox.next_due_in() <= 0.7 and 0 < swarm.sender.learner_busy_for() <= 0.7
        assert await swarm.sender.send_due() == 0  # nothing due before the learner's retry_after_s
        swarm.room["open"] = True
        swarm.outbox.retry_all_now()
        assert await swarm.sender.send_due() == 1 and swarm.ledger.seen(bid)
        await swarm.net.aclose()

    run(go())


def test_a_learner_that_dies_before_its_ack_gets_the_batch_again_and_logs_it_once(swarm):
    async def go():
        def crash(body, author, raw):
            raise RuntimeError("killed between the ledger write and the Ack")

        await swarm.start_learner(on_accept=crash)
        swarm.sender.request_timeout = 3.0  # no reply comes: the sender gives up on the stream after this
        bid, raw = _batch(swarm.sid)
        assert await swarm.send((bid, raw)) == 0  # the stream closed under the sender
        assert swarm.sender.failures == 1 and len(swarm.outbox) == 1 and swarm.ledger.seen(bid)
        await swarm.ln.aclose()
        await swarm.start_learner()  # restarted: same key, same ledger
        swarm.outbox.retry_all_now()
        assert await swarm.sender.send_due() == 1
        assert len(swarm.outbox) == 0 and swarm.ledger.count() == 1
        assert swarm.receiver.duplicates == 1 and swarm.receiver.accepted == 0
        await swarm.net.aclose()

    run(go())


def test_the_sender_loop_drains_the_outbox_and_wakes_on_notify(swarm):
    async def go():
        await swarm.start_learner()
        task = swarm.sn.spawn(swarm.sender.run())
        ids = []
        for _ in range(5):
            bid, raw = _batch(swarm.sid)
            ids.append(bid)
            await asyncio.to_thread(swarm.outbox.put, bid, raw, 3)
            swarm.sender.notify()
        await until(lambda: swarm.ledger.count() == 5, "five batches in the ledger")
        await until(lambda: len(swarm.outbox) == 0, "an empty outbox")
        assert sorted(swarm.accepted) == sorted(ids) and swarm.sender.failures == 0
        await swarm.net.aclose()
        assert task.cancelled()

    run(go())


def test_every_check_runs_in_the_intake_pool_while_the_loop_stays_free(swarm):
    """A slow check (here: one that waits for the loop itself to answer) blocks neither the node's loop nor
    the Ack path: it runs on an intake thread, and the Ack goes out only after it passed."""

    async def go():
        loop = asyncio.get_running_loop()
        seen: dict = {}

        def admit(body, author):
            answered = threading.Event()
            loop.call_soon_threadsafe(answered.set)  # only a free loop can run this
            seen["thread"] = threading.current_thread().name
            seen["loop_answered"] = answered.wait(10)
            seen["ledger_before"] = swarm.ledger.count()
            return None

        await swarm.start_learner(admit=admit)
        bid, raw = _batch(swarm.sid)
        assert await swarm.send((bid, raw)) == 1
        assert seen == {"thread": seen["thread"], "loop_answered": True, "ledger_before": 0}
        assert seen["thread"].startswith("intake") and swarm.ledger.seen(bid)
        await swarm.net.aclose()
        swarm.receiver.close()

    run(go())


def test_a_sender_has_a_window_of_batches_in_flight_on_one_stream(swarm):
    """Two batches due at once are written before either reply is read, and checked side by side: each
    check waits for the other to start (it would wait forever were the stream one batch at a time)."""

    async def go():
        both = threading.Barrier(2, timeout=10)

        def admit(body, author):
            both.wait()  # raises BrokenBarrierError after 10 s alone
            return None

        await swarm.start_learner(admit=admit)
        items = [_batch(swarm.sid) for _ in range(2)]
        for bid, raw in items:
            await asyncio.to_thread(swarm.outbox.put, bid, raw, 3)
        assert await swarm.sender.send_due() == 2
        assert swarm.accepted and sorted(swarm.accepted) == sorted(bid for bid, _ in items)
        assert swarm.net.streams_opened == 1 and len(swarm.outbox) == 0
        await swarm.net.aclose()
        swarm.receiver.close()

    run(go())


def test_bad_batches_are_refused_for_good(swarm):
    async def go():
        await swarm.start_learner()
        assert await swarm.send(_batch(swarm.sid, run_id="another-run")) == 0
        assert len(swarm.outbox) == 0 and swarm.sender.rejected == 1
        assert "run" in swarm.outbox.rejections()[0].reason
        bid, raw = _batch(swarm.sid)
        forged = bytearray(raw)
        forged[-5] ^= 1
        assert await swarm.send((bid, bytes(forged))) == 0
        assert "signature" in swarm.outbox.rejections()[0].reason
        assert swarm.ledger.count() == 0 and sum(swarm.receiver.rejected.values()) == 2
        await swarm.net.aclose()

    run(go())


class _LongestJitter(random.Random):
    """Full-jitter backoff that always draws its ceiling: a random draw near 0 s is due again at once."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_an_unreachable_learner_keeps_the_batch_and_backs_off(swarm):
    swarm.outbox._rng = _LongestJitter()

    async def go():
        swarm.sender._fixed = [LearnerAddress(swarm.lid.public_key, "12D3KooWGone", ())]
        bid, raw = _batch(swarm.sid)
        assert await swarm.send((bid, raw)) == 0
        assert swarm.sender.failures == 1 and len(swarm.outbox) == 1 and swarm.outbox.next_due_in() > 0
        await swarm.net.aclose()

    run(go())


def test_no_learner_in_the_dht_keeps_the_batch(swarm):
    async def go():
        assert await swarm.send(_batch(swarm.sid)) == 0
        assert swarm.sender.state == "waiting for a learner" and len(swarm.outbox) == 1
        await swarm.net.aclose()

    run(go())


def test_the_sender_signals_every_outcome_after_counting_it(swarm):
    async def go():
        assert await swarm.send(_batch(swarm.sid)) == 0  # no learner in the DHT yet: the batch stays
        assert swarm.changes == [(0, 0, 0, 0, 1)]
        await swarm.start_learner()
        swarm.sender._learners_at = 0.0  # look the learners up again now
        swarm.outbox.retry_all_now()
        assert await swarm.sender.send_due() == 1  # an Ack: the outbox has room again
        swarm.room["open"] = False
        assert await swarm.send(_batch(swarm.sid)) == 0  # "busy"
        swarm.outbox.retry_all_now()
        swarm.room["open"] = True
        assert await swarm.sender.send_due() == 1
        assert await swarm.send(_batch(swarm.sid, run_id="another-run")) == 0  # refused for good
        assert swarm.changes == [
            (0, 0, 0, 0, 1),
            (1, 0, 0, 0, 0),
            (1, 1, 0, 0, 1),
            (2, 1, 0, 0, 0),
            (2, 1, 1, 0, 0),
        ]
        await swarm.ln.aclose()
        assert await swarm.send(_batch(swarm.sid)) == 0  # the learner is gone: a failed send
        assert swarm.changes[-1] == (2, 1, 1, 1, 1)
        await swarm.net.aclose()

    run(go())


# ---- checkpoint chunks between fake peers ----

CHUNK = 4096


def _version(store: ChunkStore, identity: Identity, version: int, data: bytes) -> tuple[bytes, dict]:
    body, parts = manifest_body(RUN, version, version - 1, data, "float32", CHUNK)
    for h, c in zip(body["chunk_hashes"], parts, strict=True):
        store.put(h, c)
    return encode("CheckpointManifest", body, identity), body


class LyingStore(ChunkStore):
    """Serves every chunk it holds with one byte flipped."""

    def get(self, h):
        data = super().get(h)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]


async def _fetch(fetcher, store, raw, **kw):
    """fetch_checkpoint of run RUN, whose checkpoints ALICE signs."""
    keys = [ALICE.public_key]
    return await fetching.fetch_checkpoint(fetcher, store, raw, run_id=RUN, learner_keys=keys, **kw)


def test_a_version_is_fetched_from_several_providers_and_announced(tmp_path):
    async def go():
        net = FakeNetwork()
        learner, peer2, fetcher = net.node(ALICE), net.node(), net.node()
        seed_store = ChunkStore(tmp_path / "seed", 1 << 30)
        data = random.Random(1).randbytes(10 * CHUNK + 123)
        raw, body = _version(seed_store, ALICE, 1, data)
        await chunks.ChunkServer(seed_store).attach(learner)
        await chunks.publish_checkpoint(learner, seed_store, raw, body)
        copy = ChunkStore(tmp_path / "copy", 1 << 30)  # a second provider holding every chunk
        _version(copy, ALICE, 1, data)
        await chunks.ChunkServer(copy).attach(peer2)
        assert await peer2.publish(
            "Provider",
            {
                "run_id": RUN,
                "version": 1,
                "peer_id": peer2.peer_id,
                "maddrs": await peer2.addresses(),
                "complete": True,
                "timestamp": time.time(),
            },
        )

        got = await chunks.latest_manifest(fetcher, RUN, [ALICE.public_key])
        assert got is not None and got[0] == raw
        assert await chunks.latest_manifest(fetcher, RUN, [BOB.public_key]) is None  # not an allowed key
        store = ChunkStore(tmp_path / "fetcher", 1 << 30)
        report = await _fetch(fetcher, store, raw, chunks_per_request=2)
        assert store.assemble(1) == data and report.fetched_bytes == len(data)
        assert set(report.from_provider) == {learner.peer_id, peer2.peer_id}
        assert not report.bad_providers
        await until(lambda: not fetcher._tasks, "the fetcher's announcements")
        providers = await chunks.find_providers(learner, RUN, 1)
        assert {p.peer_id for p in providers} == {peer2.peer_id, fetcher.peer_id}
        await net.aclose()

    run(go())


def test_a_provider_serving_bad_chunks_is_banned_and_routed_around(tmp_path):
    async def go():
        net = FakeNetwork()
        learner, liar, fetcher = net.node(ALICE), net.node(MALLORY), net.node()
        honest = ChunkStore(tmp_path / "honest", 1 << 30)
        data = random.Random(2).randbytes(6 * CHUNK)
        raw, body = _version(honest, ALICE, 1, data)
        await chunks.ChunkServer(honest).attach(learner)
        lying = LyingStore(tmp_path / "liar", 1 << 30)
        _version(lying, ALICE, 1, data)
        await chunks.ChunkServer(lying).attach(liar)
        providers = [chunks.Provider(liar.peer_id), chunks.Provider(learner.peer_id)]
        store = ChunkStore(tmp_path / "fetcher", 1 << 30)
        report = await _fetch(fetcher, store, raw, providers=providers, refresh_s=0.05)
        assert store.assemble(1) == data
        assert report.bad_providers == [liar.peer_id] and liar.peer_id not in report.from_provider
        await net.aclose()

    run(go())


def _half_and_full(tmp_path, net):
    """A learner holding all 8 chunks of version 1 and a peer holding its first 4 (a fetcher still busy)."""
    learner, partial = net.node(ALICE), net.node()
    full = ChunkStore(tmp_path / "full", 1 << 30)
    data = random.Random(3).randbytes(8 * CHUNK)
    raw, body = _version(full, ALICE, 1, data)
    half = ChunkStore(tmp_path / "half", 1 << 30)
    for i, h in enumerate(body["chunk_hashes"][:4]):
        half.put(h, data[i * CHUNK : (i + 1) * CHUNK])
    return learner, full, partial, half, raw, data


def test_chunks_one_provider_lacks_come_from_another_and_a_manifest_needs_an_allowed_signer(tmp_path):
    async def go():
        net = FakeNetwork()
        learner, full, partial, half, raw, data = _half_and_full(tmp_path, net)
        await chunks.ChunkServer(full).attach(learner)
        await chunks.ChunkServer(half).attach(partial)
        fetcher, store = net.node(), ChunkStore(tmp_path / "fetcher", 1 << 30)
        providers = [chunks.Provider(learner.peer_id), chunks.Provider(partial.peer_id)]
        report = await _fetch(
            fetcher, store, raw, providers=providers, streams_per_provider=1, refresh_s=0.05
        )
        assert store.assemble(1) == data and not report.bad_providers
        # the peer was asked for chunks 4-7 first (the learner's stream took 0-3) and lacked them all
        assert report.from_provider == {learner.peer_id: len(data)}
        with pytest.raises(chunks.ProtocolError, match="not signed by a learner"):
            await fetching.fetch_checkpoint(
                fetcher, store, raw, run_id=RUN, learner_keys=[BOB.public_key], providers=providers
            )
        await net.aclose()

    run(go())


def test_a_provider_listed_first_that_lacks_the_last_chunks_does_not_starve_the_download(tmp_path):
    async def go():
        net = FakeNetwork()
        learner, full, partial, half, raw, data = _half_and_full(tmp_path, net)
        await chunks.ChunkServer(full).attach(learner)
        await chunks.ChunkServer(half).attach(partial)
        fetcher, store = net.node(), ChunkStore(tmp_path / "fetcher", 1 << 30)
        providers = [chunks.Provider(partial.peer_id), chunks.Provider(learner.peer_id)]
        # timeout: 20 provider refreshes, far more than an honest download of 8 chunks needs
        await _fetch(fetcher, store, raw, providers=providers, refresh_s=0.05, timeout=1.0)
        assert store.assemble(1) == data
        await net.aclose()

    run(go())


def test_a_chunk_request_over_the_cap_is_refused_by_the_server(tmp_path):
    async def go():
        net = FakeNetwork()
        server, client = net.node(), net.node()
        await chunks.ChunkServer(ChunkStore(tmp_path / "s", 1 << 20)).attach(server)
        reader, writer = await client.open_stream(server.peer_id, chunks.PROTOCOL)
        await write_frame(
            writer, msgpack.packb({"hashes": [b"h" * 32] * (chunks.MAX_HASHES_PER_REQUEST + 1)})
        )
        with pytest.raises(EOFError):  # refused: the server closes the stream without a reply
            await read_frame(reader, 100, 5)
        reader, writer = await client.open_stream(server.peer_id, chunks.PROTOCOL)
        await write_frame(writer, msgpack.packb({"hashes": [b"h" * 32]}))
        assert await read_frame(reader, 100, 5) == chunks.NOT_HELD
        with pytest.raises(ConnectionError, match="does not serve"):
            await server.open_stream(client.peer_id, chunks.PROTOCOL)
        await net.aclose()

    run(go())


def test_provider_records_live_under_their_version_key():
    async def go():
        net = FakeNetwork()
        a = net.node(ALICE)
        await chunks._announce(a, RUN, 7, complete=False)
        records = await a.lookup(providers_key(RUN, 7))
        assert [(r.kind, r.body["complete"]) for r in records] == [("Provider", False)]
        assert await a.lookup(providers_key(RUN, 8)) == []

    run(go())
