"""``heterorl peer``: join a run as a sampler (the volunteer default) or a learner, until stopped.

Ctrl-C or SIGTERM: the sampler stops generating, sends what is queued for a few seconds (the rest stays in its
on-disk outbox for next time) and leaves; the learner finishes its update, saves and publishes, and leaves.
Exit status 0 after such a leave; 1 when the peer cannot go on (its libp2p daemon died, a background task or
thread failed, the role failed: the last log line says why), so that a service manager restarts it.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .consent import Consent

log = logging.getLogger("heterorl.peer")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from heterorl.protocol.net.flags import add_net_arguments

    ap.add_argument("--role", choices=("sampler", "learner"), default="sampler", help="default: sampler")
    ap.add_argument(
        "--state-dir",
        default="~/.heterorl/peer",
        help="keys, outbox, chunk store, learner state and logs live here (default: %(default)s)",
    )
    ap.add_argument(
        "--key", default=None, help="identity key file (default: STATE_DIR/peer.key, made if missing)"
    )
    ap.add_argument(
        "--run-id", default=None, help="the run to join (default: whatever the bootstrap peers serve)"
    )
    ap.add_argument(
        "--run-key",
        default=None,
        metavar="HEX",
        help="pin the coordinator's public key (default: trust on first use, stated in the log, then pinned)",
    )
    ap.add_argument(
        "--allow-reward",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="let the run's task import and call this custom reward function, installed on this machine (the "
        "built-in rewards need no flag); repeatable. A RunSpec naming another custom reward is refused",
    )
    ap.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="your own copy of the run's model (an HF directory, safetensors weights), loaded whatever the "
        "RunSpec names; needed when the run's model is a directory on the host's machine (the learner checks "
        "its weights against the RunSpec's hash)",
    )
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: a GPU if any")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="learner: train on N devices (GPUs, or CPU processes) with FSDP2; starts torchrun with N ranks, "
        "rank 0 the peer (the same as running this command under `torchrun --nproc-per-node N`; default 1)",
    )
    ap.add_argument(
        "--nice",
        type=int,
        default=0,
        metavar="N",
        help="run at a lower CPU priority, N steps as nice(1) counts them (also the session's autogroup on "
        "Linux, which nice alone does not reach), so the peer takes only CPU nothing else wants (default: 0)",
    )
    ap.add_argument(
        "--backend",
        choices=("auto", "hf", "vllm"),
        default="auto",
        help="sampler: rollout engine. auto (default): vLLM where it is installed and serves the model on "
        "this device, else transformers' generate (the reason is logged); hf; vllm (fails with the reason "
        "if it cannot serve the model)",
    )
    ap.add_argument(
        "--engine-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="sampler: the rollout engine's dtype. auto: bfloat16 on a GPU, float32 on a CPU (CPUs without "
        "native bf16 are ~5x slower in it)",
    )
    ap.add_argument(
        "--upload-mbps",
        type=float,
        default=0,
        help="cap the checkpoint bytes this peer uploads to others, in Mbit/s (default 0: no cap)",
    )
    ap.add_argument("--join-timeout", type=float, default=120.0, help="seconds to wait for the RunSpec")
    ap.add_argument("--slowdown", type=float, default=1.0, help="sampler: run this many times slower (tests)")
    ap.add_argument("--max-batches", type=int, default=None, help="sampler: leave after this many batches")
    ap.add_argument("--max-steps", type=int, default=None, help="learner: stop after this many updates")
    ap.add_argument(
        "--adamw",
        choices=("auto", "fused", "foreach", "loop"),
        default="auto",
        help="learner: torch's AdamW kernel. auto (default): the fused one where this device has it. "
        "Learners of one run may each run another: the lineage's writer commits the update all add",
    )
    ap.add_argument("--log-level", default="INFO")
    add_net_arguments(ap)


def run(args: argparse.Namespace, peer_class: type | None = None) -> int:
    """Join and run until stopped; ``peer_class`` replaces the role's Sampler or Learner (hostile tests). A
    learner's rank > 0 under torchrun follows rank 0 instead (:mod:`.learner_ranks`)."""
    from heterorl.protocol.logs import configure_logging

    from . import learner_ranks

    ranked = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.nproc < 1 or ((args.nproc > 1 or ranked) and args.role != "learner"):
        print("error: only a learner runs on several ranks (--nproc, torchrun)", file=sys.stderr)
        return 2
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # become torchrun, which starts this again N times
        return learner_ranks.launch(sys.argv[1:], args.nproc)
    state_dir = Path(args.state_dir).expanduser()
    state_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(args.log_level, learner_ranks.rank_log(state_dir, args.role))
    if args.role == "learner" and learner_ranks.rank() > 0:  # a follower: no network, rank 0's commands
        return learner_ranks.follow_main(args.threads)
    try:
        return _run(args, state_dir, peer_class)
    finally:
        learner_ranks.end_group()


