"""The roles' settings: ``[learner]``, ``[sampler]`` and ``[adapter]`` of run.toml, each field documented
and checked when the object is made (a bad value is a ValueError naming the setting)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import CHECKPOINT_DTYPES, check_int, check_number, setting


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
    """``[learner]``: how the learner batches, updates and publishes."""

    prompts_per_update: int = setting(16, "prompt groups per update")
    group_size: int = setting(8, "completions per prompt")
    publish_every: int = setting(1, "publish a signed checkpoint every K updates")
    max_staleness: int = setting(-1, "drop batches more than N versions old (-1: use all data however stale)")
    buffer_batches: int = setting(
        16, "accepted batches kept waiting; beyond it samplers are told to slow down"
    )
    grad_clip: float = setting(1.0, "clip the gradient's global norm to this")
    micro_batch_tokens: int | None = setting(
        None,
        "token budget of one forward pass (rows × padded prompt+completion width), the gradient staying the "
        "full update's; absent: one forward for the whole update",
    )
    gradient_checkpointing: bool = setting(
        False, "recompute activations in backward (HF models): less memory"
    )
    tis_cap: float | None = setting(
        None, "C of truncated importance sampling against the sampler/learner mismatch (Yao et al. 2025)"
    )
    checkpoint_dtype: str = setting(
        "float32",
        "what published checkpoints hold (the samplers' dtype; bfloat16 for real models): the learner keeps "
        "training its float32 copy and publishes its rounding",
    )
    save_every_s: float = setting(
        300.0,
        "save the learner's state (model, optimizer, step) with a published version at most this often, in "
        "the background; a restart resumes from the last save, replays the batches applied since and goes on "
        "numbering versions after the newest published (0: save with every published version)",
    )
    eval_every: int = setting(
        25,
        "score the current policy on the task's held-out prompts every K updates, sampled at the run's "
        "temperature and greedy (0: never); into metrics and the heartbeat, so the dashboard plots it",
    )
    eval_samples: int = setting(
        4, "draws per held-out prompt where the expected reward is not computed exactly"
    )
    eval_prompts: int = setting(200, "held-out prompts scored at most")
    deltas: int = setting(
        4,
        "offer each version also as sparse lossless deltas (protocol/wire/delta.py) against each of this "
        "many published versions before it (0: full only); the manifest still signs the full state",
    )

    def __post_init__(self) -> None:
        for name in ("prompts_per_update", "group_size", "publish_every", "buffer_batches"):
            check_int(f"learner.{name}", getattr(self, name), 1)
        check_int("learner.max_staleness", self.max_staleness, -1)
        check_int("learner.deltas", self.deltas, 0, 8)
        check_int("learner.eval_every", self.eval_every, 0)
        check_int("learner.eval_samples", self.eval_samples, 1, 64)
        check_int("learner.eval_prompts", self.eval_prompts, 1, 10_000)
        check_number("learner.save_every_s", self.save_every_s, 0, low_included=True)
        check_number("learner.grad_clip", self.grad_clip, 0)
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(
                f"learner.checkpoint_dtype must be float32 or bfloat16, got {self.checkpoint_dtype!r}"
            )
        mbt = self.micro_batch_tokens
        if mbt is not None and (isinstance(mbt, bool) or not isinstance(mbt, int) or mbt < 1):
            raise ValueError(f"learner.micro_batch_tokens must be an integer >= 1 (or absent), got {mbt!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(
                f"learner.gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}"
            )
        cap = self.tis_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"learner.tis_cap must be a number > 0 (or absent), got {cap!r}")


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """``[adapter]``: LoRA on a frozen base (W = W0 + alpha/rank · B A on each target Linear layer). An
    adapter run typically wants ~10x full fine-tuning's lr."""

    rank: int = setting(8, "LoRA rank: checkpoints carry rank × (in + out) numbers per target layer")
    alpha: float = setting(16.0, "LoRA scale numerator: the update is scaled by alpha / rank")
    target_modules: tuple[str, ...] = setting(
        ("q_proj", "v_proj"),
        "module-name suffixes of the model's Linear layers (q_proj matches model.layers.0.self_attn.q_proj), "
        "checked against the model where it is loaded",
    )
    base_hash: str = setting(
        "",
        "sha256 (hex) of the base weights in the checkpoint dtype: filled in by the coordinator, never set",
    )

    def __post_init__(self) -> None:
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"adapter.rank must be an integer >= 1, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
            raise ValueError(f"adapter.alpha must be a number > 0, got {a!r}")
        t = self.target_modules
        if isinstance(t, str) or not isinstance(t, (list, tuple)) or not t:
            raise ValueError(f"adapter.target_modules must be a non-empty list of module names, got {t!r}")
        if not all(isinstance(x, str) and x and x.strip() == x for x in t):
            raise ValueError(f"adapter.target_modules must hold non-empty module names, got {list(t)!r}")
        object.__setattr__(self, "target_modules", tuple(t))
        object.__setattr__(self, "alpha", float(a))
        if not isinstance(self.base_hash, str) or (
            self.base_hash and (len(self.base_hash) != 64 or set(self.base_hash) - set("0123456789abcdef"))
        ):
            raise ValueError("adapter.base_hash must be 64 lowercase hex characters")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


ADAPTER_FLAG_HELP = (
    "LoRA adapters on the frozen base instead of full fine-tuning, e.g. "
    "rank=8,alpha=16,targets=q_proj,v_proj (targets: module-name suffixes); "
    "adapter runs want ~10x the full-FT lr"
)


def parse_adapter_flag(text: str) -> AdapterSettings:
    """``rank=8,alpha=16,targets=q_proj,v_proj`` (a bare name after ``targets=`` is one more target)."""
    fields: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        if "=" in part:
            key, value = (x.strip() for x in part.split("=", 1))
            if key not in ("rank", "alpha", "targets") or key in fields:
                raise ValueError(f"--adapter: unknown or repeated field {key!r} (rank, alpha, targets)")
            fields[key] = [value]
        elif key == "targets" and part:
            fields[key].append(part)
        else:
            raise ValueError(f"--adapter: {part!r} is not field=value (e.g. rank=8,alpha=16,targets=q_proj)")
    try:
        kw: dict[str, Any] = {"rank": int(fields["rank"][0])} if "rank" in fields else {}
        if "alpha" in fields:
            kw["alpha"] = float(fields["alpha"][0])
    except ValueError:
        raise ValueError(f"--adapter: rank must be an integer and alpha a number, got {text!r}") from None
    if "targets" in fields:
        kw["target_modules"] = tuple(fields["targets"])
    return AdapterSettings(**kw)


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """``[sampler]``: what a sampler sends and when it stops. Samplers also stop while the learner says it is
    busy."""

    prompts_per_batch: int = setting(2, "prompt groups per TrajectoryBatch")
    max_lag: int = setting(
        4,
        "stop generating while the newest published version is more than this many published versions ahead "
        "of the one held (fetching in the background meanwhile: data made now would arrive stale); "
        "0: only with the newest version known; -1: never stop",
    )

    def __post_init__(self) -> None:
        check_int("sampler.prompts_per_batch", self.prompts_per_batch, 1)
        check_int("sampler.max_lag", self.max_lag, -1)
