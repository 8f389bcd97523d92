"""``heterorl bench trust``: hostile samplers against the learner's checks, in one real swarm on 127.0.0.1.

One run of the tiny model: a coordinator, a learner and honest samplers of mixed engines (``--honest``,
default hf/float32 and hf/bfloat16). After a baseline phase of honest data alone, each attack
(:mod:`heterorl.testing.attacks`, or any ``--attack module:function``) joins as a sampler process of its own
for a phase, then leaves. Per attack it reports the share of the hostile rows that reached training
(``reached_training_frac``), whether the author was banned (``banned``, and why), and the reward during its
phase beside the baseline's. A flood is measured by the honest samplers' intake during it against an honest
phase just before it (``honest_intake_kept``). For the honest samplers: the share of their batches refused
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
    ap.add_argument("--baseline-s", type=float, default=60.0, help="honest data alone (default: %(default)s)")
    ap.add_argument(
        "--phase-s", type=float, default=40.0, help="each attack's time in the swarm (default: %(default)s)"
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
    from heterorl.peer.model.tiny import TINY_MODEL_DIR, ensure_model
    from heterorl.testing.attacks import FLOODS, REPLAY_FROM_ENV
    from heterorl.testing.swarm import Swarm

    attacks = args.attack or list(DEFAULT_ATTACKS)
    engines = [e.strip() for e in args.honest.split(",") if e.strip()]
    for e in engines:
        _engine_flags(e)
    root = Path(args.root or tempfile.mkdtemp(prefix="heterorl-trust-"))
    model = ensure_model(TINY_MODEL_DIR)
    seeded = not args.unseeded and all(e.startswith("hf/") for e in engines)
    # the run's default lr: the tiny task is not solved within the bench, so every attack meets a policy that
    # still learns (at 4x it is near-deterministic after a few thousand updates, as are the later attacks)
    swarm = Swarm(root, model, lr=5e-4, extra_toml=run_trust(seeded), prompts_per_update=8, buffer_batches=16)
    honest_names = [f"honest-{i}" for i in range(len(engines))]
    os.environ[REPLAY_FROM_ENV] = str(root / honest_names[0])
    out: dict = {"engines": engines, "seeded": seeded, "attacks": {}}
    try:
        swarm.start_coordinator()
        swarm.start_learner()
        for name, engine in zip(honest_names, engines, strict=True):
            swarm.start_sampler(name, "--nice", "10", *_engine_flags(engine))
        print(f"swarm up in {root}; warming up", flush=True)
        swarm.wait_step(5, timeout=300)
        honest16 = {_key_of(root / n)[:16] for n in honest_names}
        t0 = time.time()
        time.sleep(args.baseline_s)
        base = (t0, time.time())
        print(f"baseline: {swarm.step()} updates so far", flush=True)
        phases = {}
        controls = {}
        for i, attack in enumerate(attacks):
            name = f"attack-{i}"
            nice = "19" if attack in FLOODS else "10"
            if attack in FLOODS:  # honest data alone just before: the intake it is compared with
                t_control = time.time()
                time.sleep(args.phase_s)
                controls[attack] = (t_control, time.time())
            proc = swarm.start_sampler(
                name, "--nice", nice, "--attack", attack, module="heterorl.testing.hostile"
            )
            t_start = time.time()
            time.sleep(args.phase_s)
            proc.terminate(timeout=30)
            phases[attack] = (name, t_start, time.time())
            print(f"{attack}: phase over at update {swarm.step()}", flush=True)
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
    for attack, (name, t_start, t_end) in phases.items():
        key = _key_of(root / name)
        mine = _final(root / name)
        during = _window(metrics, t_start, t_end)
        entry: dict = {"reward_during": _reward(during), "reward_baseline": _reward(base_rows)}
        if attack in FLOODS:
            c0, c1 = controls[attack]
            control = _rows_per_s(_window(metrics, c0, c1), honest16, c0, c1)
            kept = _rows_per_s(during, honest16, t_start, t_end) / max(1e-9, control)
            flooders = {
                a: r for a, r in authors.items() if a not in {_key_of(root / n) for n in honest_names}
            }
            entry.update(
                honest_intake_kept=round(kept, 3),
                flood_batches_made=mine.get("batches_made", 0),
                flood_identities_seen=len([a for a, r in flooders.items() if r["accepted"] or r["strikes"]]),
                flood_batches_accepted=sum(r["accepted"] for r in flooders.values()),
            )
        else:
            answered = mine.get("batches_acked", 0) + mine.get("batches_rejected", 0)
            sent_rows = answered * rows_per_batch
            record = authors.get(key, {})
            entry.update(
                reached_training_frac=round(trained.get(key, 0) / max(1, sent_rows), 4),
                banned=key in bans,
                ban_reason=bans.get(key),
                hostile_batches_answered=answered,
                hostile_batches_accepted=record.get("accepted", 0),
                hostile_rows_trained=trained.get(key, 0),
                reproduced_frac=reproduced.get(key),
                strikes=record.get("strikes", 0),
            )
        out["attacks"][attack] = entry
    honest_keys = [_key_of(root / n) for n in honest_names]
    refused = sum(learner.get("strikes", {}).get(k, 0) for k in honest_keys)
    accepted = sum(authors.get(k, {}).get("accepted", 0) for k in honest_keys)
    out["honest_false_refusal"] = round(refused / max(1, refused + accepted), 5)
    out["honest_batches"] = refused + accepted
    out["honest_banned"] = sum(k in bans for k in honest_keys)
    out["honest_reproduced_frac"] = {k[:16]: reproduced.get(k) for k in honest_keys}
    c0 = base_rows[0] if base_rows else {}
    c1 = base_rows[-1] if base_rows else {}
    span = (c1.get("time", 0) - c0.get("time", 0)) or 1e-9
    out["check_time_frac"] = round((c1.get("trust/check_s", 0) - c0.get("trust/check_s", 0)) / span, 4)
    out["updates"] = learner.get("step")
    out["checked_batches"] = learner.get("trust/checked")
    out["root"] = str(root)
    return out


def report(r: dict) -> str:
    lines = [
        f"honest engines: {', '.join(r['engines'])}; {r['updates']} updates; {r['checked_batches']} checked"
    ]
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
    print(report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0
