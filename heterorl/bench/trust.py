"""``heterorl bench trust``: hostile samplers against the learner's checks, in one real swarm on 127.0.0.1.

Each attack (:mod:`heterorl.testing.attacks`, or any ``--attack module:function``) meets a fresh run of the
tiny model: a coordinator, a learner and honest samplers of mixed engines (``--honest``, default hf/float32
and hf/bfloat16); after a baseline of honest data alone, the attack joins as a sampler process of its own
for a phase. Per attack it reports the share of the hostile rows that reached training
(``reached_training_frac``), whether the author was banned (``banned``, and why), and the reward during its
phase beside the baseline's. A flood is measured by the honest samplers' intake during it against the
baseline before it (``honest_intake_kept``). For the honest samplers: the share of their batches refused
(``honest_false_refusal``) and how many were banned (``honest_banned``). ``check_time_frac`` is the checks'
time over the learner's wall time during the baseline (the default rates, no attacker).

Samplers and attackers run at ``nice 10`` and the flood at ``nice 19``, as if on machines of their own: on
these two shared cores, an attacker's CPU would otherwise slow the honest samplers, which is not what the
learner's defences are measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_ATTACKS = (
    "forged-shift",
    "forged-constant",
    "forged-copied",
    "other-model",
    "other-model-recomputed",
    "backdoor",
    "wrong-temperature",
    "perturbed-weights",
    "stale-claim",
    "replay",
    "flood",
)
SEEDED_MIN_REPRODUCED = 0.9
# the run's thresholds for the tiny model and its hf engines, as a host calibrates its run (docs/trust.md):
# the worst honest hf bfloat16 batch's mean |Δ log-prob| is 0.010 there (0 in float32), so 0.02, not the
# 0.15 a 135M model in bfloat16 on vLLM needs
TINY_TRUST = {"max_logprob_gap": 0.02}


def run_trust(seeded: bool) -> str:
    """run.toml's ``[trust]`` of the bench's run (and of the swarm tests of the same attacks)."""
    values = {**TINY_TRUST, "min_reproduced": SEEDED_MIN_REPRODUCED if seeded else 0.0}
    return "[trust]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())


ENGINES = ("hf/float32", "hf/bfloat16", "vllm/float32", "vllm/bfloat16")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--attack",
        action="append",
        metavar="NAME|MODULE:FUNCTION",
        help=f"an attack to run (repeatable; default: every built-in: {', '.join(DEFAULT_ATTACKS)})",
    )
    ap.add_argument(
        "--honest",
        default="hf/float32,hf/bfloat16",
        help=f"the honest samplers' engines, comma-separated, of {', '.join(ENGINES)} (default: %(default)s)",
    )
    ap.add_argument(
        "--unseeded",
        action="store_true",
        help="the run does not ask for seeded sampling (trust.min_reproduced 0); by default it asks for "
        "0.9 of the tokens reproduced, as a run of hf samplers can",
    )
    ap.add_argument(
        "--baseline-s", type=float, default=20.0, help="honest data alone, in each run (default: %(default)s)"
    )
    ap.add_argument(
        "--phase-s", type=float, default=40.0, help="each attack's time in the swarm (default: %(default)s)"
    )
    ap.add_argument(
        "--phase-max-s",
        type=float,
        default=150.0,
        help="an attacker not banned after --phase-s stays until it is, or this long: on a loaded machine "
        "the learner judges fewer of its batches per second, not fewer in all (default: %(default)s)",
    )
    ap.add_argument(
        "--root", default=None, help="keep the swarm's state dirs and logs here (default: a tmp dir)"
    )
    ap.add_argument("--json", default=None, help="write the figures here too")


def _engine_flags(spec: str) -> list[str]:
    if spec not in ENGINES:
        raise ValueError(f"--honest: unknown engine {spec!r}; valid: {', '.join(ENGINES)}")
    backend, dtype = spec.split("/")
    return ["--backend", backend, "--engine-dtype", dtype]


def _key_of(state_dir: Path) -> str:
    from heterorl.protocol import load_or_create_identity

    return load_or_create_identity(state_dir / "peer.key")[0].public_key.hex()


def _final(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "final_stats.json").read_text())
    except (OSError, ValueError):
        return {}


def _window(metrics: list[dict], t0: float, t1: float) -> list[dict]:
    return [m for m in metrics if t0 <= m["time"] < t1]


def _rows_per_s(rows: list[dict], keys16: set[str], t0: float, t1: float) -> float:
    n = sum(v for m in rows for k, v in m.get("rows_by_author", {}).items() if k in keys16)
    return n / max(1e-9, t1 - t0)


def _reward(rows: list[dict]) -> float | None:
    values = [m["reward/mean"] for m in rows if "reward/mean" in m]
    return round(statistics.fmean(values), 4) if values else None


def run(args: argparse.Namespace) -> dict:
    """Each attack against a fresh run (its own swarm from version 0, honest samplers, a baseline first)."""
    from heterorl.peer.model.tiny import TINY_MODEL_DIR, ensure_model

    attacks = args.attack or list(DEFAULT_ATTACKS)
    engines = [e.strip() for e in args.honest.split(",") if e.strip()]
    for e in engines:
        _engine_flags(e)
    root = Path(args.root or tempfile.mkdtemp(prefix="heterorl-trust-"))
    model = ensure_model(TINY_MODEL_DIR)
    seeded = not args.unseeded and all(e.startswith("hf/") for e in engines)
    out: dict = {"engines": engines, "seeded": seeded, "attacks": {}, "root": str(root)}
    honest = {"refused": 0, "accepted": 0, "banned": 0, "check_s": 0.0, "wall_s": 0.0, "updates": 0}
    out["honest_reproduced_frac"] = {}
    for i, attack in enumerate(attacks):
        entry, h = _one_run(root / f"run-{i}", model, engines, seeded, attack, args)
        out["attacks"][attack] = entry
        for k in honest:
            honest[k] += h[k]
        out["honest_reproduced_frac"].update(h["reproduced"])
        print(f"{attack}: {json.dumps(entry)}", flush=True)
    out["honest_false_refusal"] = round(honest["refused"] / max(1, honest["refused"] + honest["accepted"]), 5)
    out["honest_batches"] = honest["refused"] + honest["accepted"]
    out["honest_banned"] = honest["banned"]
    out["check_time_frac"] = round(honest["check_s"] / max(1e-9, honest["wall_s"]), 4)
    out["updates"] = honest["updates"]
    return out


def _until_banned(swarm, attacker_dir: Path, deadline: float) -> None:
    """Wait until the coordinator's view shows the attacker banned, or the deadline."""
    while time.time() < deadline:
        try:  # the attacker writes its key file as it starts: never create it here
            bans = swarm.view().get("learner", {}).get("bans", {})
            if (attacker_dir / "peer.key").exists() and _key_of(attacker_dir) in bans:
                return
        except (OSError, ValueError):
            pass  # no key file yet, or the dashboard busy: ask again
        time.sleep(2)


