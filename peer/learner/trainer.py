"""The Trainer: the policy, its optimiser and the objective, with nothing of the network in it.

The learner peer's network role (intake, ledger, publishing, heartbeats) and the one-process loop drive a
Trainer through :class:`TrainerLike` alone (step, snapshot, save, restore, renumber, version): nothing reaches
for its model or optimiser, so an FSDP-sharded trainer (:mod:`.fsdp`) or a rank leader (:mod:`.ranks`) takes
its place without the role knowing. What needs a model of a version (the spot checker, the held-out eval)
gets the version's published weights and builds its own (:mod:`.replica`).

It does four things:

- :meth:`step`: one update on a batch: zero the gradients, the objective's gradient
  (:func:`~.update.accumulate_gradients`), clip, the optimiser's step (its learning rate times the objective's
  ``step/lr_scale`` stat, if it reports one, for that step only); ``version`` counts the steps taken;
- :meth:`snapshot`: copies of what a version publishes (the weights, or an adapter run's adapters, rounded to
  the checkpoint dtype) and, if asked, of the model and optimiser state, made on the trainer's device between
  steps so that another thread can serialise, diff and save them while the next step runs;
- :meth:`save` / :meth:`restore`: the durable state (:mod:`.state`), from a snapshot;
- :meth:`renumber`: the next step's version after a restart that redoes updates already published.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..model import adapter as lora
from ..model.logprobs import model_device
from .combine import clip_
from .rows import Rows
from .state import load_state, save_state
from .state_transfer import load_state_bytes, state_bytes
from .update import StepOptions, accumulate_gradients, peak_memory_mib

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
LR_SCALE_KEY = "step/lr_scale"  # an objective's stat: multiply every param group's lr by it for this step


def scaled_optimizer_step(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """``optimizer.step()`` with every param group's lr multiplied by ``scale`` (finite, >= 0) for this one
    step, restored afterwards even if the step raises (VCPO's ESS-scaled step, :mod:`~..objectives.vcpo`)."""
    scale = float(scale)
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"{LR_SCALE_KEY} must be finite and >= 0, got {scale}")
    if scale == 1.0:
        optimizer.step()
        return
    base = [group["lr"] for group in optimizer.param_groups]
    try:
        for group, lr in zip(optimizer.param_groups, base, strict=True):
            group["lr"] = lr * scale
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, base, strict=True):
            group["lr"] = lr


ADAMW_KERNELS = ("auto", "fused", "foreach", "loop")


def adamw(params: Iterable[nn.Parameter], lr: float, kernel: str = "auto") -> torch.optim.Optimizer:
    """The learner's optimiser: AdamW without weight decay (the one place it is built). ``kernel``: "auto"
    takes torch's fused kernel where it has one for these parameters (CUDA, and CPU float32: ~6x faster than
    the per-tensor loop on a 135M model on 2 cores), else the default; "fused", "foreach" or "loop" (the
    per-tensor one) ask for that one. Learners of one lineage may each run another: the writer's update is
    what every learner adds (:meth:`Trainer.commit_update`)."""
    params = list(params)
    if kernel not in ADAMW_KERNELS:
        raise ValueError(f"unknown AdamW kernel {kernel!r}; valid: {', '.join(ADAMW_KERNELS)}")
    if kernel != "auto":
        opts = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[kernel]
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **opts)
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


