"""The fault campaign's invariants (``heterorl bench chaos``), judged from the files the peers wrote.

Pure over files: it reads every learner's ``lineage.jsonl``, ledger (``accepted.sqlite``, read-only) and chunk
store's signed manifests, and every sampler's ``versions.jsonl`` and manifests, once the processes are
stopped. Nothing here trusts a peer's own counters: each figure is recomputed from what was recorded.

The lineage rows it reads (others, and torn or foreign rows, are ignored):

- ``state``: the learner holds weights hashing to ``state``, labelled ``version``;
- ``commit``: it applied a commit, ``parent_state`` -> ``state``, training ``batches`` (hex ids);
- ``published``: it signed ``version`` (``manifest``: sha256 of the signed bytes; ``state``);
- ``checked``: a member compared its weights with the writer's manifest of ``version`` (``agree``);
- ``writer``: it became the writer of ``term``.

Every invariant is 0 on a correct system:

- ``forks``: version numbers naming more than one signed manifest, anywhere (stores, rows);
- ``honest_strikes``: strikes and bans the learners' ledgers hold against the honest samplers;
- ``trained_twice``: batch ids trained by more than one commit on the final lineage (the chain of commits
  leading to the newest published version's state);
- ``disagreements``: (term, version) keys whose commits name several states, members' checks that failed,
  and published versions whose state is not the one committed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import shutil
import sqlite3
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from heterorl.protocol.storage.jsonlog import read_rows

LINEAGE_LOG = "lineage.jsonl"
VERSIONS_LOG = "versions.jsonl"
LEDGER = "accepted.sqlite"
MANIFESTS = Path("chunks") / "manifests"
DROPPED = -1  # = protocol.storage.ledger.DROPPED: a batch's applied_step once dropped
SHOWN = 10  # at most this many examples of each failure in the info


@dataclasses.dataclass
class Ledger:
    """What one learner's ledger holds: each batch's applied step (None: pending) and the strikes and bans
    per author (raw keys)."""

    batches: dict[str, int | None]
    strikes: dict[bytes, int]
    bans: set[bytes]


@dataclasses.dataclass
class Result:
    invariants: dict[str, int]
    versions_published: int
    versions_after_last_fault: int
    info: dict


# ---- reading ----


def lineage_rows(d: Path) -> list[dict]:
    """The learner's lineage rows of a known event (rows of other shapes are left out)."""
    return [r for r in read_rows(Path(d) / LINEAGE_LOG) if isinstance(r.get("event"), str)]