def _one_run(
    root: Path, model: str, engines: list[str], seeded: bool, attack: str, args
) -> tuple[dict, dict]:
    from heterorl.testing.attacks import FLOODS, REPLAY_FROM_ENV
    from heterorl.testing.swarm import Swarm

    # the run's default lr: the policy still learns through the phase (a near-deterministic one, the tiny task
    # solved, is measured apart: docs/trust.md)
    swarm = Swarm(root, model, lr=5e-4, extra_toml=run_trust(seeded), prompts_per_update=8, buffer_batches=16)
    honest_names = [f"honest-{i}" for i in range(len(engines))]
    os.environ[REPLAY_FROM_ENV] = str(root / honest_names[0])
    try:
        swarm.start_coordinator()
        swarm.start_learner()
        for name, engine in zip(honest_names, engines, strict=True):
            swarm.start_sampler(name, "--nice", "10", *_engine_flags(engine))
        swarm.wait_step(5, timeout=300)
        honest16 = {_key_of(root / n)[:16] for n in honest_names}
        t0 = time.time()
        time.sleep(args.baseline_s)
        base = (t0, time.time())
        flood = attack in FLOODS
        nice = "19" if flood else "10"
        flags = ("--nice", nice, "--attack", attack)
        proc = swarm.start_sampler("attacker", *flags, module="heterorl.testing.hostile")
        t_start = time.time()
        time.sleep(args.phase_s)
        if not flood:
            _until_banned(swarm, root / "attacker", t_start + max(args.phase_s, args.phase_max_s))
        proc.terminate(timeout=30)
        t_end = time.time()
    finally:
        swarm.close()  # the learner leaves last-published and writes its final stats
    learner = _final(swarm.learner_dir)
    metrics = swarm.metrics()
    authors = learner.get("authors", {})
    trained = learner.get("trained_rows", {})
    bans = learner.get("bans", {})
    reproduced = learner.get("reproduced", {})
    rows_per_batch = swarm.sampler_settings["prompts_per_batch"] * swarm.settings["group_size"]
    base_rows = _window(metrics, *base)
    during = _window(metrics, t_start, t_end)
    entry: dict = {"reward_during": _reward(during), "reward_baseline": _reward(base_rows)}
    honest_keys = [_key_of(root / n) for n in honest_names]
    mine = _final(root / "attacker")
    if flood:  # the honest samplers' trained rows per second, during the flood and in the baseline before it
        kept = _rows_per_s(during, honest16, t_start, t_end) / max(
            1e-9, _rows_per_s(base_rows, honest16, *base)
        )
        flooders = {a: r for a, r in authors.items() if a not in set(honest_keys)}
        entry.update(
            honest_intake_kept=round(kept, 3),
            flood_batches_made=mine.get("batches_made", 0),
            flood_identities_seen=len([a for a, r in flooders.items() if r["accepted"] or r["strikes"]]),
            flood_batches_accepted=sum(r["accepted"] for r in flooders.values()),
        )
    else:
        key = _key_of(root / "attacker")
        answered = mine.get("batches_acked", 0) + mine.get("batches_rejected", 0)
        record = authors.get(key, {})
        entry.update(
            reached_training_frac=round(trained.get(key, 0) / max(1, answered * rows_per_batch), 4),
            banned=key in bans,
            ban_reason=bans.get(key),
            hostile_batches_answered=answered,
            hostile_batches_accepted=record.get("accepted", 0),
            hostile_rows_trained=trained.get(key, 0),
            strikes=record.get("strikes", 0),
            reproduced_frac=reproduced.get(key),
        )
    c0 = base_rows[0] if base_rows else {}
    c1 = base_rows[-1] if base_rows else {}
    refused = sum(learner.get("strikes", {}).get(k, 0) for k in honest_keys)
    honest = {
        "refused": refused,
        "accepted": sum(authors.get(k, {}).get("accepted", 0) for k in honest_keys),
        "banned": sum(k in bans for k in honest_keys),
        "check_s": c1.get("trust/check_s", 0) - c0.get("trust/check_s", 0),
        "wall_s": c1.get("time", 0) - c0.get("time", 0),
        "updates": learner.get("step") or 0,
        "reproduced": {k[:16]: reproduced.get(k) for k in honest_keys},
    }
    return entry, honest


def report(r: dict) -> str:
    seeded = "seeded sampling asked" if r["seeded"] else "unseeded"
    lines = [f"honest engines: {', '.join(r['engines'])}; {seeded}; {r['updates']} updates in all runs"]
    for name, a in r["attacks"].items():
        if "honest_intake_kept" in a:
            lines.append(
                f"  {name:24s} honest intake kept {a['honest_intake_kept']:.0%} "
                f"({a['flood_batches_accepted']} flood batches taken from {a['flood_identities_seen']} keys)"
            )
        else:
            lines.append(
                f"  {name:24s} reached training {a['reached_training_frac']:6.1%}  banned {a['banned']!s:5s} "
                f"({a['hostile_batches_accepted']} of {a['hostile_batches_answered']} batches accepted; "
                f"reward {a['reward_during']} vs {a['reward_baseline']})"
            )
    lines.append(
        f"honest: {r['honest_false_refusal']:.2%} of {r['honest_batches']} batches refused, "
        f"{r['honest_banned']} banned; checks {r['check_time_frac']:.1%} of learner time"
    )
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    r = run(args)
    if args.json:  # first: the figures are kept whatever the printing does
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(report(r))
    return 0
