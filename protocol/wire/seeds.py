"""Sampling seeds derived from what a batch is (Token-DiFR style): the run, the author's key, the batch id,
the version and the row. A sampler that draws its tokens with these seeds (Gumbel-max, ``peer/model/
sampling.py``) makes its token choices reproducible: a verifier with the same weights recomputes the noise
and finds the same argmax. Rows copied to another batch, another author or another version no longer
reproduce, and neither do tokens drawn at another temperature or from other weights.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # torch.Generator.manual_seed takes up to 2**64 - 1; 63 keeps it a non-negative int64 too


def row_seed(run_id: str, author: bytes, batch_id: bytes, version: int, row: int) -> int:
    """The seed of row ``row`` of a batch (pure; the same bytes on every peer)."""
    h = hashlib.blake2b(digest_size=8, person=b"heterorl-seed-1")
    for part in (run_id.encode(), bytes(author), bytes(batch_id)):
        h.update(len(part).to_bytes(4, "big") + part)
    h.update(int(version).to_bytes(8, "big") + int(row).to_bytes(4, "big"))
    return int.from_bytes(h.digest(), "big") >> (64 - SEED_BITS)
