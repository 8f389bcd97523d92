"""``heterorl local``: start the processes, watch them, stop after ``--steps`` updates, summarise."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from .options import apply_real_preset, local_model, peer_consent, run_of, run_toml
from .procs import Proc, ready_line, stop_all
from .report import curve_line, render, summarise, view_of

log = logging.getLogger("heterorl.localswarm")

SAMPLER_NICE = 10


def learner_dirs_of(out: Path, n: int) -> list[Path]:
    """``n`` learner state directories, each with its key: ``learner`` holds the lowest key (the lineage's
    writer), then ``learner-1``, ``learner-2``..."""
    from heterorl.protocol import load_or_create_identity

    made = []
    for i in range(n):
        d = out / f".learner-key-{i}"
        d.mkdir()
        made.append((load_or_create_identity(d / "peer.key")[0].public_key, d))
    dirs = []
    for i, (_, d) in enumerate(sorted(made, key=lambda x: x[0])):
        dirs.append(d.rename(out / ("learner" if i == 0 else f"learner-{i}")))
    return dirs


def key_for_learner(sampler_dir: Path, learner_keys: list[bytes], index: int) -> None:
    """Give the sampler in ``sampler_dir`` a key whose first choice of learner (rendezvous hashing) is
    ``learner_keys[index]``: on one machine, samplers are spread evenly over the learners."""
    from heterorl.protocol import load_or_create_identity
    from heterorl.protocol.net.trajectories import LearnerAddress, rendezvous_order

    learners = [LearnerAddress(k, str(i), ()) for i, k in enumerate(learner_keys)]
    sampler_dir.mkdir(parents=True, exist_ok=True)
    while True:
        key = load_or_create_identity(sampler_dir / "peer.key")[0].public_key
        if rendezvous_order(key, learners)[0].peer_id == str(index):
            return
        (sampler_dir / "peer.key").unlink()


def run(args: argparse.Namespace) -> int:
    from heterorl.protocol import load_or_create_identity

    if args.real:
        apply_real_preset(args)
    if args.samplers < 1 or args.learners < 1:
        print("error: --samplers and --learners must be >= 1", file=sys.stderr)
        return 2
    if args.learners > 1 and args.learner_nproc > 1:
        print("error: --learners and --learner-nproc: one or the other", file=sys.stderr)
        return 2
    try:
        settings = run_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        import shutil

        log.info("clearing the previous local run in %s", out)
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model = local_model(settings)
    settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, path=model))
    learner_dirs = learner_dirs_of(out, args.learners)
    keys = [load_or_create_identity(d / "peer.key")[0].public_key.hex() for d in learner_dirs]
    try:
        text = run_toml(settings, keys, f"local-{int(time.time())}")
    except ValueError as e:  # a value TOML cannot hold (a null in --task-params)
        print(f"error: {e}", file=sys.stderr)
        return 2
    (out / "run.toml").write_text(text)
    procs: list[Proc] = []
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through `finally`: stop the children
    view = None
    try:
        coord = Proc(
            "coordinator",
            [
                "coordinator",
                "--run-config",
                str(out / "run.toml"),
                "--state-dir",
                str(out / "coordinator"),
                "--dashboard-port",
                str(args.dashboard_port),
            ],
            out / "coordinator.stderr.log",
            stdout=subprocess.PIPE,
        )
        procs.append(coord)
        ready = ready_line(coord, 120)
        boot = ["--bootstrap", *ready["maddrs"], "--run-key", ready["run_key"]]
        log.info("coordinator up: dashboard %s", ready["dashboard"])
        common = ["peer", *boot, "--threads", "1", *peer_consent(settings)]
        for d in learner_dirs:
            procs.append(
                Proc(
                    d.name,
                    [*common, "--role", "learner", "--state-dir", str(d), "--max-steps", str(args.steps)]
                    + (["--nproc", str(args.learner_nproc)] if args.learner_nproc > 1 else []),
                    out / f"{d.name}.stderr.log",
                )
            )
        learner = procs[1]
        sampler_dirs = []
        for i in range(args.samplers):
            slow = args.sampler_slowdown[min(i, len(args.sampler_slowdown) - 1)]
            d = out / f"sampler-{i}"
            sampler_dirs.append(d)
            if len(keys) > 1:  # sampler i sends to learner i mod N
                key_for_learner(d, [bytes.fromhex(k) for k in keys], i % len(keys))
            backend = args.sampler_backends[min(i, len(args.sampler_backends) - 1)]
            argv = [*common, "--state-dir", str(d), "--slowdown", str(slow), "--backend", backend]
            argv += ["--nice", str(SAMPLER_NICE)]  # below the learner: samplers take the CPU it leaves
            procs.append(Proc(f"sampler-{i}", argv, out / f"sampler-{i}.stderr.log"))
        tty = sys.stdout.isatty() and not args.no_view
        shown = 0
        last_log = 0.0
        while learner.alive():
            if time.monotonic() - started > args.timeout:
                log.error("timed out after %.0f s", args.timeout)
                return 1
            for p in procs:
                if p is not learner and not p.alive():
                    log.warning("%s exited (code %s); see %s", p.name, p.p.returncode, p.log_path)
                    procs.remove(p)
                    break
            view = view_of(ready["dashboard"]) or view
            if view is not None:
                lines = render(view, args.steps, started)
                if tty:
                    sys.stdout.write(("\x1b[F\x1b[2K" * shown) + "\n".join(lines) + "\n")
                    sys.stdout.flush()
                    shown = len(lines)
                elif time.monotonic() - last_log > 5:
                    log.info("%s", lines[0])
                    last_log = time.monotonic()
            time.sleep(1.0)
        if learner.p.returncode != 0:
            log.error("the learner failed (code %s); see %s", learner.p.returncode, learner.log_path)
            return 1
        view = view_of(ready["dashboard"]) or view
    finally:
        stop_all(procs)
    summary = summarise(out, sampler_dirs, view, time.monotonic() - started, learner_dirs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{summary['steps']} learner updates in {summary['wall_s']:.0f} s: reward first 10 "
        f"{summary['reward_first10']:.3f} -> last 10 {summary['reward_last10']:.3f}; "
        f"{summary['batches_accepted']} batches accepted, {summary['batches_rejected']} rejected; "
        f"staleness {summary['staleness']}; summary at {out / 'summary.json'}"
    )
    print("reward curve: " + curve_line(summary["reward_curve"]))
    if len(learner_dirs) > 1:
        print(
            f"{len(learner_dirs)} learners; weights agree: {summary['weights_agree']}; "
            + ", ".join(f"{n}: {x['updates']} updates with its data" for n, x in summary["learners"].items())
        )
    if summary["eval_curve"]:
        print(
            "held-out eval of the current policy (update: sampled / greedy): "
            + "  ".join(f"{int(s)}: {a:.3f} / {g:.3f}" for s, a, g in summary["eval_curve"])
        )
    return 0
