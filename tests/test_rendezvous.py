"""Which learner a sampler sends to: rendezvous (highest-random-weight) hashing of its key over the run's
learners, and failover to the next in that order while a send to its first choice fails, between fake peers
(heterorl.testing.fakes)."""

from __future__ import annotations

import asyncio
import random
import time
import types

import pytest

from heterorl.protocol import Identity, encode
from heterorl.protocol.net import trajectories
from heterorl.protocol.net.trajectories import (
    FAILOVER_S,
    WINDOW,
    IntakeCounts,
    LearnerAddress,
    TrajectoryReceiver,
    TrajectorySender,
    new_batch_id,
    rendezvous_order,
)
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.outbox import Outbox
from heterorl.testing.fakes import FakeNetwork

pytestmark = pytest.mark.fast  # in `make test-fast`

RUN = "hrw-run"
DEADLINE_S = 60.0  # these finish in milliseconds; the deadline only turns a hang into a failure


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def _learners(rng: random.Random, n: int) -> list[LearnerAddress]:
    return [LearnerAddress(rng.randbytes(32), f"peer-{i}", (f"/fake/peer-{i}",)) for i in range(n)]


def _first_choices(authors: list[bytes], learners: list[LearnerAddress]) -> dict[bytes, LearnerAddress]:
    return {a: rendezvous_order(a, learners)[0] for a in authors}


# ---- the order ----


def test_the_order_depends_on_the_author_and_the_keys_not_on_the_input_order():
    rng = random.Random(1)
    learners = _learners(rng, 5)
    author = rng.randbytes(32)
    order = rendezvous_order(author, learners)
    assert sorted(order, key=lambda lr: lr.peer_id) == learners  # a permutation: none lost, none doubled
    for _ in range(10):
        shuffled = learners[:]
        rng.shuffle(shuffled)
        assert rendezvous_order(author, shuffled) == order
    assert rendezvous_order(author, learners) == order  # the input list is left as it was
    orders = {tuple(lr.peer_id for lr in rendezvous_order(rng.randbytes(32), learners)) for _ in range(50)}
    assert len(orders) > 10  # other authors, other orders
    assert rendezvous_order(author, []) == []


@pytest.mark.parametrize("n, low, high", [(2, 0.35, 0.65), (4, 0.15, 0.35)])
def test_authors_spread_evenly_over_the_learners(n, low, high):
    rng = random.Random(n)
    learners = _learners(rng, n)
    authors = [rng.randbytes(32) for _ in range(400)]
    counts = {lr.peer_id: 0 for lr in learners}
    for first in _first_choices(authors, learners).values():
        counts[first.peer_id] += 1
    assert all(low * len(authors) <= c <= high * len(authors) for c in counts.values()), counts


def test_a_learner_leaving_moves_only_the_authors_it_had():
    rng = random.Random(7)
    learners = _learners(rng, 4)
    authors = [rng.randbytes(32) for _ in range(400)]
    before = _first_choices(authors, learners)
    gone = learners[2]
    after = _first_choices(authors, [lr for lr in learners if lr is not gone])
    moved = [a for a in authors if after[a] != before[a]]
    assert moved and all(before[a] == gone for a in moved)
    assert len(moved) == sum(1 for a in authors if before[a] == gone)
    for a in moved:  # each to its second choice
        assert after[a] == rendezvous_order(a, learners)[1]


# ---- the sender: failover on a failed send, none on a busy learner ----


class _Learner:
    """A learner peer on the fake network: its receiver and ledger; it can leave and come back."""

    def __init__(self, net: FakeNetwork, tmp_path, name: str):
        self.net, self.id = net, Identity.generate()
        self.ledger = AcceptedLog(tmp_path / f"{name}.sqlite")
        self.room = {"open": True}
        self.node = None

    async def start(self) -> None:
        self.node = self.net.node(self.id)  # same key, same peer id, same ledger
        self.receiver = TrajectoryReceiver(
            self.id, RUN, self.ledger, vocab_size=16, has_room=lambda: self.room["open"], retry_after_s=0.7
        )
        await self.receiver.attach(self.node)

    async def stop(self) -> None:
        await self.node.aclose()
        self.receiver.close()

    @property
    def address(self) -> LearnerAddress:
        return LearnerAddress(self.id.public_key, self.node.peer_id, tuple(self.node.plain_maddrs()))


def _batch(identity: Identity) -> tuple[bytes, bytes]:
    bid = new_batch_id()
    row = {"group": 0, "prompt_ids": [1, 2], "completion_ids": [3] * 4, "logprobs": [-0.5] * 4, "reward": 1.0}
    body = {"run_id": RUN, "batch_id": bid, "policy_version": 3, "timestamp": time.time(), "rows": [row]}
    return bid, encode("TrajectoryBatch", body, identity)


