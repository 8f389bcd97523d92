"""``heterorl bench lineage-links``: learner peers on shaped links, one learner against two, dense or sparse.

Each setup is a swarm of real processes, every peer on a network namespace host of its own whose link tc
shapes (tbf, ``--link-mbit`` each way; the kernel here has no netem, so no added delay): a coordinator, the
setup's learners (one lineage) and ``--samplers`` samplers, sampler ``i`` sending to learner ``i mod N``.
After the first version is published it measures ``--duration`` seconds: versions committed per second, rows
trained per second (every learner's own batches in those versions), each learner's seconds waiting for the
writer, the bytes over the learners' lineage links, and ``weights_agree``: every version a member checked
against the writer's signed checkpoint hashed the same (None with one learner). The setups (``--setups``):
``1`` (one learner), ``2-dense`` and ``2-sparse`` (``[lineage] exchange``, overlap on, the default), and
``2-dense-serial`` / ``2-sparse-serial`` (overlap off).

The tiny model's float32 gradient is 0.55 MB, so a few Mbit/s stand for what 1 Gbit/s is to a 1.5B model's
6.2 GB: the default 4 Mbit/s makes a dense exchange (three gradients a version through the writer's link) take
about 3 s against an update's fraction of a second, as a 1.5B model's takes 150 s against 4 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

SETUPS = {  # name -> (learners, [lineage] toml)
    "1": (1, ""),
    "2-dense": (2, '[lineage]\nexchange = "dense"\n'),
    "2-sparse": (2, '[lineage]\nexchange = "sparse"\n'),
    "2-dense-serial": (2, '[lineage]\nexchange = "dense"\noverlap = false\n'),
    "2-sparse-serial": (2, '[lineage]\nexchange = "sparse"\noverlap = false\n'),
}
LEARNER_SETTINGS = {"prompts_per_update": 8, "group_size": 8, "publish_every": 4, "buffer_batches": 32}
SAMPLER_NICE = 10  # samplers below the learners, as if on machines of their own
WARMUP_TIMEOUT_S = 300.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--setups", nargs="+", choices=list(SETUPS), default=["1", "2-dense", "2-sparse"],
        help="what to run, one swarm each (default: %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--link-mbit", type=float, default=4.0, help="every host's link, each way (default %(default)s)"
    )
    ap.add_argument("--samplers", type=int, default=4, help="samplers per setup (default: %(default)s)")
    ap.add_argument(
        "--duration", type=float, default=120.0, help="seconds measured per setup (default: %(default)s)"
    )
    ap.add_argument(
        "--model-dir", default="runs/tiny-model", help="the model (default: the tiny one, built if missing)"
    )
    ap.add_argument("--out", default="runs/lineage-links", help="work dirs (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work dirs (logs, state dirs)")


def run_from_args(args: argparse.Namespace) -> int:
    from heterorl.testing import netns

    if os.geteuid() != 0 or netns.available() is not None:
        print(
            f"error: needs root and network namespaces ({netns.available() or 'not root'})", file=sys.stderr
        )
        return 2
    if args.link_mbit <= 0 or args.samplers < 1 or args.duration <= 0:
        print("error: --link-mbit and --duration must be > 0, --samplers >= 1", file=sys.stderr)
        return 2
    from heterorl.peer.model import ensure_model

    model = ensure_model(args.model_dir)
    results = {}
    for name in args.setups:
        print(f"{name}: starting ({args.link_mbit:g} Mbit/s links, {args.samplers} samplers)", flush=True)
        out = Path(args.out).resolve() / name
        if out.exists():
            shutil.rmtree(out)
        results[name] = measure(name, out, model, args)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print("\n".join(table(results, args.link_mbit)))
    if args.json:
        doc = {"link_mbit": args.link_mbit, "samplers": args.samplers, "duration_s": args.duration}
        Path(args.json).write_text(json.dumps({**doc, "setups": results}, indent=1))
        print(f"results in {args.json}")
    return 0


def measure(name: str, out: Path, model: str, args: argparse.Namespace) -> dict:
    """One setup's swarm, measured over ``args.duration`` seconds after its first published version."""
    from heterorl.testing.netns import Lan
    from heterorl.testing.swarm import Swarm

    learners, toml = SETUPS[name]
    swarm = Swarm(out, model, learners=learners, extra_toml=toml, **LEARNER_SETTINGS)
    samplers = [f"sampler-{i}" for i in range(args.samplers)]
    for i, s in enumerate(samplers):
        if learners > 1:
            swarm.sampler_key_for(s, i % learners)
    hosts = ["coord", *(d.name for d in swarm.learner_dirs), *samplers]
    with Lan(hosts) as lan:
        for h in hosts:
            lan.shape(h, args.link_mbit)

        def here(h: str) -> list[str]:
            return ["--host-maddrs", f"/ip4/{lan.addr(h)}/tcp/0"]

        try:
            swarm.start_coordinator(*here("coord"), wrap=lan.wrap("coord"))
            for i, d in enumerate(swarm.learner_dirs):
                swarm.start_learner(*here(d.name), wrap=lan.wrap(d.name), index=i)
            for s in samplers:
                swarm.start_sampler(s, *here(s), "--nice", str(SAMPLER_NICE), wrap=lan.wrap(s))
            deadline = time.monotonic() + WARMUP_TIMEOUT_S
            while not any(any((d / "chunks" / "manifests").glob("*.msg")) for d in swarm.learner_dirs):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{name}: no version published in {WARMUP_TIMEOUT_S:.0f} s\n{swarm.logs()}"
                    )
                time.sleep(1.0)
            t0 = time.time()
            time.sleep(args.duration)
            t1 = time.time()
        finally:
            swarm.close()
    return _figures(swarm, t0, t1)


