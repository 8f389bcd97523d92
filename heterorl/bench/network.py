"""``heterorl bench network``: checkpoint propagation, delta bytes and trajectory delivery on loopback.

Every peer is a real process (``heterorl.testing.netpeers``) with its own go-libp2p daemon and DHT node; this
process holds the bootstrap node. Figures, all from one run:

- propagation: one seeder holds a checkpoint of S MB; N fresh peers start fetching it at the same instant
  (each waits on stdin for "go"); the time until the last one holds a verified copy, against one raw TCP
  copy of the same bytes over loopback in this process (``socket.sendall`` → ``recv_into``). Peers serve
  what they hold, so later peers can fetch from earlier ones.
- delta: a peer holding version 1 fetches version 2 (a fraction of tensors changed): bytes on the wire
  against the full size (chunk reuse, for float32 checkpoints).
- delta propagation: N peers holding version 1 of a bf16 checkpoint fetch version 2 (every float32 element
  moved by ``--step-lr``) at the same instant, by its sparse delta and (fresh peers) in full: time until
  all hold it, bytes uploaded by the seeder (the learner) and by other peers.
- trajectories: one learner, one sampler sending signed batches; outbox-put → Ack latency p50/p99 and the
  wire bytes per batch against the raw payload (int32 token ids + float32 log-probs + float32 reward).

On a 2-core machine all peers share the CPUs, so N-peer times include CPU contention; the ratio to the raw
copy, measured side by side, is the figure to compare.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .network_report import format_table, raw_tcp_copy_s


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fetchers(
    procs: list,
    common: list[str],
    work: Path,
    name: str,
    n: int,
    key: str,
    manifests: list[str],
    extra: list[str],
) -> list:
    """``n`` fetch peers (serving what they hold) for ``manifests``, added to ``procs``; they wait for go."""
    from heterorl.testing.procs import PeerProcess

    group = []
    for i in range(n):
        store = ["--store", str(work / f"{name}-{i}"), "--learner-key", key, "--manifest", *manifests]
        p = PeerProcess("fetch", *common, *store, *extra, "--serve", log_path=work / f"{name}-{i}.log")
        procs.append(p)
        group.append(p)
    return group


def _go(group: list) -> tuple[float, list[dict]]:
    """Once every peer waits, say "go" to all at once; the start time and each peer's "fetched" event."""
    for p in group:
        p.wait_event("waiting", 120)
    t0 = time.time()
    for p in group:
        p.send("go")
    return t0, [p.wait_event("fetched", 900) for p in group]


def bench_checkpoints(boot, work: Path, size_mb: int, peer_counts: list[int], chunk_kb: int) -> dict:
    from heterorl.testing.procs import PeerProcess

    procs: list[PeerProcess] = []
    try:
        run = f"bench-{size_mb}mb"
        common = ["--run", run, "--bootstrap", *boot.maddrs]
        seed = PeerProcess(
            "seed",
            *common,
            "--store",
            str(work / "seed"),
            "--size-mb",
            str(size_mb),
            "--versions",
            "2",
            "--chunk-kb",
            str(chunk_kb),
            "--change-frac",
            "0.1",
            "--tensors",
            "40",
            log_path=work / "seed.log",
        )
        procs.append(seed)
        key = seed.wait_event("ready", 120)["key"]
        v1 = seed.wait_event("published", 600)
        v2 = seed.wait_event("published", 600)
        total = v1["total_size"]
        raw_s = min(raw_tcp_copy_s(total) for _ in range(3))
        out = {
            "size_mb": size_mb,
            "bytes": total,
            "chunks": v1["chunks"],
            "raw_tcp_s": raw_s,
            "propagation": [],
        }
        _say(f"  {size_mb} MB checkpoint: {v1['chunks']} chunks; raw TCP copy {raw_s:.3f} s")
        for n in peer_counts:
            group = _fetchers(procs, common, work, f"n{n}", n, key, [v1["manifest"]], ["--wait-go"])
            t0, done = _go(group)
            if any(d["sha256"] != v1["sha256"] for d in done):
                raise RuntimeError("a peer assembled different bytes than the seeder published")
            last = max(d["t_end"] for d in done) - t0
            from_seed = sum(d["from_provider"].get(seed.history[0]["peer_id"], 0) for d in done)
            row = {
                "peers": n,
                "seconds_to_all": last,
                "ratio_to_raw_copy": last / raw_s,
                "seeder_upload_fraction": from_seed / (total * n),
            }
            out["propagation"].append(row)
            _say(
                f"  → {n} peer(s): all hold it after {last:.2f} s ({last / raw_s:.1f}× raw copy); "
                f"seeder uploaded {row['seeder_upload_fraction']:.0%} of the bytes"
            )
            for p in group:
                p.stop()
            for i in range(n):
                shutil.rmtree(work / f"n{n}-{i}", ignore_errors=True)
        # delta: a peer with v1 fetches v2
        p = PeerProcess(
            "fetch",
            *common,
            "--store",
            str(work / "delta"),
            "--learner-key",
            key,
            "--manifest",
            v1["manifest"],
            v2["manifest"],
            log_path=work / "delta.log",
        )
        procs.append(p)
        full, delta = p.wait_event("fetched", 900), p.wait_event("fetched", 900)
        out["delta"] = {
            "full_bytes": full["fetched_bytes"],
            "delta_bytes": delta["fetched_bytes"],
            "fraction": delta["fetched_bytes"] / delta["total_bytes"],
            "changed_tensor_fraction": 0.1,
        }
        _say(
            f"  delta v1→v2 (10% of tensors changed): {delta['fetched_bytes'] / 2**20:.1f} MiB on the wire "
            f"of {total / 2**20:.1f} MiB ({out['delta']['fraction']:.1%})"
        )
        return out
    finally:
        for p in procs:
            p.__exit__(None, None, None)


