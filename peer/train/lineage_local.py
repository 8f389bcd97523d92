"""Several learner peers of one lineage in one process: the swarm's step arithmetic, for quality comparisons.

Each learner takes its own rows; the parts are combined as the lineage's writer combines them
(``peer/daemon/learner_lineage.py``): dense, each part's gradient clipped and weighed by its tokens, the
writer's AdamW step on the sum; sparse, each learner's own AdamW step (its own moments), a member's sent as
the top-k of its residual + step (error feedback), the writer's whole, the clipped token-weighted sum
compressed again with the writer's own residual; each learner's gradient taken at the weights plus what it
has not sent yet (the writer: its commits' residual; a member: its parts' residual times its share). With
``overlap`` a member's part is computed on the weights one version before the step it joins, as in the swarm.
One model stands for every replica: in the swarm they are bit-identical. What the network does (losses,
elections, timing) is not here.
"""

from __future__ import annotations

from torch import nn

from heterorl.protocol.settings import LineageSettings
from heterorl.protocol.wire.gradients import parameter_schema

from ..learner.combine import Accumulator
from ..learner.compress import ErrorFeedback, flatten, unflatten
from ..learner.rows import Rows
from ..learner.trainer import LR_SCALE_KEY, Trainer
from ..learner.update import StepOptions


class LocalLineage:
    """``learners`` learners on one model; :meth:`step` takes one Rows per learner (the writer's first)."""

    def __init__(self, writer: Trainer, learners: int, lineage: LineageSettings, options: StepOptions):
        if learners < 2:
            raise ValueError("a lineage in one process needs at least 2 learners")
        self.writer, self.settings, self.options = writer, lineage, options
        model: nn.Module = writer.model
        self.sparse = lineage.exchange == "sparse"
        self.members = [
            Trainer(model, options, writer.pad_id) if self.sparse else writer for _ in range(learners - 1)
        ]  # sparse: each member's own AdamW moments (its step is its own); dense: gradients need none
        self.schema = parameter_schema(model.named_parameters())
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.clip = lineage.update_clip * options.lr * numel**0.5 if self.sparse else options.grad_clip
        self.sent = [ErrorFeedback(numel, lineage.k) for _ in self.members] if self.sparse else []
        self.committed = ErrorFeedback(numel, lineage.k) if self.sparse else None
        self.share = 1.0 / learners  # a member's part's weight in the combination (equal batches)
        self.pending: list[tuple[int, dict, float]] = []  # overlap: members' parts for the next step

    def _part(self, i: int, rows: Rows) -> tuple[int, dict, float, dict]:
        """Learner ``i``'s part (0: the writer): its tokens, what it sends (decoded), lr scale, stats."""
        trainer = self.writer if i == 0 else self.members[i - 1]
        offset = None
        if self.sparse:  # the gradient where this learner's unsent steps put the lineage
            residual = self.committed.residual if i == 0 else self.sent[i - 1].residual * self.share
            offset = unflatten(residual, self.schema)
        grads, stats = trainer.gradients(rows, offset)
        lr_scale = min(1.0, float(stats.get(LR_SCALE_KEY, 1.0)))
        tokens = max(1, int(rows.mask.sum()))
        if self.sparse:
            step = trainer.local_update(grads, lr_scale)
            if i > 0:
                step = unflatten(self.sent[i - 1].step(flatten(step, self.schema)).dense.clone(), self.schema)
            return tokens, step, lr_scale, stats
        return tokens, grads, lr_scale, stats

    def step(self, rows: list[Rows]) -> dict[str, float]:
        """One version: every learner's part on its rows, combined and committed. Returns the writer's
        objective stats with ``reward/mean`` over every learner's rows."""
        if len(rows) != 1 + len(self.members):
            raise ValueError(f"{len(rows)} parts for {1 + len(self.members)} learners")
        members = [self._part(i, r)[:3] for i, r in enumerate(rows) if i > 0]
        tokens, own, lr_scale, stats = self._part(0, rows[0])
        if self.settings.overlap:  # members' parts computed on this version join the next one
            members, self.pending = self.pending, members
        acc = Accumulator(self.clip)
        acc.add(tokens, own, lr_scale)
        for t, part, lr in members:
            acc.add(t, part, lr)
        combined, norm, lr = acc.result()
        if self.sparse:
            sent = self.committed.step(flatten(combined, self.schema)).dense
            self.writer.apply_update(unflatten(sent, self.schema), None, self.writer.version + 1)
        else:
            self.writer.commit_update(combined, lr)
        reward = sum(float(r.rewards.mean()) for r in rows) / len(rows)
        return {**stats, "reward/mean": reward, "grad_norm": norm, "lineage/parts": 1 + len(members)}
