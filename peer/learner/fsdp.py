"""The learner's trainer sharded over ranks with FSDP2: :class:`ShardedTrainer`, a :class:`~.trainer.Trainer`
on every rank of a torch.distributed world (torchrun), each holding 1/world of the weights, gradients and
optimiser state.

Every method is collective: every rank calls it, in the same order, with the same arguments (the whole batch
included); :mod:`.ranks` has rank 0 drive the others so that only it runs the network role. What it does:

- the model is sharded per decoder layer then at the root (``fully_shard``); tied weights (embeddings and LM
  head) are one parameter of the root group and stay tied; every rank starts from rank 0's weights;
- :meth:`~ShardedTrainer.step`: each rank scores and backpropagates its contiguous slice of the rows
  (:func:`~.update.accumulate_gradients` with ``share``), the objective itself runs on the full batch on
  every rank, so group-coupled terms (GEPO's group expectation, batch-wide normalisers) are exact; the
  reduce-scatter SUMs the ranks' shares (divide factor 1, plain SUM: each rank's gradient is its share of
  the full batch's loss, not a loss of its own); clipping uses the global norm over the sharded gradients;
  AdamW steps the shards;
- :meth:`~ShardedTrainer.snapshot`: the full weights and (``with_state``) the full model and optimiser state,
  all-gathered tensor by tensor, in the format :meth:`Trainer.snapshot` makes (optimiser state keyed by
  parameter index), so :meth:`Trainer.save` writes the same files and a save from N ranks restores on 1 and
  back. Rank 0 gets the :class:`~.trainer.Snapshot`; the other ranks take part and get None;
- :meth:`~ShardedTrainer.restore`: rank 0 names the current save, every rank reads it (the ranks share a
  file system: the ranks of one torchrun node, or a shared folder) and keeps its own shards.

Adapter (LoRA) runs are not sharded here.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from heterorl.protocol.wire.checkpoint import deserialize_state_dict

from ..model.logprobs import model_device
from .rows import Rows
from .state import current_save
from .trainer import LR_SCALE_KEY, OptimizerFactory, Snapshot, Trainer, adamw, scaled_optimizer_step
from .update import StepOptions, accumulate_gradients, peak_memory_mib

LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (HF causal LMs: ``model.model.layers`` and the like), [] if none found."""
    for path in LAYER_PATHS:
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if isinstance(obj, nn.ModuleList):
            return list(obj)
    return []


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 in place: each decoder layer its own group, then the root (embeddings, final norm, LM head);
    gradients reduced by plain SUM (divide factor 1). Returns ``model`` (now also an ``FSDPModule``)."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # factor 1 alone picks ReduceOp.PREMUL_SUM(1.0), which gloo lacks: force a plain SUM
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def broadcast_bytes(
    data: bytes | None, device: torch.device, group: dist.ProcessGroup | None = None
) -> bytes:
    """``data`` from the group's rank 0 to every rank (the others pass None): a length, then uint8s."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    buf = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


def global_grad_norm_clip_(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """``clip_grad_norm_`` over sharded (DTensor) gradients: the norm of the whole gradient, all ranks'
    shards together (collective), then every shard scaled by the same factor. Returns the norm before."""
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


class ShardedTrainer:
    """A :class:`~.trainer.Trainer` over the ranks of ``group`` (default: the whole world), on every rank.

    ``model`` is sharded in place (put it on the rank's device first: ``cuda:LOCAL_RANK`` or CPU); its weights
    are made rank 0's before sharding. ``snapshot_device``: where rank 0's snapshot tensors go (default the
    trainer's device, as :meth:`Trainer.snapshot`; ``"cpu"`` keeps a large model's full copy off the GPU).
    """

    save = staticmethod(Trainer.save)  # rank 0, any thread: a snapshot's files are the same as Trainer's

    def __init__(
        self,
        model: nn.Module,
        options: StepOptions,
        pad_id: int,
        *,
        group: dist.ProcessGroup | None = None,
        optimizer: OptimizerFactory = adamw,
        version: int = 0,
        snapshot_device: str | torch.device | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("ShardedTrainer needs torch.distributed initialised (ranks.init_from_env)")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        device = model_device(model)
        _sync_from_rank0(model, group)
        mesh = (
            init_device_mesh(device.type, (self.world,))
            if group is None
            else DeviceMesh.from_group(group, device.type)
        )
        self.model, self.options, self.pad_id = shard_model(model, mesh), options, pad_id
        self.optimizer = optimizer([p for p in model.parameters() if p.requires_grad], options.lr)
        self.version = version
        self.snapshot_device = torch.device(snapshot_device) if snapshot_device is not None else None

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    # ---- training ----

    def step(self, rows: Rows) -> dict[str, float]:
        """One optimiser step of the objective on the whole of ``rows`` (every rank passes the same rows);
        the same stats as :meth:`Trainer.step` (the objective's are the full batch's, equal on every rank;
        ``time/*`` and ``mem/peak_mib`` this rank's) plus ``mem/peak_mib_max``, the most of any rank."""
        device = self.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.optimizer.zero_grad(set_to_none=True)
        stats = accumulate_gradients(
            self.model,
            rows,
            self.options,
            version=self.version,
            pad_id=self.pad_id,
            share=(self.rank, self.world),
            group=self.group,
        )
        grad_norm = global_grad_norm_clip_(self.model.parameters(), self.options.grad_clip)
        scaled_optimizer_step(self.optimizer, stats.get(LR_SCALE_KEY, 1.0))
        self.version += 1
        peak = peak_memory_mib(device)
        most = torch.tensor([peak], dtype=torch.float64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return {**stats, "grad_norm": grad_norm, "mem/peak_mib": peak, "mem/peak_mib_max": float(most.item())}

    # ---- versions and state ----

    def snapshot(self, dtype: str, with_state: bool = True) -> Snapshot | None:
        """Collective. Rank 0: a :class:`~.trainer.Snapshot` as :meth:`Trainer.snapshot` makes it (full
        tensors; tied weights one copy; float32 weights are the state's own copies); other ranks: None."""
        target = getattr(torch, dtype)
        keep = self.rank == 0
        out = self.snapshot_device or self.device
        live = self.model.state_dict(keep_vars=True)  # the parameters themselves: tied ones are one object
        full: dict[int, Tensor] = {}  # id(live tensor) -> its full tensor (rank 0)
        for t in live.values():  # every rank in the same order: one all-gather per distinct tensor
            if id(t) not in full:
                whole = _full(t)  # a new tensor for a DTensor; ``t`` itself otherwise
                full[id(t)] = whole.detach().to(out, copy=whole is t) if keep else t
        optimizer_state = (
            _gather_optimizer_state(self.optimizer.state_dict(), keep, out) if with_state else None
        )
        if not keep:
            return None
        casts: dict[tuple[int, torch.dtype], Tensor] = {}

        def copy_of(t: Tensor, dtype: torch.dtype) -> Tensor:
            key = (id(t), dtype)
            if key not in casts:
                casts[key] = full[id(t)] if dtype == full[id(t)].dtype else full[id(t)].to(dtype)
            return casts[key]

        model_state = {k: copy_of(v, v.dtype) for k, v in live.items()} if with_state else None
        weights = {k: copy_of(v, target if v.is_floating_point() else v.dtype) for k, v in live.items()}
        return Snapshot(self.version, weights, model_state, optimizer_state)

    def restore(self, root: Path) -> dict | None:
        """Collective. Load the current save under ``root`` (written by a Trainer or a ShardedTrainer on any
        number of ranks), each rank keeping its shards; its meta (``version`` set from its step), or None.
        Rank 0 names the save; every rank reads that folder."""
        name = None
        if self.rank == 0:
            d = current_save(Path(root))
            name = (d.name if d is not None else "").encode()
        name = broadcast_bytes(name, self.device, self.group).decode()
        if not name:
            return None
        d = Path(root) / name
        model_state = deserialize_state_dict((d / "model.safetensors").read_bytes())
        optimizer_state = torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True)
        meta = json.loads((d / "meta.json").read_text())
        self._load(model_state, optimizer_state)
        self.version = int(meta["step"])
        return meta

    def renumber(self, version: int) -> None:
        """As :meth:`Trainer.renumber` (local: every rank's version counts the same steps)."""
        if version < self.version:
            raise ValueError(f"cannot renumber back from version {self.version} to {version}")
        self.version = version

    def _load(self, model_state: dict[str, Tensor], optimizer_state: dict) -> None:
        """Full state dicts (every rank holds them) into this rank's shards."""
        live = self.model.state_dict(keep_vars=True)
        missing, unexpected = sorted(set(live) - set(model_state)), sorted(set(model_state) - set(live))
        if missing or unexpected:
            raise RuntimeError(f"save does not match the model: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name, t in live.items():
                _local(t).copy_(_local(_shard_like(model_state[name], t)))
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for i, per_param in optimizer_state["state"].items():
            p = params[int(i)]
            state[i] = {
                k: _shard_like(v, p) if isinstance(v, Tensor) and v.dim() and v.shape == p.shape else v
                for k, v in per_param.items()
            }
        self.optimizer.load_state_dict({**optimizer_state, "state": state})


def _full(t: Tensor) -> Tensor:
    """The whole of ``t``: a DTensor all-gathered (collective), any other tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: the shard's own storage


def _shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` cut as ``like`` is (this rank's shard, no communication: every rank holds ``full``)."""
    full = full.to(device=like.device, dtype=like.dtype)
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def _gather_optimizer_state(state_dict: dict, keep: bool, device: torch.device) -> dict | None:
    """An optimiser ``state_dict()`` over sharded parameters as the full one :meth:`Trainer.snapshot` copies
    (keyed by parameter index; every tensor whole and a copy). Collective, in index and key order; rank 0
    gets it (``keep``), the others None."""
    state = {}
    for i in sorted(state_dict["state"]):
        per_param = state_dict["state"][i]
        whole = {k: _full(per_param[k]) for k in sorted(per_param)}  # the same order on every rank
        if keep:
            state[i] = {
                k: (whole[k] if isinstance(v, DTensor) else v.detach().clone()).to(device)
                if isinstance(v, Tensor)
                else v
                for k, v in per_param.items()
            }
    if not keep:
        return None
    return {"state": state, "param_groups": copy.deepcopy(state_dict["param_groups"])}


def _sync_from_rank0(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank's parameters and buffers made rank 0's (before sharding: each rank keeps its own shard
    of what it holds, so all must hold the same)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src, group=group)
