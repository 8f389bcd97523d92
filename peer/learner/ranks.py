"""Rank 0 drives the other ranks of a sharded learner, so that only it runs the network role.

Under torchrun every rank builds the same :class:`~.fsdp.ShardedTrainer`; rank 0 wraps it in a
:class:`RankLeader`, which the learner role drives as any :class:`~.trainer.TrainerLike`; ranks > 0 run
:func:`follow`. Each leader call first broadcasts a command (op code and payload) to the followers, then makes
the same collective call locally while they make it too:

============  ============================================================  ==========================
op            payload                                                       follower runs
============  ============================================================  ==========================
STEP          the Rows as tensors (ragged prompts flattened + lengths)      ``trainer.step(rows)``
SNAPSHOT      ``{"dtype", "with_state"}``                                   ``trainer.snapshot(...)``
RESTORE       ``{"root"}`` (a path the followers can read: same host)       ``trainer.restore(root)``
RENUMBER      ``{"version"}``                                               ``trainer.renumber(v)``
KEEPALIVE     none (rank 0 is idle: waiting for data)                       nothing
STOP          none                                                          a barrier, then returns 0
============  ============================================================  ==========================

On the wire: an int64 header ``[op, payload length]``, then the payload as msgpack bytes in a uint8 tensor;
STEP then broadcasts each of the Rows' tensors (dtype and shape named in the payload). Nothing is pickled.

The leader is driven from one thread (collectives must come in the same order on every rank);
:meth:`RankLeader.save` is static and local, so a publisher thread may call it. A follower whose leader dies
or stops answering gets an error from the collective it waits in (the peer's socket closes, or the process
group's timeout of :func:`init_from_env` runs out): :func:`follow` returns 1 and the process should exit with
it. Every rank, leader and followers, ends with ``torch.distributed.destroy_process_group()`` (gloo aborts a
process that exits without it), also after such an error. A rank's main, in short::

    rank, world, device = init_from_env()
    trainer = ShardedTrainer(model.to(device), options, pad_id)
    if rank == 0:
        with RankLeader(trainer) as leader:
            ...  # the learner role, driving ``leader``
        code = 0
    else:
        code = follow(trainer)
    torch.distributed.destroy_process_group()
    sys.exit(code)
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import os
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

from .assembler import rows_to
from .rows import Rows
from .trainer import Snapshot, Trainer

log = logging.getLogger(__name__)

STEP, SNAPSHOT, RESTORE, RENUMBER, STOP, KEEPALIVE = 1, 2, 3, 4, 5, 6
OPS = {
    STEP: "STEP", SNAPSHOT: "SNAPSHOT", RESTORE: "RESTORE", RENUMBER: "RENUMBER", STOP: "STOP",
    KEEPALIVE: "KEEPALIVE",
}  # fmt: skip
ROW_TENSORS = ("completions", "mask", "logq", "rewards", "group_ids", "versions")
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
DEFAULT_TIMEOUT_S = 1800.0  # a follower's longest wait for the leader's next command or collective


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, torch.device]:
    """``(rank, world, device)`` from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), initialising the
    default process group: NCCL on ``cuda:LOCAL_RANK`` where CUDA is available, else gloo on the CPU, with
    ``timeout_s`` on every collective. Without that environment: ``(0, 1, cuda or cpu)``, no process group."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return rank, world, device


