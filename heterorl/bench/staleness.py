"""``heterorl bench staleness``: how much of its delay-0 skill each objective keeps on stale data, judged on
the current policy.

Every objective trains the tiny model on one-digit sums with the local loop, sampling from the policy
``delay`` versions old (the GEPO paper's latency setup), for the same number of updates, over several seeds.
Each run scores its current policy on the task's held-out prompts every ``--eval-every`` updates
(:mod:`heterorl.peer.learner.evaluate`: for one-digit sums, the exact expected reward over all 100 prompts at
the run's temperature). ``final_eval`` is the mean of the last evaluations, and "kept" is an objective's
``final_eval`` at a delay over its own at delay 0. The rollout reward is reported too, labelled as what it is:
the reward of rollouts from the policy ``delay`` versions old, so it lags the policy by the delay.

Written to ``--out``: ``results.json`` (one entry per run: ``final_eval``, ``eval_curve``, ``reward_curve``,
...), ``table.md``, ``eval_curves.png``, ``kept_vs_delay.png`` and ``is_var_vs_delay.png``. Runs already in
``--out`` are reused, so an interrupted benchmark resumes. Runs go ``--workers`` at a time, one thread each.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from heterorl.protocol.storage.jsonlog import read_rows

from .staleness_curves import FINAL_EVALS, area, final_at, updates_to

DEFAULT_OBJECTIVE = "gepo"  # what a run gets without [objective] (heterorl.peer.objectives.DEFAULT_OBJECTIVE)
# label -> (objective, its params): the default first, then every objective of the zoo
VARIANTS: dict[str, tuple[str, dict]] = {
    "gepo": ("gepo", {}),
    "gepo-nods": ("gepo", {"defensive_sampling": False}),
    "gepo_plus": ("gepo_plus", {}),
    "m2po": ("m2po", {}),
    "vcpo": ("vcpo", {}),
    "grpo": ("grpo", {}),
    "dapo": ("dapo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "gspo": ("gspo", {}),
    "gspo_token": ("gspo_token", {}),
    "cispo": ("cispo", {}),
    "topr": ("topr", {}),
    "gmpo": ("gmpo", {}),
}
# the default against the two objectives that keep most at large delays (the full grid: every objective)
QUICK_VARIANTS = ("gepo", "m2po", "cispo")
QUICK = {"delays": [0, 256], "seeds": [0, 1], "eval_every": 40}
DELAYS = [0, 8, 32, 64, 128, 256]
TO_REACH = 0.9  # "updates to 90 %": of the delay-0 run's final score over the same budget
LAST_REWARDS = 20  # the lagging rollout reward: mean of the last this many updates
# learner peers of one lineage in one process (peer/train/lineage_local.py): name -> (learners, exchange)
LINEAGES = {"1": (1, "dense"), "2-dense": (2, "dense"), "2-sparse": (2, "sparse")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--delays",
        type=int,
        nargs="+",
        default=None,
        help=f"policy delays: rollouts come from the policy this many versions old (default: {DELAYS}; "
        "any delay >= 0)",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="default: %(default)s")
    ap.add_argument(
        "--steps",
        type=int,
        default=1200,
        help="updates after the delay: a run at delay d takes d + STEPS updates, so that every delayed run "
        "trains STEPS updates on rollouts of a policy newer than the initial one (most of its updates while "
        "d < STEPS); delay 0 takes as many as the longest (max delay + STEPS), and each delay is compared "
        "with delay 0 over its own budget (delay 0 has levelled off by 1200 on one-digit sums)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="prompts per update")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4, help="the run default (run.toml's objective.lr)")
    ap.add_argument("--eval-every", type=int, default=20, help="updates between held-out evaluations")
    ap.add_argument("--objectives", nargs="+", default=None, help=f"labels, of: {' '.join(VARIANTS)}")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=OBJECTIVE[:JSON]",
        help='a further variant to run, e.g. gepo-l75=gepo:{"defensive_lambda":0.75} (repeatable; its '
        "delay-0 runs are its own)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"{' '.join(QUICK_VARIANTS)} at delays {QUICK['delays']}, seeds {QUICK['seeds']}, an evaluation "
        f"every {QUICK['eval_every']} updates (< 15 min on 2 cores); with --delays, the default objective "
        f"{DEFAULT_OBJECTIVE} alone at those delays (--quick --delays 0 512 1024: < 40 min on 2 cores)",
    )
    ap.add_argument("--workers", type=int, default=None, help="runs at a time (default: the CPU count)")
    ap.add_argument("--model", default=None, help="default: the tiny model (built if missing)")
    ap.add_argument(
        "--task-params",
        default=None,
        help="the arithmetic task's parameters as JSON (default: one-digit sums), e.g. for an instruct model "
        '\'{"style": "question", "digits": 1}\'',
    )
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the run default (6)")
    ap.add_argument("--eval-samples", type=int, default=4, help="draws per prompt where eval is not exact")
    ap.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts scored at most")
    ap.add_argument(
        "--lineage",
        nargs="+",
        choices=list(LINEAGES),
        default=None,
        help="run each objective as these learner setups too (label@SETUP): 1 learner, or 2 learner peers "
        "with the dense or sparse exchange ([lineage] overlap on), at equal rows consumed (2 learners: "
        "half the versions, each of two updates; evaluations at the same rows)",
    )
    ap.add_argument("--out", default="runs/bench-staleness")


def budget(delay: int, delays: list[int], steps: int) -> int:
    """A run's updates: ``delay + steps`` (``steps`` of them on rollouts newer than the initial policy),
    delay 0's as long as the longest delay's so that it covers every delay's budget."""
    return (delay or max(delays)) + steps


