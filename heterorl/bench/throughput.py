"""``heterorl bench throughput``: our speed against the tools people use today, side by side in one run.

On one model, task, prompt format (the chat template for instruct models), prompts per step, group size and
completion length it measures, and prints as ratios:

- ``rollout``: tokens per second of our ``vllm`` and ``hf`` rollout backends against a plain
  ``model.generate`` loop and TRL's generation path (what ``GRPOTrainer`` generates with when it has no vLLM),
  over real completion tokens (up to EOS), with each side's mean completion length;
- ``switch``: seconds to put new weights into the running vLLM engine (``load_weights``, which also resets
  the prefix cache) against restarting the engine;
- ``learner``: completion tokens per second of one learner update (log-prob recompute, objective, backward,
  AdamW) against a plain PyTorch cross-entropy step on the same tokens, both in ``--micro-batch-tokens``
  micro-batches;
- ``rl``: RL steps per second of ``heterorl train --local`` (GRPO and GEPO with the hf backend, GRPO with
  vllm) against TRL's ``GRPOTrainer``;
- ``swarm``: trajectories per second the learner of ``heterorl local`` consumes with 1 and 2 samplers,
  against the single-process loop; the shares of the learner's wall time spent waiting for data, training,
  and blocked by publishing (and the background publisher's own time per part).

Everything on vLLM's engine runs in a child process (:mod:`heterorl.bench.throughput_micro`): the engine pins
torch's threads process-wide. Rates are taken over a steady window (the first ``--warmup`` steps are
dropped); micro-benchmarks alternate the sides ``--repeats`` times and report medians. A real model
(``--model`` with 10M parameters or more) gets its own defaults: fewer and longer rollouts, fewer steps and
repeats, no swarm. ``--profile`` adds the top functions (cProfile, cumulative time) of our hf rollout and
learner step. Figures go to stdout and to ``--json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path

from heterorl.protocol.storage.jsonlog import read_rows

from .throughput_report import report

PARTS = ("rollout", "switch", "learner", "rl", "swarm")
REAL_MODEL_PARAMETERS = 10_000_000
# flag defaults: (the tiny model, a real one); a real model is slow on CPUs (SmolLM2-135M, 2 cores:
# ~80 s per forward+backward of 32 × 128 tokens)
DEFAULTS = {
    "parts": (list(PARTS), ["rollout", "switch", "learner", "rl"]),
    "prompts": (16, 4),
    "group_size": (8, 4),
    "max_new_tokens": (6, 32),
    "steps": (40, 6),
    "warmup": (5, 1),
    "repeats": (7, 3),
}


def _default(name: str) -> str:
    tiny, real = DEFAULTS[name]
    show = (lambda v: " ".join(v)) if name == "parts" else str
    return f"default: {show(tiny)}; with a real model {show(real)}"


def resolve_defaults(args: argparse.Namespace, real: bool) -> None:
    """Fill the flags left unset with the tiny model's defaults or a real model's (``DEFAULTS``)."""
    for name, (tiny_default, real_default) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, copy.copy(real_default if real else tiny_default))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--parts", nargs="+", choices=PARTS, default=None, help=f"what to measure ({_default('parts')})"
    )
    ap.add_argument(
        "--model",
        default=None,
        help=f"model directory or hub id (default: the tiny model); {REAL_MODEL_PARAMETERS // 10**6}M "
        "parameters or more is a real model, with its own defaults",
    )
    ap.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="instead of --model, build a tiny-architecture model this wide (e.g. 256): compute-bound rates",
    )
    ap.add_argument("--layers", type=int, default=2, help="layers of the model built by --hidden")
    ap.add_argument("--prompts", type=int, default=None, help=f"prompts per step ({_default('prompts')})")
    ap.add_argument(
        "--group-size", type=int, default=None, help=f"completions per prompt ({_default('group_size')})"
    )
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"completion length limit ({_default('max_new_tokens')})",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help=f"RL steps per side in the rl part ({_default('steps')})"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help=f"steps left out of every rate ({_default('warmup')})"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"alternations per side in rollout/learner, engine restarts in switch ({_default('repeats')})",
    )
    ap.add_argument(
        "--chat",
        choices=("auto", "on", "off"),
        default="auto",
        help="prompts in the tokenizer's chat template for every side (auto: when it has one)",
    )
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="token budget of one learner forward (rows × padded prompt+completion width) in the learner "
        "part and our rl loop (default: all rows at once); TRL takes the batch whole",
    )
    ap.add_argument(
        "--no-vllm",
        action="store_true",
        help="leave out every side on vLLM's engine (the vllm backend in rollout and rl; the switch part)",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads of every side (default: torch's own)"
    )
    ap.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where our hf backend, learner and loop, plain generate/CE and TRL run: auto (default: the "
        "GPU when there is one), cpu, or cuda (fails if torch sees no CUDA GPU); vLLM and the swarm "
        "keep their own",
    )
    ap.add_argument(
        "--swarm-steps", type=int, default=150, help="learner updates per swarm run (a window of ~20 s)"
    )
    ap.add_argument("--samplers", type=int, nargs="+", default=[1, 2], help="swarm sizes to run")
    ap.add_argument("--lr", type=float, default=3e-4, help="learning rate of every learner")
    ap.add_argument("--profile", action="store_true", help="print cProfile tops of our rollout and learner")
    ap.add_argument("--out", default="runs/bench-throughput", help="working directory")
    ap.add_argument("--json", default=None, help="also write the figures here (default: OUT/results.json)")


def steady_rate(ends: list[float], warmup: int, per_step: float = 1.0) -> float:
    """Units per second between the end of step ``warmup`` and the last step (``ends``: step end times)."""
    if len(ends) < warmup + 2:
        raise ValueError(f"need more than {warmup + 1} steps for a steady rate, got {len(ends)}")
    return per_step * (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])


def local_config(args, model: str, objective: str, backend: str = "hf") -> dict:
    """``heterorl train --local`` on the benchmark's configuration, as JSON (a child process reads it):
    ``run``, the run's settings by path, and the loop's own OneProcessConfig fields."""
    run = {
        "model.path": model,
        "model.chat": args.chat,
        "objective.name": objective,
        "objective.lr": args.lr,
        "learner.prompts_per_update": args.prompts,
        "learner.group_size": args.group_size,
        "learner.micro_batch_tokens": args.micro_batch_tokens,
        "sampling.max_new_tokens": args.max_new_tokens,
    }
    return {"run": run, "steps": args.steps, "seed": 0, "backend": backend, "device": args.device}


def ours_local(local: dict, out: Path, warmup: int) -> tuple[float, float]:
    """``heterorl train --local`` with ``local`` (:func:`local_config`): (steady steps/s, mean length)."""
    from heterorl.peer.train import OneProcessConfig, run_one_process
    from heterorl.protocol.settings import Run, from_overrides

    loop = {k: v for k, v in local.items() if k != "run"}
    cfg = OneProcessConfig(from_overrides(Run, local["run"]), **loop)
    t0 = time.perf_counter()
    run_one_process(cfg, out, progress=False)
    rows = list(read_rows(out / "metrics.jsonl"))
    rate = steady_rate([t0 + r["time_s"] for r in rows], warmup)
    return rate, statistics.fmean(r["completion_len/mean"] for r in rows)


# ---- the parts ----


def _rl(args, model: str, out: Path) -> dict:
    from .throughput_micro import run_vllm_child
    from .trl_grpo import run_trl_grpo

    res: dict = {}
    for objective in ("grpo", "gepo"):
        res[f"ours_{objective}_steps_per_s"], res[f"ours_{objective}_mean_length"] = ours_local(
            local_config(args, model, objective), out / f"ours-{objective}", args.warmup
        )
    trl = run_trl_grpo(
        model,
        task_name="arithmetic",
        task_params={"digits": 1},
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        seed=0,
        out=out / "trl",
        chat=args.chat,
        device=args.device,
    )
    res["trl_grpo_steps_per_s"] = steady_rate(trl["step_end_s"], args.warmup)
    res["trl_mean_length"] = trl["mean_length"]
    if args.no_vllm:
        res["vllm_skipped"] = "--no-vllm"
    else:
        d = out / "ours-grpo-vllm"
        local = local_config(args, model, "grpo", "vllm")
        spec = {
            "model": model,
            "threads": args.threads,
            "rl": {"local": local, "out": str(d), "warmup": args.warmup},
        }
        child = run_vllm_child(spec, d)
        if "unavailable" in child:
            res["vllm_skipped"] = child["unavailable"]
        else:
            res["ours_grpo_vllm_steps_per_s"] = child["rl"]["steps_per_s"]
            res["ours_grpo_vllm_mean_length"] = child["rl"]["mean_length"]
    for side in ("grpo", "gepo", "grpo_vllm"):
        if f"ours_{side}_steps_per_s" in res:
            res[f"ratio_ours_{side}_vs_trl"] = res[f"ours_{side}_steps_per_s"] / res["trl_grpo_steps_per_s"]
    return res


def swarm_window(metrics: list[dict], warmup: int) -> dict:
    """Trajectories/s and where the learner's time went over steps after ``warmup`` (learner metrics rows).

    ``publish_frac``: the share of wall time the training thread was blocked by publishing (the snapshot it
    hands over; the rest runs on the publisher thread). ``save_frac``, ``build_frac``, ``announce_frac``: the
    publisher thread's own time per part, as shares of wall time (in the background: they overlap training),
    and ``publisher_cpu_frac`` the CPU time it took (what it takes from the other processes on the machine).
    ``published_frac``: versions published over updates made (a publisher that falls behind skips versions).
    ``overhead_s_per_update``: wall time per update neither waiting for data nor in forward and backward.
    """
    if len(metrics) < warmup + 2:
        raise ValueError(f"need more than {warmup + 1} learner steps, got {len(metrics)}")
    a, rows = metrics[warmup], metrics[warmup + 1 :]
    last = rows[-1]
    wall = last["time"] - a["time"]

    fwd_bwd = sum(r.get("time/fwd_bwd_s", 0.0) for r in rows)

    def share(key: str) -> float:
        return (last.get(key, 0.0) - a.get(key, 0.0)) / wall

    return {
        "publish_frac": share("publish_blocked_s"),
        **{f"{part}_frac": share(f"publish_{part}_s") for part in ("save", "build", "announce")},
        "publisher_cpu_frac": share("publish_cpu_s"),
        "published_frac": (last.get("published", 0) - a.get("published", 0)) / len(rows),
        "trajectories_per_s": sum(r["rows"] for r in rows) / wall,
        "updates_per_s": len(rows) / wall,
        "wait_frac": share("wait_s"),
        "train_frac": share("train_s"),
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rows),
        # the learner's wall time per update outside waiting for data and outside forward and backward
        "overhead_s_per_update": (wall - (last["wait_s"] - a["wait_s"]) - fwd_bwd) / len(rows),
        "fwd_bwd_s_per_update": fwd_bwd / len(rows),
    }


def _swarm(args, model: str, out: Path, single_steps_per_s: float | None) -> dict:
    res: dict = {}
    if single_steps_per_s is None:  # the single-process loop on the same configuration, for the ratio
        single_steps_per_s, _ = ours_local(local_config(args, model, "gepo"), out / "ours-gepo", args.warmup)
    res["single_process_trajectories_per_s"] = single_steps_per_s * args.prompts * args.group_size
    for k in args.samplers:
        d = out / f"swarm-{k}"
        if d.exists():
            import shutil

            shutil.rmtree(d)
        argv = [
            sys.executable,
            "-m",
            "heterorl.cli",
            "local",
            "--samplers",
            str(k),
            "--steps",
            str(args.swarm_steps),
            "--out",
            str(d),
            "--model",
            model,
            "--lr",
            str(args.lr),
            "--prompts-per-update",
            str(args.prompts),
            "--group-size",
            str(args.group_size),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--no-view",
        ]
        logging.getLogger("heterorl.bench").info("swarm with %d sampler(s): %s", k, " ".join(argv[3:]))
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
        metrics = d / "learner" / "metrics.jsonl"
        if done.returncode != 0 or not metrics.exists():
            raise RuntimeError(f"`heterorl local --samplers {k}` failed (rc {done.returncode}); logs in {d}")
        steps = {row["step"]: row for row in read_rows(metrics)}  # a replayed step replaces the lost one
        w = swarm_window([steps[s] for s in sorted(steps)], args.warmup)
        res[f"swarm{k}"] = w
        res[f"ratio_swarm{k}_vs_single"] = w["trajectories_per_s"] / res["single_process_trajectories_per_s"]
    return res


# ---- report ----


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from heterorl.peer.daemon.hardware import detect
    from heterorl.peer.model import TINY_MODEL_DIR, ensure_model, load_model
    from heterorl.peer.model.prompts import PromptFormat

    from . import throughput_micro as micro

    try:
        hw = detect(args.device)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.device = hw.device
    logging.getLogger("heterorl.peer.train.one_process").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.hidden is not None:
        from heterorl.peer.model import build_tiny_model

        model = str(out / f"model-h{args.hidden}-l{args.layers}")
        if not Path(model).exists():
            build_tiny_model(model, steps=20, hidden=args.hidden, layers=args.layers, progress=False)
    else:
        model = ensure_model(args.model or TINY_MODEL_DIR, 0)
    loaded, tok = load_model(model)
    n_params = sum(p.numel() for p in loaded.parameters())
    del loaded
    real = args.hidden is None and n_params >= REAL_MODEL_PARAMETERS
    resolve_defaults(args, real)
    res: dict = {
        "model": model,
        "parameters": n_params,
        "real_model": real,
        "prompts": PromptFormat(tok, args.chat).describe(),
        "threads": args.threads,
        "device": hw.device,
        "device_name": hw.name,
        "args": {k: v for k, v in vars(args).items() if k != "fn"},
    }
    t0 = time.perf_counter()
    profiles = []
    if "rollout" in args.parts or "switch" in args.parts:
        part, p = micro.rollout_and_switch(args, model, out)
        res.update(part)
        profiles.append(("rollout (hf backend)", p))
    if "learner" in args.parts:
        res["learner"], p = micro.learner(args, model)
        profiles.append(("learner update (GEPO)", p))
    if "rl" in args.parts:
        res["rl"] = _rl(args, model, out)
    if "swarm" in args.parts:
        single = res["rl"]["ours_gepo_steps_per_s"] if "rl" in res else None
        res["swarm"] = _swarm(args, model, out, single)
    res["wall_s"] = time.perf_counter() - t0
    dest = Path(args.json) if args.json else out / "results.json"
    dest.write_text(json.dumps(res, indent=1))
    print(report(res, args))
    for title, text in profiles:
        if text:
            print(f"\n--- profile: {title} ---\n{text}")
    print(f"\n{res['wall_s']:.0f} s; figures in {dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="heterorl bench throughput", description=__doc__)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