class RankLeader:
    """Rank 0's :class:`~.trainer.TrainerLike`: every call is broadcast to the followers (:func:`follow`),
    then made on ``trainer`` (a :class:`~.fsdp.ShardedTrainer`). :meth:`stop` (or leaving the ``with``
    block without an error) ends the followers."""

    save = staticmethod(Trainer.save)  # local: the snapshot is rank 0's

    def __init__(self, trainer, group: dist.ProcessGroup | None = None):
        if dist.get_rank(group) != 0:
            raise RuntimeError("RankLeader runs on rank 0 of its group; the other ranks run follow()")
        self.trainer, self.group, self.stopped = trainer, group, False
        self.broken = False  # a command failed on this rank: the ranks' collectives no longer line up

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def step(self, rows: Rows) -> dict[str, float]:
        head, tensors = _rows_message(rows)
        with self._command(STEP, head):
            _broadcast_tensors(tensors, self.device, self.group)
            return self.trainer.step(rows)

    def snapshot(self, dtype: str, with_state: bool = True) -> Snapshot | None:
        with self._command(SNAPSHOT, {"dtype": str(dtype), "with_state": bool(with_state)}):
            return self.trainer.snapshot(dtype, with_state)

    def restore(self, root: Path) -> dict | None:
        with self._command(RESTORE, {"root": os.fspath(Path(root).resolve())}):
            return self.trainer.restore(root)

    def renumber(self, version: int) -> None:
        if version < self.trainer.version:  # refused here, before the followers hear of it
            raise ValueError(f"cannot renumber back from version {self.trainer.version} to {version}")
        with self._command(RENUMBER, {"version": int(version)}):
            self.trainer.renumber(version)

    def keepalive(self) -> None:
        """While rank 0 is idle (waiting for data): a command that does nothing, so that the followers'
        wait for the next one stays within the process group's timeout."""
        with self._command(KEEPALIVE, None):
            pass

    def stop(self) -> None:
        """Tell the followers to return (once; later calls, or a broken group, do nothing): STOP, then a
        barrier, so that no rank leaves the group before every rank has heard it."""
        if not self.stopped and not self.broken:
            self.stopped = True
            self._send(STOP, None)
            dist.barrier(group=self.group)

    @contextlib.contextmanager
    def _command(self, op: int, payload: dict | None):
        """Send a command, then run the same collective here; if that fails on this rank, the followers may
        be left inside a collective this rank never makes: the leader is broken (every later command
        raises, :meth:`stop` does nothing) and the process should exit non-zero so torchrun ends them."""
        self._send(op, payload)
        try:
            yield
        except BaseException:
            self.broken = True
            raise

    def __enter__(self) -> RankLeader:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.stop()
        else:  # the followers may be inside a collective: no STOP now; they fail when this process ends
            self.stopped = True

    def _send(self, op: int, payload: dict | None) -> None:
        if self.broken:
            raise RuntimeError("a command failed on rank 0: the ranks are out of step")
        if self.stopped and op != STOP:
            raise RuntimeError("the followers were stopped")
        data = msgpack.packb(payload, use_bin_type=True) if payload is not None else b""
        header = torch.tensor([op, len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(header, _src(self.group), group=self.group)
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            dist.broadcast(buf, _src(self.group), group=self.group)


def receive(device: torch.device, group: dist.ProcessGroup | None = None) -> tuple[int, object]:
    """A follower's next command from rank 0: ``(op, payload)`` (payload decoded; STEP's is the Rows)."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(header, _src(group), group=group)
    op, size = (int(v) for v in header.tolist())
    if op not in OPS or size < 0:
        raise ValueError(f"unknown command {op} (payload {size} bytes)")
    payload = None
    if size:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buf, _src(group), group=group)
        payload = msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)
    if op == STEP:  # on the device as rank 0's assembler puts them, so every rank computes alike
        payload = rows_to(_rows_from(payload, device, group), device)
    return op, payload


def follow(trainer, group: dist.ProcessGroup | None = None) -> int:
    """Ranks > 0: run rank 0's commands on ``trainer`` until STOP (returns 0). An error (a collective that
    failed or timed out: the leader died or hangs; or the command itself) is logged and returns 1."""
    device = trainer.device
    try:
        while True:
            op, payload = receive(device, group)
            if op == STOP:
                dist.barrier(group=group)
                return 0
            if op == STEP:
                trainer.step(payload)
            elif op == SNAPSHOT:
                trainer.snapshot(payload["dtype"], bool(payload["with_state"]))
            elif op == RESTORE:
                trainer.restore(Path(payload["root"]))
            elif op == RENUMBER:
                trainer.renumber(int(payload["version"]))
    except Exception:  # any failure ends this rank; the exit status says so
        log.exception("rank %d: following rank 0 failed", dist.get_rank(group))
        return 1


def _src(group: dist.ProcessGroup | None) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def _rows_message(rows: Rows) -> tuple[dict, list[Tensor]]:
    """STEP's payload (tensor names, dtypes, shapes; authors and batch ids) and its tensors, in order."""
    tensors = {
        "prompt_tokens": torch.tensor([t for p in rows.prompts for t in p], dtype=torch.int64),
        "prompt_lengths": torch.tensor([len(p) for p in rows.prompts], dtype=torch.int64),
        **{name: getattr(rows, name) for name in ROW_TENSORS},
    }
    head = {
        "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()],
        "authors": [bytes(a) for a in rows.authors],
        "batch_ids": [bytes(b) for b in rows.batch_ids],
    }
    return head, list(tensors.values())


def _broadcast_tensors(tensors: list[Tensor], device: torch.device, group: dist.ProcessGroup | None) -> None:
    for t in tensors:
        if t.numel():
            wire = t.detach().to(device, torch.uint8 if t.dtype == torch.bool else t.dtype).contiguous()
            dist.broadcast(wire, _src(group), group=group)


def _rows_from(head: dict, device: torch.device, group: dist.ProcessGroup | None) -> Rows:
    """Receive the Rows whose payload is ``head``: every tensor on the CPU, as the leader's were built."""
    got: dict[str, Tensor] = {}
    for name, dtype_name, shape in head["tensors"]:
        dtype = DTYPES[dtype_name]
        wire = torch.zeros(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        if wire.numel():
            dist.broadcast(wire, _src(group), group=group)
        got[name] = wire.cpu().to(dtype)
    tokens, lengths = got.pop("prompt_tokens").tolist(), got.pop("prompt_lengths").tolist()
    ends = list(itertools.accumulate(lengths))
    prompts = [tokens[e - n : e] for e, n in zip(ends, lengths, strict=True)]
    return Rows(
        prompts=prompts,
        **{name: got[name] for name in ROW_TENSORS},
        authors=[bytes(a) for a in head["authors"]],
        batch_ids=[bytes(b) for b in head["batch_ids"]],
    )
