"""The harness: the run's keys and signing (each signature registered with the oracle), and running one input.

:meth:`_Harness.run_case` times one case under the SIGALRM abort, sorts its outcome into the target's counts
(accepted / rejected, crash, hang, oracle violation, harness error), keeps a few examples per failure
signature, and re-times a slow input after a GC before calling it a hang. The limits are the target's own
where it sets them (``hang_s``, ``abort_s``); an oracle violation of kind ``hangs`` (a target that judges
time itself) counts as a hang.
"""

from __future__ import annotations

import gc
import hashlib
import random
import signal
import threading
import traceback
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from heterorl.protocol.wire.identity import Identity

from . import config
from .base import _Crash, _Hang, _Target
from .config import MAX_EXAMPLES
from .generators import _pack
from .oracle import Oracle, _key_id, _orecord_bytes, _osigned_bytes
from .report import TargetStats, _short, _where
from .wire import PROTOCOL_VERSION, SIG_BYTES


def _identity(seed: int, name: str) -> Identity:
    raw = hashlib.sha256(f"heterorl-fuzz-key:{seed}:{name}".encode()).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(raw))


class _Harness:
    """Keys, the oracle's signature bookkeeping, and the per-input bookkeeping of a run."""

    def __init__(self, seed: int):
        self.seed = seed
        self.oracle = Oracle()
        self.honest = [_identity(seed, "alice"), _identity(seed, "bob")]
        self.mallory = _identity(seed, "mallory")
        self.identities = [*self.honest, self.mallory]
        self._alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")

    # -- signing (every signature is registered with the oracle)
    def sign_message(
        self, kind: str, body: Any, rng: random.Random, identity: Identity | None = None
    ) -> bytes:
        return self.build_envelope(kind, body, rng, identity=identity)

    def build_envelope(
        self,
        kind: Any,
        body: Any,
        rng: random.Random,
        version: Any = PROTOCOL_VERSION,
        identity: Identity | None = None,
        tamper: bool = False,
    ) -> bytes:
        ident = identity or rng.choice(self.honest)
        author = ident.public_key
        try:
            signed = _osigned_bytes(kind, body, author)
            sig = ident.sign(signed)
            self.oracle.register_message(signed, author, sig)
        except Exception:  # unsignable (a _Deep, a mix of key types): any signature will do, none is valid
            sig = rng.randbytes(SIG_BYTES)
        env: dict[Any, Any] = {"v": version, "type": kind, "body": body, "author": author, "sig": sig}
        if tamper:
            r = rng.random()
            if r < 0.2:
                env["author"] = rng.choice(
                    [self.mallory.public_key, author[:31], author + b"\x00", author.hex()]
                )
            elif r < 0.4:
                env["sig"] = rng.choice([sig[:63], sig + b"\x00", bytes([sig[0] ^ 1]) + sig[1:], sig.hex()])
            elif r < 0.6:
                env[rng.choice(["extra", "", "V"])] = 1
            elif r < 0.8:
                del env[rng.choice(sorted(env))]
            else:
                env = [env[k] for k in ("v", "type", "body", "author", "sig")]
        try:
            return _pack(env)
        except Exception:  # e.g. an int key beyond 64 bits
            return msgpack.packb({"v": 1, "type": "Ack", "body": {}, "author": author, "sig": sig})

    def build_record(
        self,
        key_name: str | None,
        owner: Identity,
        message: bytes,
        exp: Any,
        signer: Identity | None = None,
        sig: bytes | None = None,
        key: bytes | None = None,
    ) -> Any:
        from hivemind.dht.validation import DHTRecord

        key = key if key is not None else _key_id(key_name or "")
        subkey = msgpack.packb(owner.public_key, use_bin_type=True)
        inner = msgpack.packb(message, use_bin_type=True)
        if sig is None:
            signer = signer or owner
            signed = _orecord_bytes(key, subkey, inner, exp)
            sig = signer.sign(signed)
            self.oracle.register_record(signed, signer.public_key, sig)
        return DHTRecord(key, subkey, msgpack.packb([inner, sig], use_bin_type=True), exp)

    # -- running
    def run_case(self, target: _Target, stats: TargetStats, case: Any, source: str, index: int) -> str | None:
        """Run one input; returns a failure kind (crash / hang / violation kind) or None."""
        stats.inputs += 1
        stats.sources[source] = stats.sources.get(source, 0) + 1
        blob, extra = target.describe(case)
        stats._hasher.update(len(blob).to_bytes(8, "big") + blob + repr(sorted(extra.items())).encode()[:256])
        failure = None
        example = {"index": index, "source": source, "input": _short(blob), "input_len": len(blob), **extra}
        if len(blob) <= 8192:
            example["input_hex"] = blob.hex()
        hang_s = config.HANG_S if target.hang_s is None else target.hang_s
        abort_s = config.ABORT_S if target.abort_s is None else target.abort_s
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, abort_s)
        try:
            outcome = target.execute(case)
        except _Crash as c:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats.crashes += 1
            stats.rejected += 1
            where = _where(c.exc.__traceback__)
            self._example(
                stats,
                stats.crash_examples,
                f"crash:{type(c.exc).__name__}:{where}",
                {**example, "error": type(c.exc).__name__, "detail": str(c.exc)[:200], "where": where},
            )
            self._time(stats, c.seconds, example)
            return "crash"
        except _Hang as e:
            stats.hangs += 1
            self._example(
                stats,
                stats.hang_examples,
                "hang:aborted",
                {**example, "error": "hang", "detail": str(e) or f"aborted after {abort_s:g} s"},
            )
            return "hang"
        except Exception as e:  # a bug in this harness, not in the decoder: reported apart, still a failure
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats.harness_errors += 1
            self._example(
                stats,
                stats.harness_error_examples,
                f"harness:{type(e).__name__}",
                {**example, "error": type(e).__name__, "detail": traceback.format_exc()[-600:]},
            )
            return "harness_error"
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        self._time(stats, outcome.seconds, example)
        if outcome.accepted:
            stats.accepted += 1
        else:
            stats.rejected += 1
        if outcome.seconds > hang_s and self._still_slow(target, case, outcome.seconds, hang_s, abort_s):
            stats.hangs += 1
            failure = "hang"
            self._example(
                stats,
                stats.hang_examples,
                "hang:slow",
                {**example, "error": "hang", "detail": f"{outcome.seconds:.2f} s"},
            )
        if outcome.violation:
            kind, reason, detail = outcome.violation
            setattr(stats, kind, getattr(stats, kind) + 1)
            self._example(
                stats,
                stats.hang_examples if kind == "hangs" else stats.violation_examples,
                f"{kind}:{reason}",
                {**example, "kind": kind, "reason": reason, "detail": detail},
            )
            failure = kind
        return failure

    def _still_slow(self, target: _Target, case: Any, first: float, hang_s: float, abort_s: float) -> bool:
        """A slow input is timed once more after a full GC: a pause or a busy machine is not a hang."""
        gc.collect()
        try:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, abort_s)
            again = target.execute(case).seconds
        except _Hang:
            return True
        except Exception:  # it crashed the second time: the first run decided the verdict already
            again = first
        finally:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        return again > hang_s

    @staticmethod
    def _time(stats: TargetStats, seconds: float, example: dict) -> None:
        stats.total_s += seconds
        stats.max_s = max(stats.max_s, seconds)
        if len(stats.slowest) < 3 or seconds > stats.slowest[-1]["seconds"]:
            keep = ("index", "source", "input_len", "input", "kwargs")
            stats.slowest.append({"seconds": seconds, **{k: example[k] for k in keep if k in example}})
            stats.slowest.sort(key=lambda e: -e["seconds"])
            del stats.slowest[3:]

    @staticmethod
    def _example(stats: TargetStats, bucket: list, signature: str, example: dict) -> None:
        if signature in stats._signatures:
            stats._signatures[signature] += 1
            return
        stats._signatures[signature] = 1
        if len(bucket) < MAX_EXAMPLES:
            bucket.append({"signature": signature, **example})


def _raise_hang(signum: int, frame: Any) -> None:
    raise _Hang()
