"""``heterorl bench trust-calibration``: the spot checks' statistics on honest rollouts of every engine.

For each model (the tiny one; SmolLM2-135M-Instruct where it is imported), published checkpoint dtype and
rollout engine (``hf`` and ``vllm``, each in float32 and bfloat16), it samples ``--batches`` honest batches
as a sampler does (2 prompts × 8 completions, temperature 1, top-p 1, the weights loaded from the published
checkpoint), then checks every one exactly as the learner does (:class:`~heterorl.peer.learner.spotcheck.
SpotCheck` with the published weights, its author's passed checks added up as in the learner). Per
combination it reports the batch log-prob deviation (median over rows of each row's median exp(|Δ|) - 1), the
worst row's, the batch typicality |z|, the author's z over all its batches, and the share of batches the
default ``[trust]`` thresholds would refuse (the false-refusal rate), with each statistic's worst value over
its threshold (the margin: below 1 passes).

The ``vllm`` engines run last and in this process: vLLM changes process-wide torch settings (threads), which
would otherwise apply to the ``hf`` runs too. What cannot run here (vLLM missing, a model not imported, a
head size vLLM's CPU attention lacks) is skipped with the reason.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ENGINES = ("hf/float32", "hf/bfloat16", "vllm/float32", "vllm/bfloat16")
PROMPTS_PER_BATCH, GROUP_SIZE = 2, 8  # a sampler's batch: 16 rows
TEMPERATURE, TOP_P = 1.0, 1.0
MAX_MODEL_LEN = 512  # a vLLM engine's context (prompt + completion), within the model's own limit


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    task: str
    task_params: dict[str, Any]
    max_new_tokens: int
    published: tuple[str, ...]  # checkpoint dtypes the learner publishes
    batches: int  # default batches per combination (the whole run < 15 min on 2 cores)
    batches_per_call: int  # batches generated in one engine call (as make_batches does)


MODELS: dict[str, ModelSpec] = {
    # the tiny model's runs: the bare arithmetic task, float32 checkpoints
    "tiny": ModelSpec("arithmetic", {"digits": 1}, 6, ("float32",), 40, 10),
    # a real instruct model behind its chat template, with long completions; runs publish bfloat16
    "smollm2": ModelSpec("countdown", {}, 96, ("float32", "bfloat16"), 8, 4),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} (%(default)s)"
    )
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)} (%(default)s)"
    )
    ap.add_argument(
        "--published",
        default=None,
        help="checkpoint dtypes to publish, comma-separated (default: float32 for tiny, "
        "float32,bfloat16 for smollm2)",
    )
    ap.add_argument(
        "--batches", type=int, default=None, help="batches per combination (default: 40 tiny, 8 smollm2)"
    )
    ap.add_argument("--tiny-model", default=None, help="the tiny model's dir (default: built if missing)")
    ap.add_argument("--smollm2-model", default=None, help="default: runs/models/smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2, help="torch and vLLM CPU threads (%(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here too")


@dataclasses.dataclass
class Combo:
    model: str
    engine: str  # "hf/float32" ...
    published: str

    @property
    def label(self) -> str:
        return f"{self.model} pub={self.published} {self.engine}"


def _model_dir(name: str, args: argparse.Namespace) -> str:
    from heterorl.localswarm.options import REAL_MODEL_DIR
    from heterorl.peer.model import TINY_MODEL_DIR, ensure_model

    if name == "tiny":
        return ensure_model(args.tiny_model or TINY_MODEL_DIR, 0)
    return args.smollm2_model or REAL_MODEL_DIR


def _skip_reason(model_dir: str, engine: str) -> str | None:
    if not (Path(model_dir) / "config.json").is_file():
        return f"no model at {model_dir}"
    if engine.startswith("vllm/"):
        from heterorl.peer.rollout.vllm import unsupported_reason

        return unsupported_reason(model_dir, "cpu")
    return None


def _published_bytes(model, dtype: str) -> bytes:
    """The checkpoint the learner publishes: its state with floating tensors rounded to ``dtype``."""
    import torch

    from heterorl.protocol.wire.checkpoint import serialize_state_dict

    target = getattr(torch, dtype)
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    return serialize_state_dict(state)


def _make_backend(engine: str, model_dir: str, tok, spec: ModelSpec, threads: int, seed: int):
    from heterorl.peer.model.loader import load_config
    from heterorl.peer.rollout import make_backend

    backend, dtype = engine.split("/")
    if backend == "hf":
        return make_backend("hf", model_dir, tok, dtype=dtype)
    # a float32 checkpoint rounded into a bfloat16 engine, as a sampler's is: not worth a line per tensor
    logging.getLogger("vllm.model_executor.models.utils").setLevel(logging.ERROR)
    rows = spec.batches_per_call * PROMPTS_PER_BATCH * GROUP_SIZE
    max_len = min(MAX_MODEL_LEN, getattr(load_config(model_dir), "max_position_embeddings", None) or 1 << 30)
    return make_backend(
        "vllm", model_dir, tok, dtype=dtype, threads=threads, max_rows=rows, max_model_len=max_len, seed=seed
    )


def _bodies(backend, task, fmt, spec: ModelSpec, n: int, rng, author: bytes) -> list[dict]:
    """``n`` honest TrajectoryBatch bodies of version 0 generated in one engine call, as a sampler does:
    seeded (each row drawn by Gumbel-max from its seed) on the ``hf`` engines, as a run of them asks."""
    from heterorl.peer.rollout import SamplingParams
    from heterorl.protocol.wire.seeds import row_seed

    per = PROMPTS_PER_BATCH * GROUP_SIZE
    examples = [task.sample(rng) for _ in range(n * PROMPTS_PER_BATCH)]
    prompts = [fmt.encode(e.prompt) for e in examples for _ in range(GROUP_SIZE)]
    seeded = backend.name.startswith("hf")
    bids = [rng.randbytes(16) for _ in range(n)]
    seeds = (
        tuple(row_seed("", author, bids[b], 0, r) for b in range(n) for r in range(per)) if seeded else None
    )
    roll = backend.generate(prompts, SamplingParams(TEMPERATURE, TOP_P, spec.max_new_tokens, seeds=seeds))
    rows = []
    for j in range(len(prompts)):
        k = int(roll.lengths[j])
        rows.append(
            {
                "group": (j // GROUP_SIZE) % PROMPTS_PER_BATCH,
                "prompt_ids": list(roll.prompt_ids[j]),
                "completion_ids": roll.completion_ids[j, :k].tolist(),
                "logprobs": [min(0.0, x) for x in roll.logprobs[j, :k].tolist()],
                "reward": 0.0,
            }
        )
    return [
        {
            "policy_version": 0,
            "rows": rows[b * per : (b + 1) * per],
            "engine": backend.name,
            "batch_id": bids[b],
            **({"seeded": True} if seeded else {}),
        }
        for b in range(n)
    ]


def summarize(combo: Combo, checks: list[dict], trust, author_z: float, seconds: float) -> dict:
    """One combination's figures from its batches' verdicts (``reason`` and the SpotCheck summary)."""
    dev = np.array([c["logprob_dev"] for c in checks])
    row = np.array([c["logprob_dev_row_max"] for c in checks])
    signed = np.array([c["z"] for c in checks])
    z = np.abs(signed)
    refused = [c["reason"] for c in checks if c["reason"] is not None]
    gap_row = max(c["row_logprob_gap_max"] for c in checks)
    z_row = max(c["row_abs_z_max"] for c in checks)
    margins = [c["seed_margin_max"] for c in checks if c.get("seed_margin_max") is not None]
    seed_margin = max(margins) if margins else None
    reproduced = [c["reproduced"] for c in checks if c.get("reproduced") is not None]
    return {
        "model": combo.model,
        "published": combo.published,
        "engine": combo.engine,
        "batches": len(checks),
        "tokens_per_batch": float(np.mean([c["tokens"] for c in checks])),
        "logprob_dev_median": float(np.median(dev)),
        "logprob_dev_p99": float(np.percentile(dev, 99)),
        "logprob_dev_max": float(dev.max()),
        "row_logprob_dev_max": float(row.max()),
        "abs_z_p50": float(np.median(z)),
        "abs_z_p99": float(np.percentile(z, 99)),
        "abs_z_max": float(z.max()),
        "z_mean": float(signed.mean()),  # a bias per batch: the author's z grows as z_mean * sqrt(batches)
        "author_z": author_z,
        "refused": len(refused),
        "false_refusal_rate": len(refused) / len(checks),
        "refusal_reasons": dict(collections.Counter(refused)),
        "batch_z": signed.tolist(),  # per batch, in order
        "batch_logprob_dev": dev.tolist(),
        "row_logprob_gap_max": gap_row,
        "row_abs_z_max": z_row,
        "seed_margin_max": seed_margin,
        "reproduced_min": min(reproduced) if reproduced else None,
        "margin": {  # worst honest value over the threshold: < 1 passes
            "logprob_dev": float(dev.max()) / trust.max_logprob_dev,
            "row_logprob_dev": float(row.max()) / trust.max_row_logprob_dev,
            "typicality_z": max(float(z.max()), abs(author_z)) / trust.max_typicality_z,
            "row_logprob_gap": gap_row / trust.max_row_logprob_gap,
            "row_typicality_z": z_row / trust.max_row_typicality_z,
            **({"seed_margin": seed_margin / trust.max_seed_margin} if seed_margin is not None else {}),
        },
        "seconds": seconds,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[dict]) -> str:
    lines = [
        "| model | published | engine | batches | tok/batch | dev med | dev p99 | dev max | row dev max "
        "| abs z p50 | abs z p99 | abs z max | z mean | author z | refused | margin dev/row/z "
        "| row gap max | row abs z max | seed margin max | reproduced min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["margin"]
        lines.append(
            f"| {r['model']} | {r['published']} | {r['engine']} | {r['batches']} | "
            f"{r['tokens_per_batch']:.0f} | {r['logprob_dev_median']:.2e} | {r['logprob_dev_p99']:.2e} | "
            f"{r['logprob_dev_max']:.2e} | {r['row_logprob_dev_max']:.2e} | {r['abs_z_p50']:.2f} | "
            f"{r['abs_z_p99']:.2f} | {r['abs_z_max']:.2f} | {r['z_mean']:+.2f} | {r['author_z']:+.2f} | "
            f"{r['refused']} ({r['false_refusal_rate']:.0%}) | "
            f"{m['logprob_dev']:.3f} / {m['row_logprob_dev']:.3f} / {m['typicality_z']:.2f} | "
            f"{r['row_logprob_gap_max']:.3f} | {r['row_abs_z_max']:.1f} | "
            f"{_fmt(r['seed_margin_max'], '.3f')} | {_fmt(r['reproduced_min'], '.1%')} |"
        )
    return "\n".join(lines)


def _run_model_engine(
    name: str,
    model_dir: str,
    engine: str,
    published: list[str],
    args: argparse.Namespace,
    state: dict,
    on_result: Callable[[dict], None],
) -> None:
    """Every published dtype through one engine (started once) of one model; ``on_result`` gets each
    combination's figures as soon as it is done."""
    import random

    import torch
    from tqdm import tqdm

    from heterorl.peer.learner.replica import ModelReplica
    from heterorl.peer.learner.reputation import Reputation
    from heterorl.peer.learner.spotcheck import SpotCheck, VersionWeights
    from heterorl.peer.model import load_model
    from heterorl.peer.model.prompts import PromptFormat
    from heterorl.peer.tasks import get_task
    from heterorl.protocol.settings import TrustSettings
    from heterorl.protocol.wire.checkpoint import deserialize_state_dict

    spec, trust = MODELS[name], TrustSettings()
    if name not in state:  # the learner's float32 model and its published checkpoints, once per model
        model, tok = load_model(model_dir)
        state[name] = (model, tok, {d: _published_bytes(model, d) for d in published})
    model, tok, checkpoints = state[name]
    fmt, task = PromptFormat(tok), get_task(spec.task, **spec.task_params)
    n = args.batches or spec.batches
    seed = args.seed * 1000 + ENGINES.index(engine)  # each engine samples its own tokens
    torch.manual_seed(seed)
    backend = _make_backend(engine, model_dir, tok, spec, args.threads, seed)
    try:
        for dtype in published:
            combo = Combo(name, engine, dtype)
            data = checkpoints[dtype]
            backend.load_weights(deserialize_state_dict(data))  # what a sampler does with a new version
            reputation = Reputation(trust, buffer_capacity=64)
            check = SpotCheck(
                ModelReplica(lambda: copy.deepcopy(model)),
                VersionWeights(lambda _v, data=data: data, 1),
                reputation,
                trust,
                pad_id=tok.pad_token_id,
                temperature=TEMPERATURE,
                top_p=TOP_P,
            )
            author, rng, checks, t = combo.label.encode(), random.Random(seed), [], time.perf_counter()
            with tqdm(total=n, desc=combo.label, unit="batch") as bar:
                while len(checks) < n:
                    for body in _bodies(
                        backend, task, fmt, spec, min(spec.batches_per_call, n - len(checks)), rng, author
                    ):
                        verdict = check.verify(body, author)
                        s = verdict.stats
                        if verdict.reason is None:  # as the learner does: passed checks add up per author
                            reputation.passed_check(author, s["z_num"], s["z_var"])
                        checks.append({"reason": verdict.reason, **s})
                        bar.update()
            author_z = reputation.typicality_z(author, 0.0, 0.0)
            on_result(summarize(combo, checks, trust, author_z, time.perf_counter() - t))
            del check
    finally:
        backend.close()


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from heterorl.peer.rollout.vllm import BackendUnavailable
    from heterorl.protocol.settings import TrustSettings

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [m for m in models if m not in MODELS] + [e for e in engines if e not in ENGINES]
    if bad:
        print(f"error: unknown {bad}; models: {', '.join(MODELS)}; engines: {', '.join(ENGINES)}")
        return 2
    torch.set_num_threads(max(1, args.threads))
    t0 = time.perf_counter()
    results: list[dict] = []
    skipped: list[dict] = []
    trust = TrustSettings()
    thresholds = {
        "max_logprob_dev": trust.max_logprob_dev,
        "max_row_logprob_dev": trust.max_row_logprob_dev,
        "max_typicality_z": trust.max_typicality_z,
        "max_outside_nucleus": trust.max_outside_nucleus,
        "max_row_logprob_gap": trust.max_row_logprob_gap,
        "max_row_typicality_z": trust.max_row_typicality_z,
        "max_seed_margin": trust.max_seed_margin,
    }
    rows = PROMPTS_PER_BATCH * GROUP_SIZE

    def save(complete: bool) -> None:  # after every combination: an interrupted run keeps what it measured
        if args.json:
            out = {
                "complete": complete,
                "thresholds": thresholds,
                "rows_per_batch": rows,
                "temperature": TEMPERATURE,
                "top_p": TOP_P,
                "models": {m: dataclasses.asdict(MODELS[m]) for m in models},
                "results": results,
                "skipped": skipped,
                "wall_s": time.perf_counter() - t0,
            }
            Path(args.json).write_text(json.dumps(out, indent=1))

    def on_result(r: dict) -> None:
        results.append(r)
        save(False)

    state: dict = {}
    # hf first for every model, vLLM last: its in-process engine changes torch's process-wide settings
    plan = sorted(
        ((m, e) for m in models for e in engines),
        key=lambda me: (me[1].startswith("vllm/"), models.index(me[0]), engines.index(me[1])),
    )
    for name, engine in plan:
        published = args.published.split(",") if args.published else list(MODELS[name].published)
        model_dir = _model_dir(name, args)
        reason = _skip_reason(model_dir, engine)
        if reason is None:
            try:
                _run_model_engine(name, model_dir, engine, published, args, state, on_result)
                continue
            except BackendUnavailable as e:
                reason = str(e)
        print(f"skipped {name} {engine}: {reason}")
        skipped += [{"model": name, "engine": engine, "published": d, "reason": reason} for d in published]
    save(True)
    print(
        f"\nhonest batches of {rows} rows ({PROMPTS_PER_BATCH} prompts × {GROUP_SIZE}), temperature "
        f"{TEMPERATURE}, top-p {TOP_P}, checked as the learner does; thresholds {thresholds}; "
        f"margin = worst value / threshold (< 1 passes)\n"
    )
    print(table(results))
    for s in skipped:
        print(f"skipped: {s['model']} pub={s['published']} {s['engine']}: {s['reason']}")
    print(f"\n{time.perf_counter() - t0:.0f} s" + (f"; wrote {args.json}" if args.json else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="heterorl bench trust-calibration", description=__doc__)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
