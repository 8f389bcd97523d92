"""A whole fuzz run: :func:`run_fuzz` splits the inputs over the targets, draws a share of each target's
inputs from hypothesis and the rest from a seeded generator, runs them through the harness with a progress
bar, and returns the :class:`~heterorl.bench.fuzz.report.FuzzReport`.
"""

from __future__ import annotations

import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .base import _Target
from .config import ALL_TARGETS, DEFAULT_TARGETS, TARGET_WEIGHTS
from .harness import _Harness, _raise_hang
from .report import FuzzReport, TargetStats
from .targets import _TARGET_CLASSES


def _hypothesis_version() -> str | None:
    try:
        import hypothesis
    except ImportError:
        return None
    return hypothesis.__version__


def _run_hypothesis(
    h: _Harness, target: _Target, stats: TargetStats, n: int, seed: int, tick: Callable
) -> None:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed

    count = [0]

    @hseed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
    )
    @given(target.strategy())
    def one(case: Any) -> None:
        if count[0] >= n:
            return
        h.run_case(target, stats, case, "hypothesis", count[0])
        count[0] += 1
        tick()

    one()


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done, self.bar = total, enabled, 0, None
        self._pending, self._last = 0, time.monotonic()
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="in", mininterval=1.0, dynamic_ncols=True)
            except ImportError:
                pass

    def target(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)
        elif self.enabled:
            print(f"fuzz: {name}...", file=sys.stderr, flush=True)

    def tick(self) -> None:
        self.done += 1
        self._pending += 1
        if self._pending >= 128:
            self.flush()

    def flush(self) -> None:
        if self.bar is not None:
            self.bar.update(self._pending)
        elif self.enabled and time.monotonic() - self._last > 5:
            self._last = time.monotonic()
            print(f"fuzz: {self.done}/{self.total} inputs", file=sys.stderr, flush=True)
        self._pending = 0

    def close(self) -> None:
        self.flush()
        if self.bar is not None:
            self.bar.close()


def _split(inputs: int, targets: Sequence[str]) -> dict[str, int]:
    weights = [TARGET_WEIGHTS[t] for t in targets]
    total = sum(weights)
    shares = {t: int(inputs * w / total) for t, w in zip(targets, weights, strict=False)}
    shares[targets[0]] += inputs - sum(shares.values())
    return shares


def run_fuzz(
    inputs: int = 100_000,
    seed: int = 0,
    targets: Sequence[str] = DEFAULT_TARGETS,
    progress: bool = True,
    hypothesis_share: float = 0.2,
) -> FuzzReport:
    """Fuzz the chosen targets (default: the protocol decoders) with ``inputs`` inputs in all (split by
    :data:`TARGET_WEIGHTS`)."""
    targets = list(dict.fromkeys(targets))
    unknown = [t for t in targets if t not in _TARGET_CLASSES]
    if unknown or not targets:
        raise ValueError(f"unknown fuzz targets {unknown}; valid: {', '.join(ALL_TARGETS)}")
    hyp = _hypothesis_version()
    shares = _split(inputs, targets)
    h = _Harness(seed)
    report = FuzzReport(seed=seed, requested_inputs=inputs, targets={}, hypothesis=hyp)
    bar = _Progress(inputs, progress)
    old_handler = signal.signal(signal.SIGALRM, _raise_hang) if h._alarm else None
    t0 = time.perf_counter()
    try:
        for name in targets:
            bar.target(name)
            stats = TargetStats(name)
            report.targets[name] = stats
            target = _TARGET_CLASSES[name](h)
            try:
                n = shares[name]
                n_h = int(n * hypothesis_share) if hyp else 0
                if n_h:
                    _run_hypothesis(h, target, stats, n_h, seed, bar.tick)
                rng = random.Random(f"heterorl-fuzz:{seed}:{name}")
                i = 0
                while stats.inputs < n:
                    try:
                        case = target.generate(rng)
                    except Exception as e:  # a generator bug: counted as a failed input, never silent
                        stats.inputs += 1
                        stats.harness_errors += 1
                        h._example(
                            stats,
                            stats.harness_error_examples,
                            f"generate:{type(e).__name__}",
                            {
                                "index": i,
                                "source": "random",
                                "input": "-",
                                "error": type(e).__name__,
                                "detail": traceback.format_exc()[-600:],
                            },
                        )
                    else:
                        h.run_case(target, stats, case, "random", i)
                    i += 1
                    bar.tick()
            finally:
                try:
                    stats.details = target.details()
                finally:
                    target.close()
            stats.digest = stats._hasher.hexdigest()
    finally:
        if h._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
        bar.close()
    report.wall_s = time.perf_counter() - t0
    return report
