"""``heterorl bench exchange``: what a learner's compressed contribution costs, on real RL gradients.

For each model (the tiny offline model and SmolLM2-135M-Instruct, imported once as ``heterorl local --real``
does) it runs the one-process RL loop of ``heterorl train --local`` (hf rollouts, the run's objective, AdamW)
and takes each update's gradient (clipped, as the learner steps on it). Each goes through one learner's error
feedback and the codec (``peer/learner/compress.py``: top-k of each 4 096-value chunk, 2-bit values, 12-bit
indices) into a frame (``protocol/wire/sparse_gradient.py``), and back as the receiver decodes it. Per model:

- ``bytes_ratio``: the frame's bytes over the dense float32 gradient's (a learner sends one a version);
- ``encode_s`` / ``decode_s``: seconds to compress and pack one gradient, and to check and unpack one frame,
  on this machine's CPU (means over the updates);
- ``cosine`` and ``residual_rel``: how close what was sent over the updates is to the sum of the gradients:
  the cosine of the two sums, and the residual left on the learner over the norm of the sum. Error feedback
  sends the residual later, so neither is a loss, only a delay.

``--json FILE`` writes ``{"models": {NAME: {"bytes_ratio": r, "encode_s": ..., "decode_s": ..., ...}}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .weights import DEFAULTS, model_dir, rl_updates

UPDATES = {"tiny": 8, "smollm2-135m": 3}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def gradients_of(name: str, path: str, updates: int, seed: int) -> tuple[list, object]:
    """The clipped gradient of each of ``updates`` RL updates of model ``name`` (float32 CPU copies by
    parameter name), and the (name, shape) schema of its trainable parameters."""
    from heterorl.protocol.wire.gradients import parameter_schema

    grads: list = []
    schema: list = []

    def capture(step: int, policy, stats: dict) -> None:
        if not schema:
            schema.extend(parameter_schema(policy.named_parameters()))
        if step < 0:  # the hook sees the initial policy first, before any gradient
            return
        named = policy.named_parameters()
        grads.append({n: q.grad.detach().to("cpu").clone() for n, q in named if q.grad is not None})

    rl_updates(name, path, DEFAULTS[name].runs[0][0], updates, seed, capture)
    return grads, tuple(schema)


def measure(grads: list, schema, k: int) -> dict:
    """Each gradient through one learner's error feedback and the codec, and back (see the module doc)."""
    import torch

    from heterorl.peer.learner.compress import ErrorFeedback, flatten
    from heterorl.protocol.wire.sparse_gradient import decode_frame

    numel = sum(int(torch.Size(shape).numel()) for _, shape in schema)
    feedback = ErrorFeedback(numel, k=k)
    total = torch.zeros(numel, dtype=torch.float64)
    sent = torch.zeros(numel, dtype=torch.float64)
    enc, dec, sizes = [], [], []
    for g in grads:
        full = {n: g.get(n, torch.zeros(shape)) for n, shape in schema}
        vector = flatten(full, schema)
        total += vector.double()
        t = time.perf_counter()
        frame = feedback.step(vector).frame()
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = decode_frame(frame, numel, k=k)
        dec.append(time.perf_counter() - t)
        sent += got.double()
        sizes.append(len(frame))
    dense = 4 * numel
    cosine = float(torch.nn.functional.cosine_similarity(total, sent, dim=0))
    return {
        "params": numel,
        "k": k,
        "updates": len(grads),
        "dense_bytes": dense,
        "frame_bytes": sizes[0] if sizes else 0,
        "bytes_ratio": (sum(sizes) / len(sizes)) / dense if sizes else None,
        "encode_s": sum(enc) / max(len(enc), 1),
        "decode_s": sum(dec) / max(len(dec), 1),
        "cosine": cosine,
        "residual_rel": float(feedback.residual.double().norm() / total.norm().clamp_min(1e-30)),
    }


def format_table(results: dict) -> str:
    lines = [
        "| model | parameters | dense float32 | frame | ratio | encode | decode | cosine | residual |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["models"].items():
        lines.append(
            f"| {name} | {m['params']:,} | {m['dense_bytes'] / 2**20:.2f} MiB "
            f"| {m['frame_bytes'] / 1024:.1f} KiB "
            f"| {m['bytes_ratio']:.3%} ({1 / m['bytes_ratio']:.0f}x) | {m['encode_s'] * 1e3:.0f} ms "
            f"| {m['decode_s'] * 1e3:.0f} ms | {m['cosine']:.3f} | {m['residual_rel']:.3f} |"
        )
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument(
        "--models", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS), help="default: all"
    )
    ap.add_argument(
        "--updates", type=int, default=None, help="RL updates per model (default: tiny 8, SmolLM2 3)"
    )
    ap.add_argument(
        "--k", type=int, default=None, help="values sent per 4 096-value chunk (default: the codec's, 32)"
    )
    ap.add_argument("--model-dir", default=None, help="use this model directory (with one --models entry)")
    ap.add_argument("--cache", default="runs/models", help="where the tiny model is built")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE", help="write every figure here")


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from heterorl.protocol.wire.sparse_gradient import DEFAULT_K, check_k

    args.k = DEFAULT_K if args.k is None else args.k
    try:
        check_k(args.k)
    except ValueError as e:
        print(f"error: --k: {e}", file=sys.stderr)
        return 2
    if args.model_dir and len(args.models) != 1:
        print("error: --model-dir needs exactly one --models entry", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results: dict = {"date": time.strftime("%F"), "threads": args.threads, "models": {}}
    t0 = time.perf_counter()
    for name in args.models:
        path = model_dir(name, Path(args.cache), args.model_dir)
        updates = args.updates or UPDATES[name]
        _say(f"{name}: {updates} RL updates, their gradients through the codec (k={args.k})")
        grads, schema = gradients_of(name, path, updates, args.seed)
        results["models"][name] = measure(grads, schema, args.k)
    results["wall_s"] = time.perf_counter() - t0
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
