"""Checkpoint distribution between real peer processes on 127.0.0.1: swarm, delta, resume, hostile peers.

Each peer is a ``heterorl.testing.netpeers`` process with its own go-libp2p daemon and DHT node; the test
process holds the bootstrap node.
"""

from __future__ import annotations

import pytest

from heterorl.protocol import Identity, ProtocolError, encode
from heterorl.protocol.net.chunks import latest_manifest
from heterorl.protocol.net.fetch import fetch_checkpoint
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import manifest_body


@pytest.fixture
def run(request) -> str:
    """A run id per test: DHT records of one test's (dead) peers must not be another test's providers."""
    return f"net-{request.node.name[:40]}"


def _seed(peers, boot, tmp_path, run: str, *extra: str):
    seed = peers("seed", "--run", run, "--bootstrap", *boot.maddrs, "--store", str(tmp_path / "seed"), *extra)
    ready = seed.wait_event("ready")
    return seed, ready


def _fetch(peers, boot, run: str, store, key: str, *extra: str):
    return peers(
        "fetch",
        "--run",
        run,
        "--bootstrap",
        *boot.maddrs,
        "--store",
        str(store),
        "--learner-key",
        key,
        *extra,
    )


def test_three_peers_fetch_from_one_seeder_then_serve_each_other(bootstrap_node, peers, tmp_path, run):
    seed, ready = _seed(
        peers,
        bootstrap_node,
        tmp_path,
        run,
        "--size-mb",
        "4",
        "--chunk-kb",
        "128",
        "--versions",
        "2",
        "--change-frac",
        "0.25",
    )
    v1, v2 = seed.wait_event("published"), seed.wait_event("published")
    fetchers = [
        _fetch(
            peers,
            bootstrap_node,
            run,
            tmp_path / f"f{i}",
            ready["key"],
            "--manifest",
            v1["manifest"],
            "--latest",
            "2",
            "--serve",
        )
        for i in range(3)
    ]
    for f in fetchers:
        got1, got2 = f.wait_event("fetched", 120), f.wait_event("fetched", 120)
        assert (got1["version"], got2["version"]) == (1, 2)
        assert got1["sha256"] == v1["sha256"] and got2["sha256"] == v2["sha256"]
        assert got1["fetched_bytes"] == got1["total_bytes"] == v1["total_size"]
        # v2 changed a quarter of the tensors: only their chunks cross the wire
        assert 0 < got2["fetched_bytes"] < 0.5 * got2["total_bytes"]
        assert got2["reused_bytes"] + got2["fetched_bytes"] == got2["total_bytes"]
        assert got1["bad_providers"] == got2["bad_providers"] == []
    # with the seeder gone, a newcomer still gets v2 from the peers that fetched it
    seed.kill()
    late = _fetch(peers, bootstrap_node, run, tmp_path / "late", ready["key"], "--latest", "2")
    got = late.wait_event("fetched", 120)
    assert got["sha256"] == v2["sha256"] and got["fetched_bytes"] == got["total_bytes"]
    assert set(got["from_provider"]) <= {f.history[0]["peer_id"] for f in fetchers}
    served = []
    for f in fetchers:
        f.stop()
        served.append(f.wait_event("served")["net/chunk_bytes_served"])
    assert sum(served) >= got["total_bytes"]


def test_killed_download_resumes_with_what_it_has(bootstrap_node, peers, tmp_path, run):
    # 4 MB at 8 Mbit/s takes ~4 s, enough to kill the fetcher half-way
    seed, ready = _seed(
        peers, bootstrap_node, tmp_path, run, "--size-mb", "4", "--chunk-kb", "128", "--upload-mbps", "8"
    )
    v1 = seed.wait_event("published")
    store = tmp_path / "fetcher"
    first = _fetch(peers, bootstrap_node, run, store, ready["key"], "--latest", "1")
    while True:
        p = first.wait_event("progress", 60)
        if p["fetched_bytes"] >= p["to_fetch"] // 4:
            break
    first.kill()
    again = _fetch(peers, bootstrap_node, run, store, ready["key"], "--latest", "1")
    got = again.wait_event("fetched", 120)
    assert got["sha256"] == v1["sha256"]
    assert got["reused_bytes"] >= v1["total_size"] // 4  # kept across the SIGKILL
    assert got["fetched_bytes"] + got["reused_bytes"] == v1["total_size"]
    assert got["fetched_bytes"] < v1["total_size"]


def test_corrupt_provider_is_caught_and_routed_around(bootstrap_node, peers, tmp_path, run):
    seed, ready = _seed(peers, bootstrap_node, tmp_path, run, "--size-mb", "2", "--chunk-kb", "64")
    v1 = seed.wait_event("published")
    liar = peers("corrupt", "--run", run, "--bootstrap", *bootstrap_node.maddrs, "--manifest", v1["manifest"])
    liar_id = liar.wait_event("ready")["peer_id"]
    bad_seen = 0
    for i in range(3):  # providers are shuffled per fetch; the liar is contacted in the first round anyway
        f = _fetch(peers, bootstrap_node, run, tmp_path / f"f{i}", ready["key"], "--latest", "1")
        got = f.wait_event("fetched", 120)
        assert got["sha256"] == v1["sha256"]
        assert liar_id not in got["from_provider"]  # none of its bytes were kept
        bad_seen += got["bad_providers"] == [liar_id]
    assert bad_seen >= 1


