"""Simulate a large HeteroRL run: thousands of heterogeneous volunteer samplers, churn, one or more learners.

A discrete-event model (heterorl/sim/) that reuses the real bookkeeping: the learner's staleness
rule, bounded buffer and staleness buckets, the senders' backoff, the checkpoint chunking and the wire size
of real signed messages. It reports the staleness distribution the learner sees, learner utilisation
(training / publishing / waiting for data), where samplers' time goes, and bytes per peer per hour.

Give several --samplers values to see how the run scales; --json keeps every figure. The default fleet
(--fleet to replace it) and learner speed are assumptions for a 1.5B-parameter model, stated in --help.

A checkpoint switch costs either sparse bf16 deltas (--delta-ratio: a number, or the ratio `heterorl bench
weights --json FILE` measured) or the changed chunks of the older chunk model (--changed-frac); by default the
full checkpoint every time.

--learners N (several values: one run each) trains one lineage on N learner peers: samplers spread over them
by rendezvous hashing, each version a step to which every learner with a full update contributes one. Every
learner has a link of its own (--learner-link-bytes-per-s, each way); the writer's carries the exchange. With
--exchange sparse (the default, as the run's) each member with data sends a compressed part (--exchange-ratio
of its float32 gradient, what `heterorl bench exchange` measures) and the writer sends every member its
commit, compressed again to one part's size; two encode + decode pairs (--codec-s-per-gb) sit on the round's
path. With --exchange dense the float32 gradients go in, and the commit's parameter update and combined
gradient out. A version's exchange runs while the next update is computed (--no-overlap:
after it), as the daemon's [lineage] overlap does.

example:
  heterorl simulate --samplers 100 1000 3000 --hours 2
  heterorl simulate --samplers 1000 --publish-every 10 --changed-frac 0.05
  heterorl bench weights --json w.json; heterorl simulate --samplers 1000 --delta-ratio w.json
  heterorl simulate --samplers 1000 --delta-ratio w.json:tiny --background-fetch --max-lag 16
  heterorl simulate --samplers 1000 --learners 1 2 4 --learner-link-bytes-per-s 1.25e8 --no-overlap
  heterorl simulate --samplers 1000 --learners 1 2 4 --exchange dense --learner-link-bytes-per-s 1.25e10
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from heterorl.protocol.wire.staleness import at_least


def delta_ratio(spec: str) -> tuple[float, str]:
    """``--delta-ratio``: a number, or ``FILE.json[:model]`` written by ``heterorl bench weights --json``
    (``models[model]["delta_ratio"]``; without ``:model`` the one model whose name contains "smol").
    Returns the ratio and where it came from; ValueError says what is wrong."""
    try:
        r, src = float(spec), "given"
    except ValueError:
        r, src = _ratio_from_bench_json(spec)
    if not (math.isfinite(r) and 0 < r <= 1):
        raise ValueError(f"--delta-ratio must lie in (0, 1], got {r} ({src})")
    return r, src


def _ratio_from_bench_json(spec: str) -> tuple[float, str]:
    path, model = spec, None
    if not Path(spec).exists() and ":" in spec:
        path, model = spec.rsplit(":", 1)
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--delta-ratio {spec}: not a number, and {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--delta-ratio {spec}: {path} is not JSON ({e})") from None
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f'{path}: no "models" (expected the JSON of `heterorl bench weights --json`)')
    keys = ", ".join(sorted(models))
    if model is None:
        smol = [k for k in models if "smol" in k.lower()]
        if len(smol) != 1:
            which = "no model" if not smol else "several models"
            raise ValueError(f"{path}: {which} named *smol*; pick one with {path}:MODEL (models: {keys})")
        model = smol[0]
    if model not in models:
        raise ValueError(f"{path}: no model {model!r}; models: {keys}")
    m = models[model]
    r = m.get("delta_ratio") if isinstance(m, dict) else None
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise ValueError(f"{path}: model {model!r} has no numeric delta_ratio ({r!r})")
    lr = m.get("lr")
    src = model + (f" at lr {lr:g}" if isinstance(lr, (int, float)) else "") + f", from {path}"
    if m.get("bit_identical") is False:
        src += "; WARNING: bench weights found deltas that did not rebuild bit-identically"
    return float(r), src


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from .config import SimConfig

    d = SimConfig()
    ap.add_argument("--samplers", type=int, nargs="+", default=[100, 1000, 3000], help="fleet sizes to run")
    ap.add_argument("--hours", type=float, default=d.hours, help="simulated hours (default %(default)s)")
    ap.add_argument("--warmup-h", type=float, default=d.warmup_h, help="left out of the statistics")
    ap.add_argument("--fleet", default=None, help="JSON list of hardware classes (default: built-in mix)")
    ap.add_argument("--no-churn", action="store_true", help="samplers never leave")
    ap.add_argument(
        "--background-fetch",
        action="store_true",
        help="keep generating with the held version while the next one downloads, with the stop rule "
        "(--max-lag, busy); default: fetch between batches and wait for it",
    )
    ap.add_argument(
        "--max-lag",
        type=int,
        metavar="K",
        default=None,
        help="with --background-fetch: start no batch while more than K published versions behind the "
        f"newest (run.toml sampler.max_lag; default {d.max_lag}; -1: never)",
    )
    ap.add_argument(
        "--no-busy-pause",
        action="store_true",
        help="with --background-fetch: keep generating while the learner says busy (the stop rule pauses)",
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
    g.add_argument(
        "--learners",
        type=int,
        nargs="+",
        default=[d.learners],
        help="learner peers training one lineage (several values: one run each; default %(default)s)",
    )
    g.add_argument(
        "--learner-link-bytes-per-s",
        type=float,
        default=d.learner_link_bytes_per_s,
        help="every learner's own link, each direction (full duplex); the writer's is the bottleneck: every "
        "member's contribution in, the commit out to each member (default %(default)g: 10 Gbit/s)",
    )
    g.add_argument(
        "--learner-rtt-s",
        type=float,
        default=d.learner_rtt_s,
        help="round trip between a learner and the writer (default %(default)s)",
    )
    g.add_argument(
        "--exchange",
        choices=("dense", "sparse"),
        default=d.exchange,
        help="what learner peers exchange per version, as [lineage] exchange: sparse (default): compressed "
        "parts in, a compressed commit out; dense: float32 gradients in, the parameter update and combined "
        "gradient out",
    )
    g.add_argument(
        "--exchange-ratio",
        type=float,
        metavar="R",
        default=None,
        help="with --exchange sparse: one part's bytes (and the commit's) over the float32 gradient's "
        f"(default {d.exchange_ratio}: top 32 of each 4096 values, 2-bit codes, as `heterorl bench exchange` "
        "measured)",
    )
    g.add_argument(
        "--codec-s-per-gb",
        type=float,
        metavar="S",
        default=None,
        help="with --exchange sparse: seconds to encode and decode one float32 GB of gradient on a learner; "
        f"a round's path has two such pairs, a member's part and the writer's commit (default "
        f"{d.codec_s_per_gb}: an estimate for a GPU learner, not measured; on 2 CPU cores `heterorl bench "
        "exchange` measured about 4.2 s/GB)",
    )
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=d.overlap,
        help="learner peers exchange a version while computing the next update (one exchange in flight), "
        "as the daemon's [lineage] overlap does (default %(default)s); --no-overlap: compute, then exchange",
    )
    g.add_argument("--announce-s", type=float, default=d.announce_s, help="until samplers find a manifest")
    g.add_argument("--model-bytes", type=float, default=d.model_bytes, help="checkpoint size (1.5B bf16)")
    x = g.add_mutually_exclusive_group()
    x.add_argument(
        "--delta-ratio",
        default=None,
        metavar="R|FILE.json[:MODEL]",
        help="a switch fetches sparse bf16 deltas: one update's delta is R × the checkpoint, or the "
        "delta_ratio `heterorl bench weights --json FILE` measured (MODEL default: the one named *smol*); "
        "a chain costs the sum, capped at the full checkpoint; a newcomer fetches in full",
    )
    x.add_argument(
        "--changed-frac",
        type=float,
        default=None,
        help="the older chunk model: each update changes this fraction of chunks (default 1: in full)",
    )
    g.add_argument(
        "--delta-bases",
        type=int,
        metavar="N",
        default=None,
        help="with --delta-ratio: a peer more than N published versions behind fetches in full "
        "(run.toml learner.deltas; default: no limit)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every figure here")


def _config(args: argparse.Namespace, n: int, learners: int = 1):
    from .config import SimConfig

    if not args.background_fetch and (args.max_lag is not None or args.no_busy_pause):
        raise ValueError("--max-lag and --no-busy-pause are the stop rule of --background-fetch: add it")
    if args.delta_bases is not None and args.delta_ratio is None:
        raise ValueError("--delta-bases needs --delta-ratio")
    ratio = delta_ratio(args.delta_ratio)[0] if args.delta_ratio is not None else None
    if args.exchange == "dense" and (args.exchange_ratio is not None or args.codec_s_per_gb is not None):
        raise ValueError("--exchange-ratio and --codec-s-per-gb are the sparse exchange's: not with dense")
    return SimConfig(
        samplers=n,
        hours=args.hours,
        warmup_h=args.warmup_h,
        churn=not args.no_churn,
        background_fetch=args.background_fetch,
        max_lag=SimConfig.max_lag if args.max_lag is None else args.max_lag,
        busy_pause=not args.no_busy_pause,
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
        learners=learners,
        learner_link_bytes_per_s=args.learner_link_bytes_per_s,
        learner_rtt_s=args.learner_rtt_s,
        exchange=args.exchange,
        exchange_ratio=SimConfig.exchange_ratio if args.exchange_ratio is None else args.exchange_ratio,
        codec_s_per_gb=SimConfig.codec_s_per_gb if args.codec_s_per_gb is None else args.codec_s_per_gb,
        overlap=args.overlap,
        model_bytes=int(args.model_bytes),
        changed_frac=1.0 if args.changed_frac is None else args.changed_frac,
        delta_ratio=ratio,
        delta_bases=args.delta_bases,
        seed=args.seed,
    )


def table(results: list[dict]) -> str:
    head = (
        "| samplers | updates/h | learner train / publish / wait | staleness mean · p50 · p90 · max "
        "| 0-1 · 2-7 · 8-15 · 16+ | sampler time gen / fetch / full outbox / paused behind · busy "
        "| sampler GB/h down (p90) · up "
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
            f"| {b['0'] + b['1']:.0%} · {b['2-3'] + b['4-7']:.0%} · {b['8-15']:.0%} · {at_least(b, 16):.0%} "
            f"| {t.get('generating', 0) / online:.0%} / {t.get('fetching', 0) / online:.0%} "
            f"/ {t.get('outbox full', 0) / online:.0%} "
            f"/ {t.get('paused (behind)', 0) / online:.0%} · {t.get('paused (busy)', 0) / online:.0%} "
            f"| {gb['down_median']:.1f} ({gb['down_p90']:.1f}) · {gb['up_median']:.2f} "
            f"| {r['learner_upload_GB_per_h']:.0f} "
            f"| {c.get('busy_replies', 0) / max(1, c.get('batches_accepted', 0)):.1f} "
            f"| {c.get('batches_refused_stale', 0) / max(1, c.get('batches_generated', 0)):.0%} |"
        )
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB" if nbytes else "0"


def learners_table(results: list[dict]) -> str:
    """What the learner peers did: one row a run."""
    head = (
        "| samplers | learners | versions/h | rows trained/s | exchange | overlap "
        "| lineage computing / exchanging / publishing / waiting "
        "| learner computing · in round, waiting (mean of learners) | updates per version "
        "| through the writer's link per version (s) | samplers per learner |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in results:
        lr, lt = r["learners"], r["learner"]
        per = lr["per_learner"]
        computing = sum(x["computing"] for x in per) / len(per)
        waiting = sum(x["in_round_waiting"] for x in per) / len(per)
        mode, overlap = (lr["exchange"], "yes" if lr["overlap"] else "no") if lr["count"] > 1 else ("—", "—")
        lines.append(
            f"| {r['config']['samplers']} | {lr['count']} | {r['updates_per_h']:.0f} "
            f"| {r['trajectories_per_s']:.0f} | {mode} | {overlap} "
            f"| {lr['rounds']['computing']:.0%} / {lr['rounds']['exchanging']:.0%} / {lt['publishing']:.0%} "
            f"/ {lt['waiting']:.0%} | {computing:.0%} · {waiting:.0%} | {lr['updates_per_version']:.2f} "
            f"| {_size(lr['exchange_bytes_per_version'])} ({lr['exchange_s_per_version']:.2f} s) "
            f"| {' · '.join(str(x['samplers']) for x in per)} |"
        )
    return "\n".join(lines)


def exchange_line(cfg) -> str:
    """How learner peers exchange, for the run's header."""
    g = cfg.gradient_bytes
    if cfg.exchange == "dense":
        what = f"dense exchange: float32 gradients of {_size(g)}, no codec time"
    else:
        what = (
            f"sparse exchange: parts and commits of {cfg.exchange_ratio:.4g} × the {_size(g)} float32 "
            f"gradient ({_size(cfg.part_bytes)}), codec {cfg.codec_s:.2f} s a round ({cfg.codec_s_per_gb:g} "
            "s/GB)"
        )
    when = "during the next update (overlap)" if cfg.overlap else "after the update"
    return (
        f"learner peers: {what}; every learner's link {cfg.learner_link_bytes_per_s:g} B/s each way, "
        f"round trip {cfg.learner_rtt_s:g} s; the exchange runs {when}"
    )


