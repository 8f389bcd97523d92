"""``heterorl bench soak``: a long ``heterorl local`` run, sampling every role's memory: it must stay flat.

Buffers, caches, outboxes, logs and the coordinator's view are all bounded; this measures that they are.
Every few seconds it reads the resident memory (VmRSS) of each role's process (and its libp2p daemon) and
prints, per role, the memory after warm-up, at the middle and at the end, and the growth in between.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=1500, help="learner updates (default: %(default)s)")
    ap.add_argument("--samplers", type=int, default=2)
    ap.add_argument("--every-s", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--out", default="runs/bench-soak", help="the local run's directory")
    ap.add_argument("--json", default=None, help="also write the samples and figures here")


def _rss_by_role(out: Path) -> dict[str, int]:
    """Resident bytes per role, summing each role process and the p2pd daemon it started."""
    procs: dict[int, tuple[int, str]] = {}  # pid -> (ppid, cmdline)
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(d.name)
        procs[pid] = (int(fields.get("PPid", "0").strip()), cmd)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    roles: dict[str, int] = {}
    for pid, (_ppid, cmd) in procs.items():
        if str(out) not in cmd or " -m heterorl.cli " not in f" {cmd}" or " -m heterorl.cli local " in cmd:
            continue  # only the role processes (their p2pd children are added below), not `local` itself
        role = (
            "coordinator" if " coordinator " in cmd else "learner" if "--role learner" in cmd else "sampler"
        )
        total = rss[pid] + sum(rss[c] for c, (pp, _) in procs.items() if pp == pid)  # + its p2pd
        roles[role] = roles.get(role, 0) + total
    return roles


def run_from_args(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    cmd = [sys.executable, "-m", "heterorl.cli", "local", "--samplers", str(args.samplers)]
    cmd += ["--steps", str(args.steps), "--out", str(out), "--no-view"]
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    samples: list[dict] = []
    while child.poll() is None:
        roles = _rss_by_role(out)
        if roles:
            samples.append({"t": time.monotonic() - t0, **roles})
            print(
                f"\r{samples[-1]['t']:6.0f} s  "
                + "  ".join(f"{k} {v / 2**20:6.0f} MiB" for k, v in sorted(roles.items())),
                end="",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(args.every_s)
    print(file=sys.stderr)
    final = child.stdout.read() if child.stdout else ""
    if child.returncode != 0 or len(samples) < 4:
        print(f"the local run failed or was too short (exit {child.returncode}); see {out}", file=sys.stderr)
        return 1
    lines, figures = table(samples)
    print(f"soak: {args.steps} learner updates, {args.samplers} samplers, {samples[-1]['t']:.0f} s")
    print("\n".join(lines))
    print(final.strip().splitlines()[-1] if final.strip() else "")
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "figures": figures}, indent=1))
    return 0


def table(samples: list[dict]) -> tuple[list[str], dict]:
    """Markdown rows and figures from the samples taken while every role was up (not start-up, shut-down)."""
    roles = sorted({k for s in samples for k in s if k != "t"})
    full = [s for s in samples if all(r in s for r in roles)]
    n = len(full)
    warm, mid, end = full[max(1, n // 10)], full[n // 2], full[-1]
    lines = [
        f"{n} samples with every role up, from {warm['t']:.0f} s (after warm-up) to {end['t']:.0f} s",
        "",
        "| role | after warm-up (MiB) | middle (MiB) | end (MiB) | growth warm-up → end |",
        "|---|---|---|---|---|",
    ]
    figures = {}
    for role in roles:
        a, b, c = (s.get(role, 0) / 2**20 for s in (warm, mid, end))
        figures[role] = {"warm_mib": a, "mid_mib": b, "end_mib": c, "growth": (c - a) / a if a else None}
        lines.append(f"| {role} | {a:.0f} | {b:.0f} | {c:.0f} | {100 * (c - a) / a:+.1f}% |")
    return lines, figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="heterorl bench soak", description=__doc__)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