def test_manifest_not_signed_by_an_allowed_learner_is_refused(bootstrap_node, tmp_path, run):
    mallory, learner = Identity.generate(), Identity.generate()
    data = b"\x01" * 5000
    body, chunks = manifest_body(run, 1, -1, data, "float32", 4096)
    forged = encode("CheckpointManifest", body, mallory)
    store = ChunkStore(tmp_path / "s", max_bytes=1 << 20)
    with pytest.raises(ProtocolError, match="not signed by a learner this run allows"):
        bootstrap_node.call(
            fetch_checkpoint(bootstrap_node, store, forged, run_id=run, learner_keys=[learner.public_key])
        )
    with pytest.raises(ProtocolError, match="run"):  # right signer, wrong run
        other = encode(
            "CheckpointManifest", manifest_body("other-run", 1, -1, data, "float32", 4096)[0], learner
        )
        bootstrap_node.call(
            fetch_checkpoint(bootstrap_node, store, other, run_id=run, learner_keys=[learner.public_key])
        )
    assert store.versions() == [] and store.total_bytes() == 0
    # published in the DHT by mallory, it is never offered as the latest checkpoint
    assert bootstrap_node.call(
        bootstrap_node.publish_message(encode("CheckpointManifest", body, bootstrap_node.identity))
    )
    assert bootstrap_node.call(latest_manifest(bootstrap_node, run, [learner.public_key])) is None
    found = bootstrap_node.call(latest_manifest(bootstrap_node, run, [bootstrap_node.identity.public_key]))
    assert found is not None and found[1]["version"] == 1


def test_client_mode_peer_fetches_without_serving_the_dht(bootstrap_node, peers, tmp_path, run):
    """A peer behind NAT (--client-mode, --no-relay here) still finds the manifest and fetches the chunks."""
    seed, ready = _seed(peers, bootstrap_node, tmp_path, run, "--size-mb", "1", "--chunk-kb", "64")
    v1 = seed.wait_event("published")
    f = _fetch(peers, bootstrap_node, run, tmp_path / "nat", ready["key"], "--latest", "1", "--client-mode")
    got = f.wait_event("fetched", 120)
    assert got["sha256"] == v1["sha256"] and got["fetched_bytes"] == v1["total_size"]


def test_peers_follow_a_chain_of_deltas_bit_exact_and_a_newcomer_fetches_in_full(
    bootstrap_node, peers, tmp_path, run
):
    # bf16 versions made by optimizer-like steps (every float32 element moves) with sparse deltas; version 4's
    # delta is signed but rebuilds the wrong state (a learner bug): refused, that version fetched in full
    seed, ready = _seed(
        peers,
        bootstrap_node,
        tmp_path,
        run,
        "--size-mb",
        "4",
        "--chunk-kb",
        "128",
        "--versions",
        "5",
        "--dtype",
        "bfloat16",
        "--deltas",
        "--step-lr",
        "1e-4",
        "--bad-delta",
        "4",
    )
    published = [seed.wait_event("published") for _ in range(5)]
    assert published[0]["delta_size"] is None
    assert all(0 < p["delta_size"] < 0.2 * p["total_size"] for p in published[1:])  # against the newest
    follower = _fetch(
        peers,
        bootstrap_node,
        run,
        tmp_path / "follower",
        ready["key"],
        "--manifest",
        *[p["manifest"] for p in published],
        "--serve",
    )
    got = [follower.wait_event("fetched", 120) for _ in range(5)]
    for g, p in zip(got, published, strict=True):
        assert (g["version"], g["sha256"]) == (p["version"], p["sha256"])  # bit-identical to what was signed
    assert got[0]["via"] == "full" and got[0]["fetched_bytes"] == published[0]["total_size"]
    for g, p in zip(got[1:], published[1:], strict=True):
        if p["version"] == 4:
            assert g["via"] == "full" and "reconstructs a state other" in g["delta_error"]
            assert g["fetched_bytes"] >= p["delta_size"] + 0.5 * p["total_size"]
        else:
            assert g["via"] == "delta" and g["delta_error"] == ""
            # only a delta crossed the wire: the smallest against a version held (all older ones are)
            assert (
                g["fetched_bytes"] == p["delta_sizes"][str(g["delta_base"])] == min(p["delta_sizes"].values())
            )
    # a peer that held version 1 only jumps to version 5 by one delta (offered against every older version)
    behind = _fetch(
        peers, bootstrap_node, run, tmp_path / "behind", ready["key"], "--manifest", published[0]["manifest"]
    )
    behind.wait_event("fetched", 120)
    behind = _fetch(peers, bootstrap_node, run, tmp_path / "behind", ready["key"], "--latest", "5")
    g = behind.wait_event("fetched", 120)
    assert (g["via"], g["delta_base"], g["sha256"]) == ("delta", 1, published[4]["sha256"])
    assert g["fetched_bytes"] == published[4]["delta_sizes"]["1"] < 0.5 * published[4]["total_size"]
    # a newcomer holds nothing: it fetches version 5 in full, from the follower too (who rebuilt it)
    seed.kill()
    late = _fetch(peers, bootstrap_node, run, tmp_path / "late", ready["key"], "--latest", "5")
    g = late.wait_event("fetched", 120)
    assert g["sha256"] == published[4]["sha256"] and g["via"] == "full"
    assert set(g["from_provider"]) <= {follower.history[0]["peer_id"], behind.history[0]["peer_id"]}
    follower.stop()