class _Swarm:
    """Two learners and one sampler whose sender knows both (fixed ``learners=``, in the reverse of its
    rendezvous order, so a sender that ignored the order would go wrong)."""

    def __init__(self, tmp_path):
        self.net = FakeNetwork()
        self.sid = Identity.generate()
        self.outbox = Outbox(tmp_path / "o.sqlite")
        self.sn = self.net.node(self.sid)
        self.pair = [_Learner(self.net, tmp_path, "a"), _Learner(self.net, tmp_path, "b")]

    async def start(self) -> None:
        for lr in self.pair:
            await lr.start()
        by_key = {lr.id.public_key: lr for lr in self.pair}
        order = rendezvous_order(self.sid.public_key, [lr.address for lr in self.pair])
        self.first, self.second = by_key[order[0].key], by_key[order[1].key]
        self.sender = TrajectorySender(
            self.sn, self.outbox, RUN, list(by_key), learners=order[::-1], author=self.sid.public_key
        )

    async def send(self, n: int = 1) -> int:
        for _ in range(n):
            await asyncio.to_thread(self.outbox.put, *_batch(self.sid), 3)
        return await self.sender.send_due()

    def taken(self) -> tuple[int, int]:
        """Batches the first and the second choice logged."""
        return self.first.ledger.count(), self.second.ledger.count()

    async def close(self) -> None:
        await self.net.aclose()
        for lr in self.pair:
            lr.receiver.close()
            lr.ledger.close()
        self.outbox.close()


@pytest.fixture
def clock(monkeypatch):
    """The trajectories module's monotonic clock, skewed on demand (asyncio's own clock is left alone)."""
    skew = [0.0]
    fake = types.SimpleNamespace(monotonic=lambda: time.monotonic() + skew[0], time=time.time)
    monkeypatch.setattr(trajectories, "time", fake)
    return skew


def test_a_failed_send_moves_the_next_window_to_the_second_choice_until_the_first_is_back(tmp_path, clock):
    async def go():
        s = _Swarm(tmp_path)
        await s.start()
        assert await s.send() == 1 and s.taken() == (1, 0)  # its first choice, not the first listed
        assert await s.send() == 1 and s.taken() == (2, 0) and s.net.streams_opened == 1
        await s.first.stop()
        # one send_due of two windows: the first window fails at the first choice, the next goes to the second
        assert await s.send(2 * WINDOW) == WINDOW
        assert s.sender.failures == 1 and len(s.outbox) == WINDOW and s.taken() == (2, WINDOW)
        s.outbox.retry_all_now()
        assert await s.sender.send_due() == WINDOW and s.taken() == (2, 2 * WINDOW)
        await s.first.start()  # back, but still passed over until FAILOVER_S passed
        assert await s.send() == 1 and s.taken() == (2, 2 * WINDOW + 1)
        clock[0] += FAILOVER_S + 0.1
        assert await s.send() == 1 and s.taken() == (3, 2 * WINDOW + 1)  # home again
        assert s.sender.failures == 1 and len(s.outbox) == 0
        await s.close()

    run(go())


def test_with_every_learner_passed_over_the_first_choice_is_tried(tmp_path, clock):
    async def go():
        s = _Swarm(tmp_path)
        await s.start()
        for lr in s.pair:
            await lr.stop()
        assert await s.send() == 0 and s.sender.failures == 1  # at the first choice
        s.outbox.retry_all_now()
        assert await s.sender.send_due() == 0 and s.sender.failures == 2  # at the second
        for lr in s.pair:
            await lr.start()
        s.outbox.retry_all_now()
        assert await s.sender.send_due() == 1 and s.taken() == (1, 0)  # both passed over: the first
        await s.close()

    run(go())


def test_a_busy_learner_keeps_its_authors(tmp_path, clock):
    async def go():
        s = _Swarm(tmp_path)
        await s.start()
        s.first.room["open"] = False
        assert await s.send() == 0
        assert s.sender.deferred == 1 and s.sender.failures == 0 and 0 < s.sender.learner_busy_for() <= 0.7
        for _ in range(3):
            s.outbox.retry_all_now()
            assert await s.sender.send_due() == 0
        assert s.first.receiver.counts().deferred == 4 and s.second.receiver.counts().deferred == 0
        assert s.taken() == (0, 0) and len(s.outbox) == 1
        s.first.room["open"] = True
        s.outbox.retry_all_now()
        assert await s.sender.send_due() == 1 and s.taken() == (1, 0) and s.sender.learner_busy_for() == 0
        assert s.second.receiver.counts() == IntakeCounts()  # never heard from it
        await s.close()

    run(go())