def _run(args: argparse.Namespace, state_dir: Path, peer_class: type | None) -> int:
    from heterorl.protocol import load_or_create_identity
    from heterorl.protocol.net.fetch import FetchError
    from heterorl.protocol.net.flags import net_config_from_args
    from heterorl.protocol.net.node import DaemonDied
    from heterorl.protocol.signals import install_stop_signals

    from .supervisor import BackgroundFailure, StopEvent

    stop = StopEvent()
    # a signal sets the stop from a thread of its own (the handler takes no lock); a second one leaves now
    install_stop_signals(stop.set, log)
    try:
        config = net_config_from_args(args)
        identity, created = load_or_create_identity(args.key or state_dir / "peer.key")
        run_key = bytes.fromhex(args.run_key) if args.run_key else None
        if run_key is not None and len(run_key) != 32:
            raise ValueError("--run-key must be 64 hex characters")
        consent = _consent(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("%s key %s (%s)", args.role, identity.public_key.hex(), "new" if created else "loaded")

    import torch

    from heterorl.protocol.net.join import join

    from .hardware import detect
    from .runtime import PeerRuntime

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where is every thread?
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.nice:
        from .priority import lower_process_priority

        log.info("CPU priority lowered to nice %d", lower_process_priority(args.nice))
    hw = detect(args.device)
    log.info("hardware: %s", hw.describe())
    role_class, options = _role(args, peer_class)
    try:
        joined = join(
            identity, config, state_dir, run_id=args.run_id, run_key=run_key, timeout=args.join_timeout
        )
    except (RuntimeError, TimeoutError) as e:
        log.error("could not join: %s", e)
        return 1
    log.info("joined run %s as %s; my addresses: %s", joined.spec["run_id"], args.role, joined.node.maddrs)
    upload = args.upload_mbps * 1e6 / 8 if args.upload_mbps > 0 else None
    try:
        # the runtime owns the node from here on and closes it once: in its order of leaving, or on the way
        # out of this block (a role whose constructor failed)
        with PeerRuntime(
            joined,
            identity,
            state_dir,
            hw,
            args.role,
            stop=stop,
            store_bytes=role_class.STORE_BYTES,
            upload_bytes_per_s=upload,
            consent=consent,
        ) as runtime:
            runtime.run(role_class(runtime, options))
    except BackgroundFailure as e:  # logged with its traceback when it happened; the peer left in order
        log.error("the %s stopped: %s", args.role, e)
        return 1
    except (PermissionError, ValueError, DaemonDied, FetchError) as e:  # the reason is the last log line
        log.error("%s", e)
        return 1
    except Exception:
        log.exception("the %s failed", args.role)
        return 1
    log.info("left the run")
    return 0


def _consent(args: argparse.Namespace) -> Consent:
    """What the volunteer allowed (``--allow-reward``, ``--model-dir``: a checked model directory)."""
    from heterorl.peer.model.loader import check_model_dir

    from .consent import Consent

    model_dir = None
    if args.model_dir is not None:
        model_dir = Path(args.model_dir).expanduser().resolve()
        try:
            check_model_dir(model_dir)
        except ValueError as e:
            raise ValueError(f"--model-dir: {e}") from None
    return Consent(tuple(dict.fromkeys(args.allow_reward)), model_dir)


def _role(args: argparse.Namespace, peer_class: type | None) -> tuple[type, object]:
    """The role's class (``peer_class`` if given) and its options, from the flags."""
    if args.role == "sampler":
        from .sampler import Sampler, SamplerOptions

        options = SamplerOptions(
            args.slowdown,
            max_batches=args.max_batches,
            backend=args.backend,
            engine_dtype=args.engine_dtype,
            threads=args.threads or None,
        )
        return peer_class or Sampler, options
    from .learner import Learner, LearnerOptions

    return peer_class or Learner, LearnerOptions(max_steps=args.max_steps, adamw=args.adamw)
