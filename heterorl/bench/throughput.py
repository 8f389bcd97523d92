"""``heterorl bench throughput``: our speed against the tools people use today, side by side in one run.

On one model, task, prompts per step, group size and completion length it measures, and prints as ratios:

- ``rl``: RL steps per second of ``heterorl train --local`` (GRPO and GEPO) against TRL's ``GRPOTrainer``;
- ``rollout``: tokens per second of the ``hf`` rollout backend against a plain ``model.generate`` loop;
- ``learner``: completion tokens per second of one learner update (log-prob recompute, objective, backward,
  AdamW) against a plain PyTorch cross-entropy step on the same tokens;
- ``swarm``: trajectories per second the learner of ``heterorl local`` consumes with 1 and 2 samplers,
  against the single-process loop, and the fraction of learner time spent waiting for data.

Rates are taken over a steady window (the first ``--warmup`` steps are dropped); micro-benchmarks alternate
the two sides ``--repeats`` times and report medians. ``--profile`` adds the top functions (cProfile,
cumulative time) of our rollout and learner step. Figures go to stdout and to ``--json``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import logging
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("rl", "rollout", "learner", "swarm")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure")
    ap.add_argument("--model", default=None, help="model path or hub id (default: the tiny model)")
    ap.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="instead of --model, build a tiny-architecture model this wide (e.g. 256): compute-bound rates",
    )
    ap.add_argument("--layers", type=int, default=2, help="layers of the model built by --hidden")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40, help="RL steps per side in the rl part")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of every rate")
    ap.add_argument("--repeats", type=int, default=7, help="alternations per side in rollout/learner")
    ap.add_argument("--swarm-steps", type=int, default=60, help="learner updates per swarm run")
    ap.add_argument("--samplers", type=int, nargs="+", default=[1, 2], help="swarm sizes to run")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--profile", action="store_true", help="print cProfile tops of our rollout and learner")
    ap.add_argument("--out", default="runs/bench-throughput", help="working directory")
    ap.add_argument("--json", default=None, help="also write the figures here (default: OUT/results.json)")


def steady_rate(ends: list[float], warmup: int, per_step: float = 1.0) -> float:
    """Units per second between the end of step ``warmup`` and the last step (``ends``: step end times)."""
    if len(ends) < warmup + 2:
        raise ValueError(f"need more than {warmup + 1} steps for a steady rate, got {len(ends)}")
    return per_step * (len(ends) - 1 - warmup) / (ends[-1] - ends[warmup])


# ---- the parts ----


def _ours(args, model: str, objective: str, out: Path) -> tuple[float, float]:
    """``heterorl train --local`` on the benchmark's configuration: (steady steps/s, mean length)."""
    from heterorl.peer.train import LocalConfig, run_local

    cfg = LocalConfig(
        model=model,
        objective=objective,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        lr=args.lr,
        seed=0,
    )
    d = out / f"ours-{objective}"
    t0 = time.perf_counter()
    run_local(cfg, d, progress=False)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rate = steady_rate([t0 + r["time_s"] for r in rows], args.warmup)
    return rate, statistics.fmean(r["completion_len/mean"] for r in rows)


def _rl(args, model: str, out: Path) -> dict:
    from .trl_grpo import run_trl_grpo

    res = {}
    for objective in ("grpo", "gepo"):
        res[f"ours_{objective}_steps_per_s"], res[f"ours_{objective}_mean_length"] = _ours(
            args, model, objective, out
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
    )
    res["trl_grpo_steps_per_s"] = steady_rate(trl["step_end_s"], args.warmup)
    res["trl_mean_length"] = trl["mean_length"]
    res["ratio_ours_grpo_vs_trl"] = res["ours_grpo_steps_per_s"] / res["trl_grpo_steps_per_s"]
    res["ratio_ours_gepo_vs_trl"] = res["ours_gepo_steps_per_s"] / res["trl_grpo_steps_per_s"]
    return res


def _prompts(args) -> list[str]:
    from heterorl.peer.tasks import get_task

    task, rng = get_task("arithmetic", digits=1), random.Random(0)
    return [e.prompt for e in (task.sample(rng) for _ in range(args.prompts)) for _ in range(args.group_size)]


def _real_lengths(completions, eos_id: int):
    """Tokens up to and including the first EOS, per row (the rule the hf backend uses)."""
    is_eos = completions == eos_id
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after).long().sum(-1)


