"""The learner's own check of a sampler's batch: re-score every completion from its text.

A sampler's reward is a claim. The learner decodes each row's prompt (strictly: ids that
``PromptFormat.encode`` would not make from some text are foreign) and completion with the run's tokenizer,
recomputes the reference from the prompt (``Task.reference_for``) and the reward with the task's reward
function, and refuses the batch if any claimed reward differs (a buggy or hostile sampler; the refusal is
counted against its author by the receiver). The claimed rewards are kept only as a diagnostic.
"""

from __future__ import annotations

import collections

from ..model.prompts import PromptFormat
from ..model.text import completion_text
from ..tasks import Task

REWARD_TOLERANCE = 1e-6


class RewardCheck:
    """``check(body, author) -> None | reason``; plugs into ``TrajectoryReceiver(admit=...)``."""

    def __init__(
        self, task: Task, tokenizer, tolerance: float = REWARD_TOLERANCE, prompts: PromptFormat | None = None
    ):
        self.task, self.tokenizer, self.tolerance = task, tokenizer, tolerance
        self.prompts = prompts or PromptFormat(tokenizer, "off")
        self.rows_checked = 0
        self.rows_disagreeing = 0
        self.by_author: collections.Counter[bytes] = collections.Counter()

    def rescore(self, body: dict) -> list[float | None]:
        """The learner's reward for each row, or None where the prompt is not one of this task's."""
        out: list[float | None] = []
        for row in body["rows"]:
            prompt = self.prompts.decode(row["prompt_ids"])
            reference = None if prompt is None else self.task.reference_for(prompt)
            if reference is None:
                out.append(None)
                continue
            out.append(
                self.task.reward(prompt, completion_text(self.tokenizer, row["completion_ids"]), reference)
            )
        return out

    def __call__(self, body: dict, author: bytes) -> str | None:
        rewards = self.rescore(body)
        self.rows_checked += len(rewards)
        foreign = sum(r is None for r in rewards)
        if foreign:
            self.by_author[author] += 1
            return f"{foreign} of {len(rewards)} prompts are not from this run's task"
        wrong = sum(
            abs(r - row["reward"]) > self.tolerance for r, row in zip(rewards, body["rows"], strict=True)
        )
        if wrong:
            self.rows_disagreeing += wrong
            self.by_author[author] += 1
            return (
                f"claimed rewards disagree with the learner's recomputation in {wrong} of {len(rewards)} rows"
            )
        return None
