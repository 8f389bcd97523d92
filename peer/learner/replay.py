"""Rows replayed under another key: a bounded index of the rows the learner accepted, by fingerprint.

A row's fingerprint hashes its prompt, its completion and its behaviour log-probs (their float32 bytes); a
batch's, its rows' as a multiset. A batch is refused when another author sent the same rows as a batch before,
in any order. Rows taken from several batches are not matched: honest samplers of one engine and version draw
bit-identical rows of a prompt whenever the policy is near-certain (two hf float32 samplers of the tiny model
share most of their rows), so a row seen before proves nothing. With seeded sampling such a replay stops
reproducing (:mod:`heterorl.protocol.wire.seeds`); without it, it is bounded (docs/trust.md). The index
keeps the newest ``capacity`` batches (a replay of an older one passes: its rows are then stale data, counted
once more, the only harm left). Thread-safe.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading

DEFAULT_CAPACITY = 1 << 18  # batches kept (~10 MB)


def row_fingerprint(row: dict) -> bytes:
    h = hashlib.blake2b(digest_size=12)
    for field in ("prompt_ids", "completion_ids"):
        ids = row[field]
        h.update(struct.pack(f"<I{len(ids)}I", len(ids), *ids))
    lp = row["logprobs"]
    h.update(struct.pack(f"<{len(lp)}f", *lp))
    return h.digest()


def batch_fingerprint(row_prints: list[bytes]) -> bytes:
    """The batch's rows as a multiset (any order): a whole batch replayed is refused whatever its rows."""
    h = hashlib.blake2b(digest_size=12, person=b"heterorl-batch")
    for p in sorted(row_prints):
        h.update(p)
    return h.digest()


class ReplayIndex:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._authors: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, body: dict, author: bytes) -> str | None:
        prints = [row_fingerprint(r) for r in body["rows"]]
        whole = batch_fingerprint(prints)
        with self._lock:
            if self._authors.get(whole, author) != author:
                return "its rows are a batch another author sent before"
        return None

    def add(self, body: dict, author: bytes) -> None:
        whole = batch_fingerprint([row_fingerprint(r) for r in body["rows"]])
        with self._lock:
            self._authors.setdefault(whole, author)
            self._authors.move_to_end(whole)
            while len(self._authors) > self.capacity:
                self._authors.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._authors)
