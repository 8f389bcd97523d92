"""Simulate a large HeteroRL run: thousands of heterogeneous volunteer samplers, churn, one learner.

A discrete-event model (heterorl/sim/engine.py) that reuses the real bookkeeping: the learner's staleness
rule, bounded buffer and staleness buckets, the senders' backoff, the checkpoint chunking and the wire size
of real signed messages. It reports the staleness distribution the learner sees, learner utilisation
(training / publishing / waiting for data), where samplers' time goes, and bytes per peer per hour.

Give several --samplers values to see how the run scales; --json keeps every figure. The default fleet
(--fleet to replace it) and learner speed are assumptions for a 1.5B-parameter model, stated in --help.

example:
  heterorl simulate --samplers 100 1000 3000 --hours 2
  heterorl simulate --samplers 1000 --publish-every 10 --changed-frac 0.05
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from .engine import SimConfig

    d = SimConfig()
    ap.add_argument("--samplers", type=int, nargs="+", default=[100, 1000, 3000], help="fleet sizes to run")
    ap.add_argument("--hours", type=float, default=d.hours, help="simulated hours (default %(default)s)")
    ap.add_argument("--warmup-h", type=float, default=d.warmup_h, help="left out of the statistics")
    ap.add_argument("--fleet", default=None, help="JSON list of hardware classes (default: built-in mix)")
    ap.add_argument("--no-churn", action="store_true", help="samplers never leave")
    ap.add_argument(
        "--background-fetch",
        action="store_true",
        help="what-if (not what the sampler does today): keep generating while the next checkpoint downloads",
    )
    g = ap.add_argument_group("the run (as in run.toml)")
    g.add_argument("--prompts-per-update", type=int, default=d.prompts_per_update)
    g.add_argument("--group-size", type=int, default=d.group_size)
    g.add_argument("--prompts-per-batch", type=int, default=d.prompts_per_batch)
    g.add_argument("--buffer-batches", type=int, default=d.buffer_batches)
    g.add_argument("--max-staleness", type=int, default=d.max_staleness, help="-1: keep everything")
    g.add_argument("--publish-every", type=int, default=d.publish_every)
    g.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    g.add_argument("--completion-tokens", type=int, default=d.completion_tokens, help="mean per completion")
    g = ap.add_argument_group("the learner and the checkpoint")
    g.add_argument(
        "--learner-tokens-per-s",
        type=float,
        default=d.learner_tokens_per_s,
        help="training tokens/s of the learner (default %(default)s: one GPU, 1.5B model)",
    )
    g.add_argument("--publish-s", type=float, default=d.publish_s, help="seconds to publish a checkpoint")
    g.add_argument("--announce-s", type=float, default=d.announce_s, help="until samplers find a manifest")
    g.add_argument("--model-bytes", type=float, default=d.model_bytes, help="checkpoint size (1.5B bf16)")
    g.add_argument(
        "--changed-frac", type=float, default=d.changed_frac, help="chunks one update changes (1: full FT)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every figure here")


def _config(args: argparse.Namespace, n: int):
    from .engine import SimConfig

    return SimConfig(
        samplers=n,
        hours=args.hours,
        warmup_h=args.warmup_h,
        churn=not args.no_churn,
        background_fetch=args.background_fetch,
        prompts_per_update=args.prompts_per_update,
        group_size=args.group_size,
        prompts_per_batch=args.prompts_per_batch,
        buffer_batches=args.buffer_batches,
        max_staleness=args.max_staleness,
        publish_every=args.publish_every,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
        learner_tokens_per_s=args.learner_tokens_per_s,
        publish_s=args.publish_s,
        announce_s=args.announce_s,
        model_bytes=int(args.model_bytes),
        changed_frac=args.changed_frac,
        seed=args.seed,
    )


def table(results: list[dict]) -> str:
    head = (
        "| samplers | updates/h | learner train / publish / wait | staleness mean · p50 · p90 · max "
        "| 0-1 · 2-7 · 8-15 · 16+ | sampler time gen / fetch / full outbox | sampler GB/h down (p90) · up "
        "| learner up GB/h | busy replies per accept | generated batches refused as stale |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        st, b, lt, t = r["staleness"], r["staleness"]["buckets"], r["learner"], r["sampler_time"]
        gb, c = r["sampler_GB_per_h"], r["counts"]
        online = sum(v for k, v in t.items() if k != "offline") or 1
        lines.append(
            f"| {r['config']['samplers']} | {r['updates_per_h']:.0f} "
            f"| {lt['training']:.0%} / {lt['publishing']:.0%} / {lt['waiting']:.0%} "
            f"| {st['mean']:.1f} · {st['p50']} · {st['p90']} · {st['max']} "
            f"| {b['0'] + b['1']:.0%} · {b['2-3'] + b['4-7']:.0%} · {b['8-15']:.0%} · {b['16+']:.0%} "
            f"| {t.get('generating', 0) / online:.0%} / {t.get('fetching', 0) / online:.0%} "
            f"/ {t.get('outbox full', 0) / online:.0%} "
            f"| {gb['down_median']:.1f} ({gb['down_p90']:.1f}) · {gb['up_median']:.2f} "
            f"| {r['learner_upload_GB_per_h']:.0f} "
            f"| {c.get('busy_replies', 0) / max(1, c.get('batches_accepted', 0)):.1f} "
            f"| {c.get('batches_refused_stale', 0) / max(1, c.get('batches_generated', 0)):.0%} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from .engine import Simulation
    from .fleet import load_fleet
    from .wire import chunk_lengths, synthetic_manifest, trajectory_batch_bytes

    try:
        fleet = load_fleet(args.fleet)
        configs = [_config(args, n) for n in args.samplers]
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return 2
    c0 = configs[0]
    batch_bytes = trajectory_batch_bytes(
        c0.prompts_per_batch, c0.group_size, c0.prompt_tokens, c0.completion_tokens
    )
    chunks = chunk_lengths(synthetic_manifest(c0.model_bytes))
    print(
        f"one TrajectoryBatch ({c0.prompts_per_batch}×{c0.group_size} rows, {c0.prompt_tokens}+"
        f"{c0.completion_tokens} tokens) = {batch_bytes:,} bytes on the wire; checkpoint "
        f"{c0.model_bytes / 1e9:.2f} GB = {len(chunks)} chunks; fleet: "
        + ", ".join(f"{c.name} {c.share:.0%}" for c in fleet)
    )
    results = []
    for cfg in configs:
        t = time.perf_counter()
        r = Simulation(cfg, fleet, batch_bytes, chunks).run(progress=True)
        r["wall_s"] = time.perf_counter() - t
        results.append(r)
    print(table(results))
    for r in results:
        per_class = ", ".join(
            f"{k} gen {v['generating']:.0%} fetch {v['fetching']:.0%}" for k, v in r["by_class"].items()
        )
        print(
            f"{r['config']['samplers']} samplers ({r['events']:,} events, {r['wall_s']:.0f} s): {per_class}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"figures in {args.json}")
    return 0
