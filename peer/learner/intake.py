"""The learner's checks of a sampler's batch before it is accepted: :class:`Admission` runs them in order,
cheapest first, and the first refusal wins; :class:`RewardCheck` re-scores every completion from its text.

The receiver has already decoded the batch and checked its signature, schema and run (protocol/net); what runs
here is the learner's own judgement, in the intake pool, before the ledger write and the Ack. A new check (a
verifier of behaviour log-probs, a rate limit per author) is one more entry in the list.

A sampler's reward is a claim. The learner decodes each row's prompt (strictly: ids that
``PromptFormat.encode`` would not make from some text are foreign) and completion with the run's tokenizer,
recomputes the reference from the prompt (``Task.reference_for``) and the reward with the task's reward
function, and refuses the batch if any claimed reward differs (a buggy or hostile sampler; the refusal is
counted against its author by the receiver). The claimed rewards are kept only as a diagnostic.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence

from heterorl.protocol.net.trajectories import Deferral

from ..model.prompts import PromptFormat
from ..model.text import completion_text
from ..tasks import Task

REWARD_TOLERANCE = 1e-6


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A check's refusal that is not the author's fault (``strike=False``: a version no longer held)."""

    reason: str
    strike: bool = True


Check = Callable[[dict, bytes], "str | Refusal | Deferral | None"]
"""A check of a decoded batch body and its author: None to pass, the reason to refuse (a strike against the
author), a :class:`Refusal`, or a :class:`Deferral` (flow control)."""


class Admission:
    """``admission(body, author) -> None | reason | Deferral``: ``checks`` in order (name, check), the first
    refusal wins; plugs into ``TrajectoryReceiver(admit=...)``. ``refused`` counts refusals by check name,
    ``deferred`` deferrals; ``on_strike(author, check name, reason)`` hears each refusal that counts against
    its author (not those of the checks named in ``no_strike``, nor a :class:`Refusal` with strike False)."""

    def __init__(
        self,
        checks: Sequence[tuple[str, Check]],
        on_strike: Callable[[bytes, str, str], None] | None = None,
        no_strike: Iterable[str] = (),
    ):
        self.checks = list(checks)
        self.on_strike, self.no_strike = on_strike, frozenset(no_strike)
        self.refused: collections.Counter[str] = collections.Counter()
        self.deferred: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # called from the intake pool's threads

    def count_refusal(self, name: str) -> None:
        """A refusal made outside the chain (a held batch checked later)."""
        with self._lock:
            self.refused[name] += 1

    def __call__(self, body: dict, author: bytes) -> str | Deferral | None:
        for name, check in self.checks:
            outcome = check(body, author)
            if outcome is None:
                continue
            if isinstance(outcome, Deferral):
                with self._lock:
                    self.deferred[name] += 1
                return outcome
            strike = name not in self.no_strike
            if isinstance(outcome, Refusal):
                outcome, strike = outcome.reason, strike and outcome.strike
            with self._lock:
                self.refused[name] += 1
            if strike and self.on_strike is not None:
                self.on_strike(author, name, outcome)
            return outcome
        return None


class ScoringIncident(Exception):
    """The reward worker could not score a row of the batch."""


class RewardCheck:
    """``check(body, author) -> None | reason``; plugs into ``TrajectoryReceiver(admit=...)``."""

    def __init__(
        self, task: Task, tokenizer, tolerance: float = REWARD_TOLERANCE, prompts: PromptFormat | None = None
    ):
        self.task, self.tokenizer, self.tolerance = task, tokenizer, tolerance
        self.prompts = prompts or PromptFormat(tokenizer, "off")
        self.rows_checked = 0
        self.rows_disagreeing = 0
        self.batches_unscored = 0  # dropped because a row could not be scored
        self.by_author: collections.Counter[bytes] = collections.Counter()
        self._lock = threading.Lock()  # called from the intake pool's threads

    def rescore(self, body: dict) -> list[float | None]:
        """The learner's reward for each row, or None where the prompt is not one of this task's training
        prompts (a held-out prompt is kept for evaluation: training on it would inflate the score).
        ScoringIncident where the reward worker could not score a row (a timeout, a crash, a refusal: see
        :mod:`~heterorl.peer.tasks.sandbox`): the batch's other rows are not scored (each incident costs the
        worker's time limit or a restart, so a batch pays for one)."""
        out: list[float | None] = []
        for i, row in enumerate(body["rows"]):
            prompt = self.prompts.decode(row["prompt_ids"])
            reference = None if prompt is None else self.task.reference_for(prompt)
            if reference is None or self.task.is_held_out(prompt):  # held-out prompts are not for training
                out.append(None)
                continue
            out.append(
                self.task.reward(prompt, completion_text(self.tokenizer, row["completion_ids"]), reference)
            )
            incident = getattr(self.task.scorer, "incident", None)
            if incident is not None:
                raise ScoringIncident(f"row {i}'s reward could not be computed ({incident})")
        return out

    def __call__(self, body: dict, author: bytes) -> str | Refusal | None:
        try:
            rewards = self.rescore(body)
        except ScoringIncident as e:  # dropped without a strike: a loaded learner's time limit is not the
            with self._lock:  # sampler's fault; the incident is counted and logged by the sandbox
                self.batches_unscored += 1
            return Refusal(f"{e}: the batch is dropped", strike=False)
        foreign = sum(r is None for r in rewards)
        wrong = (
            0
            if foreign
            else sum(
                abs(r - row["reward"]) > self.tolerance for r, row in zip(rewards, body["rows"], strict=True)
            )
        )
        with self._lock:
            self.rows_checked += len(rewards)
            self.rows_disagreeing += wrong
            if foreign or wrong:
                self.by_author[author] += 1
        if foreign:
            return (
                f"{foreign} of {len(rewards)} prompts are not from this run's task (or are held out for "
                "evaluation)"
            )
        if wrong:
            return (
                f"claimed rewards disagree with the learner's recomputation in {wrong} of {len(rewards)} rows"
            )
        return None
