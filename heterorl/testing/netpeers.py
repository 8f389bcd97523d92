"""Small network peer processes for tests and ``heterorl bench network``: real nodes, real streams.

``python -m heterorl.testing.netpeers ROLE --help``. Every role prints one JSON line
``{"event": "ready", ...}`` once it is on the network, then JSON lines for what it did, and runs until its
work is done (or, for serving roles, until killed or stdin closes). Roles:

- ``seed``: a learner that builds checkpoint versions (random tensors, float32 or bf16, optionally with
  sparse deltas) and publishes them;
- ``fetch``: a peer that fetches a version from the swarm, then keeps serving its chunks;
- ``corrupt``: a hostile provider that announces a version and serves wrong bytes for every chunk;
- ``learner``: a trajectory receiver with a durable accepted log;
- ``sampler``: puts N signed batches into its outbox and delivers them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _node(args, identity):
    from heterorl.protocol.net.flags import net_config_from_args
    from heterorl.protocol.net.node import Node

    return Node.start(identity, net_config_from_args(args))


def _identity(path: str | None):
    from heterorl.protocol import Identity, load_or_create_identity

    return load_or_create_identity(path)[0] if path else Identity.generate()


def _wait_stdin_closed() -> None:
    """Serve until the parent closes our stdin (or kills us)."""
    try:
        while sys.stdin.read(1):
            pass
    except (OSError, ValueError):
        time.sleep(1e9)


def make_state_dict(total_bytes: int, tensors: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    per = max(1, total_bytes // 4 // tensors)
    return {f"layer{i:03d}.weight": torch.randn(per, generator=g) for i in range(tensors)}


def build_version(
    store,
    identity,
    run_id: str,
    version: int,
    parent: int,
    state: dict,
    chunk_bytes: int,
    *,
    dtype: str = "float32",
    delta: bool = False,
    bad_delta: bool = False,
):
    """Serialise (as ``dtype``), chunk into ``store`` and sign the manifest, with sparse deltas against the
    (up to 8) newest versions in ``store`` when ``delta`` (``bad_delta``: ones that rebuild a state off by
    one word, signed anyway, as a buggy learner would); returns (manifest_raw, body). Data first."""
    import torch

    from heterorl.protocol import encode
    from heterorl.protocol.wire.checkpoint import (
        add_delta,
        manifest_body,
        referenced_hashes,
        serialize_state_dict,
    )
    from heterorl.protocol.wire.delta import CODEC, encode_delta

    data = serialize_state_dict({k: v.to(getattr(torch, dtype)) for k, v in state.items()})
    body, chunks = manifest_body(run_id, version, parent, data, dtype, chunk_bytes)
    target = bytearray(data)
    if bad_delta:
        target[-1] ^= 1
    for base in sorted(store.versions(), reverse=True)[:8] if delta else ():  # the newest first
        chunks += add_delta(body, base, encode_delta(store.assemble(base), bytes(target)), CODEC)
    for h, c in zip(referenced_hashes(body), chunks, strict=True):
        store.put(h, c)
    return encode("CheckpointManifest", body, identity), body


def cmd_seed(args) -> None:
    from heterorl.protocol.net.chunks import ChunkServer, publish_checkpoint
    from heterorl.protocol.storage.store import ChunkStore

    identity = _identity(args.key)
    store = ChunkStore(args.store, max_bytes=1 << 40)
    node = _node(args, identity)
    server = ChunkServer(store, upload_bytes_per_s=args.upload_mbps * 1e6 / 8 if args.upload_mbps else None)
    node.call(server.attach(node))
    emit("ready", maddrs=node.maddrs, key=identity.public_key.hex(), peer_id=node.peer_id)
    state = make_state_dict(args.size_mb << 20, args.tensors, seed=0)
    parent = -1
    for version in range(1, args.versions + 1):
        if version > 1 and args.step_lr:  # an optimizer step: every element moves by ~lr
            import torch

            state = {n: t + args.step_lr * torch.randn_like(t).sign() for n, t in state.items()}
        elif version > 1:  # change a fraction of the tensors, as a partial fine-tune would
            import torch

            names = sorted(state)[: max(1, int(len(state) * args.change_frac))]
            for n in names:
                state[n] = state[n] + torch.randn_like(state[n]) * 1e-3
        raw, body = build_version(
            store,
            identity,
            args.run,
            version,
            parent,
            state,
            args.chunk_kb << 10,
            dtype=args.dtype,
            delta=args.deltas,
            bad_delta=version in args.bad_delta,
        )
        node.call(publish_checkpoint(node, store, raw, body))
        emit(
            "published",
            version=version,
            sha256=hashlib.sha256(store.assemble(version)).hexdigest(),
            manifest=raw.hex(),
            total_size=body["total_size"],
            delta_size=body["deltas"][0]["total_size"] if "deltas" in body else None,  # the newest base's
            delta_sizes={str(d["base_version"]): d["total_size"] for d in body.get("deltas", ())},
            chunks=len(body["chunk_hashes"]),
        )
        if args.interval:
            time.sleep(args.interval)
        parent = version
    _wait_stdin_closed()
    node.close()


def cmd_fetch(args) -> None:
    from heterorl.protocol.net.chunks import ChunkServer, latest_manifest
    from heterorl.protocol.net.fetch import fetch_checkpoint
    from heterorl.protocol.storage.store import ChunkStore

    store = ChunkStore(args.store, max_bytes=1 << 40)
    node = _node(args, _identity(args.key))
    server = ChunkServer(store)
    node.call(server.attach(node))
    learner_keys = [bytes.fromhex(args.learner_key)]
    emit("ready", maddrs=node.maddrs, peer_id=node.peer_id, held=store.versions())
    manifests = [bytes.fromhex(m) for m in args.manifest]
    if args.latest:  # the real path: find the newest allowed manifest in the DHT
        deadline = time.monotonic() + args.timeout
        while True:
            found = node.call(latest_manifest(node, args.run, learner_keys, args.latest))
            if found is not None:
                manifests.append(found[0])
                break
            if time.monotonic() > deadline:
                emit("error", reason=f"no manifest of version >= {args.latest} in the DHT")
                sys.exit(1)
            time.sleep(0.2)
    if args.wait_go:  # start together with the other fetchers (propagation benchmarks)
        emit("waiting")
        sys.stdin.readline()
    last = [0.0]

    def progress(report, to_fetch: int) -> None:
        now = time.monotonic()
        if now - last[0] > 0.05 or report.fetched_bytes >= to_fetch:
            last[0] = now
            emit("progress", version=report.version, fetched_bytes=report.fetched_bytes, to_fetch=to_fetch)

    for n, raw in enumerate(manifests):
        if args.go_before == n:  # hold the earlier versions, then start the next one together with others
            emit("waiting")
            sys.stdin.readline()
        t = time.perf_counter()
        try:
            report = node.call(
                fetch_checkpoint(
                    node,
                    store,
                    raw,
                    run_id=args.run,
                    learner_keys=learner_keys,
                    timeout=args.timeout,
                    progress=progress,
                    use_delta=not args.no_delta,
                ),
            )
        except Exception as e:
            emit("error", reason=f"{type(e).__name__}: {e}")
            sys.exit(1)
        emit(
            "fetched",
            version=report.version,
            seconds=time.perf_counter() - t,
            t_end=time.time(),
            sha256=hashlib.sha256(store.assemble(report.version)).hexdigest(),
            fetched_bytes=report.fetched_bytes,
            reused_bytes=report.reused_bytes,
            total_bytes=report.total_bytes,
            bad_providers=report.bad_providers,
            from_provider=report.from_provider,
            via=report.via,
            delta_base=report.delta_base,
            delta_error=report.delta_error,
        )
    if args.serve:
        _wait_stdin_closed()
    emit("served", **server.stats())
    node.close()


def cmd_corrupt(args) -> None:
    from heterorl.protocol.net.chunks import PROTOCOL, _announce, _parse_request
    from heterorl.protocol.net.framing import read_frame, write_frame

    node = _node(args, _identity(None))
    sizes = {}

    async def serve_garbage(remote, reader, writer):
        while True:
            try:
                req = await read_frame(reader, 4096, 60)
            except EOFError:
                return
            for h in _parse_request(req):
                await write_frame(writer, b"\x00" + os.urandom(sizes.get(h, args.chunk_kb << 10)))

    node.call(node.add_handler(PROTOCOL, serve_garbage))
    from heterorl.protocol import decode

    for manifest_hex in args.manifest:
        _, body, _ = decode(bytes.fromhex(manifest_hex))
        n = len(body["chunk_hashes"])
        for i, h in enumerate(body["chunk_hashes"]):
            sizes[h] = (
                body["chunk_bytes"] if i < n - 1 else body["total_size"] - body["chunk_bytes"] * (n - 1)
            )
        node.call(_announce(node, args.run, body["version"], complete=True))
    emit("ready", maddrs=node.maddrs, peer_id=node.peer_id)
    _wait_stdin_closed()
    node.close()


def cmd_learner(args) -> None:
    from heterorl.protocol.net.trajectories import TrajectoryReceiver
    from heterorl.protocol.storage.ledger import AcceptedLog

    identity = _identity(args.key)
    ledger = AcceptedLog(args.ledger)
    node = _node(args, identity)

    def on_accept(body: dict, _author: bytes, _raw: bytes) -> None:
        emit("accepted", id=body["batch_id"].hex())

    receiver = TrajectoryReceiver(identity, args.run, ledger, on_accept=on_accept)
    node.call(receiver.attach(node))
    hb = {
        "run_id": args.run,
        "role": "learner",
        "state": "learning",
        "policy_version": 0,
        "tokens_per_s": 0.0,
        "timestamp": time.time(),
        "peer_id": node.peer_id,
        "maddrs": node.plain_maddrs(),
        "hardware": "cpu",
        "stats": [],
    }
    node.call(node.publish("Heartbeat", hb, 120))
    emit("ready", maddrs=node.maddrs, peer_id=node.peer_id, already=ledger.count())
    _wait_stdin_closed()
    emit("stats", **receiver.stats(), logged=ledger.count())
    node.close()
    ledger.close()


def cmd_sampler(args) -> None:
    from heterorl.protocol import encode
    from heterorl.protocol.net.trajectories import TrajectorySender, new_batch_id
    from heterorl.protocol.storage.outbox import Outbox

    identity = _identity(args.key)
    outbox = Outbox(args.outbox)
    node = _node(args, identity)
    # a learner SIGKILLed mid-stream answers nothing: a sender gives up on the stream after 10 s, not 30
    sender = TrajectorySender(node, outbox, args.run, [bytes.fromhex(args.learner_key)], request_timeout=10.0)
    task = node.spawn(sender.run())
    emit("ready", maddrs=node.maddrs, peer_id=node.peer_id)
    ids = []
    row = {
        "group": 0,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4, 5] * (args.tokens // 2),
        "logprobs": [-0.5, -0.25] * (args.tokens // 2),
        "reward": 1.0,
    }
    for _ in range(args.batches):
        bid = new_batch_id()
        body = {
            "run_id": args.run,
            "batch_id": bid,
            "policy_version": 0,
            "timestamp": time.time(),
            "rows": [row] * args.rows,
        }
        outbox.put(bid, encode("TrajectoryBatch", body, identity), 0)
        sender.notify()
        ids.append(bid.hex())
        time.sleep(args.interval)
    emit("queued", ids=ids)
    deadline = time.time() + args.timeout
    while len(outbox) and time.time() < deadline:
        time.sleep(0.1)
    rtt, delivery = sorted(sender.latencies), sorted(sender.delivery_latencies)
    emit(
        "done",
        pending=len(outbox),
        **sender.stats(),
        rtt_p50=_quantile(rtt, 0.5),
        rtt_p99=_quantile(rtt, 0.99),
        p50=_quantile(delivery, 0.5),
        p99=_quantile(delivery, 0.99),
        # the same rows as flat int32 token ids + float32 log-probs + float32 reward, no framing
        payload_bytes=args.rows * (len(row["prompt_ids"]) * 4 + len(row["completion_ids"]) * 8 + 4),
    )
    task.cancel()
    node.close()
    outbox.close()


def _quantile(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m heterorl.testing.netpeers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="role", required=True)

    def common(sp):
        from heterorl.protocol.net.flags import add_net_arguments

        sp.add_argument("--run", default="test-run")
        add_net_arguments(sp)
        sp.add_argument("--key", default=None, help="identity key file (default: a fresh key)")
        sp.add_argument("--log", default="WARNING")
        return sp

    s = common(sub.add_parser("seed"))
    s.add_argument("--store", required=True)
    s.add_argument("--size-mb", type=int, default=8)
    s.add_argument("--tensors", type=int, default=32)
    s.add_argument("--chunk-kb", type=int, default=1024)
    s.add_argument("--versions", type=int, default=1)
    s.add_argument("--change-frac", type=float, default=0.1)
    s.add_argument("--upload-mbps", type=float, default=0, help="upload cap in Mbit/s (0: none)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="published dtype")
    s.add_argument(
        "--deltas", action="store_true", help="offer each version as deltas against the older ones"
    )
    s.add_argument("--step-lr", type=float, default=0, help="versions move every element by this (0: off)")
    s.add_argument("--bad-delta", type=int, nargs="*", default=[], help="versions whose delta rebuilds wrong")
    s.add_argument("--interval", type=float, default=0, help="seconds between versions")
    s = common(sub.add_parser("fetch"))
    s.add_argument("--store", required=True)
    s.add_argument("--manifest", nargs="*", default=[], help="hex of signed manifests, fetched in order")
    s.add_argument("--latest", type=int, default=0, help="then fetch the newest version >= N from the DHT")
    s.add_argument("--wait-go", action="store_true", help="read a line from stdin before fetching")
    s.add_argument("--learner-key", required=True)
    s.add_argument("--timeout", type=float, default=300)
    s.add_argument("--serve", action="store_true", help="keep serving after the fetch until stdin closes")
    s.add_argument("--no-delta", action="store_true", help="fetch every version in full, never by its delta")
    s.add_argument("--go-before", type=int, default=-1, help="read a line from stdin before manifest #N")
    s = common(sub.add_parser("corrupt"))
    s.add_argument("--manifest", nargs="+", required=True)
    s.add_argument("--chunk-kb", type=int, default=1024)
    s = common(sub.add_parser("learner"))
    s.add_argument("--ledger", required=True)
    s = common(sub.add_parser("sampler"))
    s.add_argument("--outbox", required=True)
    s.add_argument("--learner-key", required=True)
    s.add_argument("--batches", type=int, default=20)
    s.add_argument("--rows", type=int, default=8)
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--interval", type=float, default=0.05)
    s.add_argument("--timeout", type=float, default=120)
    args = p.parse_args(argv)
    from heterorl.protocol.logs import configure_logging

    configure_logging(args.log)
    {
        "seed": cmd_seed,
        "fetch": cmd_fetch,
        "corrupt": cmd_corrupt,
        "learner": cmd_learner,
        "sampler": cmd_sampler,
    }[args.role](args)


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