def _budgets(delays: list[int], steps: int) -> str:
    sizes = sorted({budget(d, delays, steps) for d in delays})
    return f"{sizes[0]} updates" if len(sizes) == 1 else f"{sizes[0]}–{sizes[-1]} updates (delay + {steps})"


def _run_dir(out: Path, label: str, delay: int, seed: int) -> Path:
    return out / "runs" / f"{label}-d{delay}-s{seed}"


def _fingerprint(job: dict) -> dict:
    """What makes a finished run reusable: the loop's settings and the objective's parameters as they are
    now, defaults included (a changed default reruns the runs that used it)."""
    import dataclasses

    from heterorl.peer.objectives._registry import get

    fields = dataclasses.fields(get(job["loss"]).params)
    params = {f.name: repr(f.default) for f in fields if f.default is not dataclasses.MISSING}
    params.update({k: repr(v) for k, v in job["params"].items()})
    keys = ("loss", "delay", "seed", "steps", "prompts", "group_size", "lr", "eval_every", "model")
    keys += ("task_params", "max_new_tokens", "eval_samples", "eval_prompts")
    lineage = {"lineage": [job["learners"], job["exchange"]]} if job.get("exchange") else {}
    return {**{k: job[k] for k in keys}, "params": params, **lineage}


def _one(job: dict) -> dict:
    """One run in a worker process (one thread: the workers share the cores); returns its result entry."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("heterorl.peer.train.one_process").setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per run would bury the runs' own bar
    from heterorl.peer.train import OneProcessConfig, run_one_process
    from heterorl.protocol.settings import Run, from_overrides

    d = Path(job["dir"])
    done, stamp = d / "summary.json", d / "job.json"
    summary = json.loads(done.read_text()) if done.exists() else {}
    same = stamp.exists() and json.loads(stamp.read_text()) == _fingerprint(job)
    if "final_eval" not in summary or not same:  # absent, older, or another objective's settings
        run = {
            "model.path": job["model"],
            "objective.name": job["loss"],
            "objective.params": job["params"],
            "objective.lr": job["lr"],
            "learner.prompts_per_update": job["prompts"],
            "learner.group_size": job["group_size"],
            "learner.eval_every": job["eval_every"],
            "learner.eval_samples": job["eval_samples"],
            "learner.eval_prompts": job["eval_prompts"],
            **({"task.params": job["task_params"]} if job["task_params"] is not None else {}),
            **({"sampling.max_new_tokens": job["max_new_tokens"]} if job["max_new_tokens"] else {}),
            **({"lineage.exchange": job["exchange"]} if job.get("exchange") else {}),
        }
        cfg = OneProcessConfig(
            from_overrides(Run, run),
            steps=job["steps"],
            delay=job["delay"],
            seed=job["seed"],
            learners=job.get("learners") or 1,
        )
        summary = run_one_process(cfg, d, progress=False, save_checkpoint=False)
        stamp.write_text(json.dumps(_fingerprint(job)))
    rows = list(read_rows(d / "metrics.jsonl"))
    return {
        "objective": job["label"],
        "loss": job["loss"],
        "params": job["params"],
        "default_objective": DEFAULT_OBJECTIVE,
        "delay": job["delay"],
        "seed": job["seed"],
        "steps": summary["steps"],
        "learners": job.get("learners") or 1,
        "final_eval": summary["final_eval"],
        "final_eval_greedy": summary["final_eval_greedy"],
        "eval_curve": summary["eval_curve"],
        "reward_curve": summary["reward_curve"],
        "is_var_curve": [r.get("is/var") for r in rows],
        "wall_s": summary["wall_s"],
    }


def figures(run: dict) -> dict[str, float]:
    """final_eval (and greedy), the lagging rollout reward of the last updates, mean IS-weight variance."""
    var = [v for v in run["is_var_curve"] if v is not None]
    last = run["reward_curve"][-LAST_REWARDS:]
    return {
        "eval": run["final_eval"],
        "greedy": run.get("final_eval_greedy") or 0.0,
        "rollout": statistics.fmean(last) if last else 0.0,
        "is_var": statistics.fmean(var) if var else 0.0,
    }


def _groups(results: list[dict]) -> dict[tuple[str, int], list[dict]]:
    """(objective, delay) -> the figures of its runs."""
    return {key: [figures(r) for r in rs] for key, rs in _by_delay(results).items()}


def _curve(run: dict) -> list[list[float]]:
    """The run's held-out curve in updates of one learner (a lineage's version of N updates counts N)."""
    n = run.get("learners") or 1
    return [[p[0] * n, *p[1:]] for p in run["eval_curve"]]


def _budget_of(run: dict) -> float:
    """The run's length in updates of one learner (its last evaluation's, for a run without ``steps``)."""
    curve = _curve(run)
    return (run.get("steps") or 0) * (run.get("learners") or 1) or (curve[-1][0] if curve else 0.0)


def _base_final(base: list[dict], at: float) -> float:
    """Delay 0's final score over a budget of ``at`` updates: its ``final_eval`` when it ran that long, else
    the mean of its last evaluations at or before ``at`` (mean over seeds)."""
    finals = [r["final_eval"] if _budget_of(r) == at else final_at(_curve(r), at) for r in base]
    return statistics.fmean(f for f in finals if f is not None)


def _by_delay(results: list[dict]) -> dict[tuple[str, int], list[dict]]:
    out: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        out.setdefault((r["objective"], r["delay"]), []).append(r)
    return out


def kept(results: list[dict]) -> dict[tuple[str, int], float]:
    """(objective, delay) -> mean final_eval over seeds / the same objective's at delay 0 over the same
    budget."""
    runs = _by_delay(results)
    out = {}
    for (label, delay), rs in runs.items():
        base = runs.get((label, 0))
        if base:
            b = _base_final(base, _budget_of(rs[0]))
            out[(label, delay)] = statistics.fmean(r["final_eval"] for r in rs) / b if b > 0 else float("nan")
    return out


def speed(results: list[dict]) -> dict[tuple[str, int], dict]:
    """(objective, delay) -> how fast it learned against delay 0 over the same budget: ``area`` (the mean
    area under its held-out curve over delay 0's), ``mean`` (that area itself: the mean held-out score over
    the budget, comparable across objectives where ``area`` is not), ``to_90`` (the mean over seeds of the
    first evaluated update reaching 90 % of delay 0's final; None if a seed never did), ``reached`` (seeds
    that did), ``budget``."""
    runs = _by_delay(results)
    out = {}
    for (label, delay), rs in runs.items():
        base = runs.get((label, 0))
        if not base:
            continue
        at = _budget_of(rs[0])
        base_area = [area(_curve(r), at) for r in base]
        mine = [area(_curve(r), at) for r in rs]
        target = TO_REACH * _base_final(base, at)
        hits = [updates_to(_curve(r), target, at) for r in rs]
        reached = [h for h in hits if h is not None]
        mean = statistics.fmean(mine) if all(a is not None for a in mine) else float("nan")
        ok = all(a is not None for a in base_area) and statistics.fmean(base_area) > 0
        out[(label, delay)] = {
            "area": mean / statistics.fmean(base_area) if ok else float("nan"),
            "mean": mean,
            "to_90": statistics.fmean(reached) if len(reached) == len(rs) else None,
            "reached": len(reached),
            "budget": at,
        }
    return out


def _cell(xs: list[float], scale: float = 100.0, digits: int = 1) -> str:
    m = statistics.fmean(xs) * scale
    s = statistics.pstdev(xs) * scale if len(xs) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def _order(label: str) -> int:
    return list(VARIANTS).index(label) if label in VARIANTS else len(VARIANTS)


def table(results: list[dict]) -> str:
    """Markdown, one row per objective and delay (mean ± spread over seeds): the current policy's held-out
    score first, what it keeps of delay 0's, then the lagging rollout reward."""
    groups, k, sp = _groups(results), kept(results), speed(results)
    lines = [
        "| objective | delay | held-out eval, sampled (%) | kept vs delay 0 | area vs delay 0 | "
        "mean held-out over the budget (%) | updates to 90 % of delay 0 | held-out eval, greedy (%) | "
        "rollout reward, last 20 updates (%, lags by the delay) | mean IS-weight variance | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, delay), fs in sorted(groups.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]))):
        share, fast = k.get((label, delay)), sp.get((label, delay))
        rel = "-" if fast is None else f"{fast['area']:.1%}"
        mean = "-" if fast is None else f"{100 * fast['mean']:.1f}"
        lines.append(
            f"| {label} | {delay} | {_cell([f['eval'] for f in fs])} | "
            f"{'-' if share is None else f'{share:.1%}'} | {rel} | {mean} | "
            f"{_to_90(fast)} | {_cell([f['greedy'] for f in fs])} | "
            f"{_cell([f['rollout'] for f in fs])} | {_cell([f['is_var'] for f in fs], 1.0, 4)} | {len(fs)} |"
        )
    return "\n".join(lines)


def _to_90(fast: dict | None) -> str:
    if fast is None:
        return "-"
    if fast["to_90"] is None:
        return f"> {fast['budget']:.0f} ({fast['reached']} seeds reached it)"
    return f"{fast['to_90']:.0f}"


def summary(results: list[dict]) -> list[dict]:
    """results.json's ``groups``: one entry per objective and delay with its kept share, area and updates to
    90 % against delay 0 over its budget."""
    k, sp = kept(results), speed(results)
    return [
        {"objective": label, "delay": delay, "kept": k.get((label, delay)), **sp.get((label, delay), {})}
        for label, delay in sorted(_by_delay(results), key=lambda x: (x[1], _order(x[0])))
    ]


def verdict(results: list[dict]) -> str:
    """One line: what the default keeps at the largest delay and its mean score over the budget, each against
    the best objective's there."""
    k, sp = kept(results), speed(results)
    top = max((d for _, d in k), default=0)
    at = {label: v for (label, d), v in k.items() if d == top}
    if not at or top == 0:
        return "no delayed runs with a delay-0 baseline"
    best = max(at, key=at.get)
    mine = at.get(DEFAULT_OBJECTIVE)
    fast = sp.get((DEFAULT_OBJECTIVE, top))
    area_part = "" if fast is None else f"; its area under the held-out curve {fast['area']:.1%} of delay 0's"
    means = {label: f["mean"] for (label, d), f in sp.items() if d == top and not math.isnan(f["mean"])}
    if fast is not None and DEFAULT_OBJECTIVE in means and len(means) > 1:
        first = max(means, key=means.get)
        area_part += f", its mean score over the budget {fast['mean']:.1%} (best {first} {means[first]:.1%})"
    return (
        f"held-out eval kept at delay {top}: default {DEFAULT_OBJECTIVE} "
        f"{'-' if mine is None else f'{mine:.1%}'}, best {best} {at[best]:.1%}{area_part}"
    )


def plots(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delays = sorted({r["delay"] for r in results})
    labels = sorted({r["objective"] for r in results}, key=_order)
    fig, axes = plt.subplots(1, len(delays), figsize=(4.2 * len(delays), 3.6), sharey=True, squeeze=False)
    for ax, delay in zip(axes[0], delays, strict=True):
        for label in labels:
            runs = [r for r in results if r["delay"] == delay and r["objective"] == label and r["eval_curve"]]
            if not runs:
                continue
            n = min(len(r["eval_curve"]) for r in runs)
            xs = [runs[0]["eval_curve"][i][0] for i in range(n)]
            ys = [statistics.fmean(r["eval_curve"][i][1] for r in runs) for i in range(n)]
            ax.plot(xs, ys, label=label, lw=1.8 if label == DEFAULT_OBJECTIVE else 1.0)
        ax.set_title(f"delay {delay}")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out expected reward (current policy)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "eval_curves.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    k = kept(results)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label in labels:
        ds = [d for d in delays if (label, d) in k]
        ax.plot(
            ds,
            [k[(label, d)] for d in ds],
            marker="o",
            label=label,
            lw=1.8 if label == DEFAULT_OBJECTIVE else 1.0,
        )
        ys = []
        for delay in delays:
            fs = [figures(r) for r in results if r["delay"] == delay and r["objective"] == label]
            ys.append(statistics.fmean(f["is_var"] for f in fs) if fs else float("nan"))
        ax2.plot(delays, ys, marker="o", label=label)
    ax.set_xlabel("delay (policy versions)")
    ax.set_ylabel("held-out eval kept vs delay 0")
    ax.set_xscale("symlog", linthresh=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax2.set_xlabel("delay (policy versions)")
    ax2.set_ylabel("mean IS-weight variance")
    ax2.set_xscale("symlog", linthresh=8)
    ax2.set_yscale("symlog", linthresh=1e-3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    p2 = out / "kept_vs_delay.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def run_from_args(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from heterorl.peer.model import TINY_MODEL_DIR, ensure_model

    variants = dict(VARIANTS)
    for spec in args.variant:
        try:
            label, rest = spec.split("=", 1)
            loss, _, params = rest.partition(":")
            variants[label] = (loss, json.loads(params) if params else {})
        except ValueError as e:
            print(f"error: --variant {spec!r}: want LABEL=OBJECTIVE[:JSON] ({e})")
            return 2
    quick_labels = QUICK_VARIANTS if args.delays is None else (DEFAULT_OBJECTIVE,)
    labels = list(args.objectives or (quick_labels if args.quick else VARIANTS))
    labels += [spec.split("=", 1)[0] for spec in args.variant if spec.split("=", 1)[0] not in labels]
    if args.quick:
        args.seeds, args.eval_every = QUICK["seeds"], QUICK["eval_every"]
    chosen = args.delays if args.delays is not None else QUICK["delays"] if args.quick else DELAYS
    args.delays = sorted(set(chosen))
    if args.delays[0] < 0 or args.steps < 1:
        print("error: delays must be >= 0 and --steps >= 1")
        return 2
    unknown = [label for label in labels if label not in variants]
    if unknown:
        print(f"error: {unknown} not among {list(variants)}")
        return 2
    try:
        task_params = json.loads(args.task_params) if args.task_params else None
    except json.JSONDecodeError as e:
        print(f"error: --task-params is not JSON: {e}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(ensure_model(args.model or TINY_MODEL_DIR, 0))
    setups = [(s, *LINEAGES[s]) for s in args.lineage] if args.lineage else [("", 1, None)]
    jobs = [
        {
            "label": f"{label}@{setup}" if setup else label,
            "loss": variants[label][0],
            "params": variants[label][1],
            "delay": delay,
            "seed": seed,
            "dir": str(_run_dir(out, f"{label}@{setup}" if setup else label, delay, seed)),
            "model": model,
            "steps": budget(delay, args.delays, args.steps) // learners,
            "prompts": args.prompts,
            "group_size": args.group_size,
            "lr": args.lr,
            "eval_every": max(1, args.eval_every // learners),
            "learners": learners,
            "exchange": exchange,
            "eval_samples": args.eval_samples,
            "eval_prompts": args.eval_prompts,
            "task_params": task_params,
            "max_new_tokens": args.max_new_tokens,
        }
        for seed in args.seeds
        for delay in sorted(args.delays, reverse=True)  # the long-delay runs first: the slowest to snapshot
        for label in labels
        for setup, learners, exchange in setups
    ]
    workers = max(1, min(args.workers or os.cpu_count() or 1, len(jobs)))
    print(
        f"{len(jobs)} runs ({len(labels)} objectives × delays {args.delays} × seeds {args.seeds}), "
        f"{_budgets(args.delays, args.steps)}, {workers} at a time"
    )
    t0 = time.perf_counter()
    results = []
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_one, job) for job in jobs]
        for f in tqdm(as_completed(futures), total=len(futures), desc="staleness runs", unit="run"):
            results.append(f.result())
    results.sort(key=lambda r: (r["delay"], _order(r["objective"]), r["seed"]))
    (out / "results.json").write_text(
        json.dumps({"default_objective": DEFAULT_OBJECTIVE, "runs": results, "groups": summary(results)})
    )
    what = (
        "tiny model, one-digit sums. Held-out eval: the current policy's exact expected reward over all 100 "
        "prompts at temperature 1"
        if args.model is None and task_params is None
        else f"model {args.model or 'tiny'}, arithmetic {task_params or ''}. Held-out eval: the current "
        f"policy's expected reward on the task's held-out prompts (exact where the task allows, else "
        f"{args.eval_samples} seeded draws per prompt) at temperature 1"
    )
    header = (
        f"{len(results)} runs: {_budgets(args.delays, args.steps)} of {args.prompts} prompts × "
        f"{args.group_size}, "
        f"lr {args.lr}, seeds {args.seeds}, {what}, mean of its last {FINAL_EVALS} evaluations (every "
        f"{args.eval_every} updates), in percent (mean ± spread over seeds). Each delay is set against the "
        f"same objective's delay-0 runs over its own budget: kept = final score over delay 0's final at that "
        f"budget; area = the area under the held-out curve over delay 0's; mean = that area itself, the mean "
        f"held-out score over the budget (comparable across objectives); updates to 90 % = the first "
        f"evaluation reaching 90 % of delay 0's final (mean over seeds; > budget: a seed never did)."
    )
    md = table(results)
    line = verdict(results)
    (out / "table.md").write_text(header + "\n\n" + md + "\n\n" + line + "\n")
    written = plots(results, out)
    print(header + "\n\n" + md + "\n\n" + line)
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