def manifest_digests(d: Path) -> dict[int, str]:
    """version -> sha256 (hex) of the signed manifest bytes the peer's chunk store holds."""
    out = {}
    folder = Path(d) / MANIFESTS
    for f in folder.glob("*.msg") if folder.is_dir() else ():
        if f.stem.isdigit():
            with contextlib.suppress(OSError):
                out[int(f.stem)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def read_ledger(path: Path) -> Ledger | None:
    """The ledger at ``path``, opened read-only (a copy, if the file cannot be opened so), or None if absent
    or unreadable."""
    if not path.exists():
        return None
    try:
        return _read_ledger(path)
    except sqlite3.Error:
        pass
    with tempfile.TemporaryDirectory() as tmp:  # a WAL file whose -shm is missing: read a copy
        for suffix in ("", "-wal", "-shm"):
            src = path.with_name(path.name + suffix)
            if src.exists():
                shutil.copy(src, Path(tmp) / (path.name + suffix))
        try:
            return _read_ledger(Path(tmp) / path.name)
        except sqlite3.Error:
            return None


def _read_ledger(path: Path) -> Ledger:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        batches: dict[str, int | None] = {}
        if "batches" in tables:
            for batch_id, step in conn.execute("SELECT batch_id, applied_step FROM batches"):
                batches[bytes(batch_id).hex()] = step
        strikes: dict[bytes, int] = {}
        if "authors" in tables:
            for author, record in conn.execute("SELECT author, record FROM authors"):
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    strikes[bytes(author)] = int(json.loads(record).get("strikes", 0) or 0)
        bans = {bytes(a) for (a,) in conn.execute("SELECT author FROM bans")} if "bans" in tables else set()
        return Ledger(batches, strikes, bans)
    finally:
        conn.close()


# ---- the invariants ----


def forks(manifests: Iterable[tuple[int, str]]) -> dict[int, set[str]]:
    """The versions named by more than one distinct manifest digest, with those digests."""
    by_version: dict[int, set[str]] = collections.defaultdict(set)
    for version, digest in manifests:
        by_version[int(version)].add(str(digest))
    return {v: ds for v, ds in by_version.items() if len(ds) > 1}


def honest_strikes(ledgers: Iterable[Ledger], honest: Iterable[bytes]) -> int:
    keys = set(honest)
    total = 0
    for ledger in ledgers:
        total += sum(n for author, n in ledger.strikes.items() if author in keys)
        total += len(ledger.bans & keys)
    return total


def final_path(commits: Sequence[dict], published: Sequence[dict]) -> list[dict]:
    """The commits leading to the newest published version's state, newest first: from that state back
    through any learner's commit whose ``state`` it is, to a state no commit leads to. (A published row
    whose state its learner did not know, ``""``, is passed over.)"""
    known = [r for r in published if _state(r)]
    if not known:
        return []
    newest = max(known, key=lambda r: (_int(r.get("version")), _num(r.get("time"))))
    into = {c["state"]: c for c in commits if isinstance(c.get("state"), str)}
    path, seen, state = [], set(), newest.get("state")
    while state in into and state not in seen:
        seen.add(state)
        path.append(into[state])
        state = into[state].get("parent_state")
    return path


def trained_twice(path: Sequence[dict]) -> list[str]:
    """Batch ids trained by more than one commit of ``path`` (or twice by one)."""
    counts = collections.Counter(b for c in path for b in _ids(c))
    return sorted(b for b, n in counts.items() if n > 1)


def disagreements(commits: Sequence[dict], checked: Sequence[dict], published: Sequence[dict]) -> dict:
    """(a) (term, version) keys with several committed states, (b) failed checks, (c) published versions
    whose state is not the committed one (a published row naming no state is not judged)."""
    states: dict[tuple, set[str]] = collections.defaultdict(set)
    for c in commits:
        states[(c.get("term"), c.get("version"))].add(str(c.get("state")))
    split = sorted((k for k, s in states.items() if len(s) > 1), key=repr)
    failed = [r for r in checked if r.get("agree") is False]
    unlike = [
        p
        for p in published
        if _state(p) and (key := (p.get("term"), p.get("version"))) in states and states[key] != {_state(p)}
    ]
    return {"commit_states": split, "checks_failed": failed, "published_unlike_commit": unlike}


def check(
    learner_dirs: Sequence[Path],
    sampler_dirs: Sequence[Path],
    honest_keys: Iterable[bytes | str],
    fault_ends: Iterable[float],
) -> Result:
    """Every invariant and figure of a campaign from the peers' files; ``fault_ends``: wall-clock times at
    which each fault ended (its restore, resume or restart)."""
    honest = [bytes.fromhex(k) if isinstance(k, str) else bytes(k) for k in honest_keys]
    rows = {Path(d).name: lineage_rows(Path(d)) for d in learner_dirs}
    every = [r for rs in rows.values() for r in rs]
    commits = [r for r in every if r["event"] == "commit" and isinstance(r.get("state"), str)]
    published = [r for r in every if r["event"] == "published" and _is_int(r.get("version"))]
    checked = [r for r in every if r["event"] == "checked" and _is_int(r.get("version"))]

    manifests: list[tuple[int, str]] = []
    for d in [*learner_dirs, *sampler_dirs]:
        manifests += manifest_digests(Path(d)).items()
    for r in [*published, *checked]:
        if isinstance(r.get("manifest"), str):
            manifests.append((r["version"], r["manifest"]))
    for d in sampler_dirs:
        for r in read_rows(Path(d) / VERSIONS_LOG):
            if _is_int(r.get("version")) and isinstance(r.get("manifest"), str):
                manifests.append((r["version"], r["manifest"]))
    forked = forks(manifests)

    ledger_paths = {Path(d).name: Path(d) / LEDGER for d in learner_dirs}
    ledgers = {n: read_ledger(p) for n, p in ledger_paths.items()}
    held = [x for x in ledgers.values() if x is not None]
    path = final_path(commits, published)
    twice = trained_twice(path)
    split = disagreements(commits, checked, published)
    last_end = max(fault_ends, default=float("-inf"))
    versions = {r["version"] for r in published}
    after = {r["version"] for r in published if _num(r.get("time")) > last_end}

    invariants = {
        "forks": len(forked),
        "honest_strikes": honest_strikes(held, honest),
        "trained_twice": len(twice),
        "disagreements": sum(len(v) for v in split.values()),
    }
    info = {
        "versions_published": len(versions),
        "newest_published": max(versions, default=None),
        "published_without_state": sum(not _state(r) for r in published),
        "final_path_commits": len(path),
        "final_path_from_version": _int(path[-1].get("version")) if path else None,
        "commits_per_learner": {n: sum(r["event"] == "commit" for r in rs) for n, rs in rows.items()},
        "published_per_learner": {n: sum(r["event"] == "published" for r in rs) for n, rs in rows.items()},
        "checked_per_learner": {n: sum(r["event"] == "checked" for r in rs) for n, rs in rows.items()},
        "takeovers": sum(r["event"] == "writer" for r in every),
        "ledgers_unreadable": sorted(n for n, x in ledgers.items() if x is None and ledger_paths[n].exists()),
        **_batches(held, path),
        "forked_versions": {v: sorted(ds) for v, ds in sorted(forked.items())[:SHOWN]},
        "trained_twice_ids": twice[:SHOWN],
        "disagreement_counts": {k: len(v) for k, v in split.items()},
        "disagreement_examples": {k: v[:SHOWN] for k, v in split.items() if v},
    }
    return Result(invariants, len(versions), len(after), info)


def _batches(ledgers: Sequence[Ledger], path: Sequence[dict]) -> dict:
    """Batches accepted by any learner against those trained on the final path (report only)."""
    on_path = {b for c in path for b in _ids(c)}
    first = min((_int(c.get("version")) for c in path), default=None)
    status: dict[str, list[int | None]] = collections.defaultdict(list)
    for ledger in ledgers:
        for b, step in ledger.batches.items():
            status[b].append(step)
    dropped = {b for b, s in status.items() if DROPPED in s}
    lost = [b for b, s in status.items() if b not in on_path and b not in dropped and None in s]
    off_path = [  # marked applied on the final path's span, but not trained by it
        b
        for b, s in status.items()
        if b not in on_path and first is not None and any(x is not None and x >= first for x in s)
    ]
    return {
        "batches_accepted": len(status),
        "batches_trained_on_path": len(on_path),
        "batches_dropped": len(dropped),
        "batches_lost": len(lost),
        "batches_applied_off_path": len(off_path),
    }


def _state(row: dict) -> str:
    """The row's state hash, or "" where it names none."""
    state = row.get("state")
    return state if isinstance(state, str) else ""


def _ids(commit: dict) -> list[str]:
    batches = commit.get("batches")
    return [b for b in batches if isinstance(b, str)] if isinstance(batches, list) else []


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(x: object) -> int:
    return x if _is_int(x) else -1  # type: ignore[return-value]


def _num(x: object) -> float:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else float("-inf")
