"""A rollout backend that survives its engine: restart a failed vLLM engine, then fall back to ``hf``.

An engine can die under a volunteer (a driver reset, the OS killing it for memory, a bug). The sampler must
not: it restarts the engine up to ``restarts`` times, then switches to the ``hf`` backend, each time loading
the weights of the version it holds (``current_weights``). Nothing queued is lost: batches wait in the on-disk
outbox, and a batch is only made after its generation succeeded. Out-of-memory errors are not failures of
the engine; they are raised for the caller to shrink its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch import Tensor

from .base import RolloutBackend, Rollouts, SamplingParams

log = logging.getLogger(__name__)


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class ResilientBackend:
    """Wraps ``make()`` (-> the chosen backend) and ``fallback()`` (-> an ``hf`` backend)."""

    def __init__(
        self,
        make: Callable[[], RolloutBackend],
        fallback: Callable[[], RolloutBackend],
        current_weights: Callable[[], Mapping[str, Tensor] | None],
        restarts: int = 2,
    ) -> None:
        self._fallback, self._weights, self.max_restarts = fallback, current_weights, restarts
        self.inner = make()
        self.restarts = 0
        self.fell_back = False

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dtype(self) -> str:
        return self.inner.dtype

    def describe(self) -> str:
        return self.inner.describe()

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        self.inner.load_weights(state)

    def close(self) -> None:
        self.inner.close()

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollouts:
        while True:
            try:
                return self.inner.generate(prompt_ids, params)
            except Exception as e:
                if is_oom(e) or self.inner.name == "hf":
                    raise
                self._recover(e)

    def _recover(self, error: Exception) -> None:
        log.error("the %s engine failed: %s: %s", self.inner.name, type(error).__name__, error)
        try:
            if self.restarts >= self.max_restarts:
                raise RuntimeError(f"it was restarted {self.restarts} times already")
            self.restarts += 1
            self.inner.restart()
            log.warning("engine restarted (%d of %d)", self.restarts, self.max_restarts)
        except Exception as e:
            log.error("falling back to the hf backend: %s", e)
            self.inner.close()
            self.inner = self._fallback()
            self.fell_back = True
        state = self._weights()
        if state is not None:
            self.inner.load_weights(state)
