"""The gradient of one learner update: advantages, the run's objective, backward (no optimiser step).

Staleness is per row: the learner's current version minus the version the batch was sampled with; GEPO's
defensive sampling turns on by itself for stale rows. :class:`~.trainer.Trainer` owns the step around it
(zero_grad, clip, the optimiser).

Sized for real models:

* Micro-batches under a token budget with the exact full-batch gradient for every objective, group-coupled
  ones included (GEPO's group expectation, batch-wide token-mean normalisers), by the two-pass cotangent
  method: pass 1 scores all rows without grad; the objective runs on the full batch with the log-probs as
  a leaf, giving g = ∂loss/∂logp [N,T]; pass 2 re-scores each micro-batch with grad and backpropagates
  Σ g·logp. Exact because pass 2's log-probs equal pass 1's (same parameters, deterministic forward: no
  active dropout). Everything in one micro-batch: the plain single pass, no extra forward.
* Gradient checkpointing (HF models), bf16 autocast on CUDA (float32 on CPU), chunked log-softmax
  (:func:`heterorl.peer.model.completion_logprobs`).
* The inference/training mismatch of fresh rows (sampled with the learner's current version): measured
  (``mismatch/*``) and, with ``tis_cap``, corrected by truncated importance sampling (Yao et al. 2025,
  :mod:`heterorl.peer.objectives.tis`). Both use log π_learner(version) before the step, which the update
  already has: pass 1 on the micro-batched path, the detached grad forward on the direct path (the same
  parameters, so the same numbers); no forward pass is added for them. Stale rows are not measured or
  corrected: the learner no longer holds their version, and the objective's IS on log q covers both.
* Ranks (``share=(rank, world)``, :class:`~.fsdp.ShardedTrainer`): every rank holds the whole batch and
  scores only its contiguous slice (:func:`rank_slice`); the slices' log-probs are all-gathered so the
  objective (group terms, batch-wide normalisers, advantages, TIS, mismatch) runs on the full batch,
  identically on every rank; each rank then backpropagates Σ g·logp over its own slice, so the ranks'
  gradients SUM to the full batch's (the trainer's gradient reduction must sum, not average). Every rank
  runs the same number of forwards and backwards (a rank with fewer micro-batches scores a row again with a
  zero cotangent), as FSDP's collectives inside them require.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from heterorl.protocol.settings import TIS_PARAMS, Run

from .. import objectives
from ..model import completion_logprobs
from ..model.logprobs import model_device
from .rows import Rows


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What one update does, taken from the run's settings (:meth:`from_settings`, the one place settings
    map onto an update): the objective and its advantage, the sampling it re-scores with, the optimiser's
    lr and clip, and how the batch is cut into forwards."""

    objective: str
    advantage: str | None
    objective_params: dict
    temperature: float
    max_new_tokens: int
    lr: float
    grad_clip: float
    micro_batch_tokens: int | None = None
    gradient_checkpointing: bool = False
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        reserved = sorted(set(TIS_PARAMS) & set(self.objective_params))
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)}: set by the learner (learner.tis_cap), not objective params"
            )

    @classmethod
    def from_settings(cls, run: Run) -> StepOptions:
        """From a run's settings: a peer's RunSettings, or the one-process loop's ``OneProcessConfig.run``."""
        obj, ls = run.objective, run.learner
        return cls(
            objective=obj.name,
            advantage=obj.advantage,
            objective_params=dict(obj.params),
            temperature=run.sampling.temperature,
            max_new_tokens=run.sampling.max_new_tokens,
            lr=obj.lr,
            grad_clip=ls.grad_clip,
            micro_batch_tokens=ls.micro_batch_tokens,
            gradient_checkpointing=ls.gradient_checkpointing,
            tis_cap=ls.tis_cap,
        )


def plan_micro_batches(
    prompt_lengths: list[int], completion_width: int, budget: int | None
) -> list[tuple[int, int]]:
    """Consecutive row spans ``(start, stop)`` whose packed size rows × (max prompt + completion width)
    stays within ``budget`` tokens; a row alone above it is its own span. ``None``: one span of all rows.
    """
    n = len(prompt_lengths)
    if budget is None or n == 0:
        return [(0, n)]
    if budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {budget}")
    spans, start, widest = [], 0, 0
    for i, p in enumerate(prompt_lengths):
        w = max(widest, p)
        if i > start and (i - start + 1) * (w + completion_width) > budget:
            spans.append((start, i))
            start, w = i, p
        widest = w
    spans.append((start, n))
    return spans


