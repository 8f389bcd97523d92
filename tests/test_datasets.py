"""A run's data set as content-addressed chunks (protocol/wire/dataset.py) and its transfer over the swarm
(protocol/net/datasets.py), on the in-memory fakes: the host stores and announces it, a peer fetches it by the
id alone, verifies it, keeps it (a restart fetches nothing) and serves it; liars and oversized claims are
refused, never trusted."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

import msgpack
import pytest

from heterorl.protocol import Identity
from heterorl.protocol.net import chunks
from heterorl.protocol.net.datasets import fetch_dataset, held_dataset, keep_announced, store_dataset
from heterorl.protocol.net.dht import dataset_providers_key, providers_key, record_key
from heterorl.protocol.net.fetch import FetchError
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire import dataset as ds
from heterorl.protocol.wire.checkpoint import chunk_hash
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.testing.fakes import FakeNetwork

pytestmark = pytest.mark.fast  # in `make test-fast`

RUN = "dataset-run"
CHUNK = 4096  # the smallest chunk: several chunks from a few kilobytes
DEADLINE_S = 60.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def records(n: int = 400) -> bytes:
    rng = random.Random(n)
    lines = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        lines.append(f'{{"question": "{a}+{b}", "answer": "#### {a + b}"}}\n')
    return "".join(lines).encode()


def _manifest(body: dict) -> tuple[bytes, bytes]:
    raw = msgpack.packb(body, use_bin_type=True)
    return chunk_hash(raw), raw


# ---- the manifest ----


def test_a_manifest_names_the_chunks_and_the_whole_and_reads_back():
    data = records()
    dataset_id, raw, parts = ds.make_manifest(data, CHUNK)
    body = ds.read_manifest(raw, dataset_id)
    assert dataset_id == hashlib.sha256(raw).digest() and b"".join(parts) == data
    assert body["total_size"] == len(data) and body["chunk_hashes"] == [chunk_hash(p) for p in parts]
    assert len(parts) == -(-len(data) // CHUNK) > 1
    ds.check_whole(body, data)
    with pytest.raises(ProtocolError, match="sha256"):
        ds.check_whole(body, data[:-1] + b"x")
    with pytest.raises(ValueError, match="empty"):
        ds.make_manifest(b"")


def _good_body(**over) -> dict:
    _, raw, _ = ds.make_manifest(records(), CHUNK)  # several chunks
    return {**msgpack.unpackb(raw, raw=False), **over}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (_good_body(total_size=1 << 40), r"total_size: \d+ outside"),  # claims a terabyte: refused, said cap
        (_good_body(total_size=ds.MAX_DATASET_BYTES + 1), "outside"),
        (_good_body(chunk_bytes=1), "chunk_bytes"),
        (_good_body(total_size=5), "chunks"),  # the sizes disagree with the hash count
        (_good_body(format="heterorl-dataset/9"), "format"),
        (_good_body(chunk_hashes=[b"x" * 31]), "length 31"),
        ({**_good_body(), "extra": 1}, "unexpected"),
        ([1, 2, 3], "expected a map"),
    ],
)
def test_a_manifest_that_hashes_right_but_is_not_one_is_refused(body, match):
    dataset_id, raw = _manifest(body)
    with pytest.raises(ProtocolError, match=match):
        ds.read_manifest(raw, dataset_id)


def test_a_manifest_over_the_byte_cap_or_of_another_id_is_refused_before_decoding():
    huge = b"\x00" * (ds.MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ProtocolError, match=f"{ds.MAX_MANIFEST_BYTES}-byte cap"):
        ds.read_manifest(huge, chunk_hash(huge))
    dataset_id, raw, _ = ds.make_manifest(records(), CHUNK)
    with pytest.raises(ProtocolError, match="does not hash"):
        ds.read_manifest(raw + b"\x00", dataset_id)
    with pytest.raises(ProtocolError, match="well-formed"):
        bad = b"\xc1"  # never valid msgpack
        ds.read_manifest(bad, chunk_hash(bad))


def test_a_task_names_a_data_set_only_by_a_well_formed_id():
    h = b"\x07" * 32
    assert ds.dataset_id_of("jsonl", {"dataset": h.hex(), "answer_field": "a"}) == h
    assert ds.dataset_id_of("arithmetic", {"digits": 1}) is None
    for name, value in [("jsonl", "zz"), ("jsonl", h.hex()[:-2]), ("jsonl", 7), ("arithmetic", h.hex())]:
        with pytest.raises(ValueError, match="data set's id"):
            ds.dataset_id_of(name, {"dataset": value})
    # reasoning_gym's `dataset` is the task's own parameter (a reasoning-gym data set's name), not an id
    assert ds.dataset_id_of("reasoning_gym", {"dataset": "basic_arithmetic"}) is None


def test_dataset_provider_records_live_under_the_data_sets_key():
    h = b"\x01" * 32
    body = {"run_id": RUN, "version": 0, "peer_id": "p", "maddrs": [], "complete": True, "timestamp": 1.0}
    assert record_key("Provider", {**body, "dataset": h}) == dataset_providers_key(RUN, h)
    assert record_key("Provider", body) == providers_key(RUN, 0)


# ---- the transfer ----


class LyingStore(ChunkStore):
    """Serves every chunk it holds with one byte flipped (the manifest too)."""

    def get(self, h):
        data = super().get(h)
        return None if data is None else bytes([data[0] ^ 1]) + data[1:]


def test_a_peer_fetches_the_data_set_by_id_keeps_it_and_serves_it(tmp_path):
    async def go():
        net = FakeNetwork()
        host, peer, newcomer = net.node(Identity.generate()), net.node(), net.node()
        data = records()
        host_store = ChunkStore(tmp_path / "host", 1 << 30)
        dataset_id = store_dataset(host_store, data)
        assert held_dataset(host_store, dataset_id) == data
        await chunks.ChunkServer(host_store).attach(host)
        announcing = asyncio.ensure_future(keep_announced(host, RUN, dataset_id, every_s=0.05))
        store = ChunkStore(tmp_path / "peer", 1 << 30)
        assert held_dataset(store, dataset_id) is None
        got = await fetch_dataset(peer, store, RUN, dataset_id, refresh_s=0.05)
        assert got == data and held_dataset(store, dataset_id) == data
        announcing.cancel()

        # a restart: nothing to fetch, even with nobody to fetch from
        again = ChunkStore(tmp_path / "peer", 1 << 30)
        assert await fetch_dataset(peer, again, RUN, dataset_id, providers=[], timeout=0.1) == data

        # the peer serves it in turn: a newcomer fetches it from the peer alone, the host gone
        await chunks.ChunkServer(again).attach(peer)
        providers = [chunks.Provider(peer.peer_id)]
        fresh = ChunkStore(tmp_path / "newcomer", 1 << 30)
        assert await fetch_dataset(newcomer, fresh, RUN, dataset_id, providers=providers) == data
        found = await chunks.find_providers(newcomer, RUN, 0, dataset=dataset_id)
        assert host.peer_id in {
            p.peer_id for p in found
        }  # the host announced itself under the data set's key
        assert await chunks.find_providers(newcomer, RUN, 0) == []  # not under the checkpoint version key
        await net.aclose()

    run(go())


def test_liars_are_banned_and_the_download_routes_around_them(tmp_path):
    async def go():
        net = FakeNetwork()
        honest, liar, fetcher = net.node(), net.node(), net.node()
        data = records()
        good = ChunkStore(tmp_path / "honest", 1 << 30)
        dataset_id = store_dataset(good, data)
        await chunks.ChunkServer(good).attach(honest)
        lying = LyingStore(tmp_path / "liar", 1 << 30)
        store_dataset(lying, data)
        await chunks.ChunkServer(lying).attach(liar)
        providers = [chunks.Provider(liar.peer_id), chunks.Provider(honest.peer_id)]
        store = ChunkStore(tmp_path / "fetcher", 1 << 30)
        got = await fetch_dataset(fetcher, store, RUN, dataset_id, providers=providers, refresh_s=0.05)
        assert got == data

        # the manifest fetched from the honest one, the liar's chunks refused: with the liar alone, nothing
        only_liar = ChunkStore(tmp_path / "fetcher2", 1 << 30)
        with pytest.raises(FetchError, match="no provider served its manifest"):
            await fetch_dataset(fetcher, only_liar, RUN, dataset_id, providers=providers[:1], timeout=0.3)
        only_liar.put(
            dataset_id, good.get(dataset_id)
        )  # the manifest held already: then every chunk is refused
        with pytest.raises(FetchError, match="still missing at the deadline"):
            await fetch_dataset(
                fetcher, only_liar, RUN, dataset_id, providers=providers[:1], timeout=0.3, refresh_s=0.05
            )
        await net.aclose()

    run(go())


def test_a_provider_announcing_an_oversized_manifest_is_refused_before_it_is_read(tmp_path):
    async def go():
        net = FakeNetwork()
        mallory, fetcher = net.node(), net.node()
        dataset_id = b"\x05" * 32

        class Huge(ChunkStore):
            def get(self, h):
                return b"\x00" * (ds.MAX_MANIFEST_BYTES + 10) if h == dataset_id else None

        await chunks.ChunkServer(Huge(tmp_path / "m", 1 << 30)).attach(mallory)
        store = ChunkStore(tmp_path / "f", 1 << 30)
        started = time.monotonic()
        with pytest.raises(FetchError):
            await fetch_dataset(
                fetcher, store, RUN, dataset_id, providers=[chunks.Provider(mallory.peer_id)], timeout=0.3
            )
        assert time.monotonic() - started < 30 and store.get(dataset_id) is None
        await net.aclose()

    run(go())


def test_a_manifest_the_run_names_that_claims_too_much_is_refused_not_fetched(tmp_path):
    """The RunSpec's signer chose the id: a manifest hashing to it that claims a terabyte ends the fetch."""

    async def go():
        net = FakeNetwork()
        host, fetcher = net.node(), net.node()
        dataset_id, raw = _manifest(_good_body(total_size=1 << 40))
        evil = ChunkStore(tmp_path / "evil", 1 << 30)
        evil.put(dataset_id, raw)
        await chunks.ChunkServer(evil).attach(host)
        store = ChunkStore(tmp_path / "f", 1 << 30)
        with pytest.raises(ProtocolError, match="outside"):
            await fetch_dataset(fetcher, store, RUN, dataset_id, providers=[chunks.Provider(host.peer_id)])
        await net.aclose()

    run(go())
