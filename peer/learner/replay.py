"""Rows replayed under another key: a bounded index of the rows the learner accepted, by fingerprint.

A row's fingerprint hashes its prompt, its completion and its behaviour log-probs (their float32 bytes), so
two honest samplers only collide where they drew the same completion of the same prompt with the same
version and engine down to the last bit; a replay collides always. A batch is refused when at least half of
its rows (and two distinct ones) were accepted before from another author. The index keeps the newest
``capacity`` fingerprints (a replay of rows older than that passes: the row is then stale data, counted once
more, the only harm left). Thread-safe.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading

DEFAULT_CAPACITY = 1 << 18  # fingerprints kept (~40 MB)


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
        prints = [row_fingerprint(r) for r in body["rows"]]
        with self._lock:
            others = [p for p in prints if self._authors.get(p, author) != author]
        if len(others) * 2 >= len(prints) and len(set(others)) >= 2:
            return f"{len(others)} of {len(prints)} rows were sent before by another author"
        return None

    def add(self, body: dict, author: bytes) -> None:
        prints = [row_fingerprint(r) for r in body["rows"]]
        with self._lock:
            for p in prints:
                self._authors.setdefault(p, author)
                self._authors.move_to_end(p)
            while len(self._authors) > self.capacity:
                self._authors.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._authors)
