"""What a fuzz target is, and what running one input yields.

:class:`_Target` is the interface every target implements (generate / strategy / execute / describe, plus the
atheris hooks). :func:`_call` runs the code under test and turns an undocumented exception into
:class:`_Crash`; :class:`_Hang` is what SIGALRM raises into a stuck input; :class:`_Outcome` is one input's
verdict (accepted, seconds, and the oracle violation if any).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from heterorl.protocol.wire.errors import ProtocolError

if TYPE_CHECKING:
    from .harness import _Harness


class _Crash(Exception):
    def __init__(self, exc: BaseException, seconds: float):
        super().__init__(type(exc).__name__)
        self.exc, self.seconds = exc, seconds


class _Hang(BaseException):
    """Raised by SIGALRM into an input that runs past ABORT_S (a BaseException: decoders must not eat it)."""


@dataclasses.dataclass
class _Outcome:
    accepted: bool
    seconds: float
    violation: tuple[str, str, str] | None = None  # (kind, stable reason, detail)


def _call(fn: Callable, *args: Any, allowed: tuple[type[BaseException], ...] = (ProtocolError,), **kw: Any):
    """(accepted, result or refusal, seconds); any exception outside ``allowed`` raises _Crash."""
    t0 = time.perf_counter()
    try:
        result = fn(*args, **kw)
    except allowed as e:
        return False, e, time.perf_counter() - t0
    except Exception as e:
        raise _Crash(e, time.perf_counter() - t0) from e
    return True, result, time.perf_counter() - t0


class _Target:
    name = ""
    # This target's own hang limits; None: config.HANG_S / config.ABORT_S (read at run time). A target whose
    # inputs legitimately take a while (``rewards``: up to the sandbox's limit) judges time in its oracle.
    hang_s: float | None = None
    abort_s: float | None = None

    def __init__(self, h: _Harness):
        self.h = h

    def generate(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def strategy(self) -> Any:
        raise NotImplementedError

    def execute(self, case: Any) -> _Outcome:
        raise NotImplementedError

    def describe(self, case: Any) -> tuple[bytes, dict]:
        """(input bytes for the digest and the example, extra fields for the example)."""
        raise NotImplementedError

    def from_bytes(self, data: bytes) -> Any:
        """A case from raw fuzzer bytes (atheris)."""
        return self.generate(random.Random(data))

    def corpus(self) -> list[bytes]:
        """Seed inputs for atheris."""
        return [bytes([i]) * 8 for i in range(4)]

    def details(self) -> dict:
        """Target-specific counts for the report (``TargetStats.details``)."""
        return {}

    def close(self) -> None:
        pass
