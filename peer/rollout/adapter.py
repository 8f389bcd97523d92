"""A rollout backend for adapter runs: it takes adapter states where a backend takes full ones.

Every adapter is first checked against the base this sampler holds (names and shapes; ValueError with the
reason otherwise, the held adapter kept). A vLLM engine started with LoRA support serves it as a LoRA adapter
(a peft directory under ``work_dir``, a fresh request id per version, no restart, no weight reload); any other
backend (``hf``) gets the base with the adapter merged in, W = W0 + (alpha/rank) · B @ A.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from heterorl.protocol.settings import AdapterSettings

from ..model import adapter as lora
from .base import RolloutBackend, Rollouts, SamplingParams

log = logging.getLogger(__name__)

KEEP_DIRS = 2  # adapter directories kept on disk (the one served and the one before)


class AdapterBackend:
    def __init__(
        self,
        inner: RolloutBackend,
        base: Mapping[str, Tensor],
        adapter: AdapterSettings,
        work_dir: Path,
    ) -> None:
        """``base``: the base state in the checkpoint dtype (already checked against the run's hash)."""
        self.inner, self.base, self.adapter = inner, base, adapter
        self.shapes = {k: tuple(v.shape) for k, v in base.items()}
        self.work_dir = Path(work_dir)
        self.loaded = 0

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dtype(self) -> str:
        return self.inner.dtype

    @property
    def native(self) -> bool:
        """Does the engine serve LoRA adapters itself (vLLM started with LoRA support)?"""
        return bool(getattr(self.inner, "lora_rank", None))

    def describe(self) -> str:
        how = "served as LoRA" if self.native else "merged into the weights"
        return f"{self.inner.describe()}, adapter r{self.adapter.rank} {how}"

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Apply an adapter state; ValueError (nothing changed) if it does not fit the base held."""
        lora.check_fits(self.shapes, state, self.adapter)
        if not self.native:
            self.inner.load_weights(lora.merge(self.base, state, self.adapter))
            return
        self.loaded += 1
        path = lora.write_peft_dir(self.work_dir / f"adapter-{self.loaded:06d}", state, self.adapter)
        self.inner.load_lora(path)
        for old in sorted(self.work_dir.glob("adapter-*"))[:-KEEP_DIRS]:
            shutil.rmtree(old, ignore_errors=True)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollouts:
        return self.inner.generate(prompt_ids, params)

    def restart(self) -> None:
        self.inner.restart()

    def close(self) -> None:
        self.inner.close()