def rank_slice(n: int, share: tuple[int, int]) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``r`` of ``w`` (``share``) in a batch of ``n``: contiguous, near-equal, the
    first ``n % w`` ranks one row more (a rank may get none when ``n < w``)."""
    r, w = share
    if not 0 <= r < w:
        raise ValueError(f"rank {r} outside a world of {w}")
    base, extra = divmod(n, w)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on a CUDA device that has bf16; otherwise a no-op (float32, e.g. on CPU)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def activation_checkpointing(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """HF gradient checkpointing (non-reentrant) while inside; restores the model's previous setting."""
    if not enabled or getattr(model, "is_gradient_checkpointing", False):
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory in MiB: CUDA's max allocated since the last reset; elsewhere the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def accumulate_gradients(
    policy: torch.nn.Module,
    rows: Rows,
    opts: StepOptions,
    *,
    version: int,
    pad_id: int,
    diagnose_mismatch: bool = True,
    share: tuple[int, int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Backpropagate ``opts.objective`` on ``rows`` into the parameters' ``.grad`` (which the caller zeroed:
    :meth:`~.trainer.Trainer.step` owns zero_grad, clipping and the optimiser step); the objective's stats
    plus reward and staleness.

    ``version``: the policy's version (rows sampled with it are fresh; the others' staleness is the gap).
    ``opts.micro_batch_tokens``: token budget of one forward (rows × padded prompt+completion width);
    ``None`` = all rows at once. The gradient is the full batch's either way (module docstring).
    ``opts.tis_cap``: C of truncated importance sampling on fresh rows; ``None`` = off.
    ``diagnose_mismatch``: report ``mismatch/*`` over fresh rows (costs no forward pass).
    ``share``: ``(rank, world)``: this rank's share of a batch that every rank of ``group`` (default: the
    default process group) holds whole and calls this on together (module docstring); its ``.grad`` is its
    slice's part of the full batch's gradient. ``None`` or a world of 1: the whole batch here.
    Also reports ``learner/micro_batches`` (this rank's forwards per pass) and ``time/fwd_bwd_s`` (seconds in
    the forwards and backward).
    """
    device = model_device(policy)
    sharded = share is not None and share[1] > 1
    if sharded:
        spans = _rank_spans(rows, opts.micro_batch_tokens, share)
    else:
        spans = plan_micro_batches(
            [len(p) for p in rows.prompts], rows.completions.shape[1], opts.micro_batch_tokens
        )
    adv_name = opts.advantage or objectives.default_advantage(opts.objective)
    adv = objectives.advantages(adv_name, rows.rewards, rows.group_ids).to(device)
    staleness = (version - rows.versions).clamp_min(0).float()
    fresh = (rows.versions == version).to(device)
    logq, mask, group_ids = rows.logq.to(device), rows.mask.to(device), rows.group_ids.to(device)
    params = {"max_len": opts.max_new_tokens, **opts.objective_params}
    tis_cap = opts.tis_cap

    def objective_on(logp: Tensor, logp_old: Tensor) -> tuple[Tensor, dict[str, float]]:
        tis = {} if tis_cap is None else {"tis_cap": tis_cap, "tis_logp": logp_old, "tis_rows": fresh}
        return objectives.compute(
            opts.objective, logp, logq, mask, adv, group_ids, staleness=staleness.to(device), **params, **tis
        )

    def score(start: int, stop: int) -> Tensor:
        with autocast_for(device):
            return completion_logprobs(
                policy,
                rows.prompts[start:stop],
                rows.completions[start:stop],
                rows.mask[start:stop],
                pad_id,
                opts.temperature,
            )

    policy.train()
    t0 = time.perf_counter()
    try:
        with activation_checkpointing(policy, opts.gradient_checkpointing):
            if sharded:
                loss, stats, logp_old = _sharded_backward(spans, score, objective_on, rows, share, group)
            elif len(spans) == 1:  # direct: one forward with grad; its detached values are π_learner(version)
                logp = score(0, len(rows.prompts))
                logp_old = logp.detach()
                loss, stats = objective_on(logp, logp_old)
                loss.backward()
            else:  # cotangent method: exact full-batch gradient from micro-batch forwards
                with torch.no_grad():
                    logp_old = torch.cat([score(a, b) for a, b in spans])
                leaf = logp_old.clone().requires_grad_(True)
                loss, stats = objective_on(leaf, logp_old)
                loss.backward()
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                for a, b in spans:
                    (score(a, b) * g[a:b]).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time below is the kernels', not their launch
    finally:
        policy.eval()
    fwd_bwd_s = time.perf_counter() - t0
    if diagnose_mismatch:
        stats.update(objectives.mismatch_stats(logp_old, logq, mask, fresh))
    return {
        **{k: float(v) for k, v in stats.items()},
        "loss": float(loss.detach()),
        "reward/mean": float(rows.rewards.mean()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        "rows": float(len(rows.rewards)),
        "learner/micro_batches": float(len(spans)),
        "time/fwd_bwd_s": fwd_bwd_s,  # the forwards and backward (the objective's own math included)
    }


def _rank_spans(rows: Rows, budget: int | None, share: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """This rank's forwards: ``(start, stop, live)`` over the whole batch's rows, its slice's micro-batches
    then, up to the most any rank runs, ``live=False`` repeats of one row (scored, zero cotangent)."""
    n, width = len(rows.prompts), rows.completions.shape[1]
    lengths = [len(p) for p in rows.prompts]
    plans = []
    for r in range(share[1]):
        lo, hi = rank_slice(n, (r, share[1]))
        spans = plan_micro_batches(lengths[lo:hi], width, budget) if hi > lo else []
        plans.append([(lo + a, lo + b) for a, b in spans])
    own = plans[share[0]]
    forwards = max(1, max(len(p) for p in plans))
    spare = own[0][0] if own else 0
    return [(a, b, True) for a, b in own] + [(spare, spare + 1, False)] * (forwards - len(own))


def _sharded_backward(spans, score, objective_on, rows: Rows, share, group):
    """The ranks' two passes (module docstring); returns the full batch's loss, stats and log π_old."""
    n, width = len(rows.prompts), rows.completions.shape[1]
    world = share[1]
    slices = [rank_slice(n, (r, world)) for r in range(world)]

    def gathered(mine: list[Tensor], like: Tensor) -> Tensor:
        """The full batch's [N, T] log-probs from every rank's slice (padded to the longest, trimmed)."""
        most = max(hi - lo for lo, hi in slices)
        buf = like.new_zeros((most, width))
        if mine:
            own = torch.cat(mine)
            buf[: len(own)] = own
        parts = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(parts, buf, group=group)
        return torch.cat([p[: hi - lo] for p, (lo, hi) in zip(parts, slices, strict=True)])

    def objective_grad(logp_old: Tensor):
        leaf = logp_old.clone().requires_grad_(True)
        loss, stats = objective_on(leaf, logp_old)
        loss.backward()
        return loss, stats, (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))

    def cotangent(g: Tensor, a: int, b: int, live: bool, like: Tensor) -> Tensor:
        return g[a:b] if live else torch.zeros_like(like)

    if len(spans) == 1:  # one forward with grad per rank: its detached values are π_old of its slice
        a, b, live = spans[0]
        logp = score(a, b)
        logp_old = gathered([logp.detach()] if live else [], logp)
        loss, stats, g = objective_grad(logp_old)
        (logp * cotangent(g, a, b, live, logp)).sum().backward()
        return loss, stats, logp_old
    with torch.no_grad():
        scored = [(score(a, b), live) for a, b, live in spans]
    logp_old = gathered([lp for lp, live in scored if live], scored[0][0])
    loss, stats, g = objective_grad(logp_old)
    for a, b, live in spans:
        logp = score(a, b)
        (logp * cotangent(g, a, b, live, logp)).sum().backward()
    return loss, stats, logp_old
