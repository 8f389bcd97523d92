"""Staleness bands: how many versions old the policy that sampled a row was when the learner trained on it.

The learner counts the rows it trains on by band: its metrics.jsonl rows carry each update's
(``staleness_rows``), its heartbeat the run's so far as ``stale:<band>`` counts, which the coordinator's
view, dashboard and /metrics show; the simulator and ``heterorl local`` summarise with the same bands. The
bands go to 1 024 versions and beyond because volunteer samplers can be that far behind (the simulator's
1 000-sampler run sees 1 300), and the staleness grid measures learning there.
"""

from __future__ import annotations

STALENESS_BUCKETS = ("0", "1", "2-3", "4-7", "8-15", "16-63", "64-255", "256-1023", "1024+")
_BOUNDS = ((2, 3), (4, 7), (8, 15), (16, 63), (64, 255), (256, 1023))


def staleness_bucket(delta: int) -> str:
    """0, 1, 2-3, 4-7, 8-15, 16-63, 64-255, 256-1023, 1024+ (a negative lag counts as 0)."""
    if delta <= 1:
        return str(max(0, delta))
    for lo, hi in _BOUNDS:
        if delta <= hi:
            return f"{lo}-{hi}"
    return "1024+"


def at_least(hist: dict[str, float], versions: int) -> float:
    """The sum of ``hist``'s bands that start at ``versions`` or more (``versions`` a band's start)."""
    starts = {b: int(b.split("-")[0].rstrip("+")) for b in STALENESS_BUCKETS}
    return sum(v for b, v in hist.items() if starts.get(b, -1) >= versions)
