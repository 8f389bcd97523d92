"""What a run reports: per-target counts and failure examples (:class:`TargetStats`), the whole run
(:class:`FuzzReport`: the printed table and the JSON dict), and the helpers that shorten inputs and locate a
crash in the decoder's code for those examples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import traceback
from typing import Any

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # frames in here are the fuzzer's own


@dataclasses.dataclass
class TargetStats:
    """Counts for one target. ``violations`` = the three oracle-disagreement counts, over_read, and escaped
    (something a reward answer tried got out of the sandbox: a file, a connection, a process). ``details``:
    what the target adds of its own (the ``rewards`` target: counts per scorer)."""

    name: str
    inputs: int = 0
    rejected: int = 0
    accepted: int = 0
    crashes: int = 0
    hangs: int = 0
    accepted_but_should_not: int = 0
    rejected_but_should_not: int = 0
    wrong_result: int = 0
    over_read: int = 0
    escaped: int = 0
    harness_errors: int = 0
    max_s: float = 0.0
    total_s: float = 0.0
    sources: dict[str, int] = dataclasses.field(default_factory=dict)
    crash_examples: list[dict] = dataclasses.field(default_factory=list)
    hang_examples: list[dict] = dataclasses.field(default_factory=list)
    violation_examples: list[dict] = dataclasses.field(default_factory=list)
    harness_error_examples: list[dict] = dataclasses.field(default_factory=list)
    slowest: list[dict] = dataclasses.field(default_factory=list)  # the 3 slowest inputs
    digest: str = ""
    details: dict = dataclasses.field(default_factory=dict)
    _signatures: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    _hasher: Any = dataclasses.field(default_factory=hashlib.sha256, repr=False)

    @property
    def violations(self) -> int:
        return (
            self.accepted_but_should_not
            + self.rejected_but_should_not
            + self.wrong_result
            + self.over_read
            + self.escaped
        )

    @property
    def mean_s(self) -> float:
        return self.total_s / self.inputs if self.inputs else 0.0

    @property
    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.violations or self.harness_errors)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        d.update(
            violations=self.violations, mean_s=self.mean_s, ok=self.ok, failure_signatures=self._signatures
        )
        return d


@dataclasses.dataclass
class FuzzReport:
    seed: int
    requested_inputs: int
    targets: dict[str, TargetStats]
    wall_s: float = 0.0
    hypothesis: str | None = None  # its version, None when not installed (random generator only)

    @property
    def inputs(self) -> int:
        return sum(t.inputs for t in self.targets.values())

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.targets.values())

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "requested_inputs": self.requested_inputs,
            "inputs": self.inputs,
            "wall_s": self.wall_s,
            "inputs_per_s": self.inputs / self.wall_s if self.wall_s else None,
            "hypothesis": self.hypothesis,
            "ok": self.ok,
            "targets": {k: v.to_dict() for k, v in self.targets.items()},
        }

    def format_table(self) -> str:
        cols = (
            "target",
            "inputs",
            "hypoth",
            "rejected",
            "accepted",
            "crashes",
            "hangs",
            "acc_bad",
            "rej_bad",
            "wrong",
            "overread",
            "escaped",
            "max_ms",
            "mean_us",
        )
        rows = [cols]
        for t in self.targets.values():
            rows.append(
                (
                    t.name,
                    t.inputs,
                    t.sources.get("hypothesis", 0),
                    t.rejected,
                    t.accepted,
                    t.crashes,
                    t.hangs,
                    t.accepted_but_should_not,
                    t.rejected_but_should_not,
                    t.wrong_result,
                    t.over_read,
                    t.escaped,
                    f"{t.max_s * 1e3:.1f}",
                    f"{t.mean_s * 1e6:.0f}",
                )
            )
        lines = _columns(rows)
        for t in self.targets.values():
            per = t.details.get("scorers")
            if per:  # one row per scorer, the columns of the first
                keys = list(next(iter(per.values())))
                lines += ["", f"{t.name}: per scorer", *_columns([("scorer", *keys)] + [
                    (name, *(_cell(row.get(k)) for k in keys)) for name, row in per.items()
                ])]  # fmt: skip
            for key, value in t.details.items():
                if key != "scorers" and value:
                    lines.append(f"{t.name}: {key}: {value}")
        rate = self.inputs / self.wall_s if self.wall_s else 0.0
        lines.append("")
        lines.append(
            f"{self.inputs} inputs in {self.wall_s:.1f} s ({rate:.0f}/s), seed {self.seed}, hypothesis "
            f"{self.hypothesis or 'not installed'}: {'PASS' if self.ok else 'FAIL'}"
        )
        for t in self.targets.values():
            for label, examples in (
                ("crash", t.crash_examples),
                ("hang", t.hang_examples),
                ("violation", t.violation_examples),
                ("harness error", t.harness_error_examples),
            ):
                for ex in examples:
                    if "kind" in ex:  # an oracle violation: what the oracle said, what the decoder did
                        what = f"{ex['kind']}: oracle says {ex['reason']!r}; {ex['detail']}"
                    else:
                        what = f"{ex['error']}: {ex['detail']} at {ex.get('where', '-')}"
                    count = t._signatures.get(ex["signature"], 1)
                    lines.append(
                        f"  {t.name} {label} (x{count}, input #{ex['index']} from {ex['source']}): {what}"
                    )
                    lines.append(f"      input ({ex.get('input_len', '?')} bytes) {ex['input'][:300]}")
                    if ex.get("kwargs"):
                        lines.append(f"      kwargs {ex['kwargs']}")
        return "\n".join(lines)


def _columns(rows: list) -> list[str]:
    """``rows`` (the first the header) as aligned text lines, a rule under the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def _cell(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _short(b: Any, n: int = 120) -> str:
    if isinstance(b, (bytes, bytearray)) and len(b) > n:
        return f"{bytes(b[:n])!r}...(+{len(b) - n} bytes)"
    r = repr(b)
    return r if len(r) <= 2 * n else r[: 2 * n] + "..."


def _where(tb: Any) -> str:
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        ours = os.path.abspath(fr.filename).startswith(_PACKAGE_DIR)  # the fuzzer's frames, not the decoder's
        if ("protocol" in fr.filename or "heterorl" in fr.filename) and not ours:
            return (
                f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name}"
            )
    fr = frames[-1] if frames else None
    return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name}" if fr else "-"