def bench_delta_propagation(
    boot, work: Path, size_mb: int, peers: int, chunk_kb: int, step_lr: float, seed_mbps: float = 0
) -> dict:
    """N peers that hold version 1 fetch version 2 at the same instant, once by its sparse bf16 delta and once
    in full (fresh stores each time): time until all hold it, and who uploaded the bytes (seeder vs peers)."""
    from heterorl.testing.procs import PeerProcess

    procs: list[PeerProcess] = []
    try:
        run = f"bench-delta-{size_mb}mb"
        common = ["--run", run, "--bootstrap", *boot.maddrs]
        seed_args = ["--store", str(work / "seed"), "--size-mb", str(size_mb), "--versions", "2"]
        seed_args += ["--chunk-kb", str(chunk_kb), "--tensors", "40", "--dtype", "bfloat16", "--deltas"]
        seed_args += ["--step-lr", str(step_lr), "--upload-mbps", str(seed_mbps)]
        seed = PeerProcess("seed", *common, *seed_args, log_path=work / "seed.log")
        procs.append(seed)
        key = seed.wait_event("ready", 120)["key"]
        seed_id = seed.history[0]["peer_id"]
        v1, v2 = seed.wait_event("published", 600), seed.wait_event("published", 600)
        out = {"size_mb": size_mb, "peers": peers, "bytes": v2["total_size"], "delta_size": v2["delta_size"]}
        out["seed_upload_mbps"] = seed_mbps or None
        _say(
            f"  {size_mb} MB bf16 checkpoint; version 2's delta {v2['delta_size'] / 2**20:.2f} MiB "
            f"({v2['delta_size'] / v2['total_size']:.2%} of the state)"
        )
        for mode in ("delta", "full"):
            extra = ["--go-before", "1", *(["--no-delta"] if mode == "full" else [])]
            group = _fetchers(procs, common, work, mode, peers, key, [v1["manifest"], v2["manifest"]], extra)
            for p in group:
                p.wait_event("fetched", 900)  # version 1, in full
            t0, done = _go(group)
            if any(d["sha256"] != v2["sha256"] for d in done):
                raise RuntimeError("a peer assembled different bytes than the seeder published")
            from_seed = sum(d["from_provider"].get(seed_id, 0) for d in done)
            wire = sum(d["fetched_bytes"] for d in done)
            out[mode] = {
                "seconds_to_all": max(d["t_end"] for d in done) - t0,
                "bytes_on_wire": wire,
                "seeder_upload": from_seed,
                "peer_upload": wire - from_seed,
                "via": sorted({d["via"] for d in done}),
            }
            r = out[mode]
            _say(
                f"  → {peers} peers by {mode}: all hold version 2 after {r['seconds_to_all']:.2f} s; "
                f"seeder uploaded {from_seed / 2**20:.1f} MiB, "
                f"other peers {(wire - from_seed) / 2**20:.1f} MiB"
            )
            for p in group:
                p.stop()
        out["speedup"] = out["full"]["seconds_to_all"] / max(out["delta"]["seconds_to_all"], 1e-9)
        return out
    finally:
        for p in procs:
            p.__exit__(None, None, None)


