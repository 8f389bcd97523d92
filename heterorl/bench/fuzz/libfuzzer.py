"""The optional coverage-guided mode: one target under atheris/libFuzzer, with the same oracles.

It instruments only ``heterorl.protocol``, seeds libFuzzer with the target's own corpus, and raises
:class:`FuzzFailure` at the first failure so libFuzzer saves the input. atheris is not a dependency: it is
imported only here, only when this mode runs.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Sequence
from typing import Any

from . import config
from .config import ALL_TARGETS
from .harness import _Harness
from .report import TargetStats
from .targets import _TARGET_CLASSES


class FuzzFailure(AssertionError):
    """Raised into libFuzzer (atheris) for a crash, hang or oracle violation, so that it saves the input."""


def _instrument_protocol(atheris: Any) -> int:
    """Coverage-instrument every function of heterorl.protocol, closures included (instrument_all() would
    also walk torch and hivemind: tens of thousands of functions, minutes)."""
    import types

    done = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith("heterorl.protocol"):
            try:
                atheris.instrument_func(obj)
                done += 1
            except Exception:  # a function atheris cannot patch stays uninstrumented
                pass
    print(f"INFO: instrumented {done} heterorl.protocol functions", file=sys.stderr)
    return done


def atheris_main(argv: Sequence[str] | None = None) -> int:
    """Coverage-guided fuzzing of one target with atheris: ``TARGET [libFuzzer flags...]``."""
    try:
        import atheris
    except ImportError:
        print(
            "atheris is not installed (pip install atheris); the built-in fuzzer needs nothing extra",
            file=sys.stderr,
        )
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and not argv[0].startswith("-") else "decode"
    if name not in _TARGET_CLASSES:
        print(f"unknown target {name!r}; valid: {', '.join(ALL_TARGETS)}", file=sys.stderr)
        return 2
    h = _Harness(0)
    h._alarm = False  # libFuzzer's -timeout does this job
    target = _TARGET_CLASSES[name](h)
    stats = TargetStats(name)

    def one(data: bytes) -> None:
        failure = h.run_case(target, stats, target.from_bytes(data), "atheris", stats.inputs)
        if failure:
            examples = stats.crash_examples + stats.hang_examples + stats.violation_examples
            raise FuzzFailure(f"{name}: {failure}: {json.dumps(examples[-1:], default=str)[:2000]}")

    _instrument_protocol(atheris)
    flags = [a for a in argv if a.startswith("-")]
    dirs = [a for a in argv if not a.startswith("-")]
    if not any(a.startswith("-runs") for a in flags):
        flags.append("-runs=100000")
    if not any(a.startswith("-timeout") for a in flags):
        flags.append(f"-timeout={max(1, int(config.HANG_S))}")
    if not any(a.startswith("-max_len") for a in flags):
        flags.append("-max_len=65536")
    if not dirs:  # start from the target's own seeds: random bytes never reach a signed envelope
        import tempfile

        corpus = tempfile.mkdtemp(prefix=f"heterorl-fuzz-{name}-")
        for i, data in enumerate(target.corpus()):
            with open(f"{corpus}/seed-{i:03d}", "wb") as f:
                f.write(data)
        dirs = [corpus]
        print(f"INFO: corpus in {corpus}", file=sys.stderr)
    atheris.Setup([sys.argv[0], *flags, *dirs], one)
    atheris.Fuzz()
    return 0