def _alternate(fns: dict, repeats: int, profile: str | None = None) -> tuple[dict, str]:
    """Call each fn ``repeats`` times, interleaved; median seconds per call and, optionally, a profile."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in fns}
    units: dict[str, list[float]] = {k: [] for k in fns}
    prof = cProfile.Profile() if profile else None
    for rep in range(repeats + 1):
        for name, fn in fns.items():
            torch.manual_seed(rep)
            if prof and name == profile and rep > 0:
                prof.enable()
            t = time.perf_counter()
            n = fn()
            dt = time.perf_counter() - t
            if prof and name == profile and rep > 0:
                prof.disable()
            if rep > 0:  # the first round warms caches up
                times[name].append(dt)
                units[name].append(n)
    med = {k: statistics.median(u / t for u, t in zip(units[k], times[k], strict=True)) for k in fns}
    text = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
        text = buf.getvalue()
    return med, text


def _rollout(args, model_path: str) -> tuple[dict, str]:
    import torch

    from heterorl.peer.model import load_model
    from heterorl.peer.model.logprobs import left_pad
    from heterorl.peer.rollout import SamplingParams, make_backend

    model, tok = load_model(model_path)
    prompts = _prompts(args)
    backend = make_backend("hf", tok)
    sampling = SamplingParams(1.0, 1.0, args.max_new_tokens)

    def ours() -> float:
        return float(backend.generate(model, prompts, sampling).lengths.sum())

    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []

    @torch.no_grad()
    def plain() -> float:
        ids, attn, width = left_pad(
            [bos + tok.encode(p, add_special_tokens=False) for p in prompts], tok.pad_token_id
        )
        seq = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        return float(_real_lengths(seq[:, width:], tok.eos_token_id).sum())

    med, prof = _alternate({"ours": ours, "plain": plain}, args.repeats, "ours" if args.profile else None)
    return {
        "hf_backend_tokens_per_s": med["ours"],
        "plain_generate_tokens_per_s": med["plain"],
        "ratio_hf_vs_plain": med["ours"] / med["plain"],
    }, prof


def _learner(args, model_path: str) -> tuple[dict, str]:
    import torch

    from heterorl.peer.learner.update import Rows, update
    from heterorl.peer.model import load_model
    from heterorl.peer.model.logprobs import pack
    from heterorl.peer.rollout import SamplingParams, make_backend

    model, tok = load_model(model_path)
    torch.manual_seed(0)
    roll = make_backend("hf", tok).generate(
        model, _prompts(args), SamplingParams(1.0, 1.0, args.max_new_tokens)
    )
    n = len(roll.prompt_ids)
    rows = Rows(
        prompts=roll.prompt_ids,
        completions=roll.completion_ids,
        mask=roll.completion_mask,
        logq=roll.logprobs,
        rewards=torch.rand(n),
        group_ids=torch.arange(args.prompts).repeat_interleave(args.group_size),
        versions=torch.zeros(n, dtype=torch.long),
    )
    tokens = float(roll.completion_mask.sum())
    ours_model, plain_model = model, copy.deepcopy(model)
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=args.lr, weight_decay=0.0)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=args.lr, weight_decay=0.0)
    ids, attn, pos, width = pack(rows.prompts, rows.completions, rows.mask, tok.pad_token_id)
    labels = torch.where(rows.mask > 0, rows.completions, torch.full_like(rows.completions, -100))

    def ours() -> float:
        update(
            ours_model,
            ours_opt,
            rows,
            version=0,
            objective="gepo",
            advantage=None,
            objective_params={},
            temperature=1.0,
            max_new_tokens=args.max_new_tokens,
            pad_id=tok.pad_token_id,
            grad_clip=1.0,
        )
        return tokens

    def plain() -> float:
        plain_model.train()
        logits = plain_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        step_logits = logits[:, width - 1 : width - 1 + labels.shape[1]]
        loss = torch.nn.functional.cross_entropy(
            step_logits.reshape(-1, step_logits.shape[-1]), labels.reshape(-1)
        )
        plain_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain_opt.step()
        return tokens

    med, prof = _alternate({"ours": ours, "plain": plain}, args.repeats, "ours" if args.profile else None)
    return {
        "learner_tokens_per_s": med["ours"],
        "plain_ce_tokens_per_s": med["plain"],
        "ratio_learner_vs_plain_ce": med["ours"] / med["plain"],
        "completion_tokens_per_update": tokens,
    }, prof


def swarm_window(metrics: list[dict], warmup: int) -> dict:
    """Trajectories/s and where the learner's time went over steps after ``warmup`` (learner metrics rows)."""
    if len(metrics) < warmup + 2:
        raise ValueError(f"need more than {warmup + 1} learner steps, got {len(metrics)}")
    a, rows = metrics[warmup], metrics[warmup + 1 :]
    wall = rows[-1]["time"] - a["time"]
    wait = rows[-1]["wait_s"] - a["wait_s"]
    train = rows[-1]["train_s"] - a["train_s"]
    publish = {
        k.removeprefix("publish_").removesuffix("_s") + "_frac": (rows[-1][k] - a.get(k, 0.0)) / wall
        for k in rows[-1]
        if k.startswith("publish_") and k.endswith("_s")
    }
    return {
        **publish,  # where checkpoint publishing time goes: save, build, announce
        "trajectories_per_s": sum(r["rows"] for r in rows) / wall,
        "updates_per_s": len(rows) / wall,
        "wait_frac": wait / wall,
        "train_frac": train / wall,
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rows),
    }


