"""The lineage protocol's state offer, over the in-memory network: a learner that joins at another version
gets the writer's state and the ids of the batches the lineage trained after its own version, so it drops
its pending copies of them (a sampler that lost an Ack resent them elsewhere); an offer whose ids are not a
whole number of batch ids is refused."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from heterorl.protocol import ProtocolError
from heterorl.protocol.net.lineage import LineageLink, LineageWriter
from heterorl.protocol.wire.identity import Identity
from heterorl.testing.fakes import FakeNetwork

pytestmark = pytest.mark.fast

SCHEMA = (("w", (4, 4)),)
WRITER_STATE, JOINER_STATE = hashlib.sha256(b"writer").digest(), hashlib.sha256(b"joiner").digest()


async def _join(trained_since, joiner_version: int = 2):
    net = FakeNetwork()
    w_id, m_id = Identity.generate(), Identity.generate()
    keys = [w_id.public_key, m_id.public_key]
    wn, mn = net.node(w_id), net.node(m_id)
    writer = LineageWriter(w_id, "run", keys, SCHEMA)
    await writer.attach(wn)
    writer.activate(5, WRITER_STATE)
    link = LineageLink(mn, m_id, "run", w_id.public_key, SCHEMA)
    opening = asyncio.ensure_future(link._open(wn.peer_id, wn.maddrs, joiner_version, JOINER_STATE))
    for _ in range(200):  # the writer's training thread answers between two steps
        if writer.state_wanted():
            break
        await asyncio.sleep(0.01)
    writer.offer_state(5, WRITER_STATE, b"weights", b"optimizer", trained_since)
    return await asyncio.wait_for(opening, 10)


def test_a_joiner_gets_the_ids_the_lineage_trained_after_its_version():
    asked = []
    ids = [bytes([i]) * 16 for i in range(3)]

    def trained_since(version: int, limit: int) -> list[bytes]:
        asked.append((version, limit))
        return ids

    offered = asyncio.run(_join(trained_since))
    assert asked and asked[0][0] == 2  # after the joiner's version
    assert (offered.version, offered.state, offered.weights, offered.optimizer) == (
        5,
        WRITER_STATE,
        b"weights",
        b"optimizer",
    )
    assert offered.trained == ids


def test_an_offer_whose_ids_are_cut_is_refused():
    with pytest.raises(ProtocolError, match="whole number of ids"):
        asyncio.run(_join(lambda version, limit: [b"\x01" * 15]))
