"""``heterorl bench chaos``: a seeded fault campaign against learner peers, judged from the files they wrote.

It runs a coordinator, ``--learners`` learners (one lineage: every key is in run.toml's ``learner_keys``)
and ``--samplers`` honest samplers as real processes on this machine; as root, each on a network namespace
"host" of its own (``--link-mbit``: every host's link shaped with tc tbf, both directions). After the first
version is published it applies a seeded schedule of faults (:mod:`.chaos_faults`: kills, pauses, a writer
killed as a member resumes, cut links, dropped and delayed commits, every learner restarted at once) for
``--duration`` seconds, leaves ``--quiet-s`` seconds without faults, stops every process with SIGTERM, and
checks the invariants (:mod:`.chaos_check`) from the learners' lineage logs, ledgers and stores and the
samplers' logs and stores, never from the processes' own counters: no version signed twice (``forks``), no
strike or ban against an honest sampler (``honest_strikes``), no batch trained twice on the final lineage
(``trained_twice``), no two learners' weights apart (``disagreements``), no process that exited on its own
with an error (``crashed``); and versions published after the last fault.

Every process gets ``HETERORL_CHAOS=1`` (the learner acts on the commit faults' ``chaos-fault`` file only
then). The work dir (``--out``) is deleted at the end unless ``--keep`` is given or an invariant failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from .chaos_faults import EVERY_S, Executor, Role, schedule

LEARNER_SETTINGS = {  # every learner saves often: a killed one loses little; a version per update
    "publish_every": 1,
    "save_every_s": 5,
    "prompts_per_update": 8,
    "group_size": 8,
}
SAMPLER_NICE = 10  # samplers below the learners, as if on machines of their own (= heterorl local's)
WARMUP_TIMEOUT_S = 300.0  # the first version must be published within this long, or the campaign fails
STOP_TIMEOUT_S = 20.0  # = Swarm.close's: SIGKILL after this
CHAOS_ENV = "HETERORL_CHAOS"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--learners", type=int, default=3, help="learner peers of one lineage (default: %(default)s)"
    )
    ap.add_argument("--samplers", type=int, default=3, help="honest samplers (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of faults (default: %(default)s)")
    ap.add_argument("--quiet-s", type=float, default=45.0, help="a fault-free tail (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1, help="the schedule's seed (default: %(default)s)")
    ap.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="shape every host's link to this many Mbit/s each way (tc tbf; needs root and namespaces)",
    )
    ap.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every peer on a network namespace host of its own (default: when root); adds link cuts",
    )
    ap.add_argument("--out", default=None, help="the work dir (default: runs/chaos-SEED)")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument(
        "--fault-every-s",
        type=float,
        nargs=2,
        metavar=("MIN", "MAX"),
        default=list(EVERY_S),
        help="a fault every U(MIN, MAX) seconds (default: %(default)s)",
    )
    ap.add_argument(
        "--model-dir", default="runs/tiny-model", help="the model (default: the tiny one, built if missing)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, state dirs) at the end")


def _refusal(args: argparse.Namespace) -> str | None:
    from heterorl.testing import netns

    lo, hi = args.fault_every_s
    if args.learners < 1 or args.samplers < 1:
        return "--learners and --samplers must be >= 1"
    if args.duration <= 0 or args.quiet_s < 0 or not 0 < lo <= hi:
        return "--duration > 0, --quiet-s >= 0 and 0 < MIN <= MAX for --fault-every-s"
    if args.link_mbit is not None:
        if os.geteuid() != 0:
            return "--link-mbit needs root: each peer runs on a network namespace host whose link tc shapes"
        if args.netns is False:
            return "--link-mbit shapes the namespace hosts' links: not with --no-netns"
        if args.link_mbit <= 0:
            return "--link-mbit must be > 0"
    if args.netns and netns.available() is not None:
        return f"--netns: {netns.available()}"
    return None


def run_from_args(args: argparse.Namespace) -> int:
    why = _refusal(args)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    use_netns = args.netns if args.netns is not None else os.geteuid() == 0
    from heterorl.peer.model import ensure_model

    model = ensure_model(args.model_dir)
    if not Path(model).exists():
        print(f"error: no model at {model}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/chaos-{args.seed}").resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ[CHAOS_ENV] = "1"  # every process started from here inherits it (Proc passes the environment)
    faults = schedule(
        args.seed, args.duration, args.learners, args.samplers, use_netns, tuple(args.fault_every_s)
    )
    (out / "schedule.json").write_text(json.dumps([f.__dict__ for f in faults], indent=1))
    where = "network namespaces" if use_netns else "127.0.0.1"
    if args.link_mbit:
        where += f", links {args.link_mbit:g} Mbit/s"
    print(
        f"chaos: {args.learners} learners, {args.samplers} samplers, {len(faults)} faults over "
        f"{args.duration:.0f} s (seed {args.seed}), then {args.quiet_s:.0f} s quiet; {where}; work dir {out}",
        flush=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through `finally`: stop the children
    try:
        result = _campaign(args, out, model, faults, use_netns)
    except _WarmupFailed as e:
        print(f"error: {e}\nwork dir kept: {out}", file=sys.stderr)
        return 1
    lines, failed = table(result)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"result in {args.json}")
    if args.keep or failed:
        print(f"work dir kept: {out}" + (" (an invariant failed)" if failed and not args.keep else ""))
    else:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


class _WarmupFailed(RuntimeError):
    pass


def _campaign(args: argparse.Namespace, out: Path, model: str, faults: list, use_netns: bool) -> dict:
    from heterorl.protocol import load_or_create_identity
    from heterorl.testing.netns import Lan
    from heterorl.testing.swarm import Swarm

    from .chaos_check import check

    swarm = Swarm(out, model, learners=args.learners, **LEARNER_SETTINGS)
    samplers = [f"sampler-{i}" for i in range(args.samplers)]
    for i, name in enumerate(samplers):  # sampler i sends to learner i mod N first
        swarm.sampler_key_for(name, i % args.learners)
    honest = [load_or_create_identity(out / n / "peer.key")[0].public_key for n in samplers]
    hosts = ["coord", *(d.name for d in swarm.learner_dirs), *samplers]
    shaped: dict[str, str] = {}
    with Lan(hosts) if use_netns else contextlib.nullcontext() as lan:
        if lan is not None and args.link_mbit:
            for h in hosts:
                lan.shape(h, args.link_mbit)
            shaped = {h: lan.qdiscs(h) for h in hosts}

        roles = _roles(swarm, lan, samplers)
        executor = Executor(
            swarm, roles, lan, args.seed, _say, swarm.learner_keys, out / "coordinator" / "view.json"
        )
        started = time.time()
        try:
            executor.start_all()  # the coordinator first: the others join through it
            _warm_up(executor, swarm, time.monotonic() + WARMUP_TIMEOUT_S)
            _say(f"first version published after {time.time() - started:.0f} s: faults begin")
            executor.run(faults)
            executor.settle()
            _say(f"last fault done; {args.quiet_s:.0f} s quiet")
            executor.sleep(args.quiet_s)
        finally:
            executor.finish()
            swarm.close()
        stop_codes = {r.name: (r.proc.p.returncode if r.proc is not None else None) for r in roles}
    with (out / "faults.jsonl").open("w") as f:
        for rec in executor.records():
            f.write(json.dumps(rec) + "\n")
    checked = check(swarm.learner_dirs, [out / n for n in samplers], honest, executor.fault_ends())
    done = [a for a in executor.applied if not a.skipped]
    crashed = [e for e in executor.exits if e["code"] != 0]
    return {
        "faults": len(done),
        "fault_kinds": dict(collections.Counter(a.fault.kind for a in done)),
        "invariants": {**checked.invariants, "crashed": len(crashed)},
        "versions_after_last_fault": checked.versions_after_last_fault,
        "versions_published": checked.versions_published,
        "info": {
            **checked.info,
            "faults_skipped": sum(a.skipped for a in executor.applied),
            "exits": executor.exits,
            "left_down": [r.name for r in roles if r.proc is None],
            "exit_codes_at_stop": stop_codes,
            "wall_s": round(time.time() - started, 1),
            "shaping": shaped,
            "fault_log": executor.records(),
        },
        "seed": args.seed,
        "duration_s": args.duration,
        "link_mbit": args.link_mbit,
        "netns": use_netns,
    }


def _roles(swarm, lan, samplers: list[str]) -> list[Role]:
    """The coordinator (watched, never a fault's target), the learners and the samplers, each started (again)
    on its own state dir and, with namespaces, on its own host."""

    def here(host: str) -> list[str]:
        return ["--host-maddrs", f"/ip4/{lan.addr(host)}/tcp/0"] if lan is not None else []

    def wrap(host: str) -> list[str] | None:
        return lan.wrap(host) if lan is not None else None

    def coordinator():
        swarm.start_coordinator(*here("coord"), wrap=wrap("coord"))
        return swarm.coord

    def learner(i: int, name: str):
        return swarm.start_learner(*here(name), wrap=wrap(name), index=i)

    def sampler(name: str):
        return swarm.start_sampler(name, *here(name), "--nice", str(SAMPLER_NICE), wrap=wrap(name))

    roles = [Role("coordinator", "coordinator", "coord", coordinator, swarm.root / "coordinator")]
    for i, d in enumerate(swarm.learner_dirs):
        roles.append(Role(d.name, "learner", d.name, functools.partial(learner, i, d.name), d))
    for n in samplers:
        roles.append(Role(n, "sampler", n, functools.partial(sampler, n), swarm.root / n))
    return roles


def _warm_up(executor: Executor, swarm, deadline: float) -> None:
    """Wait for a learner to hold a published version (its store's first signed manifest)."""
    while not any(any((d / "chunks" / "manifests").glob("*.msg")) for d in swarm.learner_dirs):
        if time.monotonic() > deadline:
            raise _WarmupFailed(f"no version published in {WARMUP_TIMEOUT_S:.0f} s\n{swarm.logs()}")
        if all(r.proc is None for r in executor.learners):
            raise _WarmupFailed(f"every learner exited, again and again, before a version\n{swarm.logs()}")
        executor.sleep(1.0)


def _say(line: str) -> None:
    print(line, flush=True)


def table(result: dict) -> tuple[list[str], bool]:
    """The final table, and whether the campaign failed (an invariant not 0, no version after the faults)."""
    inv = result["invariants"]
    failed = any(v != 0 for v in inv.values()) or result["versions_after_last_fault"] == 0
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(result["fault_kinds"].items()))
    info = result["info"]
    lines = [
        f"faults survived: {result['faults']} ({kinds})",
        "",
        "| invariant | count |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in inv.items()),
        "",
        f"versions published: {result['versions_published']}, after the last fault: "
        f"{result['versions_after_last_fault']}; takeovers {info.get('takeovers')}; commits per learner "
        f"{info.get('commits_per_learner')}",
        f"batches: {info.get('batches_accepted')} accepted, {info.get('batches_trained_on_path')} trained "
        f"on the final lineage ({info.get('final_path_commits')} commits), {info.get('batches_dropped')} "
        f"dropped, {info.get('batches_lost')} pending and never trained",
    ]
    for e in info.get("exits", []):
        lines.append(f"exited on its own: {e['name']} code {e['code']} at {e['at_s']:.0f} s")
    why = [k for k, v in inv.items() if v]
    if result["versions_after_last_fault"] == 0:
        why.append("no version published after the last fault")
    lines.append("FAIL: " + ", ".join(why) if failed else "PASS")
    return lines, failed
