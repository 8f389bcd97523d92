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
MAX_TRAINED_IDS = 1 << 17  # batches a StateOffer's lineage window names (id and hash each: 6 MiB)
MAX_TERM = 1 << 53  # a lineage's writer terms count up from 1
MAX_MANIFESTS_SENT = (
    64  # signed manifests a lineage writer's reply carries (a joiner: those published lately)
)

_token_ids = s.array(s.integer(0, 1 << 31), MAX_TOKENS)
_run_id = s.text(128)
_key = s.binary(PUBLIC_KEY_BYTES, PUBLIC_KEY_BYTES)
_peer_id = s.text(128)  # libp2p peer id, base58
_maddrs = s.array(s.text(256), 16)
_hash = s.binary(HASH_BYTES, HASH_BYTES)
_version = s.integer(0, 1 << 53)
_term = s.integer(0, MAX_TERM)
# a batch a learner of a lineage trains on, named by its id and the sha256 of its signed bytes: another
# learner holding that id drops its own copy only if the bytes are the same (none names others' away)
_named_batch = s.record({"batch_id": s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES), "sha256": _hash})

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
            # sha256 of the signed CheckpointManifest of the weights it was sampled on: a learner checks the
            # batch against exactly those weights (one version number, one set of weights)
            "manifest_sha256": _hash,
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
            ),
            # learner peers: the signing writer's term (protocol/net/lineage.py); a higher term fences a lower
            "term": _term,
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
            # a learner of a lineage: the highest term it knows, whether it writes in it, the version of the
            # state it holds, and (a writer) the highest version it may commit before its next heartbeat
            "lineage": s.record(
                {"term": _term, "writes": s.boolean(), "applied": _version, "reserved": _version}
            ),
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
    # authenticates, bound here to its signing key), to whom, of which model, at which version, in which term
    "LineageHello": s.record(
        {
            "run_id": _run_id,
            "peer_id": _peer_id,
            "to_peer_id": _peer_id,
            "schema": _hash,  # sha256 of the parameters' names, shapes, dtypes
            "version": _version,
            "state": _hash,  # sha256 of its float32 weights at that version
            "term": _term,  # the highest writer term the sender knows (the writer's own, from the writer)
        }
    ),
    # the writer's state at ``version``, for a learner that joins at another version or with other weights:
    # three frames follow, float32 weights and optimiser state (safetensors) and the lineage's window of
    # trained batches (48 bytes each: id, sha256), hashing to the fields below
    "StateOffer": s.record(
        {
            "run_id": _run_id,
            "term": _term,
            "version": _version,
            "state": _hash,  # what the weights hash to once loaded (state_sha256)
            "weights_sha256": _hash,
            "optimizer_sha256": _hash,
            "trained_sha256": _hash,
            "trained_from": _version,  # the window names every batch the lineage trained from this version on
        }
    ),
    # a learner's gradient on version ``version`` in the writer's term ``term`` (the next frame: safetensors
    # of float32 tensors, hashing to ``grad_sha256``; none without batches), from the batches it names, each
    # with its tokens (the part's weight is their sum, each bounded by the run's batch size)
    "Contribution": s.record(
        {
            "run_id": _run_id,
            "term": _term,
            "version": _version,
            "batches": s.array(
                s.record(
                    {
                        "batch_id": s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES),
                        "sha256": _hash,
                        "tokens": s.integer(1, MAX_ROWS * MAX_TOKENS),
                    }
                ),
                MAX_LINEAGE_BATCHES,
            ),
            "lr_scale": s.number(0.0, 1.0),
            "grad_sha256": s.binary(0, HASH_BYTES),
        }
    ),
    # the writer's step from ``parent_version`` to ``version`` in its term: the parameter update every member
    # adds (the next frame, hashing to ``update_sha256``), the combined gradient its optimiser moments take
    # (the frame after, ``grad_sha256``), whose batches it holds, the state it was taken on and the one it
    # gives, and the signed manifests of versions published since the last commit to this member
    "Commit": s.record(
        {
            "run_id": _run_id,
            "term": s.integer(1, MAX_TERM),
            "version": s.integer(1, 1 << 53),
            "parent_version": _version,
            "parent_state": _hash,  # sha256 of the float32 weights at parent_version
            "state": _hash,  # ... at version, once the update is added
            "applied": s.array(
                s.record({"learner": _key, "batches": s.array(_named_batch, MAX_LINEAGE_BATCHES)}),
                MAX_LEARNERS,
            ),
            "tokens": s.integer(1, 1 << 40),
            "lr_scale": s.number(0.0, 1.0),
            "update_sha256": _hash,
            "grad_sha256": _hash,
            "publish": s.boolean(),  # the writer publishes ``version``: members keep its bytes to check
            "manifests": s.array(s.binary(1, 1 << 20), MAX_MANIFESTS_SENT),
        }
    ),
    # no commit for the member yet: ``pending`` (its part waits in the round: keep waiting, a keepalive sent
    # every few seconds) or not (no round closed, or its part was ``refused``: contribute again)
    "LineageWait": s.record(
        {
            "run_id": _run_id,
            "term": _term,
            "version": _version,
            "pending": s.boolean(),
            "manifests": s.array(s.binary(1, 1 << 20), MAX_MANIFESTS_SENT),
        },
        # the member's part is left out for good, with the reason: it drops those batches, never resends them
        optional={
            "refused": s.record(
                {
                    "batch_ids": s.array(s.binary(BATCH_ID_BYTES, BATCH_ID_BYTES), MAX_LINEAGE_BATCHES),
                    "reason": s.text(256),
                }
            )
        },
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
