"""``heterorl bench trust``: hostile samplers against the learner's checks, in one real swarm on 127.0.0.1.

Each attack (:mod:`heterorl.testing.attacks`, or any ``--attack module:function``) meets a fresh run of the
tiny model: a coordinator, a learner and honest samplers of mixed engines (``--honest``, default hf/float32
and hf/bfloat16); after a baseline of honest data alone, the attack joins as a sampler process of its own
for a phase. A control run comes first: the same baseline and phase with no attacker (``control``).

Per attack it reports the share of the hostile rows that reached training (``reached_training_frac``),
whether the author was banned (``banned``, and why), and the reward during its phase beside the baseline's.
The attacker lists the batches it changed (a sleeper's honest batches are not among them); the learner's
ledger says which of those it trained on: ``hostile_batches_sent``, ``hostile_batches_trained`` and
``hostile_trained_frac``. The held-out evaluation (``eval/sampled``, every ``learner.eval_every`` = 10
updates) gives ``eval_baseline`` (the last before the attacker joined) and ``eval_end`` (the last during its
phase, or the first after it), beside the control's ``eval_end``. For ``probation-restart`` the learner is
restarted (SIGTERM, then started again on its state dir) once it accepted a few of the attacker's batches,
all still held on probation (``learner_restarted``). A flood is measured by the honest samplers' intake
during its phase against the baseline before it (``honest_intake_kept``), and from its first batch on
(``honest_intake_kept_flooding``; the phase holds the flood's start-up, ``flood_started_after_s``, which at
nice 19 on a loaded machine can outlast the phase). For the honest samplers: the share of
their batches refused (``honest_false_refusal``) and how many were banned (``honest_banned``).
``check_time_frac`` is the checks' time (the checker's model held: loading a version, recomputing, judging)
over the learner's wall time during the baselines (the default rates and shares, no attacker);
``check_wait_frac`` the checks' time spent waiting for that model (another check, the held-out eval).

Samplers and attackers run at ``nice 10`` and the flood at ``nice 19``, as if on machines of their own: on
these two shared cores, an attacker's CPU would otherwise slow the honest samplers, which is not what the
learner's defences are measured on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
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
    "sparse-foreign",
    "sleeper",
    "probation-restart",
    "flood",
)
CONTROL = "none"  # the control run's name: no attacker
EVAL_EVERY = 10  # learner.eval_every of the bench's runs: several held-out evaluations per phase
# probation-restart: the learner restarts once it accepted this many of the attacker's batches
RESTART_AFTER_ACCEPTED = 3
MIN_FLOODING_S = 5.0  # a flood's intake from its first batch on is reported when it flooded this long

SEEDED_MIN_REPRODUCED = 0.9
# the run's thresholds for the tiny model and its hf engines, as a host calibrates its run (docs/trust.md):
# the worst honest hf bfloat16 batch's mean |Δ log-prob| is 0.010 there (0 in float32), so 0.02, not the
# 0.15 a 135M model in bfloat16 on vLLM needs; its worst row's 0.040 (0.1, not 0.3); its worst seeded token
# missed by a margin of 0.003 (0.1, not the 1.5 SmolLM2's hf bfloat16 needs)
TINY_TRUST = {"max_logprob_gap": 0.02, "max_row_logprob_gap": 0.1, "max_seed_margin": 0.1}


def run_trust(seeded: bool) -> str:
    """run.toml's ``[trust]`` of the bench's run (and of the swarm tests of the same attacks)."""
    values = {**TINY_TRUST, "min_reproduced": SEEDED_MIN_REPRODUCED if seeded else 0.0}
    return "[trust]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())


ENGINES = ("hf/float32", "hf/bfloat16", "vllm/float32", "vllm/bfloat16")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.epilog = (
        f"A control run with no attacker ({CONTROL!r}) comes first. Per attack: reached_training_frac, "
        "banned, hostile_batches_sent and hostile_batches_trained (the attacker's changed batches that "
        "the learner's ledger says it trained on), eval_end beside eval_baseline and the control's "
        "eval_end; probation-restart restarts the learner while the attacker is on probation "
        "(learner_restarted); a flood: honest_intake_kept."
    )
    ap.add_argument(
        "--attack",
        action="append",
        metavar="NAME|MODULE:FUNCTION",
        help=f"an attack to run (repeatable; default: every built-in: {', '.join(DEFAULT_ATTACKS)}); a "
        f"control run with no attacker ({CONTROL!r}) comes first either way",
    )
    ap.add_argument(
        "--attacks",
        nargs="+",
        action="extend",
        dest="attack",
        metavar="NAME|MODULE:FUNCTION",
        help="several attacks at once (the same as --attack, once for each)",
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
        "--baseline-s", type=float, default=15.0, help="honest data alone, in each run (default: %(default)s)"
    )
    ap.add_argument(
        "--phase-s",
        type=float,
        default=30.0,
        help="each attack's time in the swarm, and the control run's with no attacker (default: %(default)s)",
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


def held_out_evals(metrics: list[dict], t_join: float, t0: float, t1: float) -> dict:
    """The held-out evaluations around a phase ``[t0, t1)`` (``metrics``: the learner's rows, one per step,
    an evaluation's figures in the row of the step it followed): ``eval_baseline`` (the last before
    ``t_join``, when the attacker joined), ``eval_end`` (the last in the phase, or the first after it) and
    their steps; None where there is none."""
    evals = [(m["time"], m["step"], m["eval/sampled"]) for m in metrics if "eval/sampled" in m]
    before = [e for e in evals if e[0] < t_join]
    during = [e for e in evals if t0 <= e[0] < t1]
    after = [e for e in evals if e[0] >= t1]
    base = before[-1] if before else None
    end = during[-1] if during else after[0] if after else None
    return {
        "eval_baseline": None if base is None else round(base[2], 4),
        "eval_baseline_step": None if base is None else base[1],
        "eval_end": None if end is None else round(end[2], 4),
        "eval_end_step": None if end is None else end[1],
    }


def ledger_batches(path: Path, author: bytes) -> dict[str, int | None]:
    """``author``'s batches in the learner's ledger (``accepted.sqlite``, opened read-only): hex batch id ->
    ``applied_step`` (>= 0: trained at that step; None: held or pending; -1: dropped). Empty if there is
    no ledger (yet)."""
    if not Path(path).exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            rows = conn.execute(
                "SELECT batch_id, applied_step FROM batches WHERE author = ?", (bytes(author),)
            ).fetchall()
        finally:
            conn.close()
    except sqlite3.Error as e:
        log.warning("ledger %s not read: %s", path, e)
        return {}
    return {bytes(b).hex(): step for b, step in rows}


def hostile_figures(hostile_ids: list[str], ledger: dict[str, int | None]) -> tuple[int, list[str]]:
    """How many of ``hostile_ids`` the ledger says were trained on (``applied_step >= 0``), and which."""
    trained = sorted(i for i in hostile_ids if (step := ledger.get(i)) is not None and step >= 0)
    return len(trained), trained


def reached_training(
    rows_trained: int, answered: int, rows_per_batch: int, all_hostile: bool, hostile_trained_frac: float
) -> float:
    """The share of hostile rows that reached training, never less than the share of hostile batches
    (``hostile_trained_frac``). Rows: the attacker's rows trained over the rows of the batches it had
    answered, where all it sent was hostile; else (a sleeper's honest batches are its own) the hostile
    batches' share is the figure."""
    rows = rows_trained / max(1, answered * rows_per_batch) if all_hostile else 0.0
    return round(max(rows, hostile_trained_frac), 4)


def run(args: argparse.Namespace) -> dict:
    """A control run with no attacker, then each attack against a fresh run (its own swarm from version 0,
    honest samplers, a baseline first)."""
    from heterorl.peer.model.tiny import TINY_MODEL_DIR, ensure_model

    attacks = args.attack or list(DEFAULT_ATTACKS)
    engines = [e.strip() for e in args.honest.split(",") if e.strip()]
    for e in engines:
        _engine_flags(e)
    root = Path(args.root or tempfile.mkdtemp(prefix="heterorl-trust-"))
    model = ensure_model(TINY_MODEL_DIR)
    seeded = not args.unseeded and all(e.startswith("hf/") for e in engines)
    out: dict = {"engines": engines, "seeded": seeded, "attacks": {}, "root": str(root)}
    honest = {
        "refused": 0,
        "accepted": 0,
        "banned": 0,
        "check_s": 0.0,
        "check_wait_s": 0.0,
        "wall_s": 0.0,
        "updates": 0,
    }
    out["honest_reproduced_frac"] = {}
    runs = [(CONTROL, root / "run-control")] + [(a, root / f"run-{i}") for i, a in enumerate(attacks)]
    for attack, run_root in runs:
        entry, h = _one_run(run_root, model, engines, seeded, None if attack == CONTROL else attack, args)
        if attack == CONTROL:
            out["control"] = entry
        else:
            out["attacks"][attack] = entry
        for k in honest:
            honest[k] += h[k]
        out["honest_reproduced_frac"].update(h["reproduced"])
        print(f"{attack}: {json.dumps(entry)}", flush=True)
    out["honest_false_refusal"] = round(honest["refused"] / max(1, honest["refused"] + honest["accepted"]), 5)
    out["honest_batches"] = honest["refused"] + honest["accepted"]
    out["honest_banned"] = honest["banned"]
    out["check_time_frac"] = round(honest["check_s"] / max(1e-9, honest["wall_s"]), 4)
    out["check_wait_frac"] = round(honest["check_wait_s"] / max(1e-9, honest["wall_s"]), 4)
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


def first_batch(attacker_dir: Path, deadline: float) -> float | None:
    """When the attacker first queued a batch in its outbox (polled; None if it made none by ``deadline``):
    a flood at nice 19 takes a while to start (on a loaded machine, longer than a phase lasts)."""
    path = attacker_dir / "outbox.sqlite"
    while time.time() < deadline:
        try:
            if path.exists():
                conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
                try:
                    made = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'items'").fetchone()
                finally:
                    conn.close()
                if made and made[0] > 0:
                    break
        except sqlite3.Error:
            pass  # not created yet, or being written: ask again
        time.sleep(0.5)
    else:
        return None
    return time.time()


def restart_on_probation(swarm, learner, attacker_dir: Path, deadline: float, after: int = 3) -> tuple:
    """Once the learner's ledger holds ``after`` of the attacker's batches (or at ``deadline``), restart the
    learner (:meth:`~heterorl.testing.swarm.Swarm.restart_learner`). Returns (the new learner process, how
    many of its batches the ledger held at the restart)."""
    n = 0
    while time.time() < deadline:
        try:  # the attacker writes its key file as it starts: never create it here
            if (attacker_dir / "peer.key").exists():
                author = bytes.fromhex(_key_of(attacker_dir))
                n = len(ledger_batches(swarm.learner_dir / "accepted.sqlite", author))
                if n >= after:
                    break
        except (OSError, ValueError):
            pass  # a key file being written: read it again
        time.sleep(0.5)
    log.info("restarting the learner with %d of the attacker's batches accepted", n)
    return swarm.restart_learner(learner), n


def _one_run(
    root: Path, model: str, engines: list[str], seeded: bool, attack: str | None, args
) -> tuple[dict, dict]:
    """One fresh swarm: honest samplers, a baseline, then ``attack`` for its phase (None: a control run,
    the same phase with no attacker). Returns (the attack's entry, the honest samplers' figures)."""
    from heterorl.testing.attacks import FLOODS, REPLAY_FROM_ENV, RESTARTS
    from heterorl.testing.swarm import Swarm

    # the run's default lr: the policy still learns through the phase (a near-deterministic one, the tiny task
    # solved, is measured apart: docs/trust.md)
    swarm = Swarm(
        root,
        model,
        lr=5e-4,
        extra_toml=run_trust(seeded),
        prompts_per_update=8,
        buffer_batches=16,
        eval_every=EVAL_EVERY,
    )
    honest_names = [f"honest-{i}" for i in range(len(engines))]
    os.environ[REPLAY_FROM_ENV] = str(root / honest_names[0])
    flood = attack in FLOODS
    restarted: dict = {}
    try:
        swarm.start_coordinator()
        learner = swarm.start_learner()
        for name, engine in zip(honest_names, engines, strict=True):
            swarm.start_sampler(name, "--nice", "10", *_engine_flags(engine))
        swarm.wait_step(5, timeout=300)
        honest16 = {_key_of(root / n)[:16] for n in honest_names}
        t0 = time.time()
        time.sleep(args.baseline_s)
        base = (t0, time.time())
        proc = None
        if attack is not None:
            flags = ("--nice", "19" if flood else "10", "--attack", attack)
            proc = swarm.start_sampler("attacker", *flags, module="heterorl.testing.hostile")
        t_start = time.time()
        t_first = None  # a flood's first batch: its phase holds the flood's start-up, then the flood
        if flood and proc is not None:
            t_first = first_batch(root / "attacker", t_start + args.phase_s)
        if attack in RESTARTS:
            deadline = t_start + max(args.phase_s, args.phase_max_s)
            learner, n = restart_on_probation(
                swarm, learner, root / "attacker", deadline, RESTART_AFTER_ACCEPTED
            )
            restarted = {"learner_restarted": True, "restarted_with_accepted": n}
        time.sleep(max(0.0, t_start + args.phase_s - time.time()))
        if proc is not None and not flood:
            _until_banned(swarm, root / "attacker", t_start + max(args.phase_s, args.phase_max_s))
        if proc is not None:
            proc.terminate(timeout=30)
        t_end = time.time()
    finally:
        swarm.close()  # the learner leaves last-published and writes its final stats
    learner_stats = _final(swarm.learner_dir)
    metrics = swarm.metrics()
    authors = learner_stats.get("authors", {})
    trained = learner_stats.get("trained_rows", {})
    bans = learner_stats.get("bans", {})
    reproduced = learner_stats.get("reproduced", {})
    rows_per_batch = swarm.sampler_settings["prompts_per_batch"] * swarm.settings["group_size"]
    base_rows = _window(metrics, *base)
    during = _window(metrics, t_start, t_end)
    entry: dict = {"reward_during": _reward(during), "reward_baseline": _reward(base_rows)}
    entry.update(held_out_evals(metrics, t_start, t_start, t_end))
    honest_keys = [_key_of(root / n) for n in honest_names]
    mine = _final(root / "attacker") if attack is not None else {}
    if flood:  # the honest samplers' trained rows per second, during the flood and in the baseline before it
        base_rate = max(1e-9, _rows_per_s(base_rows, honest16, *base))
        kept = _rows_per_s(during, honest16, t_start, t_end) / base_rate
        flooding = None  # from its first batch on
        if t_first is not None and t_end - t_first >= MIN_FLOODING_S:
            flooding = _rows_per_s(_window(metrics, t_first, t_end), honest16, t_first, t_end) / base_rate
        flooders = {a: r for a, r in authors.items() if a not in set(honest_keys)}
        entry.update(
            honest_intake_kept=round(kept, 3),
            honest_intake_kept_flooding=None if flooding is None else round(flooding, 3),
            flood_started_after_s=None if t_first is None else round(t_first - t_start, 1),
            flood_batches_made=mine.get("batches_made", 0),
            flood_identities_seen=len([a for a, r in flooders.items() if r["accepted"] or r["strikes"]]),
            flood_batches_accepted=sum(r["accepted"] for r in flooders.values()),
        )
    elif attack is not None:
        key = _key_of(root / "attacker")
        answered = mine.get("batches_acked", 0) + mine.get("batches_rejected", 0)
        record = authors.get(key, {})
        # the attacker's rows trained: the learner's final stats count its last session only (a restart),
        # its metrics every step of the final lineage
        rows_trained = max(
            trained.get(key, 0), sum(m.get("rows_by_author", {}).get(key[:16], 0) for m in metrics)
        )
        hostile_ids = mine.get("hostile_batch_ids", [])
        sent = mine.get("hostile_batches_sent", len(hostile_ids))
        ledger = ledger_batches(swarm.learner_dir / "accepted.sqlite", bytes.fromhex(key))
        n_trained, trained_ids = hostile_figures(hostile_ids, ledger)
        trained_frac = round(n_trained / max(1, sent), 4)
        all_hostile = len(hostile_ids) >= mine.get("batches_made", 0)
        entry.update(
            reached_training_frac=reached_training(
                rows_trained, answered, rows_per_batch, all_hostile, trained_frac
            ),
            banned=key in bans,
            ban_reason=bans.get(key),
            hostile_batches_answered=answered,
            hostile_batches_accepted=record.get("accepted", 0),
            hostile_rows_trained=rows_trained if all_hostile else n_trained * rows_per_batch,
            hostile_batches_sent=sent,
            hostile_batches_trained=n_trained,
            hostile_trained_frac=trained_frac,
            hostile_trained_ids=trained_ids[:20],
            attacker_batches_made=mine.get("batches_made", 0),
            strikes=record.get("strikes", 0),
            reproduced_frac=reproduced.get(key),
            **restarted,
        )
    c0 = base_rows[0] if base_rows else {}
    c1 = base_rows[-1] if base_rows else {}
    # refused at intake (the receiver's count, staleness included), or struck by a check of a held batch
    # after it was accepted (the author's record): whichever says more
    at_intake = learner_stats.get("strikes", {})
    refused = sum(max(at_intake.get(k, 0), authors.get(k, {}).get("strikes", 0)) for k in honest_keys)
    honest = {
        "refused": refused,
        "accepted": sum(authors.get(k, {}).get("accepted", 0) for k in honest_keys),
        "banned": sum(k in bans for k in honest_keys),
        "check_s": c1.get("trust/check_s", 0) - c0.get("trust/check_s", 0),
        "check_wait_s": c1.get("trust/check_wait_s", 0) - c0.get("trust/check_wait_s", 0),
        "wall_s": c1.get("time", 0) - c0.get("time", 0),
        "updates": learner_stats.get("step") or 0,
        "reproduced": {k[:16]: reproduced.get(k) for k in honest_keys},
    }
    return entry, honest


def _eval_text(a: dict) -> str:
    return f"eval {a.get('eval_end')} vs {a.get('eval_baseline')} before"


def report(r: dict) -> str:
    seeded = "seeded sampling asked" if r["seeded"] else "unseeded"
    lines = [f"honest engines: {', '.join(r['engines'])}; {seeded}; {r['updates']} updates in all runs"]
    if "control" in r:
        c = r["control"]
        lines.append(
            f"  {'control (no attacker)':24s} eval {c.get('eval_end')} at the phase's end vs "
            f"{c.get('eval_baseline')} before it; reward {c.get('reward_during')} vs "
            f"{c.get('reward_baseline')}"
        )
    for name, a in r["attacks"].items():
        if "honest_intake_kept" in a:
            flooding = a.get("honest_intake_kept_flooding")
            since = (
                f", {flooding:.0%} from its first batch ({a['flood_started_after_s']} s in)"
                if flooding is not None
                else ""
            )
            lines.append(
                f"  {name:24s} honest intake kept {a['honest_intake_kept']:.0%}{since} "
                f"({a['flood_batches_accepted']} flood batches taken from {a['flood_identities_seen']} keys; "
                f"{_eval_text(a)})"
            )
        else:
            hostile = (
                f"; hostile batches trained {a['hostile_batches_trained']} of {a['hostile_batches_sent']}"
                if "hostile_batches_sent" in a
                else ""
            )
            restart = "; learner restarted" if a.get("learner_restarted") else ""
            lines.append(
                f"  {name:24s} reached training {a['reached_training_frac']:6.1%}  banned {a['banned']!s:5s} "
                f"({a['hostile_batches_accepted']} of {a['hostile_batches_answered']} batches accepted"
                f"{hostile}{restart}; reward {a['reward_during']} vs {a['reward_baseline']}; {_eval_text(a)})"
            )
    wait = ""
    if "check_wait_frac" in r:
        wait = f" (and {r['check_wait_frac']:.1%} waiting for the checker's model)"
    lines.append(
        f"honest: {r['honest_false_refusal']:.2%} of {r['honest_batches']} batches refused, "
        f"{r['honest_banned']} banned; checks {r['check_time_frac']:.1%} of learner time{wait}"
    )
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    r = run(args)
    if args.json:  # first: the figures are kept whatever the printing does
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(report(r))
    return 0
