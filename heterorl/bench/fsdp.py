"""``heterorl bench fsdp``: the learner update on 1 rank (the plain Trainer) and sharded over N ranks (the
FSDP2 ShardedTrainer, gloo on the CPU or NCCL with one GPU a rank) on the same batches.

Each side runs in fresh processes (N ranks started as torchrun starts them: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); GEPO on ``--prompts`` groups of ``--group-size`` random prompts and completions,
``--steps`` updates of which the first ``--warmup`` are left out. Per side: the update's wall time (median)
and tokens/s (prompt and completion tokens of the batch over that time), per rank the peak memory
(``update.peak_memory_mib``: the process's peak RSS on the CPU, max allocated on CUDA) and the bytes of the
training state it holds (its parameters, gradients and optimiser state: its shards under FSDP), and the
largest difference of the final float32 weights from the 1-rank side's. Prints a table and one JSON line.
On the CPU the peak RSS is the updates' alone (reset after the set-up) with glibc's mmap threshold fixed
(``MALLOC_MMAP_THRESHOLD_=65536`` unless set), so that freed tensors leave it.

``--arch`` builds an architecture of :mod:`.gpu_check` with random weights (``tiny-arch`` by default,
``smollm2-135m-arch`` for a real size); ``--model DIR`` loads real weights.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--arch", default="tiny-arch", help="an architecture of gpu_check (random weights)")
    src.add_argument("--model", default=None, help="a model directory (real weights)")
    ap.add_argument("--world", type=int, default=2, help="ranks of the sharded side (default: %(default)s)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="updates left out of the figures")
    ap.add_argument("--prompts", type=int, default=4, help="prompt groups per update")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--micro-batch-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the figures here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _side(args: argparse.Namespace, world: int, work: Path) -> list[dict]:
    """Run one side in ``world`` fresh processes; every rank's figures."""
    work.mkdir(parents=True)
    config = json.dumps({**vars(args), "fn": None, "work": str(work)}, default=str)
    port = _free_port()
    procs = []
    for r in range(world):
        # a fixed mmap threshold: freed tensors leave the RSS, so its peak tracks the live tensors (glibc's
        # sliding threshold keeps freed heap, which hides what sharding saves)
        env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if world > 1:
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                    "WORLD_SIZE": str(world), "LOCAL_RANK": str(r)}  # fmt: skip
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        log = open(work / f"rank{r}.log", "wb")  # noqa: SIM115 - the child holds it
        cmd = [sys.executable, "-m", "heterorl.bench.fsdp", "--worker", config]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    codes = [p.wait() for p in procs]
    if any(codes):
        tails = "\n".join((work / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(world))
        raise SystemExit(f"{world}-rank side failed ({codes}):\n{tails}")
    return [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]


def _state_mib(trainer) -> float:
    """MiB of the training state this rank holds: parameters, gradients, optimiser state (local shards)."""

    import torch

    def local(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in trainer.model.parameters())
    for per_param in trainer.optimizer.state.values():
        total += sum(local(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return total / 2**20


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: VmHWM via /proc/self/clear_refs); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_mib(field: str) -> float | None:
    """VmRSS or VmHWM (peak) of this process from /proc/self/status, in MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def worker(config: dict) -> int:
    """One rank of one side (``--worker``): figures to ``work/rank<r>.json``, final weights from rank 0."""
    import torch

    from heterorl.peer.learner.ranks import init_from_env
    from heterorl.peer.learner.rows import rows_from_bodies
    from heterorl.peer.learner.trainer import Trainer
    from heterorl.peer.learner.update import StepOptions

    from .learner_overhead import _rows_bodies

    torch.set_num_threads(config["threads"])
    rank, world, device = init_from_env(timeout_s=1800)
    if config["device"] == "cuda" and device.type != "cuda":
        raise SystemExit("--device cuda: torch sees no CUDA GPU")
    if config["model"]:
        from heterorl.peer.model import load_model

        model = load_model(config["model"], device=str(device))[0].float()
    else:
        from .gpu_check import build

        model = build(config["arch"], str(device))
    opts = StepOptions("gepo", None, {}, 1.0, config["new_tokens"], lr=1e-5, grad_clip=1.0,
                       micro_batch_tokens=config["micro_batch_tokens"])  # fmt: skip
    if world > 1:
        from heterorl.peer.learner.fsdp import ShardedTrainer

        trainer = ShardedTrainer(model, opts, pad_id=0)
    else:
        trainer = Trainer(model, opts, pad_id=0)
    bodies = _rows_bodies(config["steps"], config["prompts"], config["group_size"], config["prompt_len"],
                          config["new_tokens"], model.config.vocab_size)  # fmt: skip
    rss_before = _rss_mib("VmRSS")
    reset = device.type == "cpu" and _reset_peak_rss()  # from here: the updates' peak, not the set-up's
    times, tokens, peaks = [], [], []
    for body in bodies:
        rows = rows_from_bodies([body], pad_id=0)
        t0 = time.perf_counter()
        stats = trainer.step(rows)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(len(p) for p in rows.prompts) + int(rows.mask.sum()))
        peaks.append(stats["mem/peak_mib"])
    peak = (_rss_mib("VmHWM") if reset else None) or max(peaks)  # before the snapshot's gathers
    steady = slice(config["warmup"], None)
    update_s = statistics.median(times[steady])
    snap = trainer.snapshot("float32", with_state=False)
    work = Path(config["work"])
    if snap is not None:
        torch.save({k: v.cpu() for k, v in snap.weights.items()}, work / "weights.pt")
    figures = {
        "rank": rank,
        "world": world,
        "device": str(device),
        "update_s": update_s,
        "tokens_per_step": statistics.median(tokens[steady]),
        "tokens_per_s": statistics.median(tokens[steady]) / update_s,
        "peak_mib": peak,
        "rss_before_mib": rss_before,
        "state_mib": _state_mib(trainer),
        "fwd_bwd_s": stats["time/fwd_bwd_s"],
        "micro_batches": stats["learner/micro_batches"],
    }
    (work / f"rank{rank}.json").write_text(json.dumps(figures))
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    if args.world < 2:
        raise SystemExit("--world: at least 2 ranks for the sharded side")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        raise SystemExit(f"--device cuda: {args.world} ranks need {args.world} GPUs")
    source = args.model or args.arch
    print(f"{source} on {args.device}, {args.threads} torch thread(s) a rank, {args.steps} updates "
          f"({args.warmup} warm-up) of {args.prompts}x{args.group_size} rows")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        sides = {w: _side(args, w, Path(tmp) / f"world{w}") for w in (1, args.world)}
        weights = {w: torch.load(Path(tmp) / f"world{w}" / "weights.pt", weights_only=True) for w in sides}
    base = weights[1]
    out = {"bench": "fsdp", "source": source, "device": args.device, "threads_per_rank": args.threads,
           "args": {k: v for k, v in vars(args).items() if k != "fn"}, "sides": {}}  # fmt: skip
    print(f"{'ranks':>5} {'tokens/step':>11} {'update s':>9} {'tokens/s':>9} {'peak MiB per rank':>24} "
          f"{'state MiB per rank':>19} {'max |dw| vs 1 rank':>19}")  # fmt: skip
    for w, ranks in sides.items():
        diff = max(float((weights[w][k] - base[k]).abs().max()) for k in base)
        lead = ranks[0]
        side = {
            "update_s": lead["update_s"],
            "tokens_per_step": lead["tokens_per_step"],
            "tokens_per_s": lead["tokens_per_s"],
            "peak_mib": [r["peak_mib"] for r in ranks],
            "rss_before_mib": [r["rss_before_mib"] for r in ranks],
            "state_mib": [r["state_mib"] for r in ranks],
            "max_abs_weight_diff_vs_1_rank": diff,
        }
        out["sides"][str(w)] = side
        peaks = ", ".join(f"{p:.0f}" for p in side["peak_mib"])
        states = ", ".join(f"{s:.1f}" for s in side["state_mib"])
        speed = f"{side['tokens_per_step']:>11.0f} {side['update_s']:>9.3f} {side['tokens_per_s']:>9.0f}"
        print(f"{w:>5} {speed} {peaks:>24} {states:>19} {diff:>19.2e}")
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]))
    ap = argparse.ArgumentParser(prog="python -m heterorl.bench.fsdp", description=__doc__)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
