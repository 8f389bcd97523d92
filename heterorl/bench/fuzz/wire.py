"""The wire format as the oracle knows it: size limits, key and signature lengths, DHT TTLs, and one schema
(:data:`SPEC`) per message type, written from the protocol documentation.

It is a second, independent statement of the format, shared by the oracle (what must be accepted) and the
generators (what to build and how to break it); the decoders under test never see it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# ---------------------------------------------------------------------------------------------------------
# The wire format, restated from the protocol documentation for the oracle. Deliberately NOT imported from
# protocol/wire/{messages,schema}.py: if the decoder and this table ever drift apart, the fuzzer
# reports every disagreement.
# ---------------------------------------------------------------------------------------------------------
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20
MAX_ROWS = 4096
MAX_TOKENS = 32768
MAX_TEXT = 4096
PUBKEY_BYTES, SIG_BYTES, HASH_BYTES, BATCH_ID_BYTES = 32, 64, 32, 16
ENVELOPE_KEYS = frozenset({"v", "type", "body", "author", "sig"})
DHT_TTL_S = {"RunSpec": 7 * 86400.0, "CheckpointManifest": 86400.0, "Heartbeat": 600.0, "Provider": 3600.0}
DHT_SKEW_S = 300.0
MAX_RECORD_BYTES = MAX_MESSAGE_BYTES + 256
MAX_HASHES_PER_REQUEST = 16


@dataclasses.dataclass(frozen=True)
class _Int:
    lo: int
    hi: int
    typical_hi: int | None = None  # most generated values stay in [lo, typical_hi]


@dataclasses.dataclass(frozen=True)
class _Num:
    lo: float | None
    hi: float | None


@dataclasses.dataclass(frozen=True)
class _Text:
    n: int


@dataclasses.dataclass(frozen=True)
class _Bin:
    lo: int
    hi: int


@dataclasses.dataclass(frozen=True)
class _Bool:
    pass


@dataclasses.dataclass(frozen=True)
class _List:
    item: Any
    lo: int
    hi: int
    typical: int = 3


@dataclasses.dataclass(frozen=True)
class _Rec:
    fields: tuple[tuple[str, Any], ...]
    optional: tuple[tuple[str, Any], ...] = ()

    def names(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.fields)

    def optional_names(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.optional)


def _rec(_optional: dict[str, Any] | None = None, **fields: Any) -> _Rec:
    return _Rec(tuple(fields.items()), tuple((_optional or {}).items()))


_TOKENS = _List(_Int(0, 1 << 31, typical_hi=99), 0, MAX_TOKENS, typical=6)
_RUN_ID = _Text(128)
_MADDRS = _List(_Text(256), 0, 16)
SPEC: dict[str, _Rec] = {
    "TrajectoryBatch": _rec(
        run_id=_RUN_ID,
        batch_id=_Bin(BATCH_ID_BYTES, BATCH_ID_BYTES),
        policy_version=_Int(0, 1 << 53),
        timestamp=_Num(0.0, 1e11),
        rows=_List(
            _rec(
                group=_Int(0, MAX_ROWS),
                prompt_ids=_TOKENS,
                completion_ids=_TOKENS,
                logprobs=_List(_Num(None, 0.0), 0, MAX_TOKENS),
                reward=_Num(-1e6, 1e6),
            ),
            1,
            MAX_ROWS,
        ),
        _optional={"engine": _Text(16), "engine_dtype": _Text(16)},
    ),
    "CheckpointManifest": _rec(
        run_id=_RUN_ID,
        version=_Int(0, 1 << 53),
        parent_version=_Int(-1, 1 << 53),
        chunk_hashes=_List(_Bin(HASH_BYTES, HASH_BYTES), 1, 1 << 16),
        total_size=_Int(1, 1 << 45),
        dtype=_Text(16),
        chunk_bytes=_Int(4096, 64 << 20),
        _optional={
            "deltas": _List(
                _rec(
                    base_version=_Int(0, 1 << 53),
                    codec=_Text(32),
                    chunk_hashes=_List(_Bin(HASH_BYTES, HASH_BYTES), 1, 1 << 16),
                    total_size=_Int(1, 1 << 45),
                ),
                1,
                8,
            )
        },
    ),
    "RunSpec": _rec(
        run_id=_RUN_ID,
        model=_Text(MAX_TEXT),
        initial_checkpoint=_Bin(HASH_BYTES, HASH_BYTES),
        task=_Text(MAX_TEXT),
        reward=_Text(MAX_TEXT),
        objective=_Text(64),
        hyperparameters=_Text(MAX_TEXT),
        sampling=_rec(
            temperature=_Num(1e-6, 100.0), top_p=_Num(1e-6, 1.0), max_new_tokens=_Int(1, MAX_TOKENS)
        ),
        learner_keys=_List(_Bin(PUBKEY_BYTES, PUBKEY_BYTES), 1, 64),
        vocab_size=_Int(1, 1 << 24),
        max_batch_rows=_Int(1, MAX_ROWS),
    ),
    "Heartbeat": _rec(
        run_id=_RUN_ID,
        role=_Text(16),
        state=_Text(64),
        policy_version=_Int(-1, 1 << 53),
        tokens_per_s=_Num(0.0, 1e12),
        timestamp=_Num(0.0, 1e11),
        peer_id=_Text(128),
        maddrs=_MADDRS,
        hardware=_Text(256),
        stats=_List(_rec(name=_Text(32), value=_Num(-1e15, 1e15)), 0, 64),
        _optional={"backend": _Text(64)},
    ),
    "Provider": _rec(
        run_id=_RUN_ID,
        version=_Int(0, 1 << 53),
        peer_id=_Text(128),
        maddrs=_MADDRS,
        complete=_Bool(),
        timestamp=_Num(0.0, 1e11),
    ),
    "Ack": _rec(run_id=_RUN_ID, batch_id=_Bin(BATCH_ID_BYTES, BATCH_ID_BYTES)),
    "Reject": _rec(
        run_id=_RUN_ID, batch_id=_Bin(0, BATCH_ID_BYTES), reason=_Text(512), retry_after_s=_Num(0.0, 3600.0)
    ),
}
KINDS = tuple(SPEC)
DHT_KINDS = tuple(DHT_TTL_S)
RUN = "run-1"
