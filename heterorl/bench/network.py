"""``heterorl bench network``: checkpoint propagation, delta bytes and trajectory delivery on loopback.

Every peer is a real process (``heterorl.testing.netpeers``) with its own go-libp2p daemon and DHT node; this
process holds the bootstrap node. Figures, all from one run:

- propagation: one seeder holds a checkpoint of S MB; N fresh peers start fetching it at the same instant
  (each waits on stdin for "go"); the time until the last one holds a verified copy, against one raw TCP
  copy of the same bytes over loopback in this process (``socket.sendall`` → ``recv_into``). Peers serve
  what they hold, so later peers can fetch from earlier ones.
- delta: a peer holding version 1 fetches version 2 (a fraction of tensors changed): bytes on the wire
  against the full size.
- trajectories: one learner, one sampler sending signed batches; outbox-put → Ack latency p50/p99 and the
  wire bytes per batch against the raw payload (int32 token ids + float32 log-probs + float32 reward).

On a 2-core machine all peers share the CPUs, so N-peer times include CPU contention; the ratio to the raw
copy, measured side by side, is the figure to compare.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


def raw_tcp_copy_s(nbytes: int) -> float:
    """Seconds for one loopback TCP transfer of ``nbytes`` (sender thread → receiver, 1 MiB buffers)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = memoryview(bytes(1 << 20))

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            left = nbytes
            while left > 0:
                n = min(left, len(payload))
                conn.sendall(payload[:n])
                left -= n

    t = threading.Thread(target=send, daemon=True)
    t.start()
    buf = bytearray(1 << 20)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        got = 0
        while got < nbytes:
            n = c.recv_into(buf)
            if n == 0:
                raise RuntimeError("raw copy: connection closed early")
            got += n
    elapsed = time.perf_counter() - start
    t.join()
    server.close()
    return elapsed


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
            group = []
            for i in range(n):
                p = PeerProcess(
                    "fetch",
                    *common,
                    "--store",
                    str(work / f"n{n}-{i}"),
                    "--learner-key",
                    key,
                    "--manifest",
                    v1["manifest"],
                    "--wait-go",
                    "--serve",
                    log_path=work / f"n{n}-{i}.log",
                )
                procs.append(p)
                group.append(p)
            for p in group:
                p.wait_event("waiting", 120)
            t0 = time.time()
            for p in group:
                p.send("go")
            done = [p.wait_event("fetched", 900) for p in group]
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
    ap.add_argument("--quick", action="store_true", help="8 MB, 1 and 2 peers, 50 batches (a smoke run)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--workdir", default=None, help="where peers keep their stores (default: a temp dir)")


def run_from_args(args: argparse.Namespace) -> int:
    from heterorl.protocol import Identity
    from heterorl.protocol.node import NetConfig, Node

    if args.quick:
        args.sizes_mb, args.peers, args.batches = [8], [1, 2], 50
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


def format_table(results: dict) -> str:
    lines = [
        "| checkpoint | peers | time to all (s) | raw TCP copy (s) | ratio | seeder share |",
        "|---|---|---|---|---|---|",
    ]
    for c in results["checkpoints"]:
        for r in c["propagation"]:
            lines.append(
                f"| {c['size_mb']} MB | {r['peers']} | {r['seconds_to_all']:.2f} | {c['raw_tcp_s']:.3f} | "
                f"{r['ratio_to_raw_copy']:.1f}× | {r['seeder_upload_fraction']:.0%} |"
            )
    lines += [
        "",
        "| checkpoint | full fetch (MiB) | delta fetch, 10% tensors changed (MiB) | fraction |",
        "|---|---|---|---|",
    ]
    for c in results["checkpoints"]:
        d = c["delta"]
        lines.append(
            f"| {c['size_mb']} MB | {d['full_bytes'] / 2**20:.1f} | {d['delta_bytes'] / 2**20:.1f} | "
            f"{d['fraction']:.1%} |"
        )
    t = results["trajectories"]
    if t:
        lines += [
            "",
            "| batches | rows × tokens | delivery p50 (ms) | p99 (ms) | Ack round trip p50 (ms) "
            "| wire B/batch | raw B/batch | wire/raw |",
            "|---|---|---|---|---|---|---|---|",
            f"| {t['batches']} | {t['rows']}×{t['tokens_per_row']} | {t['p50_s'] * 1e3:.1f} | "
            f"{t['p99_s'] * 1e3:.1f} | {t['rtt_p50_s'] * 1e3:.1f} | {t['wire_bytes_per_batch']:.0f} | "
            f"{t['raw_payload_bytes']} | {t['wire_to_raw']:.2f}× |",
        ]
    return "\n".join(lines)


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
