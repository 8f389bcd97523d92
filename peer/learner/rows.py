"""An update's rows as padded tensors, each row carrying where it came from (author, batch, version).

A learner update takes whole TrajectoryBatches; every row keeps its author's key and its batch id all the way
to the objective, so whatever comes next (a verifier weighing authors, per-author statistics, dropping a
banned author's rows) has them at hand. Group ids are made unique across batches, so each sampler's prompt
groups stay groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .buffer import Buffered


@dataclasses.dataclass
class Rows:
    prompts: list[list[int]]
    completions: torch.Tensor  # [N, T] padded
    mask: torch.Tensor  # [N, T]
    logq: torch.Tensor  # [N, T] behaviour log-probs, 0 on padding
    rewards: torch.Tensor  # [N]
    group_ids: torch.Tensor  # [N]
    versions: torch.Tensor  # [N] policy version each row was sampled with
    authors: list[bytes] = dataclasses.field(default_factory=list)  # [N] the signer of each row's batch
    batch_ids: list[bytes] = dataclasses.field(default_factory=list)  # [N] each row's batch

    def __post_init__(self) -> None:
        n = len(self.prompts)
        for name in ("authors", "batch_ids"):
            got = len(getattr(self, name))
            if got not in (0, n):  # empty: rows made in one process (no network author)
                raise ValueError(f"Rows.{name} has {got} entries for {n} rows")

    def __len__(self) -> int:
        return len(self.prompts)


def rows_from_bodies(
    bodies: Sequence[dict], pad_id: int, sources: Sequence[tuple[bytes, bytes]] | None = None
) -> Rows:
    """``bodies`` (decoded TrajectoryBatches) as one padded :class:`Rows`; ``sources``: (author, batch id)
    of each body, carried to every row (default: the bodies' own ``batch_id`` and no author)."""
    if sources is not None and len(sources) != len(bodies):
        raise ValueError(f"{len(sources)} sources for {len(bodies)} bodies")
    flat = [(b, r, bi) for bi, b in enumerate(bodies) for r in b["rows"]]
    width = max(1, max((len(r["completion_ids"]) for _, r, _ in flat), default=1))
    n = len(flat)
    completions = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    logq = torch.zeros((n, width), dtype=torch.float32)
    for i, (_, r, _) in enumerate(flat):
        k = len(r["completion_ids"])
        if k:
            completions[i, :k] = torch.tensor(r["completion_ids"])
            mask[i, :k] = 1
            logq[i, :k] = torch.tensor(r["logprobs"], dtype=torch.float32)
    groups: dict[tuple[int, int], int] = {}
    group_ids = torch.tensor([groups.setdefault((bi, r["group"]), len(groups)) for _, r, bi in flat])
    if sources is None:
        sources = [(b"", bytes(b.get("batch_id", b""))) for b in bodies]
    return Rows(
        prompts=[list(r["prompt_ids"]) for _, r, _ in flat],
        completions=completions,
        mask=mask,
        logq=logq,
        rewards=torch.tensor([float(r["reward"]) for _, r, _ in flat]),
        group_ids=group_ids,
        versions=torch.tensor([b["policy_version"] for b, _, _ in flat]),
        authors=[sources[bi][0] for _, _, bi in flat],
        batch_ids=[sources[bi][1] for _, _, bi in flat],
    )


def rows_from_batches(batches: Sequence[Buffered], pad_id: int) -> Rows:
    """The buffer's batches as one :class:`Rows`, every row with its author and batch id."""
    return rows_from_bodies([b.body for b in batches], pad_id, [(b.author, b.batch_id) for b in batches])