def _figures(swarm, t0: float, t1: float) -> dict:
    from heterorl.protocol.storage.jsonlog import read_rows

    versions: set[int] = set()
    rows = 0
    waits, link = [], 0
    for i, d in enumerate(swarm.learner_dirs):
        for r in swarm.metrics(i):
            if t0 <= r["time"] < t1:
                versions.add(r["step"])
                rows += sum((r.get("rows_by_author") or {}).values())
        stats_path = d / "final_stats.json"
        lineage = json.loads(stats_path.read_text()).get("lineage", {}) if stats_path.exists() else {}
        waits.append(round(lineage.get("lineage/member_wait_s", 0.0), 1))
        link += lineage.get("lineage/link_bytes_sent", 0) + lineage.get("lineage/bytes_sent", 0)
    checked = []
    for d in swarm.learner_dirs:
        with contextlib.suppress(FileNotFoundError):
            checked += [r for r in read_rows(d / "lineage.jsonl") if r.get("event") == "checked"]
    span = t1 - t0
    agree = None if len(swarm.learner_dirs) == 1 else bool(checked) and all(r["agree"] for r in checked)
    return {
        "learners": len(swarm.learner_dirs),
        "versions_per_s": round(len(versions) / span, 3),
        "rows_per_s": round(rows / span, 2),
        "member_wait_s": waits,
        "lineage_bytes_sent": link,
        "versions_checked": len(checked),
        "weights_agree": agree,
    }


def table(results: dict, mbit: float) -> list[str]:
    base = results.get("1", {}).get("rows_per_s")
    lines = [
        f"learner peers on {mbit:g} Mbit/s links (tc tbf, each way):",
        "",
        "| setup | versions/s | rows/s | vs 1 learner | member wait s | lineage bytes sent | weights agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = f"{r['rows_per_s'] / base:.2f}×" if base else "—"
        agree = "—" if r["weights_agree"] is None else ("yes" if r["weights_agree"] else "NO")
        lines.append(
            f"| {name} | {r['versions_per_s']:.2f} | {r['rows_per_s']:.1f} | {ratio} | "
            f"{' · '.join(str(w) for w in r['member_wait_s'])} | {r['lineage_bytes_sent']:,} | {agree} "
            f"({r['versions_checked']} checked) |"
        )
    return lines
