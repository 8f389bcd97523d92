"""Staleness histogram buckets: how many versions old a batch was when the learner took it.

The learner's heartbeat carries ``stale:<bucket>`` counts, the coordinator's view and dashboard show them,
the simulator and ``heterorl local`` summarise with them: one definition for all.
"""

from __future__ import annotations

STALENESS_BUCKETS = ("0", "1", "2-3", "4-7", "8-15", "16+")


def staleness_bucket(delta: int) -> str:
    """0, 1, 2-3, 4-7, 8-15, 16+ (a negative lag counts as 0)."""
    if delta <= 1:
        return str(max(0, delta))
    for lo, hi in ((2, 3), (4, 7), (8, 15)):
        if delta <= hi:
            return f"{lo}-{hi}"
    return "16+"
