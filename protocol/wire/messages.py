"""Versioned, signed msgpack messages and the one strict decoder, :func:`decode`.

Wire form: a msgpack map ``{"v": version, "type": name, "body": {...}, "author": pubkey, "sig": sig}``.
The signature covers the canonical encoding of ``[v, type, body, author]`` (maps with sorted keys),
so any changed byte of a signed field fails verification. Decoding checks, in this order: size cap,
msgpack structure (no ext types, bounded containers), protocol version, message type, signature, the
body's schema, then run id and vocabulary bounds when the caller gives them.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from heterorl.protocol.wire import schema as s
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20
MAX_ROWS = 4096
MAX_TOKENS = 32768
MAX_TEXT = 4096
BATCH_ID_BYTES = 16
MAX_STATS = 64
HASH_BYTES = 32
MAX_BANS = 32  # banned authors a learner's heartbeat names (the most recent)
MAX_BAN_REASON = 200
MAX_DELTAS = 8  # a manifest offers its version as a delta against at most this many older versions
MAX_LEARNERS = 64  # learner keys a RunSpec may list
MAX_LINEAGE_BATCHES = 4096  # batches one learner contributes to one version
MAX_TRAINED_IDS = 1 << 19  # batch ids a StateOffer names (8 MiB)

_token_ids = s.array(s.integer(0, 1 << 31), MAX_TOKENS)
_run_id = s.text(128)
_key = s.binary(PUBLIC_KEY_BYTES, PUBLIC_KEY_BYTES)
_peer_id = s.text(128)  # libp2p peer id, base58
_maddrs = s.array(s.text(256), 16)

SCHEMAS: dict[str, s.Check] = {
    "TrajectoryBatch": s.record(
        {
            "run_id": _run_id,
            "batch_id": s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES),
            "policy_version": s.integer(0, 1 << 53),
            "timestamp": s.number(0, 1e11),
            "rows": s.array(
                s.record(
                    {
                        "group": s.integer(0, MAX_ROWS),
                        "prompt_ids": _token_ids,
                        "completion_ids": _token_ids,
                        "logprobs": s.array(s.number(hi=0.0), MAX_TOKENS),
                        "reward": s.number(-1e6, 1e6),
                    }
                ),
                MAX_ROWS,
                min_len=1,
            ),
        },
        # the rollout engine and its dtype ("vllm", "bfloat16"): the learner's mismatch diagnostics per engine
        optional={
            "engine": s.text(16),
            "engine_dtype": s.text(16),
            # rows drawn by Gumbel-max from protocol/wire/seeds.py row_seed: reproducible by a verifier
            "seeded": s.boolean(),
        },
    ),
    "CheckpointManifest": s.record(
        {
            "run_id": _run_id,
            "version": s.integer(0, 1 << 53),
            "parent_version": s.integer(-1, 1 << 53),
            "chunk_hashes": s.array(s.binary(HASH_BYTES, HASH_BYTES), 1 << 16, min_len=1),
            "total_size": s.integer(1, 1 << 45),
            "dtype": s.text(16),
            "chunk_bytes": s.integer(4096, 64 << 20),  # all chunks but the last; see checkpoint.py
        },
        # the version also as sparse deltas against older versions (delta.py), in chunks of chunk_bytes; the
        # chunk_hashes above stay the full state, which a peer rebuilds from a delta and checks
        optional={
            "deltas": s.array(
                s.record(
                    {
                        "base_version": s.integer(0, 1 << 53),
                        "codec": s.text(32),
                        "chunk_hashes": s.array(s.binary(HASH_BYTES, HASH_BYTES), 1 << 16, min_len=1),
                        "total_size": s.integer(1, 1 << 45),
                    }
                ),
                MAX_DELTAS,
                min_len=1,
            )
        },
    ),
    "RunSpec": s.record(
        {
            "run_id": _run_id,
            "model": s.text(MAX_TEXT),
            "initial_checkpoint": s.binary(HASH_BYTES, HASH_BYTES),
            "task": s.text(MAX_TEXT),
            "reward": s.text(MAX_TEXT),
            "objective": s.text(64),
            "hyperparameters": s.text(MAX_TEXT),  # JSON of the run's settings (protocol/settings/spec.py)
            "sampling": s.record(
                {
                    "temperature": s.number(1e-6, 100.0),
                    "top_p": s.number(1e-6, 1.0),
                    "max_new_tokens": s.integer(1, MAX_TOKENS),
                }
            ),
            "learner_keys": s.array(_key, MAX_LEARNERS, min_len=1),
            "vocab_size": s.integer(1, 1 << 24),
            "max_batch_rows": s.integer(1, MAX_ROWS),
        }
    ),
    "Heartbeat": s.record(
        {
            "run_id": _run_id,
            "role": s.text(16),
            "state": s.text(64),
            "policy_version": s.integer(-1, 1 << 53),
            "tokens_per_s": s.number(0, 1e12),
            "timestamp": s.number(0, 1e11),
            "peer_id": _peer_id,
            "maddrs": _maddrs,
            "hardware": s.text(256),
            # what the peer wants the swarm's view to show: learner step, reward, ESS, staleness buckets...
            "stats": s.array(s.record({"name": s.text(32), "value": s.number(-1e15, 1e15)}), MAX_STATS),
        },
        optional={
            "backend": s.text(64),  # a sampler's rollout engine, e.g. "vllm 0.32.0, bfloat16, cuda"
            # a learner's banned authors and why (the coordinator's view shows them)
            "bans": s.array(s.record({"author": _key, "reason": s.text(MAX_BAN_REASON)}), MAX_BANS),
        },
    ),
    # "I hold chunks of this checkpoint version; fetch them from me" (complete: every chunk held).
    "Provider": s.record(
        {
            "run_id": _run_id,
            "version": s.integer(0, 1 << 53),
            "peer_id": _peer_id,
            "maddrs": _maddrs,
            "complete": s.boolean(),
            "timestamp": s.number(0, 1e11),
        },
        # ... of the run's data set with this id instead (protocol/wire/dataset.py; version 0)
        optional={"dataset": s.binary(HASH_BYTES, HASH_BYTES)},
    ),
    # ---- learner peers: one lineage of versions across several learners (protocol/net/lineage.py) ----
    # the first frame each way on a lineage stream: who speaks (its libp2p peer id, which the stream itself
    # authenticates, bound here to its signing key), to whom, of which model, at which version
    "LineageHello": s.record(
        {
            "run_id": _run_id,
            "peer_id": _peer_id,
            "to_peer_id": _peer_id,
            "schema": s.binary(HASH_BYTES, HASH_BYTES),  # sha256 of the parameters' names, shapes, dtypes
            "version": s.integer(0, 1 << 53),
            "state": s.binary(HASH_BYTES, HASH_BYTES),  # sha256 of its float32 weights at that version
        }
    ),
    # the writer's state at ``version``, for a learner that joins at another version or with other weights:
    # two frames follow, float32 weights and optimiser state (safetensors), hashing to the fields below
    "StateOffer": s.record(
        {
            "run_id": _run_id,
            "version": s.integer(0, 1 << 53),
            "state": s.binary(HASH_BYTES, HASH_BYTES),  # what the weights hash to once loaded (state_sha256)
            "weights_sha256": s.binary(HASH_BYTES, HASH_BYTES),
            "optimizer_sha256": s.binary(HASH_BYTES, HASH_BYTES),
            # the ids of the batches the lineage trained after the joiner's version, concatenated (16 bytes
            # each, newest first): a joiner drops its own pending copies of them, never training one twice
            "trained": s.binary(0, MAX_TRAINED_IDS * BATCH_ID_BYTES),
        }
    ),
    # a learner's gradient on version ``version`` (the next frame: safetensors of float32 tensors, hashing
    # to ``grad_sha256``; none when ``tokens`` is 0), from the batches it names
    "Contribution": s.record(
        {
            "run_id": _run_id,
            "version": s.integer(0, 1 << 53),
            "batch_ids": s.array(s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES), MAX_LINEAGE_BATCHES),
            "tokens": s.integer(0, 1 << 40),
            "lr_scale": s.number(0.0, 1e6),
            "grad_sha256": s.binary(0, HASH_BYTES),
        }
    ),
    # the writer's step from ``version - 1`` to ``version``: the gradient every member applies (the next
    # frame, hashing to ``grad_sha256``), whose batches it holds, the state it was taken on, and the signed
    # manifests of versions published since the last commit to this member
    "Commit": s.record(
        {
            "run_id": _run_id,
            "version": s.integer(1, 1 << 53),
            "parent_state": s.binary(HASH_BYTES, HASH_BYTES),  # sha256 of the float32 weights at version - 1
            "applied": s.array(
                s.record(
                    {
                        "learner": _key,
                        "batch_ids": s.array(s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES), MAX_LINEAGE_BATCHES),
                    }
                ),
                MAX_LEARNERS,
            ),
            "tokens": s.integer(1, 1 << 40),
            "lr_scale": s.number(0.0, 1e6),
            "grad_sha256": s.binary(HASH_BYTES, HASH_BYTES),
            "publish": s.boolean(),  # the writer publishes ``version``: members keep its bytes to check
            "manifests": s.array(s.binary(1, 1 << 20), 8),
        }
    ),
    # no round closed while the member waited with nothing to give: it contributes again
    "LineageWait": s.record(
        {"run_id": _run_id, "version": s.integer(0, 1 << 53), "manifests": s.array(s.binary(1, 1 << 20), 8)}
    ),
    "LineageRefuse": s.record({"run_id": _run_id, "reason": s.text(512)}),
    "Ack": s.record({"run_id": _run_id, "batch_id": s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES)}),
    "Reject": s.record(
        {
            "run_id": _run_id,
            "batch_id": s.binary(0, BATCH_ID_BYTES),
            "reason": s.text(512),
            "retry_after_s": s.number(0, 3600),
        }
    ),
}


MAX_NESTING = 16  # our schemas nest 4 deep; anything deeper is refused before recursion can blow up


def _nesting_depth_ok(obj: Any, limit: int = MAX_NESTING) -> bool:
    """Iteratively check that ``obj`` nests at most ``limit`` containers deep (no recursion)."""
    stack = [(obj, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth >= limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return True


def pack_stats(stats: dict[str, float]) -> list[dict]:
    """A Heartbeat's ``stats`` field from a flat name → number map (finite values only, sorted, capped)."""
    items = [(k[:32], float(v)) for k, v in sorted(stats.items()) if v is not None and math.isfinite(v)]
    return [{"name": k, "value": max(-1e15, min(1e15, v))} for k, v in items[:MAX_STATS]]


