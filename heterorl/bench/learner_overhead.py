"""``python -m heterorl.bench.learner_overhead``: what a learner update costs besides forward and backward,
and what publishing every version costs the update rate.

The learner's own pipeline, without the network: batches wait in a :class:`TrajectoryBuffer` (as accepted
batches do), the :class:`BatchAssembler` thread builds each update's tensors, the training thread runs
``Trainer.step``, marks the batches applied in a real ledger and hands a snapshot to the :class:`Publisher`
thread, which saves the state, chunks and diffs the version (on the trainer's device), stores it in a real
chunk store and "announces" it (no DHT here). Two runs side by side on the same model and batches: publishing
every update, and no publishing. Per update it reports the wall time, the forward+backward time
(``time/fwd_bwd_s``), everything else on the training thread (the overhead), the training thread's time
blocked by publishing (the snapshot), the publisher thread's time and how many versions it published.

``--model DIR`` takes real weights (e.g. SmolLM2-135M-Instruct imported by ``heterorl model import smollm2``);
``--arch`` builds a known architecture with random weights (what ``gpu_check`` runs at 1.5B on a GPU).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch


def _rows_bodies(n_batches: int, prompts: int, group: int, prompt_len: int, new_tokens: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    bodies = []
    for b in range(n_batches):
        rows = [
            {
                "group": i // group,
                "prompt_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist(),
                "completion_ids": torch.randint(3, vocab, (new_tokens,), generator=g).tolist(),
                "logprobs": [-2.0] * new_tokens,
                "reward": float(torch.randint(0, 2, (1,), generator=g)),
            }
            for i in range(prompts * group)
        ]
        bodies.append({"batch_id": b.to_bytes(16, "big"), "policy_version": 0, "rows": rows})
    return bodies


def run(model, args, publish: bool, work: Path) -> dict:
    from heterorl.peer.daemon.announcer import Announcer
    from heterorl.peer.daemon.publisher import Publisher
    from heterorl.peer.learner.assembler import BatchAssembler
    from heterorl.peer.learner.buffer import Buffered, TrajectoryBuffer
    from heterorl.peer.learner.trainer import Trainer
    from heterorl.peer.learner.update import StepOptions
    from heterorl.protocol import Identity
    from heterorl.protocol.storage.ledger import AcceptedLog
    from heterorl.protocol.storage.store import ChunkStore

    opts = StepOptions("gepo", None, {}, 1.0, args.new_tokens, lr=1e-6, grad_clip=1.0,
                       micro_batch_tokens=args.micro_batch_tokens)  # fmt: skip
    trainer = Trainer(model, opts, pad_id=0)
    ledger = AcceptedLog(work / "ledger.sqlite")
    store = ChunkStore(work / "chunks", max_bytes=64 << 30)

    def announced(raw: bytes, body: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut

    pub = Publisher(run_id="bench", identity=Identity.generate(), store=store, ledger=ledger,
                    announcer=Announcer(announced), state_root=work / "state",
                    checkpoint_dtype=args.checkpoint_dtype, deltas=args.deltas)  # fmt: skip
    buf = TrajectoryBuffer(capacity=args.updates + 1)
    per_update = args.prompts  # each body is one update's groups
    vocab = model.config.vocab_size
    for body in _rows_bodies(
        args.updates, args.prompts, args.group_size, args.prompt_len, args.new_tokens, vocab
    ):
        ledger.accept(body["batch_id"], b"a" * 32, 0, b"x", 0.0)
        buf.put(Buffered(body["batch_id"], b"a" * 32, body, 0.0))
    asm = BatchAssembler(buf, lambda: per_update, 0, trainer.device)
    threads = [threading.Thread(target=asm.run, daemon=True)]
    if publish:
        threads.append(threading.Thread(target=pub.run, daemon=True))
        pub.publish_now(trainer.snapshot(args.checkpoint_dtype, with_state=False))  # version 0
    for t in threads:
        t.start()
    rows, blocked = [], 0.0
    for _ in range(args.updates):
        t0 = time.perf_counter()
        got = asm.take()
        t1 = time.perf_counter()
        stats = trainer.step(got.rows)
        ledger.mark_applied([b.batch_id for b in got.batches], trainer.version)
        t2 = time.perf_counter()
        if publish:
            pub.offer(lambda: trainer.snapshot(args.checkpoint_dtype))
        t3 = time.perf_counter()
        blocked += t3 - t2
        rows.append({"wall_s": t3 - t0, "wait_s": t1 - t0, "fwd_bwd_s": stats["time/fwd_bwd_s"],
                     "blocked_s": t3 - t2})  # fmt: skip
    if publish:
        pub.close()
        pub.wait_idle()
    asm.close()
    ledger.close()
    steady = rows[args.warmup :]
    wall = sum(r["wall_s"] for r in steady)
    return {
        "updates_per_s": len(steady) / wall,
        "update_s": statistics.median(r["wall_s"] for r in steady),
        "fwd_bwd_s": statistics.median(r["fwd_bwd_s"] for r in steady),
        # everything on the training thread but forward and backward (and a wait for data, none here)
        "overhead_s": statistics.median(r["wall_s"] - r["fwd_bwd_s"] - r["wait_s"] for r in steady),
        "blocked_s": statistics.median(r["blocked_s"] for r in steady),
        "published": pub.published,
        "publisher_s": {k: round(v, 3) for k, v in pub.seconds.items()},
        "delta_ratio": pub.stats()["delta_ratio"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m heterorl.bench.learner_overhead", description=__doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory (real weights)")
    src.add_argument("--arch", help="an architecture of heterorl.bench.gpu_check (random weights)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="updates left out of the figures")
    ap.add_argument("--prompts", type=int, default=4, help="prompt groups per update")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=None)
    ap.add_argument("--checkpoint-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--deltas", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")

    def fresh():
        if args.model:
            from heterorl.peer.model import load_model

            return load_model(args.model, device=args.device)[0]
        from .gpu_check import build

        return build(args.arch, args.device)

    out = {"source": args.model or args.arch, "device": args.device, "threads": torch.get_num_threads(),
           "args": vars(args)}  # fmt: skip
    for name, publish in (("no_publishing", False), ("publish_every_update", True)):
        with tempfile.TemporaryDirectory() as work:
            out[name] = run(fresh(), args, publish, Path(work))
        print(name, json.dumps(out[name]), flush=True)
    out["rate_ratio"] = out["publish_every_update"]["updates_per_s"] / out["no_publishing"]["updates_per_s"]
    p = out["publish_every_update"]
    print(
        f"{out['source']} on {args.device}: update {p['update_s']:.3f} s, of which forward+backward "
        f"{p['fwd_bwd_s']:.3f} s and everything else {p['overhead_s']:.3f} s (snapshot for the publisher "
        f"{p['blocked_s']:.3f} s); {p['published']} of {args.updates + 1} versions published in the "
        f"background; update rate with publishing every update / without: {out['rate_ratio']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
