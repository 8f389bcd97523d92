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


def run(args: argparse.Namespace) -> int:
    from heterorl.protocol import load_or_create_identity

    if args.real:
        apply_real_preset(args)
    if args.samplers < 1:
        print("error: --samplers must be >= 1", file=sys.stderr)
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
    learner_dir = out / "learner"
    learner_dir.mkdir()
    learner_key, _ = load_or_create_identity(learner_dir / "peer.key")
    try:
        text = run_toml(settings, learner_key.public_key.hex(), f"local-{int(time.time())}")
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
        learner = Proc(
            "learner",
            [*common, "--role", "learner", "--state-dir", str(learner_dir), "--max-steps", str(args.steps)]
            + (["--nproc", str(args.learner_nproc)] if args.learner_nproc > 1 else []),
            out / "learner.stderr.log",
        )
        procs.append(learner)
        sampler_dirs = []
        for i in range(args.samplers):
            slow = args.sampler_slowdown[min(i, len(args.sampler_slowdown) - 1)]
            d = out / f"sampler-{i}"
            sampler_dirs.append(d)
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
    summary = summarise(out, sampler_dirs, view, time.monotonic() - started)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{summary['steps']} learner updates in {summary['wall_s']:.0f} s: reward first 10 "
        f"{summary['reward_first10']:.3f} -> last 10 {summary['reward_last10']:.3f}; "
        f"{summary['batches_accepted']} batches accepted, {summary['batches_rejected']} rejected; "
        f"staleness {summary['staleness']}; summary at {out / 'summary.json'}"
    )
    print("reward curve: " + curve_line(summary["reward_curve"]))
    if summary["eval_curve"]:
        print(
            "held-out eval of the current policy (update: sampled / greedy): "
            + "  ".join(f"{int(s)}: {a:.3f} / {g:.3f}" for s, a, g in summary["eval_curve"])
        )
    return 0
