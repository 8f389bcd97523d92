"""Rows replayed under another key: a bounded index of the rows the learner accepted, by fingerprint.

A row's fingerprint hashes its prompt, its completion and its behaviour log-probs (their float32 bytes), so
two honest samplers only collide where they drew the same completion of the same prompt with the same
version and engine down to the last bit; a replay collides always. A batch is refused when another author
sent the same rows as a batch before (in any order), or when at least half of its rows, four distinct ones
at least, from two of its groups, were accepted before from another author (a peaked model draws the same
few rows of a prompt for every sampler of one engine and version: those alone are not a replay). With seeded
sampling a replay under another key also stops reproducing (:mod:`heterorl.protocol.wire.seeds`). The index
keeps the newest ``capacity`` fingerprints (a replay of rows older than that passes: the row is then stale
data, counted once more, the only harm left). Thread-safe.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading

DEFAULT_CAPACITY = 1 << 18  # fingerprints kept (~40 MB)
MIN_DISTINCT = 4  # distinct rows a partial replay must share: two honest samplers of one engine and version
# draw identical rows of a near-certain prompt (the tiny model's "3+4=" -> "7"), a replay shares them all


def batch_fingerprint(row_prints: list[bytes]) -> bytes:
    """The batch's rows as a multiset (any order): a whole batch replayed is refused whatever its rows."""
    h = hashlib.blake2b(digest_size=12, person=b"heterorl-batch")
    for p in sorted(row_prints):
        h.update(p)
    return h.digest()


def _groups(rows: list[dict]) -> int:
    return len({r["group"] for r in rows})


def row_fingerprint(row: dict) -> bytes:
    h = hashlib.blake2b(digest_size=12)
    for field in ("prompt_ids", "completion_ids"):
        ids = row[field]
        h.update(struct.pack(f"<I{len(ids)}I", len(ids), *ids))
    lp = row["logprobs"]
    h.update(struct.pack(f"<{len(lp)}f", *lp))
    return h.digest()


class ReplayIndex:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._authors: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, body: dict, author: bytes) -> str | None:
        rows = body["rows"]
        prints = [row_fingerprint(r) for r in rows]
        whole = batch_fingerprint(prints)
        with self._lock:
            if self._authors.get(whole, author) != author:
                return "its rows are a batch another author sent before"
            others = [i for i, p in enumerate(prints) if self._authors.get(p, author) != author]
        distinct = len({prints[i] for i in others})
        groups = len({rows[i]["group"] for i in others})
        if len(others) * 2 >= len(prints) and distinct >= MIN_DISTINCT and groups >= min(2, _groups(rows)):
            return f"{len(others)} of {len(prints)} rows were sent before by another author"
        return None

    def add(self, body: dict, author: bytes) -> None:
        prints = [row_fingerprint(r) for r in body["rows"]]
        with self._lock:
            for p in [*prints, batch_fingerprint(prints)]:
                self._authors.setdefault(p, author)
                self._authors.move_to_end(p)
            while len(self._authors) > self.capacity:
                self._authors.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._authors)
