"""Spot checks: recompute a random, unpredictable sample of batches under the version each one claims, and
judge their behaviour log-probs and token choices (:mod:`.rollout_stats`).

Which batches: all of an author's until it has a record, then ``trust.check_rate`` of them, drawn from the
OS's randomness (:class:`.reputation.Reputation`). The weights of the claimed version come from the learner's
own chunk store (every version it published, as the samplers received it, in the checkpoint dtype), a few
kept in memory, loaded into the learner's :class:`.replica.ModelReplica` (its own copy of the model, shared
with the held-out evaluation), so training never waits on it nor shares its weights. A version the store no
longer holds cannot be checked: the batch is refused without a strike (its data is that stale anyway). A
check that fails on this side (weights that do not load, a CUDA out-of-memory, any error in the model) is no
verdict on the batch: the sampler is told to retry it later (a :class:`Deferral`). Nor is a check the
budget (:mod:`.budget`) has no time for: it is not run (``busy``); a batch of an author without a record is
deferred, one of an author with a record accepted unchecked and held (deferred once it holds
``trust.hold_batches``).

The verdict (:func:`judge`) refuses a batch whose claimed log-probs disagree with the recomputation (the
median over rows of each row's median ``exp(|Δ|) - 1``, or any one row's, or the mean ``|Δ|`` over all its
tokens), whose token choices are atypical
of the run's sampling distribution (the batch's z, or the author's checked batches' z taken together), or
that holds tokens outside the top-p nucleus.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch
from torch import Tensor

from heterorl.protocol.net.trajectories import Deferral
from heterorl.protocol.settings import TrustSettings
from heterorl.protocol.wire.checkpoint import deserialize_state_dict
from heterorl.protocol.wire.seeds import row_seed

from ..model.logprobs import completion_logits
from .budget import CheckBudget
from .intake import Refusal
from .replica import ModelReplica
from .reputation import Reputation
from .rollout_stats import RowStats, row_stats
from .rows import rows_from_bodies

log = logging.getLogger(__name__)

# a row's own z is tested only when its tokens' variances sum to this: over a few near-certain tokens one
# honest draw of a rare token gives z ~ 30 (p = 0.999 against 0.001), far from N(0, 1)
ROW_Z_MIN_VARIANCE = 4.0
CHECK_RETRY_AFTER_S = 5.0  # when the sampler retries a batch whose check failed on this side


@dataclasses.dataclass(frozen=True)
class Verdict:
    reason: str | None  # None: passed
    strike: bool = True  # False: the batch could not be checked (not the author's fault)
    stats: dict = dataclasses.field(default_factory=dict)
    retry: bool = False  # True: the check itself failed (this side's error); the batch may be checked again
    busy: bool = False  # True: not checked, the checks' share of time is spent (check it later)


def judge(stats: RowStats, trust: TrustSettings, author_z: float | None = None) -> str | None:
    """Why a checked batch is refused, or None (pure: the thresholds are the run's ``[trust]``). The batch as
    a whole first, then each row on its own (a batch with one foreign row among honest ones)."""
    n = len(stats.tokens)
    dev = stats.batch_logprob_dev_median()
    if dev > trust.max_logprob_dev:
        return f"behaviour log-probs disagree with the recomputation (median exp|Δ|-1 {dev:.3f})"
    gap = stats.batch_logprob_gap_mean()
    if gap > trust.max_logprob_gap:
        return f"behaviour log-probs disagree with the recomputation (mean |Δ| {gap:.3f})"
    worst = float(stats.logprob_dev_median.max()) if len(stats.tokens) else 0.0
    if worst > trust.max_row_logprob_dev:
        return f"a row's behaviour log-probs disagree with the recomputation (median exp|Δ|-1 {worst:.3f})"
    tokens = float(stats.tokens.sum())
    outside = float(stats.outside.sum()) / max(1.0, tokens)
    if outside > trust.max_outside_nucleus:
        return f"{outside:.1%} of tokens lie outside the run's top-p nucleus"
    z = stats.batch_typicality_z()
    if abs(z) > trust.max_typicality_z:
        likely = "less" if z > 0 else "more"
        return f"tokens {likely} likely than the run's sampling makes them (z = {z:+.1f})"
    if trust.min_reproduced > 0:
        share = stats.reproduced_share()
        if share is None or stats.seed_margin is None:
            return "the run asks for seeded sampling and the batch's rows are not seeded"
        if share < trust.min_reproduced:
            return f"its seeds reproduce {share:.0%} of its tokens (the run asks {trust.min_reproduced:.0%})"
        row, margin = _worst(stats.seed_margin)
        if margin > trust.max_seed_margin:
            return (
                f"row {row}'s seed does not reproduce one of its tokens, by a margin of {margin:.2f} (more "
                "than an engine's near-ties)"
            )
    # each row on its own: one foreign row among honest ones barely moves the batch's figures
    row, gap = _worst(stats.row_logprob_gap_mean())
    if gap > trust.max_row_logprob_gap:
        return f"row {row}'s behaviour log-probs disagree with the recomputation (mean |Δ| {gap:.3f})"
    zs = torch.where(
        stats.variance >= ROW_Z_MIN_VARIANCE, stats.typicality_z(), torch.zeros_like(stats.variance)
    )
    row, _ = _worst(zs.abs())
    z = float(zs[row]) if n else 0.0
    if abs(z) > trust.max_row_typicality_z:
        likely = "less" if z > 0 else "more"
        return f"row {row}'s tokens are {likely} likely than the run's sampling makes them (z = {z:+.1f})"
    if author_z is not None and abs(author_z) > trust.max_typicality_z:
        likely = "less" if author_z > 0 else "more"
        return f"its checked tokens together are {likely} likely than sampled ones (z = {author_z:+.1f})"
    return None


def _worst(values: Tensor) -> tuple[int, float]:
    """The row with the largest value and the value (0, 0.0 for no rows)."""
    if not len(values):
        return 0, 0.0
    row = int(values.argmax())
    return row, float(values[row])


class VersionWeights:
    """Published versions' weights from the chunk store (``load(version) -> safetensors bytes or None``), the
    ``keep`` most recently used kept in memory."""

    def __init__(self, load: Callable[[int], bytes | None], keep: int):
        self.load, self.keep = load, keep
        self._cache: collections.OrderedDict[int, dict[str, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()  # the publisher puts, the checker gets
        self.loads = 0

    def put(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """A version just published (its tensors, not copied: a snapshot is never changed after)."""
        with self._lock:
            self._cache[version] = state
            self._trim()

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        with self._lock:
            if version in self._cache:
                self._cache.move_to_end(version)
                return self._cache[version]
        data = self.load(version)
        if data is None:
            return None
        state = deserialize_state_dict(data)
        with self._lock:
            self.loads += 1
            self._cache[version] = state
            self._trim()
        return state

    def _trim(self) -> None:
        while len(self._cache) > self.keep:
            self._cache.popitem(last=False)


class SpotCheck:
    """``check(body, author) -> None | Refusal | Deferral`` for the admission chain; ``last`` is the latest
    verdict. ``replica``: the model the claimed versions are loaded into (shared, held while checking)."""

    def __init__(
        self,
        replica: ModelReplica,
        versions: VersionWeights,
        reputation: Reputation,
        trust: TrustSettings,
        *,
        pad_id: int,
        temperature: float,
        top_p: float,
        run_id: str = "",
        budget: CheckBudget | None = None,
    ):
        self.replica, self.budget = replica, budget
        self.versions, self.reputation, self.trust = versions, reputation, trust
        self.pad_id, self.temperature, self.top_p, self.run_id = pad_id, temperature, top_p, run_id
        # per author: (tokens reproduced, tokens of seeded batches checked): what seeded sampling adds
        self.reproduced: collections.defaultdict[bytes, list[float]] = collections.defaultdict(
            lambda: [0.0, 0.0]
        )
        self._lock = threading.Lock()  # the counters (the replica is held while it is read)
        self.checked = 0
        self.refused = 0
        self.unverifiable = 0
        self.failed = 0  # checks that failed on this side: deferred, the batch retried later
        self.seconds = 0.0  # checking: the replica held (loading the version, recomputing, judging)
        self.wait_seconds = 0.0  # waiting for the replica (another check, the held-out eval): not in seconds
        self.rows_checked = 0
        self.last: Verdict | None = None

    def __call__(self, body: dict, author: bytes) -> str | Refusal | Deferral | None:
        if not self.reputation.should_check(author):
            return None
        verdict = self.check(body, author)
        if verdict.reason is None:
            return None
        if verdict.busy:  # the checks' share of time is spent
            n, _ = self.reputation.held(author)
            if self.reputation.has_record(author) and n + 1 <= self.trust.hold_batches:
                return None  # accepted unchecked: held until a later check of the author passes
            probation = not self.reputation.has_record(author)
            wait = self.budget.retry_after_s(probation) if self.budget is not None else CHECK_RETRY_AFTER_S
            return Deferral(verdict.reason, wait)
        if verdict.retry:  # not accepted, not refused: the sampler keeps the batch and sends it again
            return Deferral(verdict.reason, CHECK_RETRY_AFTER_S)
        return Refusal(verdict.reason, verdict.strike)

    def check(self, body: dict, author: bytes) -> Verdict:
        """Verify a batch now and count a pass in the author's record (the batch then vouches for the
        author's batches held before it); a refusal is the caller's to count. A verdict with ``retry`` is no
        verdict on the batch (the check failed on this side): keep it, check it again later; one with
        ``busy`` was not checked (the budget's share of time is spent): the same."""
        verdict = self.verify(body, author)
        self.last = verdict
        if verdict.reason is None:
            s = verdict.stats
            self.reputation.passed_check(author, s["z_num"], s["z_var"], batch_id=body["batch_id"])
        return verdict

    def verify(self, body: dict, author: bytes) -> Verdict:
        """Recompute and judge one batch, if the budget has time for it (``busy`` if not): the time the
        replica is held is counted in ``seconds`` and charged to the budget (of probation while the author
        has no record), the wait for it in ``wait_seconds``."""
        asked = time.perf_counter()
        with self.replica:  # one check (or eval) at a time: the budget sees the previous check's charge
            t = time.perf_counter()
            probation = not self.reputation.has_record(author)
            try:
                if self.budget is not None and not self.budget.allows(probation):
                    kind = "authors without a record" if probation else "all checks"
                    return Verdict(f"busy: the checks of {kind} have taken their share of the learner's time",
                                   strike=False, busy=True)  # fmt: skip
                return self._verify(body, author)
            finally:
                took = time.perf_counter() - t
                with self._lock:
                    self.wait_seconds += t - asked
                    self.seconds += took
                if self.budget is not None:
                    self.budget.spend(took, probation)

    def _verify(self, body: dict, author: bytes) -> Verdict:
        """Recompute and judge one batch (the replica held)."""
        try:
            stats = self._stats(body, author)
        except Exception as e:  # weights that do not load, an out-of-memory, a failing model: this side's
            log.warning("a batch could not be checked (retried later): %s: %s", type(e).__name__, e)
            with self._lock:
                self.failed += 1
            return Verdict(f"could not be checked now ({type(e).__name__})", strike=False, retry=True)
        with self._lock:
            if stats is None:
                self.unverifiable += 1
                v = body["policy_version"]
                return Verdict(f"version {v} is no longer held to check the batch against", strike=False)
            self.checked += 1
            self.rows_checked += len(stats.tokens)
        num = float((stats.surprise - stats.entropy).sum())
        var = float(stats.variance.sum())
        reason = judge(stats, self.trust, self.reputation.typicality_z(author, num, var))
        if reason is not None:
            with self._lock:
                self.refused += 1
        summary = {
            "logprob_dev": stats.batch_logprob_dev_median(),
            "logprob_gap": stats.batch_logprob_gap_mean(),
            "logprob_dev_row_max": float(stats.logprob_dev_median.max()),
            "z": stats.batch_typicality_z(),
            "z_num": num,
            "z_var": var,
            "tokens": float(stats.tokens.sum()),
            "reproduced": stats.reproduced_share(),
            "row_logprob_gap_max": _worst(stats.row_logprob_gap_mean())[1],
            "row_abs_z_max": _worst(stats.typicality_z().abs())[1],
            "seed_margin_max": None if stats.seed_margin is None else _worst(stats.seed_margin)[1],
        }
        return Verdict(reason, stats=summary)

    @torch.no_grad()
    def _stats(self, body: dict, author: bytes) -> RowStats | None:
        version = body["policy_version"]
        with self.replica:  # one reader at a time: the eval may share it
            # the tag is the version: the replica holds its published weights (those of VersionWeights)
            if self.replica.tag != version:
                state = self.versions.get(version)
                if state is None:
                    return None
                self.replica.load(state, version)
            rows = rows_from_bodies([body], self.pad_id)
            model = self.replica.model
            logits = completion_logits(model, rows.prompts, rows.completions, rows.mask, self.pad_id)
            seeds = None
            if body.get("seeded"):
                bid = body["batch_id"]
                seeds = [row_seed(self.run_id, author, bid, version, r) for r in range(len(body["rows"]))]
            stats = row_stats(
                logits, rows.completions, rows.mask, rows.logq, self.temperature, self.top_p, seeds=seeds
            )
            del logits
        if stats.reproduced is not None:
            with self._lock:
                tally = self.reproduced[author]
                tally[0] += float(stats.reproduced.sum())
                tally[1] += float(stats.tokens.sum())
        return stats

    def reproduced_by_author(self) -> dict[str, float]:
        """Per author (hex): the share of its seeded checked tokens its seeds reproduced."""
        with self._lock:
            return {a.hex(): r / t for a, (r, t) in self.reproduced.items() if t}

    def stats(self) -> dict[str, float]:
        return {
            "trust/checked": self.checked,
            "trust/refused": self.refused,
            "trust/unverifiable": self.unverifiable,
            "trust/check_failed": self.failed,
            "trust/check_s": round(self.seconds, 3),
            "trust/check_wait_s": round(self.wait_seconds, 3),
            "trust/rows_checked": self.rows_checked,
        }
