"""The figures a simulated run reports: throughput, staleness quantiles, time shares, bytes per peer class."""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING

from heterorl.protocol.wire.staleness import STALENESS_BUCKETS

if TYPE_CHECKING:
    from .engine import Simulation


def summarise(sim: Simulation, events: int) -> dict:
    """The figures of a finished run, over the measurement window (after warm-up)."""
    window_h = (sim.t_end - sim.t_start) / 3600
    window_s = sim.t_end - sim.t_start
    rows_per_update = sim.cfg.prompts_per_update * sim.cfg.group_size
    versions = sim.counts["updates"]
    total = sum(sim.stale.values()) or 1
    values = sorted(sim.stale_values) or [0]

    def q(p: float) -> int:
        return values[min(len(values) - 1, int(p * len(values)))]

    learner_total = sum(sim.learner_time.values()) or 1
    per_h = [(s.down_bytes / window_h, s.up_bytes / window_h) for s in sim.samplers]
    downs, ups = sorted(d for d, _ in per_h), sorted(u for _, u in per_h)
    state_s = collections.Counter()
    for s in sim.samplers:
        state_s.update(s.time)
    state_total = sum(state_s.values()) or 1
    by_class = collections.defaultdict(list)
    for s in sim.samplers:
        by_class[s.spec.cls.name].append(s)
    return {
        "config": dataclasses.asdict(sim.cfg),
        "events": events,
        "window_h": window_h,
        "updates_per_h": sim.counts["updates"] / window_h,
        "trajectories_per_s": sim.parts * rows_per_update / (window_h * 3600),  # rows trained per second
        "learner": {k: sim.learner_time[k] / learner_total for k in ("training", "publishing", "waiting")},
        "learner_upload_GB_per_h": sim.learner_up / window_h / 1e9,
        "learners": {  # learner peers: "learner" above is the lineage (a round in progress is "training")
            "count": sim.cfg.learners,
            "exchange": sim.cfg.exchange,  # "dense" or "sparse" (none with one learner)
            "overlap": sim.cfg.overlap,  # the exchange runs while the next update is computed
            "gradient_bytes": sim.cfg.gradient_bytes,
            "updates_per_version": sim.parts / max(1, versions),
            "exchange_bytes_per_version": sim.exchange_bytes / max(1, versions),  # the writer's, in + out
            "exchange_s_per_version": sim.exchange_s / max(1, versions),  # from its start to the commit
            "rounds": {k: sim.round_time[k] / window_s for k in ("computing", "exchanging")},
            "per_learner": [
                {
                    "samplers": ln.samplers,
                    "computing": ln.time["computing"] / window_s,
                    "in_round_waiting": ln.time["in round"] / window_s,
                    "rows_per_s": ln.parts * rows_per_update / window_s,
                }
                for ln in sim.learners
            ],
        },
        "staleness": {
            "buckets": {b: sim.stale[b] / total for b in STALENESS_BUCKETS},
            "mean": statistics.fmean(values),
            "p50": q(0.5),
            "p90": q(0.9),
            "p99": q(0.99),
            "max": values[-1],
        },
        "generation_lag": {  # what the stop rule bounds; staleness adds the time in outboxes and buffer
            "mean": statistics.fmean(sim.gen_lag) if sim.gen_lag else 0.0,
            "max": max(sim.gen_lag, default=0),
        },
        "sampler_time": {k: v / state_total for k, v in sorted(state_s.items())},
        "sampler_GB_per_h": {
            "down_median": statistics.median(downs) / 1e9,
            "down_p90": downs[int(0.9 * (len(downs) - 1))] / 1e9,
            "up_median": statistics.median(ups) / 1e9,
            "up_p90": ups[int(0.9 * (len(ups) - 1))] / 1e9,
        },
        "by_class": {
            name: {
                "samplers": len(group),
                "generating": sum(s.time["generating"] for s in group)
                / max(1e-9, sum(sum(s.time.values()) for s in group)),
                "fetching": sum(s.time["fetching"] for s in group)
                / max(1e-9, sum(sum(s.time.values()) for s in group)),
                "down_GB_per_h": statistics.fmean(s.down_bytes for s in group) / window_h / 1e9,
            }
            for name, group in sorted(by_class.items())
        },
        "counts": dict(sim.counts),
    }
