"""``python -m heterorl.bench.learner_overhead``: what a learner update costs besides forward and backward,
and what publishing every version costs the update rate.

The learner's own pipeline, without the network: batches wait in a :class:`TrajectoryBuffer` (as accepted
batches do), the :class:`BatchAssembler` thread builds each update's tensors, the training thread runs
``Trainer.step``, marks the batches applied in a real ledger and hands a snapshot to the :class:`Publisher`
thread, which saves the state, chunks and diffs the version (on the trainer's device), stores it in a real
chunk store and "announces" it (no DHT here). Runs side by side on the same model and batches (``--sides``):
no publishing; every version offered to the background publisher (saving the state every
``--save-every-s``); and, for comparison, every version saved and published on the training thread, as the
learner did before. Per update it reports the wall time, the forward+backward time (``time/fwd_bwd_s``),
everything else on the training thread (the overhead), the training thread's time blocked by publishing,
the publisher thread's time and how many versions it published.

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


SIDES = {
    "no_publishing": "no versions published",
    "background": "every version handed to the publisher thread (what the learner does)",
    "inline": "every version saved and published on the training thread (what the learner did before)",
}


def run(model, args, publish: bool | str, work: Path) -> dict:
    """One side: ``publish`` False (none), True or "background" (the publisher thread), "inline"."""
    from heterorl.peer.daemon.announcer import Announcer
    from heterorl.peer.daemon.publisher import Publisher
    from heterorl.peer.learner.assembler import BatchAssembler
    from heterorl.peer.learner.buffer import Buffered, TrajectoryBuffer
    from heterorl.peer.learner.trainer import Trainer, adamw
    from heterorl.peer.learner.update import StepOptions
    from heterorl.protocol import Identity
    from heterorl.protocol.storage.ledger import AcceptedLog
    from heterorl.protocol.storage.store import ChunkStore

    opts = StepOptions("gepo", None, {}, 1.0, args.new_tokens, lr=1e-6, grad_clip=1.0,
                       micro_batch_tokens=args.micro_batch_tokens)  # fmt: skip
    unfused = getattr(args, "unfused", False)
    optimizer = (lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.0)) if unfused else adamw
    trainer = Trainer(model, opts, pad_id=0, optimizer=optimizer)
    inline = publish == "inline"
    background = bool(publish) and not inline
    ledger = AcceptedLog(work / "ledger.sqlite")
    store = ChunkStore(work / "chunks", max_bytes=64 << 30)

    def announced(raw: bytes, body: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut

    pub = Publisher(run_id="bench", identity=Identity.generate(), store=store, ledger=ledger,
                    announcer=Announcer(announced), state_root=work / "state",
                    checkpoint_dtype=args.checkpoint_dtype, deltas=args.deltas,
                    save_every_s=getattr(args, "save_every_s", 300.0))  # fmt: skip
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
    if background:
        threads.append(threading.Thread(target=pub.run, daemon=True))
    if publish:
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
        if background:
            pub.offer(lambda: trainer.snapshot(args.checkpoint_dtype, with_state=pub.save_due()))
        elif inline:
            pub.publish_now(trainer.snapshot(args.checkpoint_dtype))
        t3 = time.perf_counter()
        blocked += t3 - t2
        rows.append({"wall_s": t3 - t0, "wait_s": t1 - t0, "fwd_bwd_s": stats["time/fwd_bwd_s"],
                     "blocked_s": t3 - t2})  # fmt: skip
    if background:
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
    ap.add_argument(
        "--save-every-s", type=float, default=300.0, help="the background side's learner.save_every_s"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument(
        "--sides",
        nargs="+",
        choices=list(SIDES),
        default=["no_publishing", "background"],
        help="; ".join(f"{k}: {v}" for k, v in SIDES.items()),
    )
    ap.add_argument(
        "--unfused",
        action="store_true",
        help="AdamW's per-tensor loop instead of torch's fused kernel (what the learner used before)",
    )
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
    print(
        f"{out['source']} on {args.device}, {out['threads']} torch threads, {args.updates} updates per side"
    )
    for side in args.sides:
        with tempfile.TemporaryDirectory() as work:
            out[side] = run(fresh(), args, {"no_publishing": False}.get(side, side), Path(work))
        print(side, json.dumps(out[side]), flush=True)
    base = out.get("no_publishing")
    for side in args.sides:
        p = out[side]
        ratio = p["updates_per_s"] / base["updates_per_s"] if base else None
        p["rate_vs_no_publishing"] = ratio
        print(
            f"{side:14s} update {p['update_s']:.3f} s: forward+backward {p['fwd_bwd_s']:.3f} s, everything "
            f"else {p['overhead_s']:.3f} s (of it blocked by publishing {p['blocked_s']:.3f} s); "
            f"{p['published']} versions published"
            + (f"; update rate {ratio:.2f}x no publishing" if ratio is not None else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
