"""``[lineage]``: how the learner peers of one run combine each version (docs/architecture.md).

``sparse`` (the default, for learners on internet links): each learner takes an AdamW step of its own on
its own batches without applying it, and sends the top ``k`` of each 4 096 values of that step plus what it
has not sent yet (error feedback), at 2 bits a value; the writer combines the parts by tokens and commits the
top ``k`` of the combination (with its own error feedback): 0.39 % of dense float32 bytes each way at ``k`` =
32.
Each learner takes its gradient at the weights plus what it has not sent yet, so that error feedback delays
the bytes, not the learning. ``dense``: float32 gradients in, the parameter update and the combined gradient
out (exact, 770× the bytes: for learners on a datacenter's fabric). Either way every learner adds
the same committed bytes: replicas stay bit-identical. With ``overlap`` a member computes its next part while
the exchange of its last one runs.
"""

from __future__ import annotations

import dataclasses
import math

from .base import setting

EXCHANGES = ("sparse", "dense")
MAX_K = 256  # protocol/wire/sparse_gradient.py's bound (this module stays numpy- and torch-free)


@dataclasses.dataclass(frozen=True)
class LineageSettings:
    """``[lineage]``: the exchange between learner peers (only when the run lists several learner keys)."""

    exchange: str = setting(
        "sparse",
        "sparse (each learner sends the top-k of each 4096 values of its own AdamW step, 2-bit, with error "
        "feedback; the writer commits the top-k of their combination: ~0.4 % of dense bytes, for internet "
        "links) | dense (float32 gradients in, the update and combined gradient out: exact, for a fabric)",
    )
    k: int = setting(32, "sparse: values sent per 4096 (a multiple of 4, 4 to 256): 32 is 0.39 % of dense")
    overlap: bool = setting(
        True,
        "a member sends its part and computes its next one while the exchange runs (the part joins the "
        "next step: one more version of staleness); false: it waits for each commit before computing on",
    )
    update_clip: float = setting(
        8.0,
        "sparse: the writer clips each part to this × lr × √(parameters) (a step moving every weight by lr "
        "has that norm; an honest part with its error feedback measured about 1 on the tiny model)",
    )

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ValueError(f"lineage.exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 4 <= self.k <= MAX_K or self.k % 4:
            raise ValueError(f"lineage.k must be a multiple of 4 from 4 to {MAX_K}, got {self.k!r}")
        if not (math.isfinite(self.update_clip) and self.update_clip > 0):
            raise ValueError(f"lineage.update_clip must be > 0, got {self.update_clip!r}")