def pack_bans(bans: dict[bytes, str]) -> list[dict]:
    """A Heartbeat's ``bans`` field from author key → reason (the last :data:`MAX_BANS`, reasons capped)."""
    items = list(bans.items())[-MAX_BANS:]
    return [{"author": bytes(a), "reason": r[:MAX_BAN_REASON]} for a, r in items]


def unpack_stats(stats: list[dict]) -> dict[str, float]:
    return {item["name"]: item["value"] for item in stats}


def _canonical(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_canonical(x) for x in obj]
    return obj


def _signed_bytes(version: int, kind: str, body: dict, author: bytes) -> bytes:
    return msgpack.packb(_canonical([version, kind, body, author]), use_bin_type=True)


def encode(kind: str, body: dict, identity: Identity) -> bytes:
    """Validate ``body`` against its schema, sign it with ``identity`` and pack it."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown message type {kind!r}; valid: {', '.join(SCHEMAS)}")
    body = SCHEMAS[kind](body, kind)
    author = identity.public_key
    sig = identity.sign(_signed_bytes(PROTOCOL_VERSION, kind, body, author))
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "type": kind, "body": body, "author": author, "sig": sig}, use_bin_type=True
    )


def decode(
    data: bytes, expected: str | None = None, *, run_id: str | None = None, vocab_size: int | None = None
) -> tuple[str, dict, bytes]:
    """Decode and verify a message; returns (type, body, author public key) or raises ProtocolError."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("message must be bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte cap")
    try:
        env = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_array_len=MAX_TOKENS * 2,
            max_map_len=64,
            max_str_len=MAX_TEXT * 4,
            max_bin_len=1 << 20,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types on malformed input
        raise ProtocolError(f"not a well-formed message: {type(e).__name__}") from None
    if not isinstance(env, dict) or set(env) != {"v", "type", "body", "author", "sig"}:
        raise ProtocolError("not a message envelope")
    if not _nesting_depth_ok(env):
        raise ProtocolError(f"message nests deeper than {MAX_NESTING} levels")
    version = env["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:  # 1.0 and True compare equal to 1
        shown = repr(version) if type(version) in (int, str) else type(version).__name__
        raise ProtocolError(
            f"protocol version {shown[:40]} not supported (this peer speaks {PROTOCOL_VERSION})"
        )
    kind = env["type"]
    if not isinstance(kind, str) or kind not in SCHEMAS:
        shown = repr(kind[:40]) if isinstance(kind, str) else type(kind).__name__
        raise ProtocolError(f"unknown message type {shown}")
    if expected is not None and kind != expected:
        raise ProtocolError(f"expected {expected}, got {kind}")
    author = s.binary(PUBLIC_KEY_BYTES, PUBLIC_KEY_BYTES)(env["author"], "author")
    sig = s.binary(SIGNATURE_BYTES, SIGNATURE_BYTES)(env["sig"], "sig")
    if not isinstance(env["body"], dict):
        raise ProtocolError("body: expected a map")
    try:
        signed = _signed_bytes(PROTOCOL_VERSION, kind, env["body"], author)
    except (TypeError, ValueError):
        raise ProtocolError("body cannot be canonicalised") from None
    if not verify(author, sig, signed):
        raise ProtocolError("bad signature")
    body = SCHEMAS[kind](env["body"], kind)
    if run_id is not None and body["run_id"] != run_id:
        raise ProtocolError(f"message for run {body['run_id']!r}, this peer is in run {run_id!r}")
    if kind == "TrajectoryBatch":
        _check_rows(body["rows"], vocab_size)
    return kind, body, author


def _check_rows(rows: list[dict], vocab_size: int | None) -> None:
    for i, row in enumerate(rows):
        if len(row["logprobs"]) != len(row["completion_ids"]) or not row["completion_ids"]:
            raise ProtocolError(
                f"rows[{i}]: {len(row['logprobs'])} log-probs for "
                f"{len(row['completion_ids'])} completion tokens"
            )
        if vocab_size is not None:
            for field in ("prompt_ids", "completion_ids"):
                if any(t >= vocab_size for t in row[field]):
                    raise ProtocolError(f"rows[{i}].{field}: token id outside the vocabulary ({vocab_size})")
