"""``[trust]``: how learners check what samplers send (spot checks of behaviour log-probs and token choices,
version claims, strikes and bans, and rate limits on authors without a record). Defaults are calibrated on
honest runs of every engine and dtype we have (docs/trust.md)."""

from __future__ import annotations

import dataclasses

from .base import check_int, check_number, setting


@dataclasses.dataclass(frozen=True)
class TrustSettings:
    """``[trust]``: the learner's checks of sampled rollouts and what a failed one costs its author."""

    check_rate: float = setting(
        0.05, "share of batches from authors with a record whose rows are recomputed and checked"
    )
    record_batches: int = setting(
        8,
        "an author's first N batches (and N more after any strike) are all checked, rate-limited and held "
        "out of training until they passed",
    )
    max_logprob_dev: float = setting(
        0.10,
        "refuse a batch whose median over rows of the median per-token exp(|log q - log π|) - 1 exceeds "
        "this (claimed vs recomputed behaviour log-probs)",
    )
    max_logprob_gap: float = setting(
        0.15, "refuse a batch whose mean |log q - log π| over all its tokens exceeds this"
    )
    max_row_logprob_dev: float = setting(
        1.0, "refuse a batch holding any row whose median exp(|log q - log π|) - 1 exceeds this"
    )
    max_row_logprob_gap: float = setting(
        0.3, "refuse a batch holding any row whose mean |log q - log π| over its tokens exceeds this"
    )
    max_row_typicality_z: float = setting(
        12.0,
        "refuse a batch holding any row whose own token choices are this many standard deviations more or "
        "less likely than the run's sampling makes them (one foreign row hides in the batch's z)",
    )
    max_seed_margin: float = setting(
        1.5,
        "in a run that asks for seeded sampling, refuse a batch holding any row with a token its seed does "
        "not reproduce by more than this Gumbel-max margin (nats): an honest engine of another dtype misses "
        "only near-ties",
    )
    max_typicality_z: float = setting(
        6.0,
        "refuse a batch whose token choices are this many standard deviations more or less likely than "
        "the run's sampling distribution makes them (also an author's checked batches taken together)",
    )
    max_outside_nucleus: float = setting(
        0.02, "refuse a batch with more than this share of tokens outside the top-p nucleus"
    )
    min_reproduced: float = setting(
        0.0,
        "refuse a checked batch unless its rows are seeded (drawn by Gumbel-max from seeds derived from the "
        "batch: the hf engine) and the seeds reproduce at least this share of its tokens (0: measure only)",
    )
    ban_strikes: int = setting(3, "ban an author for the run after this many refused batches...")
    ban_strike_share: float = setting(
        0.1, "... if they are also at least this share of its checked batches (0: strikes alone)"
    )
    new_author_batches_per_s: float = setting(
        1.0, "batches per second taken from all authors without a record together (more are deferred)"
    )
    new_author_buffer_share: float = setting(
        0.25,
        "batches of authors without a record held on probation, as a share of learner.buffer_batches (at "
        "least 2 × record_batches); more are deferred",
    )
    check_share: float = setting(
        0.10,
        "spot checks together take at most this share of the learner's wall time (seconds of checking per "
        "second, counted while a check holds the checker's model); a check past it is not run: the batch is "
        'deferred ("busy, retry later", no strike) or, of an author with a record, stays held',
    )
    probation_check_share: float = setting(
        0.05,
        "... of which checks of authors without a record (probation) take at most this share: a flood of "
        "fresh keys is deferred past it, and authors with a record keep check_share - probation_check_share",
    )
    hold_batches: int = setting(
        16,
        "an author with a record has its unchecked batches held out of training until one of its later "
        "batches passes a check; at most this many: the next one is checked (1: every batch is checked)",
    )
    hold_s: float = setting(
        20.0,
        "... nor longer than this: a batch arriving after its author's oldest held one waited this long is "
        "checked, and an author gone quiet has its newest held batch checked",
    )
    record_expiry_s: float = setting(
        900.0, "an author that never earned a record and sent nothing for this long is forgotten"
    )
    check_versions: int = setting(
        8, "published versions the checker keeps in memory, in the checkpoint dtype (others are read back)"
    )

    def __post_init__(self) -> None:
        for name in ("check_rate", "new_author_buffer_share", "min_reproduced"):
            value = getattr(self, name)
            check_number(f"trust.{name}", value, 0, low_included=True)
            if value > 1:
                raise ValueError(f"trust.{name} must be at most 1, got {value!r}")
        positive = (
            "max_logprob_dev",
            "max_logprob_gap",
            "max_row_logprob_dev",
            "max_row_logprob_gap",
            "max_row_typicality_z",
            "max_seed_margin",
            "max_typicality_z",
            "new_author_batches_per_s",
            "hold_s",
            "record_expiry_s",
        )
        for name in positive:
            check_number(f"trust.{name}", getattr(self, name), 0)
        for name in ("check_share", "probation_check_share"):
            check_number(f"trust.{name}", getattr(self, name), 0)
        if self.check_share > 1:
            raise ValueError(f"trust.check_share must be at most 1, got {self.check_share!r}")
        if self.probation_check_share >= self.check_share:
            raise ValueError(
                "trust.probation_check_share must be less than trust.check_share (authors with a record get "
                f"the rest), got {self.probation_check_share!r} and {self.check_share!r}"
            )
        check_number("trust.max_outside_nucleus", self.max_outside_nucleus, 0, low_included=True)
        check_number("trust.ban_strike_share", self.ban_strike_share, 0, low_included=True)
        check_int("trust.record_batches", self.record_batches, 0)
        check_int("trust.ban_strikes", self.ban_strikes, 1)
        check_int("trust.check_versions", self.check_versions, 1)
        check_int("trust.hold_batches", self.hold_batches, 1)
