"""What the learner reports, built in one place: the heartbeat's stats (the coordinator's view, its dashboard
and /metrics), the metrics row of each update (``metrics.jsonl``) and ``final_stats.json``.

The training thread records each update here (:meth:`LearnerStats.updated`) and its time (``wait_s``,
``train_s``, ``blocked_s``); the sources (the receiver's counts, the publisher, the announcer, the trust
gate, the buffer) are read when a report is built, each through its own thread-safe accessor.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from heterorl.protocol.wire.staleness import STALENESS_BUCKETS, staleness_bucket

from ..learner.buffer import Buffered

MAX_SHOWN_STRIKES = 8
SHOWN_STATS = (  # of an update's stats, those every heartbeat carries
    "reward/mean",
    "is/ess",
    "is/var",
    "is/mean",
    "clip/frac",
    "kl/k3",
    "staleness/mean",
    "mismatch/abs_mean",
    "mismatch/abs_max",
    "mem/peak_mib",
)
SHOWN_EVAL = ("eval/step", "eval/sampled", "eval/greedy")
SHOWN_REWARD_COUNTS = ("timeouts", "crashes", "blocked")  # what went wrong in the reward worker


def _short(author: bytes) -> str:
    return author.hex()[:16]


class LearnerStats:
    """The learner's running figures and the three reports built from them.

    ``step`` / ``published``: the trainer's version and the newest published one. ``receiver``: has
    ``counts()`` (a consistent copy of its counters). ``publisher``: ``stats()``; ``announcer``:
    ``failures``; ``trust``: ``stats()`` and ``final()``; ``buffer``: ``len()``; ``rewards``: the reward
    worker's counts (:meth:`~heterorl.peer.tasks.sandbox.RewardSandbox.stats`).
    """

    def __init__(
        self,
        *,
        step: Callable[[], int],
        published: Callable[[], int],
        receiver,
        publisher,
        announcer,
        trust,
        buffer,
        world_size: int = 1,
        rewards: Callable[[], dict] = dict,
    ):
        self._step, self._published, self.rewards = step, published, rewards
        self.receiver, self.publisher, self.announcer = receiver, publisher, announcer
        self.trust, self.buffer, self.world_size = trust, buffer, world_size
        self.staleness: collections.Counter[str] = collections.Counter()
        self.trained_rows: collections.Counter[bytes] = collections.Counter()  # rows trained on, per author
        self.last: dict[str, float] = {}  # the latest update's stats
        self.last_eval: dict[str, float] = {}
        self.replayed = 0
        self.wait_s = 0.0  # the training thread waiting for data
        self.train_s = 0.0  # ... training (and evaluating)
        self.blocked_s = 0.0  # ... spent on publishing (snapshots, the last version)

    def updated(self, step: int, batches: list[Buffered], stats: dict[str, float]) -> dict:
        """Record update ``step`` (made of ``batches``, which gave ``stats``); its metrics row."""
        hist = collections.Counter(staleness_bucket(step - 1 - b.body["policy_version"]) for b in batches)
        rows_hist: collections.Counter[str] = collections.Counter()
        for b in batches:
            rows_hist[staleness_bucket(step - 1 - b.body["policy_version"])] += len(b.body["rows"])
        self.staleness.update(rows_hist)
        rows_by_author: collections.Counter[str] = collections.Counter()
        for b in batches:
            self.trained_rows[b.author] += len(b.body["rows"])
            rows_by_author[_short(b.author)] += len(b.body["rows"])
        self.last = stats
        return {
            "step": step,
            "time": time.time(),
            "batches": [b.batch_id.hex() for b in batches],
            "authors": sorted({_short(b.author) for b in batches}),
            "rows_by_author": dict(rows_by_author),
            "staleness_hist": dict(hist),  # batches by staleness band
            "staleness_rows": dict(rows_hist),  # rows by band (the heartbeat's stale:<band>, summed)
            # which rollout engines made this update's batches ("vllm/bfloat16": 3, "hf/float32": 5)
            "engines": dict(
                collections.Counter(
                    f"{b.body.get('engine', '?')}/{b.body.get('engine_dtype', '?')}" for b in batches
                )
            ),
            # cumulative, so any window's shares can be read off: waiting for data, training, and the
            # training thread blocked by publishing; publish_{save,build,announce}_s are the publisher's own
            "wait_s": self.wait_s,
            "train_s": self.train_s,
            "publish_blocked_s": self.blocked_s,
            "ranks": self.world_size,
            **self.publisher.stats(),
            **self.trust.stats(),
            **stats,
        }

    def heartbeat(self) -> dict[str, float]:
        """The stats every heartbeat carries (numbers only: the coordinator's view and /metrics)."""
        c = self.receiver.counts()
        delta = self.publisher.stats()["delta_ratio"]
        stats = {
            "step": self._step(),
            "ranks": self.world_size,
            "buffer": len(self.buffer),
            "accepted": c.accepted,
            "rejected": sum(c.rejected.values()),
            "duplicates": c.duplicates,
            "deferred": c.deferred,
            "replayed": self.replayed,
            "publish_failures": self.announcer.failures,
            "wait_frac": self.wait_s / max(1e-9, self.wait_s + self.train_s),
            **({"delta_ratio": delta} if delta is not None else {}),
            # rows by staleness band, the bands with rows only (a heartbeat holds at most MAX_STATS figures)
            **{f"stale:{b}": self.staleness[b] for b in STALENESS_BUCKETS if self.staleness.get(b)},
            **{k: self.last[k] for k in SHOWN_STATS if k in self.last},
            **self.trust.stats(),
            **{k: v for k, v in self.last_eval.items() if k in SHOWN_EVAL},
            **{f"reward_{k}": v for k, v in self.rewards().items() if k in SHOWN_REWARD_COUNTS and v},
        }
        strikes = collections.Counter(c.strikes)
        for who, n in strikes.most_common(MAX_SHOWN_STRIKES):
            stats[f"rej:{who[:27]}"] = n
        return stats

    def final(self, rows_disagreeing: int = 0) -> dict:
        """``final_stats.json``: what this session did."""
        c = self.receiver.counts()
        return {
            "step": self._step(),
            "published_version": self._published(),
            "ranks": self.world_size,
            "accepted": c.accepted,
            "duplicates": c.duplicates,
            "deferred": c.deferred,
            "rejected": sum(c.rejected.values()),
            "rejected_by_reason": dict(c.rejected),
            "strikes": dict(c.strikes),
            "rows_disagreeing": rows_disagreeing,
            "trained_rows": {a.hex(): n for a, n in self.trained_rows.items()},
            "train_s": self.train_s,
            "wait_s": self.wait_s,
            "eval": self.last_eval,
            "rewards": self.rewards(),  # answers scored in the reward worker, timeouts, crashes, refusals
            **self.trust.final(),
        }
