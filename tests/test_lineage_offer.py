"""The lineage protocol over the in-memory network (protocol/net/lineage.py): a joiner gets the writer's state
and the lineage's window of trained batches; a writer that stops writing refuses its joiners at once; a part
that breaks the rules is refused at once with the reason; a member waiting for its commit hears keepalives,
and calls a silent writer gone; terms fence both ways."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from heterorl.peer.learner.combine import Accumulator, part_refusal
from heterorl.protocol import ProtocolError, encode
from heterorl.protocol.net import lineage as lineage_mod
from heterorl.protocol.net.lineage import (
    LineageLink,
    LineageRefused,
    LineageWriter,
    StateForJoiner,
    WriterGone,
    unpack_trained,
)
from heterorl.protocol.wire.gradients import encode_gradient
from heterorl.protocol.wire.identity import Identity
from heterorl.testing.fakes import FakeNetwork

pytestmark = pytest.mark.fast

SCHEMA = (("w", (4, 4)),)
WRITER_STATE, JOINER_STATE = hashlib.sha256(b"writer").digest(), hashlib.sha256(b"joiner").digest()
TRAINED = [(bytes([i]) * 16, bytes([i]) * 32) for i in range(3)]


def _pair(vet=lambda learner, batches: None):
    net = FakeNetwork()
    w_id, m_id = Identity.generate(), Identity.generate()
    keys = [w_id.public_key, m_id.public_key]
    acc = Accumulator(1.0)
    writer = LineageWriter(
        w_id,
        "run",
        keys,
        SCHEMA,
        refusal=lambda batches, lr, grad: part_refusal(batches, lr, grad, batch_tokens=64),
        vet=vet,
        accumulate=lambda part, grads: acc.add(part.tokens, grads, part.lr_scale),
    )
    return net, writer, net.node(w_id), net.node(m_id), w_id, m_id, acc


async def _answer(writer: LineageWriter, state: StateForJoiner) -> None:
    for _ in range(200):  # the writer's training thread answers between two steps
        if writer.state_wanted():
            writer.offer_state(lambda since: state)
            return
        await asyncio.sleep(0.01)


def test_a_joiner_gets_the_writers_state_and_the_lineages_window_of_trained_batches():
    async def go():
        net, writer, wn, mn, w_id, m_id, _ = _pair()
        await writer.attach(wn)
        writer.activate(4, 5, WRITER_STATE)
        link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
        opening = asyncio.ensure_future(link._open(wn.peer_id, wn.maddrs, 2, JOINER_STATE, term=3))
        await _answer(writer, StateForJoiner(4, 5, WRITER_STATE, b"weights", b"optimizer", TRAINED, 3))
        return await asyncio.wait_for(opening, 10), link

    offered, link = asyncio.run(go())
    assert (offered.term, offered.version, offered.state) == (4, 5, WRITER_STATE)
    assert (offered.weights, offered.optimizer) == (b"weights", b"optimizer")
    assert offered.trained == TRAINED and offered.trained_from == 3
    assert link.term == 4  # it learned the writer's term


def test_a_window_cut_mid_entry_is_refused():
    with pytest.raises(ProtocolError, match="whole number"):
        unpack_trained(b"\x01" * 47)


def test_a_writer_that_stops_writing_refuses_the_joiners_waiting_for_its_state_at_once():
    async def go():
        net, writer, wn, mn, w_id, m_id, _ = _pair()
        await writer.attach(wn)
        writer.activate(1, 5, WRITER_STATE)
        link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
        opening = asyncio.ensure_future(link._open(wn.peer_id, wn.maddrs, 2, JOINER_STATE, term=1))
        for _ in range(200):
            if writer.state_wanted():
                break
            await asyncio.sleep(0.01)
        writer.deactivate("a writer in term 2")
        with pytest.raises(LineageRefused, match="term 2"):
            await asyncio.wait_for(opening, 5)  # not after STATE_TIMEOUT_S: now

    asyncio.run(go())


def test_terms_fence_both_ways():
    async def go():
        net, writer, wn, mn, w_id, m_id, _ = _pair()
        await writer.attach(wn)
        writer.activate(3, 5, WRITER_STATE)
        link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
        with pytest.raises(LineageRefused, match="knows term 4"):  # the writer: a joiner knows more
            await asyncio.wait_for(link._open(wn.peer_id, wn.maddrs, 5, WRITER_STATE, term=4), 5)
        link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
        await asyncio.wait_for(link._open(wn.peer_id, wn.maddrs, 5, WRITER_STATE, term=2), 5)
        assert link.term == 3  # a joiner that knew less learns the writer's term

    asyncio.run(go())


def _contribution(m_id, term, version, batches, lr=1.0, grads=None):
    data = sha = None
    if grads is not None:
        data, sha = encode_gradient(grads)
    body = {
        "run_id": "run",
        "term": term,
        "version": version,
        "batches": [{"batch_id": b, "sha256": h, "tokens": t} for b, h, t in batches],
        "lr_scale": lr,
        "grad_sha256": sha or b"",
    }
    return encode("Contribution", body, m_id), data


def test_a_part_that_breaks_the_rules_is_refused_at_once_and_one_in_the_round_hears_keepalives(monkeypatch):
    monkeypatch.setattr(lineage_mod, "KEEPALIVE_S", 0.05)

    async def go():
        net, writer, wn, mn, w_id, m_id, acc = _pair()
        await writer.attach(wn)
        writer.activate(2, 5, WRITER_STATE)
        link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
        await link._open(wn.peer_id, wn.maddrs, 5, WRITER_STATE, term=2)
        g = {"w": torch.ones(4, 4)}
        too_big = [(b"\x07" * 16, b"\x07" * 32, 65)]  # more tokens than one batch of the run holds
        reply = await asyncio.wait_for(link._exchange(*_contribution(m_id, 2, 5, too_big, grads=g)), 5)
        assert reply.kind == "LineageWait" and not reply.body["pending"]
        assert reply.body["refused"]["batch_ids"] == [b"\x07" * 16]
        assert "65 tokens" in reply.body["refused"]["reason"]
        ok = [(b"\x08" * 16, b"\x08" * 32, 10)]
        exchange = asyncio.ensure_future(link._exchange(*_contribution(m_id, 2, 5, ok, grads=g)))
        for _ in range(200):
            if writer.wait_for_data(0.0):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # keepalives meanwhile: the member keeps waiting
        assert not exchange.done()
        gathered = await asyncio.to_thread(writer.gather, 1.0)
        assert [p.batch_ids for p in gathered.parts] == [[b"\x08" * 16]] and acc.tokens == 10
        update, _ = encode_gradient({"w": torch.zeros(4, 4)})
        named = [{"batch_id": b"\x08" * 16, "sha256": b"\x08" * 32}]
        fields = {
            "term": 2, "version": 6, "parent_version": 5, "parent_state": WRITER_STATE, "state": JOINER_STATE,
            "applied": [{"learner": m_id.public_key, "batches": named}],
            "tokens": 10, "lr_scale": 1.0, "update_sha256": hashlib.sha256(update).digest(),
            "grad_sha256": hashlib.sha256(update).digest(), "publish": False,
        }  # fmt: skip
        writer.commit(fields, update, update)
        reply = await asyncio.wait_for(exchange, 5)
        assert (
            reply.kind == "Commit"
            and reply.body["version"] == 6
            and torch.equal(reply.update["w"], torch.zeros(4, 4))
        )
        assert writer.parts_refused and writer.stats()["lineage/parts_refused"] == 1

    asyncio.run(go())


def test_a_silent_writer_is_gone_after_a_few_seconds_though_its_stream_never_closed(monkeypatch):
    monkeypatch.setattr(lineage_mod, "KEEPALIVE_S", 60.0)  # a writer that says nothing (paused, cut off)
    monkeypatch.setattr(lineage_mod, "WRITER_SILENT_S", 0.3)

    async def go():
        net, writer, wn, mn, w_id, m_id, _ = _pair()
        await writer.attach(wn)
        writer.activate(1, 5, WRITER_STATE)
        link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
        await link._open(wn.peer_id, wn.maddrs, 5, WRITER_STATE, term=1)
        part = [(b"\x08" * 16, b"\x08" * 32, 10)]
        with pytest.raises(WriterGone, match="silent"):
            await asyncio.wait_for(
                link._exchange(*_contribution(m_id, 1, 5, part, grads={"w": torch.ones(4, 4)})), 5
            )

    asyncio.run(go())
