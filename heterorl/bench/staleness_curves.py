"""Held-out curves of the staleness grid, reduced to the figures that say how fast a delayed run learns.

A curve is a run's ``eval_curve``: ``[update, sampled, greedy]`` rows, the first at update 0. Every function
is pure (lists in, floats out) and takes a ``budget``: the updates over which two runs are compared, so that
a delay-0 run longer than a delayed one is cut to the delayed run's length before the two are set side by
side.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

FINAL_EVALS = 5  # final: the mean of this many last evaluations (heterorl.peer.train.one_process)


def within(curve: Sequence[Sequence[float]], budget: float) -> list[tuple[float, float]]:
    """The (update, sampled score) points of ``curve`` at or before ``budget``."""
    return [(float(p[0]), float(p[1])) for p in curve if p[0] <= budget]


def final_at(curve: Sequence[Sequence[float]], budget: float, n: int = FINAL_EVALS) -> float | None:
    """The mean of the last ``n`` evaluations at or before ``budget`` (a run's ``final_eval`` when the
    budget is its length); None without one."""
    pts = within(curve, budget)[-n:]
    return statistics.fmean(s for _, s in pts) if pts else None


def area(curve: Sequence[Sequence[float]], budget: float) -> float | None:
    """The trapezoidal area under the sampled score from update 0 to ``budget``, over ``budget``: the mean
    score over those updates (1.0: perfect from the start). Past the last evaluation the score is held at its
    last value. None without two points or a positive budget."""
    pts = within(curve, budget)
    if len(pts) < 2 or budget <= 0:
        return None
    total = sum((u1 - u0) * (s0 + s1) / 2 for (u0, s0), (u1, s1) in zip(pts, pts[1:], strict=False))
    total += (budget - pts[-1][0]) * pts[-1][1]
    return total / (budget - pts[0][0])


def updates_to(curve: Sequence[Sequence[float]], target: float, budget: float) -> float | None:
    """The first evaluated update at or before ``budget`` whose sampled score reaches ``target``; None if
    none does."""
    return next((u for u, s in within(curve, budget) if s >= target), None)
