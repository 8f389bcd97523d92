"""Byte counts the simulation charges, from the real wire formats rather than estimates.

A trajectory batch is a real signed ``TrajectoryBatch`` message of the configured shape; a checkpoint is cut
into chunks by the real chunking rule (``protocol.checkpoint``) and announced by a real signed manifest.
"""

from __future__ import annotations

import random

from heterorl.protocol import Identity, encode
from heterorl.protocol.net.trajectories import new_batch_id
from heterorl.protocol.wire.checkpoint import CHUNK_BYTES, check_manifest, chunk_length


def trajectory_batch_bytes(
    groups: int,
    group_size: int,
    prompt_tokens: int,
    completion_tokens: int,
    vocab: int = 32000,
    seed: int = 0,
) -> int:
    """Wire size of one signed TrajectoryBatch with ``groups × group_size`` rows of the given lengths."""
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for _ in range(group_size):
            rows.append(
                {
                    "group": g,
                    "prompt_ids": prompt,
                    "completion_ids": [rng.randrange(vocab) for _ in range(completion_tokens)],
                    "logprobs": [-rng.expovariate(1.0) for _ in range(completion_tokens)],
                    "reward": float(rng.random() < 0.5),
                }
            )
    body = {"run_id": "sim", "batch_id": new_batch_id(), "policy_version": 1, "timestamp": 0.0, "rows": rows}
    return len(encode("TrajectoryBatch", body, Identity.generate()))


def synthetic_manifest(total_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """A manifest body for a ``total_bytes`` checkpoint (hashes are placeholders), checked like a real one."""
    n = -(-total_bytes // chunk_bytes)
    body = {
        "run_id": "sim",
        "version": 1,
        "parent_version": 0,
        "chunk_hashes": [i.to_bytes(32, "big") for i in range(n)],
        "total_size": total_bytes,
        "dtype": "bfloat16",
        "chunk_bytes": chunk_bytes,
    }
    check_manifest(body)
    return body


def chunk_lengths(manifest: dict) -> list[int]:
    return [chunk_length(manifest, i) for i in range(len(manifest["chunk_hashes"]))]


def manifest_bytes(manifest: dict) -> int:
    return len(encode("CheckpointManifest", manifest, Identity.generate()))