def _swarm(args, model: str, out: Path, single_steps_per_s: float | None) -> dict:
    res: dict = {}
    if single_steps_per_s is None:  # the single-process loop on the same configuration, for the ratio
        single_steps_per_s, _ = _ours(args, model, "gepo", out)
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
        steps = {}
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            steps[row["step"]] = row
        w = swarm_window([steps[s] for s in sorted(steps)], args.warmup)
        res[f"swarm{k}"] = w
        res[f"ratio_swarm{k}_vs_single"] = w["trajectories_per_s"] / res["single_process_trajectories_per_s"]
    return res


# ---- report ----


def report(res: dict, args) -> str:
    lines = [
        f"throughput: {args.prompts} prompts × {args.group_size} completions, "
        f"≤ {args.max_new_tokens} new tokens, model {res['model']} ({res['parameters']:,} parameters), "
        f"{res['threads']} torch threads"
    ]
    if "rl" in res:
        r = res["rl"]

        def cells(*keys: str, fmt: str = "{:10.2f}") -> str:
            return " ".join(fmt.format(r[k]) for k in keys)

        lines += [
            "",
            "                            ours-grpo  ours-gepo  TRL GRPOTrainer",
            "RL steps/s (steady)        "
            + cells("ours_grpo_steps_per_s", "ours_gepo_steps_per_s", "trl_grpo_steps_per_s"),
            "mean completion length     "
            + cells("ours_grpo_mean_length", "ours_gepo_mean_length", "trl_mean_length"),
            "ratio vs TRL               "
            + cells("ratio_ours_grpo_vs_trl", "ratio_ours_gepo_vs_trl", fmt="{:9.2f}×"),
        ]
    if "rollout" in res:
        r = res["rollout"]
        lines += [
            "",
            f"rollout tokens/s: hf backend {r['hf_backend_tokens_per_s']:.0f}, plain model.generate "
            f"{r['plain_generate_tokens_per_s']:.0f}  -> {r['ratio_hf_vs_plain']:.2f}×",
        ]
    if "learner" in res:
        r = res["learner"]
        lines += [
            f"learner tokens/s: GEPO update {r['learner_tokens_per_s']:.0f}, plain CE step "
            f"{r['plain_ce_tokens_per_s']:.0f}  -> {r['ratio_learner_vs_plain_ce']:.2f}× "
            f"({r['completion_tokens_per_update']:.0f} completion tokens per update)",
        ]
    if "swarm" in res:
        r = res["swarm"]
        single = r["single_process_trajectories_per_s"]
        lines += ["", f"swarm trajectories/s (learner intake); single-process loop {single:.0f}"]
        for k in args.samplers:
            w = r[f"swarm{k}"]
            lines.append(
                f"  {k} sampler(s): {w['trajectories_per_s']:6.0f}/s = {r[f'ratio_swarm{k}_vs_single']:.2f}× "
                f"single; learner waits {w['wait_frac']:.0%}, trains {w['train_frac']:.0%}; "
                f"staleness {w['staleness_mean']:.1f}"
            )
            if "announce_frac" in w:
                lines.append(
                    f"      publishing a checkpoint each update: save {w['save_frac']:.0%}, "
                    f"build {w['build_frac']:.0%}, DHT announce {w['announce_frac']:.0%} of learner time"
                )
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from heterorl.cli import DEFAULT_MODEL_DIR, _ensure_model

    logging.getLogger("heterorl.peer.train.local").setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.hidden is not None:
        from heterorl.peer.model import build_tiny_model

        model = str(out / f"model-h{args.hidden}-l{args.layers}")
        if not Path(model).exists():
            build_tiny_model(model, steps=20, hidden=args.hidden, layers=args.layers, progress=False)
    else:
        model = _ensure_model(args.model or DEFAULT_MODEL_DIR, 0)
    from heterorl.peer.model import load_model

    n_params = sum(p.numel() for p in load_model(model)[0].parameters())
    res: dict = {
        "model": model,
        "parameters": n_params,
        "threads": torch.get_num_threads(),
        "args": {k: v for k, v in vars(args).items() if k != "fn"},
    }
    t0 = time.perf_counter()
    profiles = []
    if "rl" in args.parts:
        res["rl"] = _rl(args, model, out)
    if "rollout" in args.parts:
        res["rollout"], p = _rollout(args, model)
        profiles.append(("rollout (hf backend)", p))
    if "learner" in args.parts:
        res["learner"], p = _learner(args, model)
        profiles.append(("learner update (GEPO)", p))
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