@runtime_checkable
class TrainerLike(Protocol):
    """What the learner role needs of a trainer: :class:`Trainer`, :class:`~.fsdp.ShardedTrainer` (on every
    rank) or :class:`~.ranks.RankLeader` (rank 0, driving the other ranks)."""

    @property
    def version(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def step(self, rows: Rows) -> dict[str, float]: ...

    def snapshot(self, dtype: str, with_state: bool = True) -> Snapshot | None: ...

    @staticmethod
    def save(root: Path, snapshot: Snapshot, meta: dict) -> Path: ...

    def restore(self, root: Path) -> dict | None: ...

    def renumber(self, version: int) -> None: ...


@runtime_checkable
class LineageTrainer(TrainerLike, Protocol):
    """What a learner of a lineage (several learner keys, :mod:`~heterorl.peer.daemon.learner_lineage`) needs
    of its trainer besides :class:`TrainerLike`: a gradient without a step, the writer's step turned into an
    update, a member's step from that update, and its state as bytes for a joiner (one process only)."""

    def named_trainable(self) -> list[tuple[str, Tensor]]: ...

    def gradients(
        self, rows: Rows, offset: dict[str, Tensor] | None = None
    ) -> tuple[dict[str, Tensor], dict[str, float]]: ...

    def commit_update(self, grads: dict[str, Tensor], lr_scale: float = 1.0) -> dict[str, Tensor]: ...

    def apply_update(
        self, update: dict[str, Tensor], grads: dict[str, Tensor] | None, version: int
    ) -> None: ...

    def local_update(self, grads: dict[str, Tensor], lr_scale: float = 1.0) -> dict[str, Tensor]: ...

    def state_bytes(self) -> tuple[bytes, bytes]: ...

    def load_state_bytes(self, version: int, weights: bytes, optimizer: bytes) -> None: ...


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A version as it stood after ``version`` steps, copied off the live tensors.

    ``weights``: what a checkpoint of it carries, in the checkpoint dtype, on the trainer's device.
    ``model_state`` / ``optimizer_state``: the trainer's full state for :meth:`Trainer.save` (None when the
    snapshot is for publishing only).
    """

    version: int
    weights: dict[str, Tensor]
    model_state: dict[str, Tensor] | None = None
    optimizer_state: dict | None = None
    publish: bool = True  # False: saved, not published (a lineage member signs nothing)


class Trainer:
    """Owns ``model`` (in train mode only inside :meth:`step`), its optimiser and the update's options."""

    def __init__(
        self,
        model: nn.Module,
        options: StepOptions,
        pad_id: int,
        *,
        adapter: bool = False,
        optimizer: OptimizerFactory = adamw,
        version: int = 0,
    ):
        """``adapter``: ``model`` is a peft LoRA model whose checkpoints carry the adapters alone."""
        self.model, self.options, self.pad_id, self.adapter = model, options, pad_id, adapter
        self.optimizer = optimizer([p for p in model.parameters() if p.requires_grad], options.lr)
        self.version = version

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    # ---- training ----

    def step(self, rows: Rows) -> dict[str, float]:
        """One optimiser step of the objective on ``rows``; returns the objective's stats plus the gradient
        norm (before clipping) and peak memory. Rows sampled with ``version`` are fresh."""
        device = self.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.optimizer.zero_grad(set_to_none=True)
        stats = accumulate_gradients(self.model, rows, self.options, version=self.version, pad_id=self.pad_id)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.options.grad_clip))
        scaled_optimizer_step(self.optimizer, stats.get(LR_SCALE_KEY, 1.0))
        self.version += 1
        return {**stats, "grad_norm": grad_norm, "mem/peak_mib": peak_memory_mib(device)}

    # ---- a step in parts: one learner's gradient, and a gradient applied (learner peers) ----

    def gradients(
        self, rows: Rows, offset: dict[str, Tensor] | None = None
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        """The objective's gradient on ``rows`` at the current version, as float32 CPU copies by parameter
        name (unclipped), and the objective's stats; the model keeps no gradient after.

        ``offset`` (by name): take the gradient at weights + offset instead, the weights restored bit for bit
        after. A sparse exchange's learner passes the steps it has not yet sent (its residual, scaled to its
        share of the combination): its gradient is taken where its own steps have put the lineage once they
        arrive, not where error feedback holds them back (:mod:`~heterorl.peer.daemon.learner_lineage`)."""
        named = self.named_trainable()
        held = None
        if offset is not None:
            held = [p.detach().clone() for _, p in named]
            with torch.no_grad():
                for n, p in named:
                    p.add_(offset[n].to(p.device, p.dtype))
        try:
            self.optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                self.model, rows, self.options, version=self.version, pad_id=self.pad_id
            )
            grads = {
                n: (torch.zeros_like(p) if p.grad is None else p.grad).to("cpu", torch.float32, copy=True)
                for n, p in named
            }
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            if held is not None:
                with torch.no_grad():
                    for (_, p), h in zip(named, held, strict=True):
                        p.copy_(h)
        return grads, stats

    def commit_update(self, grads: dict[str, Tensor], lr_scale: float = 1.0) -> dict[str, Tensor]:
        """A lineage writer's step on ``grads`` (already combined: none clips on its own): the optimiser's
        step, taken here with whatever kernel this device has, turned into the update every learner adds.
        Returns ``update`` (by name, on the device, the parameters' dtype) with this trainer's weights set to
        ``old + update`` exactly as :meth:`apply_update` sets a member's: one IEEE addition, the same bits on
        any hardware. The next version."""
        named, old = self._stepped(grads, lr_scale)
        update = {}
        with torch.no_grad():
            for n, p in named:
                update[n] = p.detach() - old[n]
                p.copy_(old[n].add_(update[n]))
        self.version += 1
        return update

    def apply_update(self, update: dict[str, Tensor], grads: dict[str, Tensor] | None, version: int) -> None:
        """A lineage member's step: add the writer's ``update`` to the weights (bit-identical to the writer's,
        whatever kernel either runs) and take the combined ``grads`` into this learner's own AdamW moments
        (the exact arithmetic there does not matter: they shape updates only once this learner writes; None:
        a sparse exchange, where each learner's moments take its own gradients in :meth:`local_update`).
        ``version``: the commit's (a new writer's first commit may skip numbers)."""
        with torch.no_grad():
            for n, p in self.named_trainable():
                p.add_(update[n].to(p.device, p.dtype))
                if grads is not None:
                    self._moments(p, grads[n].to(p.device, torch.float32))
        self.version = version

    def local_update(self, grads: dict[str, Tensor], lr_scale: float = 1.0) -> dict[str, Tensor]:
        """This learner's own AdamW step on ``grads`` (consumed: clipped in place to the run's norm), not
        applied: the weights stay exactly as they were, the optimiser's moments and step count advance.
        Returns the step (new − old) as float32 CPU tensors by name: a sparse exchange's part before
        compression (the pseudo-gradient of one inner step, as SparseLoCo's with H = 1)."""
        clip_(grads, self.options.grad_clip)
        named, old = self._stepped(grads, lr_scale)
        step = {}
        with torch.no_grad():
            for n, p in named:
                step[n] = (p.detach().float() - old[n].float()).to("cpu")
                p.copy_(old[n])
        return step

    def _stepped(
        self, grads: dict[str, Tensor], lr_scale: float
    ) -> tuple[list[tuple[str, Tensor]], dict[str, Tensor]]:
        """The optimiser's step on ``grads`` taken on the live weights: the trainable parameters by name and
        copies of their weights from before it (the caller turns the two into an update)."""
        named = self.named_trainable()
        old = {n: p.detach().clone() for n, p in named}
        for n, p in named:
            p.grad = grads[n].to(p.device, p.dtype)
        scaled_optimizer_step(self.optimizer, lr_scale)
        self.optimizer.zero_grad(set_to_none=True)
        return named, old

    def _moments(self, p: nn.Parameter, g: Tensor) -> None:
        """AdamW's moments and step count of ``p`` after gradient ``g`` (the weights do not change)."""
        group = next(gr for gr in self.optimizer.param_groups if any(q is p for q in gr["params"]))
        beta1, beta2 = group["betas"]
        state = self.optimizer.state[p]
        if not state:
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        state["exp_avg"].lerp_(g.to(state["exp_avg"].dtype), 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)

    def named_trainable(self) -> list[tuple[str, Tensor]]:
        """The parameters that train, by name (the lineage's gradient schema and state hash)."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    # ---- versions and state ----

    def published_state(self) -> dict[str, Tensor]:
        """The live tensors a checkpoint carries: the model's state, or an adapter run's adapters."""
        return lora.adapter_state(self.model) if self.adapter else self.model.state_dict()

    def snapshot(self, dtype: str, with_state: bool = True) -> Snapshot:
        """Copies, on the trainer's device, of the checkpoint tensors (floating ones rounded to ``dtype``)
        and, with ``with_state``, of the model and optimiser state. Between steps only: this is the one
        moment the training thread spends on publishing."""
        target = getattr(torch, dtype)
        copies: dict[tuple, Tensor] = {}  # one copy per storage: tied weights stay tied, copied once

        def copy_of(t: Tensor, dtype: torch.dtype) -> Tensor:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), dtype)
            if key not in copies:
                copies[key] = t.detach().to(dtype, copy=True)
            return copies[key]

        model_state = optimizer_state = None
        if with_state:
            model_state = {k: copy_of(v, v.dtype) for k, v in self.model.state_dict().items()}
            optimizer_state = _clone_tensors(self.optimizer.state_dict())
        weights = {
            name: copy_of(t, target if t.is_floating_point() else t.dtype)  # float32: the state's own copy
            for name, t in self.published_state().items()
        }
        return Snapshot(self.version, weights, model_state, optimizer_state)

    @staticmethod
    def save(root: Path, snapshot: Snapshot, meta: dict) -> Path:
        """Write ``snapshot``'s model and optimiser state as the save of its version (any thread)."""
        if snapshot.model_state is None or snapshot.optimizer_state is None:
            raise ValueError("this snapshot carries no state to save (made with with_state=False)")
        return save_state(root, snapshot.model_state, snapshot.optimizer_state, snapshot.version, meta)

    def restore(self, root: Path) -> dict | None:
        """Load the current save under ``root``; its meta (``version`` set from its step), or None."""
        meta = load_state(root, self.model, self.optimizer)
        if meta is not None:
            self.version = int(meta["step"])
        return meta

    def state_bytes(self) -> tuple[bytes, bytes]:
        """The float32 weights and AdamW state as safetensors, for a joining learner (:mod:`.state_transfer`).
        """
        return state_bytes(self.named_trainable(), self.optimizer.state_dict())

    def load_state_bytes(self, version: int, weights: bytes, optimizer: bytes) -> None:
        """Another learner's :meth:`state_bytes` as this trainer's state at ``version`` (checked)."""
        load_state_bytes(self, version, weights, optimizer)

    def renumber(self, version: int) -> None:
        """Number the next step ``version + 1`` (a restart redoing updates already published after its save:
        a version number is never signed twice)."""
        if version < self.version:
            raise ValueError(f"cannot renumber back from version {self.version} to {version}")
        self.version = version


def _clone_tensors(obj):
    """A deep copy of an optimiser ``state_dict()`` whose tensors are clones (it holds live references)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    return copy.deepcopy(obj)