def bench_trajectories(boot, work: Path, batches: int, rows: int, tokens: int, interval: float) -> dict:
    from heterorl.protocol import load_or_create_identity
    from heterorl.testing.procs import PeerProcess

    key_path = work / "learner.key"
    identity, _ = load_or_create_identity(key_path)
    common = ["--run", "bench-traj", "--bootstrap", *boot.maddrs]
    learner = PeerProcess(
        "learner",
        *common,
        "--key",
        str(key_path),
        "--ledger",
        str(work / "ledger.sqlite"),
        log_path=work / "learner.log",
    )
    sampler = None
    try:
        learner.wait_event("ready", 120)
        sampler = PeerProcess(
            "sampler",
            *common,
            "--outbox",
            str(work / "outbox.sqlite"),
            "--learner-key",
            identity.public_key.hex(),
            "--batches",
            str(batches),
            "--rows",
            str(rows),
            "--tokens",
            str(tokens),
            "--interval",
            str(interval),
            log_path=work / "sampler.log",
        )
        done = sampler.wait_event("done", 600)
        if done["pending"]:
            raise RuntimeError(f"{done['pending']} batches were not delivered")
        wire = done["net/bytes_sent"] / max(1, done["net/batches_acked"])
        out = {
            "batches": batches,
            "rows": rows,
            "tokens_per_row": tokens,
            "p50_s": done["p50"],
            "p99_s": done["p99"],
            "rtt_p50_s": done["rtt_p50"],
            "rtt_p99_s": done["rtt_p99"],
            "wire_bytes_per_batch": wire,
            "raw_payload_bytes": done["payload_bytes"],
            "wire_to_raw": wire / done["payload_bytes"],
        }
        _say(
            f"  {batches} batches of {rows}×{tokens} tokens: delivery p50 {done['p50'] * 1e3:.1f} ms, "
            f"p99 {done['p99'] * 1e3:.1f} ms; {wire:.0f} B on the wire per batch "
            f"vs {done['payload_bytes']} B "
            f"raw ({out['wire_to_raw']:.2f}×)"
        )
        return out
    finally:
        for p in (sampler, learner):
            if p is not None:
                p.__exit__(None, None, None)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 200], help="checkpoint sizes")
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 4, 8], help="fetching peer counts")
    ap.add_argument("--chunk-kb", type=int, default=4096, help="checkpoint chunk size")
    ap.add_argument("--batches", type=int, default=300, help="trajectory batches to deliver")
    ap.add_argument("--rows", type=int, default=16, help="rows per batch")
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per row")
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between batches")
    ap.add_argument(
        "--delta-peers", type=int, default=8, help="peers fetching a new version by delta vs full"
    )
    ap.add_argument(
        "--step-lr", type=float, default=1e-5, help="per-element step between the versions of the delta run"
    )
    ap.add_argument(
        "--seed-upload-mbps",
        type=float,
        default=0,
        help="cap the seeder's upload in the delta run (Mbit/s; 0: none): a learner on a real link",
    )
    ap.add_argument("--quick", action="store_true", help="8 MB, 1 and 2 peers, 50 batches (a smoke run)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--workdir", default=None, help="where peers keep their stores (default: a temp dir)")


def run_from_args(args: argparse.Namespace) -> int:
    from heterorl.protocol import Identity
    from heterorl.protocol.net.config import NetConfig
    from heterorl.protocol.net.node import Node

    if args.quick:
        args.sizes_mb, args.peers, args.batches, args.delta_peers = [8], [1, 2], 50, 2
    work = Path(args.workdir or tempfile.mkdtemp(prefix="heterorl-bench-net-"))
    work.mkdir(parents=True, exist_ok=True)
    boot = Node.start(Identity.generate(), NetConfig())
    results: dict = {"checkpoints": [], "trajectories": None}
    try:
        for size in args.sizes_mb:
            _say(f"checkpoint propagation, {size} MB:")
            results["checkpoints"].append(
                bench_checkpoints(boot, work / f"ckpt{size}", size, args.peers, args.chunk_kb)
            )
        if args.delta_peers:
            size = args.sizes_mb[0]
            _say(f"new version by delta vs in full, {args.delta_peers} peers, {size} MB:")
            results["delta_propagation"] = bench_delta_propagation(
                boot,
                work / "delta",
                size,
                args.delta_peers,
                args.chunk_kb,
                args.step_lr,
                args.seed_upload_mbps,
            )
        _say("trajectory delivery:")
        results["trajectories"] = bench_trajectories(
            boot, work / "traj", args.batches, args.rows, args.tokens, args.interval
        )
    finally:
        boot.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="heterorl bench network",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
