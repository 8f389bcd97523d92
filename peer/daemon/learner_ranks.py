"""A learner over several devices: ``heterorl peer --role learner`` under torchrun (or ``--nproc N``, which
starts torchrun itself).

Rank 0 is the learner peer: it joins the run, speaks the protocol (intake, ledger, trust, publishing) and
drives the others through :class:`~heterorl.peer.learner.ranks.RankLeader`. It first broadcasts what they need
to build the same :class:`~heterorl.peer.learner.fsdp.ShardedTrainer` (the model's directory on this host, the
update's options, the pad id: msgpack, nothing pickled). Ranks > 0 join nothing: they build the trainer and
follow rank 0's commands (:func:`~heterorl.peer.learner.ranks.follow`) until it stops them.

Failure is all or nothing, as torchrun supervises it: a rank that dies fails rank 0's next collective (or its
followers' wait), that rank exits non-zero, torchrun stops the others and exits non-zero for its own
supervisor; a restart resumes from the last save like a one-device learner. SIGTERM/SIGINT reach every rank
from torchrun: rank 0 leaves in order (its last publish and save need the followers), so followers ignore
them and end on rank 0's STOP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist

from heterorl.protocol.signals import install_stop_signals

from ..learner.fsdp import ShardedTrainer, broadcast_bytes
from ..learner.ranks import RankLeader, follow, init_from_env
from ..learner.update import StepOptions
from ..model import load_model

log = logging.getLogger(__name__)


def launch(argv: list[str], nproc: int) -> int:
    """Run ``torchrun --standalone --nproc-per-node NPROC -m heterorl ARGV`` (ARGV less ``--nproc``); its
    exit status. A stop signal is passed to rank 0 alone, which leaves in order (the last version
    published and saved) and ends the other ranks: all exit 0. (torchrun itself, when signalled, exits
    non-zero and kills the ranks after a grace period.) A second signal kills them all at once."""
    import psutil

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "heterorl", *without_nproc(argv)]
    print(f"starting {nproc} learner ranks: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)  # a terminal's Ctrl-C reaches this process only

    groups = [proc.pid]  # what a second signal kills: torchrun's group and each rank's (own sessions)

    def to_rank0() -> None:
        try:
            children = psutil.Process(proc.pid).children()
            groups.extend(p.pid for p in children)
            ranks = [p for p in children if p.environ().get("RANK") == "0"]
        except psutil.Error:
            ranks = []
        target = ranks[0].pid if ranks else proc.pid  # not started yet: torchrun ends it all
        who = "rank 0" if ranks else "torchrun"
        print(f"stop: passed to {who} (pid {target})", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.kill(target, signal.SIGTERM)

    install_stop_signals(to_rank0, log, kill_groups=groups)
    return proc.wait()


def without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def rank() -> int:
    """This process's rank under torchrun (0 without it)."""
    return int(os.environ.get("RANK", "0"))


def lead(model: torch.nn.Module, options: StepOptions, pad_id: int, model_dir: str) -> RankLeader:
    """Rank 0: tell the followers how to build the trainer, build it, and drive it."""
    device = torch.device(next(model.parameters()).device)
    setup = {"model_dir": model_dir, "options": dataclasses.asdict(options), "pad_id": pad_id}
    broadcast_bytes(msgpack.packb(setup, use_bin_type=True), device)
    # on a GPU, rank 0's full copies (to publish and save) go to host memory, not next to its shard
    snapshot_device = "cpu" if device.type == "cuda" else None
    return RankLeader(ShardedTrainer(model, options, pad_id, snapshot_device=snapshot_device))


def follow_main(threads: int) -> int:
    """Ranks > 0: build the trainer rank 0 describes and follow its commands; the exit status."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop (module docstring)
        signal.signal(sig, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    me, world, device = init_from_env()
    code = 1
    try:
        setup = msgpack.unpackb(broadcast_bytes(None, device), raw=False)
        log.info("rank %d of %d: model %s on %s", me, world, setup["model_dir"], device)
        model, _ = load_model(setup["model_dir"], device=str(device))
        trainer = ShardedTrainer(model, StepOptions(**setup["options"]), int(setup["pad_id"]))
        code = follow(trainer)
    except Exception:
        log.exception("rank %d failed", me)
    finally:
        dist.destroy_process_group()
    log.info("rank %d leaves (status %d)", me, code)
    return code


def end_group() -> None:
    """Rank 0, on the way out: the process group ends (gloo aborts a process that exits inside one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank_log(state_dir: Path, role: str) -> Path:
    """Each rank's log file: ``learner.log`` for rank 0, ``learner.rank1.log`` ..."""
    r = rank()
    return state_dir / (f"{role}.log" if r == 0 else f"{role}.rank{r}.log")