def run(args: argparse.Namespace) -> int:
    from .engine import Simulation, label
    from .fleet import load_fleet
    from .wire import chunk_lengths, synthetic_manifest, trajectory_batch_bytes

    try:
        fleet = load_fleet(args.fleet)
        configs = [_config(args, n, k) for n in args.samplers for k in args.learners]
    except (ValueError, OSError) as e:
        print(f"error: {e}")
        return 2
    c0 = configs[0]
    if c0.delta_ratio is not None:
        bases = "no limit" if c0.delta_bases is None else f"at most {c0.delta_bases} versions behind"
        switch = (
            f"sparse bf16 deltas, {c0.delta_ratio:.4g} of the checkpoint per update "
            f"({delta_ratio(args.delta_ratio)[1]}), chained ({bases}), else in full"
        )
    elif c0.changed_frac < 1:
        switch = f"changed chunks, {c0.changed_frac:.4g} of them per update"
    else:
        switch = "the full checkpoint"
    rule = (
        f"background fetch, stop rule max_lag {c0.max_lag}" + (", paused while busy" if c0.busy_pause else "")
        if c0.background_fetch
        else "fetch between batches, waiting for it"
    )
    print(f"a checkpoint switch fetches {switch}; {rule}")
    if any(c.learners > 1 for c in configs):
        print(exchange_line(c0))
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
    if any(r["learners"]["count"] > 1 for r in results):
        print(learners_table(results))
    for cfg, r in zip(configs, results, strict=True):
        per_class = ", ".join(
            f"{k} gen {v['generating']:.0%} fetch {v['fetching']:.0%}" for k, v in r["by_class"].items()
        )
        c = r["counts"]
        switches = f"; versions behind when a batch starts: mean {r['generation_lag']['mean']:.1f}, max "
        switches += f"{r['generation_lag']['max']}; switches by delta {c.get('fetched_delta', 0):,}, "
        switches += f"in full {c.get('fetched_full', 0):,}"
        print(f"{label(cfg)} ({r['events']:,} events, {r['wall_s']:.0f} s): {per_class}" + switches)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"figures in {args.json}")
    return 0
