"""A copy of the run's model the learner loads published weights into, for what reads a version rather than
trains it: the spot checker (:mod:`.spotcheck`) and the held-out evaluation (:mod:`.evaluate`).

Training's model is never read: under FSDP it is sharded, and reading it would race the optimiser. The
replica is built from a factory (the run's model loaded again, on the device it runs on) on first use, in eval
mode with no gradients, and holds one version at a time: :meth:`ModelReplica.load` copies a published state
into it (by the model's own names; floating tensors cast to the replica's dtype and device; tied weights stay
tied, copied once; names the state lacks keep the model's own values, the base under an adapter run's
adapters), and does nothing when the tag loaded last is asked again. One user at a time: hold the replica
(``with replica:``) across the load and the forward passes that read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping

import torch
from torch import Tensor, nn


class ModelReplica:
    """The learner's model for reading published versions; see the module docstring.

    ``with replica: model = replica.load(weights, tag)`` (the lock is re-entrant: ``load`` and ``model``
    take it themselves too). ``builds`` / ``loads`` count factory calls and state copies."""

    def __init__(self, factory: Callable[[], nn.Module]):
        self.factory = factory
        self._model: nn.Module | None = None
        self._targets: dict[str, Tensor] = {}  # a name the weights may use -> the tensor it loads into
        self._tag: Hashable | None = None
        self._lock = threading.RLock()
        self.builds = 0
        self.loads = 0

    def __enter__(self) -> ModelReplica:
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @property
    def model(self) -> nn.Module:
        """The model (built on first use), holding the weights of :attr:`tag`, or the factory's if None."""
        with self._lock:
            if self._model is None:
                model = self.factory().eval().requires_grad_(False)
                self._targets = _targets(model)
                self._model = model
                self.builds += 1
            return self._model

    @property
    def tag(self) -> Hashable | None:
        """The tag of the weights loaded last (None: none yet, or a load that did not complete)."""
        return self._tag

    def forget(self) -> None:
        """The next :meth:`load` copies its weights whatever its tag."""
        with self._lock:
            self._tag = None

    @torch.no_grad()
    def load(self, weights: Mapping[str, Tensor], tag: Hashable | None = None) -> nn.Module:
        """The model holding ``weights`` (a published state, full or partial: names it lacks keep their
        values); skipped when ``tag`` (not None) is the tag loaded last. ValueError, the model untouched,
        for a name the model does not have, a shape that differs, or a non-floating tensor of another
        dtype."""
        with self._lock:
            model = self.model
            if tag is not None and tag == self._tag:
                return model
            plan: dict[int, tuple[Tensor, Tensor]] = {}  # one copy per target tensor: tied weights once
            for name in sorted(weights):
                src, dst = weights[name], self._targets.get(name)
                if dst is None:
                    raise ValueError(f"weights name {name[:120]!r}, which the model does not have")
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: shape {tuple(src.shape)}, the model's is {tuple(dst.shape)}")
                if dst.is_floating_point() != src.is_floating_point() or (
                    not dst.is_floating_point() and src.dtype != dst.dtype
                ):
                    raise ValueError(f"{name}: dtype {src.dtype}, the model's is {dst.dtype}")
                plan.setdefault(id(dst), (dst, src))
            self._tag = None  # until the copy completes
            for dst, src in plan.values():
                dst.copy_(src)
            self.loads += 1
            self._tag = tag
            return model


def _targets(model: nn.Module) -> dict[str, Tensor]:
    """The model's state tensors by every name a published state may use: the state dict's names (tied
    weights under each of their names) and, for a peft model, its adapters' saved names (peft's
    ``get_peft_model_state_dict`` drops the adapter's name: ``…lora_A.default.weight`` is saved as
    ``…lora_A.weight``)."""
    targets = dict(model.state_dict(keep_vars=True))  # the parameters themselves: tied names, one object
    for adapter in getattr(model, "peft_config", None) or {}:
        marker = f".{adapter}."
        for name, t in list(targets.items()):
            if marker in name:
                targets.setdefault(name.replace(marker, ".", 1), t)
    return targets
