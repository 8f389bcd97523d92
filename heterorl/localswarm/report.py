"""What ``heterorl local`` shows and leaves behind: the live view, summary.json, the reward curve line."""

from __future__ import annotations

import collections
import json
import logging
import time
import urllib.request
from pathlib import Path

from heterorl.protocol.wire.staleness import STALENESS_BUCKETS

log = logging.getLogger("heterorl.localswarm")


def view_of(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "api/view", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def render(view: dict, steps: int, started: float) -> list[str]:
    lr = view.get("learner", {})
    curve = lr.get("reward_curve", [])
    reward = f"{curve[-1][1]:.3f}" if curve else "-"
    first = f"{sum(p[1] for p in curve[:5]) / len(curve[:5]):.3f}" if curve else "-"
    hist = lr.get("staleness_hist", {})
    lines = [
        f"run {view.get('run_id')}  {time.monotonic() - started:5.0f} s   "
        f"learner step {lr.get('step', 0)}/{steps}   reward {reward} (first {first})   "
        f"checkpoint v{view.get('latest_version')}",
        f"batches accepted {lr.get('accepted', 0)}  rejected {lr.get('rejected', 0)}   staleness "
        + " ".join(f"{k}:{v}" for k, v in hist.items()),
    ]
    for p in view.get("peers", []):
        lines.append(
            f"  {p['role']:8s} {p['key']}  v{p['policy_version']:<4} {p['tokens_per_s']:7.0f} tok/s  "
            f"{'alive' if p['alive'] else 'gone '}  {p['state'][:48]}"
        )
    return lines


def summarise(
    out: Path, samplers: list[Path], view: dict | None, wall: float, learners: list[Path] | None = None
) -> dict:
    from heterorl.protocol.storage.jsonlog import read_rows
    from heterorl.protocol.storage.ledger import AcceptedLog

    learners = learners or [out / "learner"]
    steps: dict[int, dict] = {}
    for row in read_rows(out / "learner" / "metrics.jsonl"):
        steps[row["step"]] = row  # a replayed step (after a learner restart) replaces the lost one
    if len(learners) > 1:  # one lineage: a version's reward over the batches of every learner in it
        steps = _lineage_steps(steps, [d / "metrics.jsonl" for d in learners[1:]])
    rows = [steps[k] for k in sorted(steps)]
    hist: collections.Counter[str] = collections.Counter()
    for r in rows:
        hist.update(r.get("staleness_hist", {}))
    final = {}
    final_path = out / "learner" / "final_stats.json"
    if final_path.exists():
        final = json.loads(final_path.read_text())
    with AcceptedLog(out / "learner" / "accepted.sqlite") as ledger:
        accepted, applied = ledger.count(), ledger.applied_count()
    per_sampler = {}
    for d in samplers:
        loads = list(read_rows(d / "versions.jsonl"))
        per_sampler[d.name] = {
            "versions_loaded": [x["version"] for x in loads],
            "fetched_bytes": sum(x.get("fetched_bytes", 0) for x in loads),
            "fetched_via": dict(collections.Counter(x.get("via", "full") for x in loads)),
        }
    curve = [r["reward/mean"] for r in rows]
    k = min(10, len(curve))
    return {
        "steps": len(rows),
        "reward_curve": curve,
        "reward_first10": sum(curve[:k]) / k if k else None,
        "reward_last10": sum(curve[-k:]) / k if k else None,
        # the learner's held-out evaluations of its current policy: [step, sampled, greedy]
        "eval_curve": [
            [r["eval/step"], r["eval/sampled"], r["eval/greedy"]] for r in rows if "eval/step" in r
        ],
        "staleness": {b: hist.get(b, 0) for b in STALENESS_BUCKETS},
        "is_var_curve": [r.get("is/var") for r in rows],
        "ess_curve": [r.get("is/ess") for r in rows],
        "batches_accepted": accepted,
        "batches_applied": applied,
        "batches_rejected": final.get("rejected", 0),
        "rejections": final.get("rejected_by_reason", {}),
        "samplers": per_sampler,
        # compressed delta bytes over full checkpoint bytes, over the versions the learner offered a delta for
        "delta_ratio": next((r["delta_ratio"] for r in reversed(rows) if r.get("delta_ratio")), None),
        "wall_s": wall,
        "peers_seen": len(view.get("peers", [])) if view else None,
        **(lineage_summary(learners) if len(learners) > 1 else {}),
    }


def _lineage_steps(writer: dict[int, dict], members: list[Path]) -> dict[int, dict]:
    """The writer's rows, each version's ``reward/mean`` the row-weighted mean over the learners whose
    batches it held (a learner's row carries its own batches' stats)."""
    from heterorl.protocol.storage.jsonlog import read_rows

    parts: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
    rows_of = [list(writer.values())] + [list(read_rows(p)) for p in members]
    for rows in rows_of:
        for r in rows:
            if "reward/mean" in r:
                parts[r["step"]].append((r["reward/mean"], sum(r.get("rows_by_author", {}).values()) or 1))
    out = {}
    for step, row in writer.items():
        if parts.get(step):
            n = sum(w for _, w in parts[step])
            out[step] = {**row, "reward/mean": sum(x * w for x, w in parts[step]) / n}
    return out


def lineage_summary(learners: list[Path]) -> dict:
    """``learners``: per learner whether it wrote at the end, the updates its batches went into, the batches
    it had applied, and the versions it checked as a member; ``weights_agree``: no learner ever found its
    weights other than a published version's signed bytes, and each member checked every version published
    while it was a member (between its first and last check); ``lineage_bytes_per_version``: the bytes of
    the members' links to the writer (gradients both ways, and state sent to joiners) per version."""
    from heterorl.protocol.storage.jsonlog import read_rows
    from heterorl.protocol.storage.ledger import AcceptedLog

    rows = {d.name: list(read_rows(d / "lineage.jsonl")) for d in learners}
    published = {r["version"] for rs in rows.values() for r in rs if r.get("event") == "published"}
    per, agree, checked, link_bytes, versions = {}, True, False, 0, 0
    for d in learners:
        final_path = d / "final_stats.json"
        final = json.loads(final_path.read_text()) if final_path.exists() else {}
        with AcceptedLog(d / "accepted.sqlite") as ledger:
            applied = ledger.applied_count()
        lineage = final.get("lineage", {})
        link_bytes += lineage.get("lineage/link_bytes_sent", 0) + lineage.get(
            "lineage/link_bytes_received", 0
        )
        versions = max(versions, int(final.get("step", 0)))
        checks = [r for r in rows[d.name] if r.get("event") == "checked"]
        agreed = {r["version"] for r in checks if r["agree"]}
        own = {r["version"] for r in rows[d.name] if r.get("event") == "published"}
        span = (min(agreed), max(agreed)) if agreed else (0, -1)
        missed = sorted(v for v in published - own if span[0] <= v <= span[1] and v not in agreed)
        per[d.name] = {
            "writer": bool(lineage.get("lineage/writer")),
            "updates": int(lineage.get("lineage/steps_with_my_data", 0)),
            "batches": applied,
            "versions_checked": len(checks),
            "versions_agreed": len(agreed),
            "versions_missed": missed,
        }
        checked = checked or bool(checks)
        agree = agree and not missed and all(r["agree"] for r in checks)
    return {
        "learners": per,
        "weights_agree": agree and checked,
        "lineage_bytes_per_version": link_bytes / max(1, versions),
    }


def curve_line(curve: list[float], points: int = 10) -> str:
    """The curve in at most ``points`` numbers (means over equal spans of updates)."""
    if not curve:
        return "-"
    span = max(1, -(-len(curve) // points))
    parts = [curve[i : i + span] for i in range(0, len(curve), span)]
    label = "per update" if span == 1 else f"mean of every {span} updates"
    return " ".join(f"{sum(p) / len(p):.3f}" for p in parts) + f"  ({label})"
