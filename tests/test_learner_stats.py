"""The learner's reports (peer/daemon/learner_stats.py): one builder for the heartbeat, the metrics row and
final_stats.json, from stand-in sources."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest

from heterorl.peer.daemon.learner_stats import MAX_SHOWN_STRIKES, LearnerStats
from heterorl.peer.learner.buffer import Buffered

pytestmark = pytest.mark.fast


@dataclasses.dataclass
class Counts:
    accepted: int = 5
    duplicates: int = 1
    deferred: int = 2
    rejected: dict = dataclasses.field(default_factory=lambda: {"bad signature": 2, "schema": 1})
    strikes: dict = dataclasses.field(default_factory=dict)


class Source:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def batch(n: int, author: bytes, version: int, rows: int = 2, engine: str = "hf") -> Buffered:
    body = {"policy_version": version, "rows": [{}] * rows, "engine": engine, "engine_dtype": "float32"}
    return Buffered(bytes([n]) * 16, author, body, 0.0)


def make(counts: Counts | None = None, delta=None) -> LearnerStats:
    counts = counts or Counts()
    return LearnerStats(
        step=lambda: 7,
        published=lambda: 6,
        receiver=Source(counts=lambda: counts),
        publisher=Source(stats=lambda: {"delta_ratio": delta, "publish_build_s": 0.5}),
        announcer=Source(failures=3),
        trust=Source(stats=lambda: {"trust/held": 4}, final=lambda: {"bans": {}, "trust/held": 4}),
        buffer=[1, 2],
        world_size=2,
    )


def test_an_update_row_has_its_batches_staleness_engines_and_sources():
    st = make()
    st.wait_s, st.train_s = 1.0, 3.0
    a, b = b"a" * 32, b"b" * 32
    row = st.updated(7, [batch(1, a, 6), batch(2, b, 2, rows=3, engine="vllm")], {"reward/mean": 0.5})
    assert row["step"] == 7 and row["ranks"] == 2
    assert row["rows_by_author"] == {a.hex()[:16]: 2, b.hex()[:16]: 3}
    assert sum(row["staleness_hist"].values()) == 2  # batches; the running count is of rows
    assert sum(row["staleness_rows"].values()) == 5
    assert st.staleness == collections.Counter(row["staleness_rows"])
    assert row["engines"] == {"hf/float32": 1, "vllm/float32": 1}
    assert row["publish_build_s"] == 0.5 and row["trust/held"] == 4 and row["reward/mean"] == 0.5
    assert st.trained_rows == {a: 2, b: 3}
    json.dumps(row)  # a metrics.jsonl line


def test_the_heartbeat_carries_counts_shown_stats_and_the_worst_strikers_only():
    strikes = {f"author{i:02d}": i for i in range(MAX_SHOWN_STRIKES + 4)}
    st = make(Counts(strikes=strikes), delta=0.1)
    st.updated(7, [batch(1, b"a" * 32, 7)], {"reward/mean": 0.25, "is/ess": 0.9, "loss": 1.0})
    st.updated(8, [batch(2, b"b" * 32, 1, rows=3)], {"reward/mean": 0.25, "is/ess": 0.9, "loss": 1.0})
    st.last_eval = {"eval/step": 5.0, "eval/sampled": 0.3, "eval/time_s": 2.0}
    hb = st.heartbeat()
    # rows by staleness band, the bands holding rows only: 2 rows 0 versions old, 3 rows 6 versions old
    assert {k: v for k, v in hb.items() if k.startswith("stale:")} == {"stale:0": 2, "stale:4-7": 3}
    assert hb["step"] == 7 and hb["accepted"] == 5 and hb["rejected"] == 3 and hb["buffer"] == 2
    assert hb["publish_failures"] == 3 and hb["delta_ratio"] == 0.1 and hb["ranks"] == 2
    assert hb["reward/mean"] == 0.25 and hb["is/ess"] == 0.9 and "loss" not in hb  # shown stats only
    assert hb["eval/sampled"] == 0.3 and "eval/time_s" not in hb
    shown = sorted(k for k in hb if k.startswith("rej:"))
    assert len(shown) == MAX_SHOWN_STRIKES and "rej:author00" not in shown and "rej:author11" in shown
    assert all(isinstance(v, int | float) for v in hb.values())
    assert "delta_ratio" not in make(delta=None).heartbeat()


def test_final_stats_hold_the_session_and_the_trust_record():
    st = make()
    st.updated(7, [batch(1, b"a" * 32, 7)], {})
    final = st.final(rows_disagreeing=2)
    assert final["published_version"] == 6 and final["rejected_by_reason"] == {
        "bad signature": 2,
        "schema": 1,
    }
    assert final["rows_disagreeing"] == 2 and final["trained_rows"] == {(b"a" * 32).hex(): 2}
    assert final["bans"] == {} and final["trust/held"] == 4
    json.dumps(final)


def test_the_reward_workers_counts_reach_the_heartbeat_when_not_zero_and_the_final_stats():
    st = make()
    st.rewards = lambda: {"answers": 40, "timeouts": 2, "crashes": 0, "blocked": 1}
    hb = st.heartbeat()
    assert hb["reward_timeouts"] == 2 and hb["reward_blocked"] == 1
    assert "reward_crashes" not in hb and "reward_answers" not in hb  # zeros and plain counts stay out
    assert st.final()["rewards"]["answers"] == 40
