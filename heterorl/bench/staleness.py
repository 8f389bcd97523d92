"""``heterorl bench staleness``: GEPO's staleness claim at small scale, against the other objectives.

Every objective (GEPO with and without defensive sampling, GRPO, GSPO, CISPO, Dr. GRPO, GMPO) trains the tiny
model on the arithmetic task with the local loop, sampling from the policy ``delay`` versions old (as the GEPO
paper simulates network latency), for the same step budget, over several seeds. Written to ``--out``:
``results.json`` (one entry per run), ``table.md`` (Best, Last, best-to-last gap, mean IS-weight variance per
objective and delay, mean ± spread over seeds), ``reward_curves.png`` and ``is_var_vs_delay.png``. Runs
already in ``--out`` are reused, so an interrupted benchmark resumes.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

VARIANTS: tuple[tuple[str, bool], ...] = (
    ("gepo", True),
    ("gepo", False),
    ("grpo", False),
    ("gspo", False),
    ("cispo", False),
    ("dr_grpo", False),
    ("gmpo", False),
)
SMOOTH = 10  # Best and Last are means over this many updates


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--delays", type=int, nargs="+", default=[0, 8, 32, 64])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200, help="updates per run (the same for every objective)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per update")
    ap.add_argument("--group-size", type=int, default=8)
    # at 1e-3, Adam's first steps knock the tiny model back (reward 0.33 -> 0.13) before it learns
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--objectives", nargs="+", default=None, help="subset of gepo gepo-nods grpo gspo ...")
    ap.add_argument("--quick", action="store_true", help="120 updates of 8 prompts, seeds 0 1 (< 15 min)")
    ap.add_argument("--model", default=None, help="default: the tiny model (built if missing)")
    ap.add_argument("--out", default="runs/bench-staleness")


def _label(objective: str, defensive: bool) -> str:
    return objective if objective != "gepo" else ("gepo" if defensive else "gepo-nods")


def _run_one(model: str, objective: str, defensive: bool, delay: int, seed: int, args, out: Path) -> dict:
    from heterorl.peer.train import OneProcessConfig, run_one_process
    from heterorl.protocol.settings import Run, from_overrides

    d = out / "runs" / f"{_label(objective, defensive)}-d{delay}-s{seed}"
    done = d / "summary.json"
    if not done.exists():
        params = {"defensive_sampling": defensive} if objective == "gepo" else {}
        run = {
            "model.path": model,
            "objective.name": objective,
            "objective.params": params,
            "objective.lr": args.lr,
            "learner.prompts_per_update": args.prompts,
            "learner.group_size": args.group_size,
        }
        cfg = OneProcessConfig(from_overrides(Run, run), steps=args.steps, delay=delay, seed=seed)
        run_one_process(cfg, d, progress=False)
    summary = json.loads(done.read_text())
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return {
        "objective": objective,
        "defensive_sampling": defensive,
        "delay": delay,
        "seed": seed,
        "steps": summary["steps"],
        "reward_curve": summary["reward_curve"],
        "is_var_curve": [r.get("is/var") for r in rows],
        "wall_s": summary["wall_s"],
    }


def _smooth(xs: list[float], k: int = SMOOTH) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def figures(run: dict) -> dict[str, float]:
    curve = _smooth(run["reward_curve"])
    curve = curve[SMOOTH - 1 :] or curve  # only full windows: a single early sample is not a "best"
    var = [v for v in run["is_var_curve"] if v is not None]
    best, last = max(curve), curve[-1]
    return {"best": best, "last": last, "gap": best - last, "is_var": statistics.fmean(var) if var else 0.0}


def _cell(xs: list[float], scale: float = 100.0, digits: int = 1) -> str:
    m = statistics.fmean(xs) * scale
    s = statistics.pstdev(xs) * scale if len(xs) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def table(results: list[dict]) -> str:
    """Markdown: one row per objective and delay; rewards in percent (mean ± spread over seeds)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((_label(r["objective"], r["defensive_sampling"]), r["delay"]), []).append(
            figures(r)
        )
    lines = [
        "| objective | delay | Best (%) | Last (%) | best-to-last gap | mean IS-weight variance | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    order = [_label(o, d) for o, d in VARIANTS]
    for (label, delay), fs in sorted(groups.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        lines.append(
            f"| {label} | {delay} | {_cell([f['best'] for f in fs])} | {_cell([f['last'] for f in fs])} | "
            f"{_cell([f['gap'] for f in fs])} | {_cell([f['is_var'] for f in fs], 1.0, 4)} | {len(fs)} |"
        )
    return "\n".join(lines)


def plots(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delays = sorted({r["delay"] for r in results})
    labels = [
        _label(o, d)
        for o, d in VARIANTS
        if any(_label(r["objective"], r["defensive_sampling"]) == _label(o, d) for r in results)
    ]
    fig, axes = plt.subplots(1, len(delays), figsize=(4.5 * len(delays), 3.6), sharey=True, squeeze=False)
    for ax, delay in zip(axes[0], delays, strict=True):
        for label in labels:
            runs = [
                r
                for r in results
                if r["delay"] == delay and _label(r["objective"], r["defensive_sampling"]) == label
            ]
            if not runs:
                continue
            n = min(len(r["reward_curve"]) for r in runs)
            mean = [statistics.fmean(r["reward_curve"][i] for r in runs) for i in range(n)]
            ax.plot(_smooth(mean), label=label, lw=1.6 if label.startswith("gepo") else 1.0)
        ax.set_title(f"delay {delay}")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"mean reward ({SMOOTH}-update average)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    p1 = out / "reward_curves.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label in labels:
        ys = []
        for delay in delays:
            fs = [
                figures(r)
                for r in results
                if r["delay"] == delay and _label(r["objective"], r["defensive_sampling"]) == label
            ]
            ys.append(statistics.fmean(f["is_var"] for f in fs) if fs else float("nan"))
        ax.plot(delays, ys, marker="o", label=label)
    ax.set_xlabel("delay (policy versions)")
    ax.set_ylabel("mean IS-weight variance")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = out / "is_var_vs_delay.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def run_from_args(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from heterorl.peer.model import TINY_MODEL_DIR, ensure_model

    if args.quick:
        args.steps, args.prompts, args.seeds = 120, 8, [0, 1]
    logging.getLogger("heterorl.peer.train.one_process").setLevel(logging.WARNING)
    variants = [v for v in VARIANTS if args.objectives is None or _label(*v) in args.objectives]
    if not variants:
        print(f"error: none of {args.objectives} is one of {[_label(*v) for v in VARIANTS]}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ensure_model(args.model or TINY_MODEL_DIR, 0)
    grid = [(o, d, delay, seed) for delay in args.delays for seed in args.seeds for o, d in variants]
    results, t0 = [], time.perf_counter()
    for o, d, delay, seed in tqdm(grid, desc="staleness runs", unit="run"):
        results.append(_run_one(model, o, d, delay, seed, args, out))
    (out / "results.json").write_text(json.dumps(results))
    md = table(results)
    header = (
        f"{len(results)} runs: {args.steps} updates of {args.prompts} prompts × {args.group_size}, "
        f"lr {args.lr}, seeds {args.seeds}, tiny model, arithmetic; Best/Last = {SMOOTH}-update mean reward "
        f"at its best / at the end, in percent (mean ± spread over seeds)."
    )
    (out / "table.md").write_text(header + "\n\n" + md + "\n")
    written = plots(results, out)
    print(header + "\n\n" + md)
    print(
        f"\n{time.perf_counter() - t0:.0f} s; wrote {out / 'results.json'}, {out / 'table.md'}, "
        + ", ".join(map(str, written))
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="heterorl bench staleness", description=__doc__)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
