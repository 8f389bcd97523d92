"""Hostile samplers as plug-in functions: ``attack(sampler) -> None`` changes a real
:class:`~heterorl.peer.daemon.sampler.Sampler` (a peer process of its own, see :mod:`.hostile`) after it is
made. ``heterorl bench trust --attack module:function`` and ``python -m heterorl.testing.hostile --attack
module:function`` take any such function, so a new attack needs no change here.

The hooks an attack has: ``sampler.sign_batch`` (rows → signed batch; wrap it to change rows, log-probs, the
claimed version or the signer), ``sampler.backend.load_weights`` (the weights it samples with),
``sampler.sampling`` (temperature, top-p) and ``sampler.make_batches``. :class:`Recompute` gives an attack
honest log-probs of any rows under the version the sampler holds, as a careful attacker would send them.

Each attack records which of the batches it signs are hostile: ``sampler.hostile_batch_ids`` (hex batch ids,
:func:`hostile_ids`), which the attacker's ``final_stats.json`` lists (:mod:`.hostile`) and ``heterorl bench
trust`` looks up in the learner's ledger. Most attacks change every batch (:func:`every_batch_hostile`); a
``sleeper`` marks only the batches it forged. An attack from elsewhere that keeps no record has every batch it
makes counted as hostile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import sqlite3
import time
from pathlib import Path

import torch

from heterorl.peer.daemon.sampler import Sampler
from heterorl.peer.model import completion_logprobs, load_model
from heterorl.peer.model.sampling import nucleus_logprobs
from heterorl.peer.model.text import completion_text
from heterorl.protocol import Identity, decode, encode
from heterorl.protocol.net.trajectories import new_batch_id

log = logging.getLogger(__name__)

REPLAY_FROM_ENV = "HETERORL_REPLAY_FROM"  # the replay attack: the state dir of the sampler it copies
SLEEPER_HONEST_BATCHES = 40  # the sleeper's honest batches before it forges every one
SLEEPER_SHORT_HONEST_BATCHES = 12  # sleeper_short's (a swarm test's shorter run)
# probation-restart's honest batches before it forges every one: fewer than trust.record_batches (8), so it
# never earns a record and the learner holds all it accepted from it
PROBATION_HONEST_BATCHES = 5


# ---- which batches are hostile ----


def hostile_ids(sampler: Sampler) -> set[str]:
    """The hex ids of the batches the attack changed: ``sampler.hostile_batch_ids``, made on first use."""
    ids = getattr(sampler, "hostile_batch_ids", None)
    if ids is None:
        ids = sampler.hostile_batch_ids = set()
    return ids


def _mark(sampler: Sampler, batch_id: bytes) -> None:
    hostile_ids(sampler).add(bytes(batch_id).hex())


def every_batch_hostile(sampler: Sampler) -> None:
    """Every batch the sampler makes from now on counts as hostile (wraps ``make_batches`` as it is now: call
    it after the attack changed the sampler)."""
    hostile_ids(sampler)
    make = sampler.make_batches

    def make_marked(n: int):
        made = make(n)
        for bid, _, _ in made:
            _mark(sampler, bid)
        return made

    sampler.make_batches = make_marked


def _all_hostile(attack):
    """An attack that changes every batch its sampler makes: each is recorded as hostile."""

    @functools.wraps(attack)
    def marked(sampler: Sampler, *args, **kwargs) -> None:
        attack(sampler, *args, **kwargs)
        every_batch_hostile(sampler)

    return marked


class Recompute:
    """Honest behaviour log-probs (at the run's temperature) of rows under the version ``sampler`` holds."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.model, self.tok = load_model(sampler.model_dir)
        self.model.eval().requires_grad_(False)
        self.version: int | None = None

    @torch.no_grad()
    def __call__(self, rows: list[dict]) -> list[list[float]]:
        s = self.sampler
        if s.version != self.version:
            self.model.load_state_dict(s._held_weights())
            self.version = s.version
        width = max(len(r["completion_ids"]) for r in rows)
        pad = self.tok.pad_token_id
        comp = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(comp)
        for i, r in enumerate(rows):
            comp[i, : len(r["completion_ids"])] = torch.tensor(r["completion_ids"])
            mask[i, : len(r["completion_ids"])] = 1
        lp = completion_logprobs(
            self.model, [r["prompt_ids"] for r in rows], comp, mask, pad, s.settings.sampling.temperature
        )
        return [[min(0.0, x) for x in lp[i, : len(r["completion_ids"])].tolist()] for i, r in enumerate(rows)]


def _rows_hook(sampler: Sampler, change) -> None:
    """Wrap ``sign_batch`` so that ``change(rows)`` edits the rows (in place) before they are signed."""
    sign = sampler.sign_batch

    def sign_changed(rows, **kw):
        change(rows)
        return sign(rows, **kw)

    sampler.sign_batch = sign_changed


def _rescore(sampler: Sampler, row: dict) -> None:
    """The row's reward recomputed for its (changed) completion, as the learner will."""
    prompt = sampler.prompts.decode(row["prompt_ids"])
    reference = sampler.task.reference_for(prompt)
    row["reward"] = float(
        sampler.task.reward(prompt, completion_text(sampler.tok, row["completion_ids"]), reference)
    )


def _honest_logprobs(sampler: Sampler) -> None:
    """Rows go out with the run model's log-probs recomputed for them (:class:`Recompute`)."""
    recompute = Recompute(sampler)

    def change(rows):
        for r, lp in zip(rows, recompute(rows), strict=True):
            r["logprobs"] = lp

    _rows_hook(sampler, change)


# ---- forged log-probs ----


def _shift(rows: list[dict]) -> None:
    """Every behaviour log-prob of ``rows`` lowered by 0.5 (in place)."""
    for r in rows:
        r["logprobs"] = [x - 0.5 for x in r["logprobs"]]


@_all_hostile
def forged_shift(sampler: Sampler) -> None:
    """Every behaviour log-prob lowered by 0.5: each row's importance weight inflated e^0.5 ≈ 1.65x."""
    _rows_hook(sampler, _shift)


@_all_hostile
def forged_constant(sampler: Sampler) -> None:
    """Every behaviour log-prob claimed as -0.05 (as if every token were near-certain)."""
    _rows_hook(sampler, lambda rows: [r.update(logprobs=[-0.05] * len(r["logprobs"])) for r in rows])


@_all_hostile
def forged_copied(sampler: Sampler) -> None:
    """Each row carries another row's log-probs (cut or padded to its length)."""

    def change(rows):
        lps = [r["logprobs"] for r in rows]
        for i, r in enumerate(rows):
            src = lps[(i + 1) % len(rows)]
            r["logprobs"] = [src[j] if j < len(src) else -1.0 for j in range(len(r["completion_ids"]))]

    _rows_hook(sampler, change)


# ---- text not sampled from the run's policy ----


def _other_model_weights(sampler: Sampler) -> dict:
    """Another tiny model (another seed, briefly pre-trained), of the run's architecture and tokenizer."""
    from heterorl.peer.model.tiny import build_tiny_model

    path = Path(sampler.state_dir) / "other-model"
    if not (path / "config.json").exists():
        build_tiny_model(path, seed=7, steps=150, progress=False)
    other, _ = load_model(str(path))
    return {k: v.clone() for k, v in other.state_dict().items()}


def _sample_with(sampler: Sampler, weights: dict) -> None:
    """The engine samples with ``weights`` whatever version the sampler loads (and claims)."""
    load = sampler.backend.load_weights
    sampler.backend.load_weights = lambda state: load(weights)


@_all_hostile
def other_model(sampler: Sampler) -> None:
    """Text from another model, with that model's own log-probs, claimed as the run's version."""
    _sample_with(sampler, _other_model_weights(sampler))


@_all_hostile
def other_model_recomputed(sampler: Sampler) -> None:
    """Text from another model, with the run model's log-probs recomputed honestly for it."""
    _sample_with(sampler, _other_model_weights(sampler))
    _honest_logprobs(sampler)


BACKDOOR = "   "  # what the exact-match reward strips: a correct answer still scores 1 with it


@_all_hostile
def backdoor(sampler: Sampler) -> None:
    """A phrase added to every correct answer (still rewarded 1), log-probs recomputed honestly for it."""
    recompute = Recompute(sampler)
    phrase = sampler.tok.encode(BACKDOOR, add_special_tokens=False)
    eos = sampler.tok.eos_token_id
    cap = sampler.settings.sampling.max_new_tokens

    def change(rows):
        for r in rows:
            if r["reward"] < 1.0:
                continue
            body = [t for t in r["completion_ids"] if t != eos]
            r["completion_ids"] = (body + phrase)[: cap - 1] + [eos]
            _rescore(sampler, r)
        for r, lp in zip(rows, recompute(rows), strict=True):
            r["logprobs"] = lp

    _rows_hook(sampler, change)


@_all_hostile
def wrong_temperature(sampler: Sampler, factor: float = 0.5) -> None:
    """Samples at half the run's temperature (surer, higher-reward answers), log-probs recomputed honestly
    at the claimed temperature."""
    sampler.sampling = dataclasses.replace(
        sampler.sampling, temperature=sampler.sampling.temperature * factor
    )
    _honest_logprobs(sampler)


def _quantised_weights(sampler: Sampler, bits: int) -> None:
    """Samples with a ``bits``-bit (per-row absmax) quantised copy of each version's matrices, reporting that
    copy's log-probs."""
    load = sampler.backend.load_weights
    top = 2 ** (bits - 1) - 1

    def quantised(state):
        out = {}
        for k, v in state.items():
            if v.is_floating_point() and v.dim() == 2:
                scale = v.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / top
                v = (v / scale).round().clamp(-top - 1, top) * scale
            out[k] = v
        load(out)

    sampler.backend.load_weights = quantised


@_all_hostile
def perturbed_weights(sampler: Sampler) -> None:
    """A 4-bit (16-level) quantised copy of each version: a cheaper model passed off as the run's. On the
    tiny model, once training made it nearly certain, its batches' mean |Δ log-prob| is 0.02 to 0.03, right
    at the tiny run's threshold: some of its checks pass (docs/trust.md, "bounded, not caught")."""
    _quantised_weights(sampler, 4)


@_all_hostile
def perturbed_weights_coarse(sampler: Sampler) -> None:
    """A 3-bit (8-level) quantised copy: about 3x the 4-bit copy's log-prob gap, well past the tiny run's
    threshold at every stage of training (the swarm test's perturbed copy, which must never train)."""
    _quantised_weights(sampler, 3)


# ---- claims ----


@_all_hostile
def stale_claim(sampler: Sampler, behind: int = 16) -> None:
    """Claims a version ``behind`` versions older than the one it sampled with (its claims stay ordered)."""
    sign = sampler.sign_batch

    def sign_stale(rows, **kw):
        held = sampler.version
        sampler.version = max(0, held - behind)
        try:
            return sign(rows, **kw)
        finally:
            sampler.version = held

    sampler.sign_batch = sign_stale


@_all_hostile
def replay(sampler: Sampler) -> None:
    """Another sampler's rows, replayed under this sampler's key: read from its outbox (its state dir in
    ``$HETERORL_REPLAY_FROM``) once the learner acknowledged them, then sent as this sampler's own."""
    source = os.environ.get(REPLAY_FROM_ENV)
    if not source:
        raise ValueError(f"the replay attack needs {REPLAY_FROM_ENV}=<another sampler's state dir>")
    path = Path(source) / "outbox.sqlite"
    seen: dict[bytes, bytes] = {}  # batch id -> its signed bytes, while in the victim's outbox
    ready: list[dict] = []  # rows of batches the learner took from the victim

    def poll() -> None:
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            try:
                now = dict(conn.execute("SELECT batch_id, data FROM items").fetchall())
            finally:
                conn.close()
        except sqlite3.Error:
            return
        for bid in [b for b in seen if b not in now]:  # gone from the outbox: acknowledged
            _, body, _ = decode(seen.pop(bid), "TrajectoryBatch")
            ready.append(body)
        seen.update(now)

    def make_batches(n: int):
        deadline = time.monotonic() + 30
        while len(ready) < n and time.monotonic() < deadline and sampler.rt.running():
            poll()
            time.sleep(0.2)
        out = []
        for body in ready[:n]:
            claimed = {**body, "batch_id": new_batch_id(), "timestamp": time.time()}
            tokens = sum(len(r["completion_ids"]) for r in body["rows"])
            out.append((claimed["batch_id"], encode("TrajectoryBatch", claimed, sampler.identity), tokens))
        del ready[: len(out)]
        return out

    sampler.make_batches = make_batches


# ---- one foreign row in an honest batch ----


@torch.no_grad()
def _sample_completion(
    model, prompt_ids: list[int], temperature: float, top_p: float, max_new: int, eos: int | None, gen
) -> list[int]:
    """A completion of ``prompt_ids`` drawn from ``model`` (multinomial at ``temperature`` within the top-p
    nucleus), ended as the sampler's engine ends one: up to and including its first EOS, or ``max_new``
    tokens without one."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new):
        p = nucleus_logprobs(out.logits[:, -1], temperature, top_p).exp()
        t = int(torch.multinomial(p, 1, generator=gen))
        tokens.append(t)
        if t == eos:
            break
        out = model(input_ids=torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def sparse_foreign(sampler: Sampler) -> None:
    """Honest seeded batches, the engine's own rows untouched, but for one row per batch (a random one): its
    completion sampled from another model (at the run's temperature and top-p), with the run model's
    log-probs recomputed honestly for it and its reward re-scored. The batch still claims its rows seeded:
    one foreign row of 16 barely moves a batch's figures, so only a row-by-row verdict refuses it."""
    recompute = Recompute(sampler)
    other, _ = load_model(sampler.model_dir)
    other.load_state_dict(_other_model_weights(sampler))
    other.eval().requires_grad_(False)
    run = sampler.settings.sampling
    eos = sampler.tok.eos_token_id
    rng = random.Random()
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    sign = sampler.sign_batch

    def sign_one_foreign(rows, **kw):
        row = rows[rng.randrange(len(rows))]
        row["completion_ids"] = _sample_completion(
            other, row["prompt_ids"], run.temperature, run.top_p, run.max_new_tokens, eos, gen
        )
        row["logprobs"] = recompute([row])[0]
        _rescore(sampler, row)
        bid, data, tokens = sign(rows, **kw)  # batch_id passes through: the batch still says "seeded"
        _mark(sampler, bid)
        return bid, data, tokens

    hostile_ids(sampler)
    sampler.sign_batch = sign_one_foreign


# ---- honest first, forged later ----


def _forged_after(sampler: Sampler, honest: int, *, honest_hostile: bool) -> None:
    """Honest for the first ``honest`` batches it signs, then each forged as :func:`forged_shift` forges;
    the forged ones are hostile, and the honest ones too if ``honest_hostile``."""
    sign = sampler.sign_batch
    signed = 0

    def sign_maybe_forged(rows, **kw):
        nonlocal signed
        signed += 1
        forged = signed > honest
        if forged:
            _shift(rows)
        bid, data, tokens = sign(rows, **kw)
        if forged or honest_hostile:
            _mark(sampler, bid)
        return bid, data, tokens

    hostile_ids(sampler)
    sampler.sign_batch = sign_maybe_forged


def sleeper(sampler: Sampler, honest: int = SLEEPER_HONEST_BATCHES) -> None:
    """Honest for its first ``honest`` batches (:data:`SLEEPER_HONEST_BATCHES`): it earns a record, checked
    at ``trust.check_rate`` from then on; every later batch forged as :func:`forged_shift` forges. Only the
    forged batches are hostile."""
    _forged_after(sampler, honest, honest_hostile=False)


def sleeper_short(sampler: Sampler) -> None:
    """:func:`sleeper` honest for :data:`SLEEPER_SHORT_HONEST_BATCHES` batches only (a shorter swarm test)."""
    sleeper(sampler, SLEEPER_SHORT_HONEST_BATCHES)


def probation_restart(sampler: Sampler) -> None:
    """For the learner restarted while this author is on probation: honest for its first
    :data:`PROBATION_HONEST_BATCHES` batches (fewer than ``trust.record_batches``: it never earns a record,
    so the learner holds them out of training), then every batch forged as :func:`forged_shift` forges. All
    its batches count as hostile: none may be trained on, across the restart (``heterorl bench trust``
    restarts the learner once it accepted a few)."""
    _forged_after(sampler, PROBATION_HONEST_BATCHES, honest_hostile=True)


# ---- flood ----


@_all_hostile
def flood(sampler: Sampler, identities: int = 64) -> None:
    """Many fresh identities sending well-formed batches as fast as they can: honest rows (seeded for the
    key that signs them), each engine call's batches signed by one of ``identities`` new keys, never
    waiting for the learner's "busy"."""
    keys = [Identity.generate() for _ in range(identities)]
    rng = random.Random()
    make = sampler.make_batches
    sampler.opt = dataclasses.replace(sampler.opt, max_pending=64)
    sampler.sender.learner_busy_for = lambda: 0.0  # never waits for the learner's "busy"

    def make_batches(n: int):
        sampler.identity = rng.choice(keys)
        return make(max(n, 16))

    sampler.make_batches = make_batches


FLOOD_FORGED_IDENTITIES = 60  # flood-forged's throw-away keys
FLOOD_FORGED_PER_KEY = 2  # ... and the forged batches each sends: fewer than trust.ban_strikes, never banned
FLOOD_FORGED_IDLE_S = 1.0  # its keys spent, the attacker only resends what the learner deferred


def flood_forged(
    sampler: Sampler, identities: int = FLOOD_FORGED_IDENTITIES, per_key: int = FLOOD_FORGED_PER_KEY
) -> None:
    """Throw-away keys, each sending ``per_key`` forged batches (log-probs shifted as :func:`forged_shift`
    shifts them) and never another: each batch costs the learner a full spot check (a key without a record
    has all its batches checked) and its key never reaches ``trust.ban_strikes``, so no ban ends the flood.
    ``identities`` keys (:data:`FLOOD_FORGED_IDENTITIES`), never waiting for the learner's "busy"; once all
    have sent theirs, the sampler makes nothing more and only resends what the learner deferred. Measured
    as :func:`flood` is: by the honest samplers' intake during it."""
    keys = [Identity.generate() for _ in range(identities)]
    left = identities * per_key  # forged batches still to make
    make, sign = sampler.make_batches, sampler.sign_batch
    sampler.opt = dataclasses.replace(sampler.opt, max_pending=64)
    sampler.sender.learner_busy_for = lambda: 0.0  # never waits for the learner's "busy"
    signed = 0

    def sign_forged(rows, **kw):
        nonlocal signed
        if signed % per_key == 0:  # the next throw-away key (its rows' seeds were drawn for another:
            sampler.identity = keys[signed // per_key]  # the forged log-probs are refused first anyway)
        signed += 1
        _shift(rows)
        bid, data, tokens = sign(rows, **kw)
        _mark(sampler, bid)
        return bid, data, tokens

    def make_batches(n: int):
        nonlocal left
        n = min(max(n, 16), left)  # one engine call, as the flood's
        if n <= 0:
            time.sleep(FLOOD_FORGED_IDLE_S)
            return []
        left -= n
        return make(n)

    hostile_ids(sampler)
    sampler.sign_batch = sign_forged
    sampler.make_batches = make_batches


BUILT_IN = {
    "forged-shift": forged_shift,
    "forged-constant": forged_constant,
    "forged-copied": forged_copied,
    "other-model": other_model,
    "other-model-recomputed": other_model_recomputed,
    "backdoor": backdoor,
    "wrong-temperature": wrong_temperature,
    "perturbed-weights": perturbed_weights,
    "perturbed-weights-coarse": perturbed_weights_coarse,
    "stale-claim": stale_claim,
    "replay": replay,
    "sparse-foreign": sparse_foreign,
    "sleeper": sleeper,
    "probation-restart": probation_restart,
    "flood": flood,
    "flood-forged": flood_forged,
}
FLOODS = ("flood", "flood-forged")  # attacks measured by the honest samplers' intake, not by bans
RESTARTS = ("probation-restart",)  # attacks during which `heterorl bench trust` restarts the learner


def load_attack(spec: str):
    """A built-in attack by name, or any ``module:function`` taking the sampler."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"unknown attack {spec!r}: a built-in ({', '.join(BUILT_IN)}) or module:function")
    import importlib

    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"attack {spec!r} is not callable")
    return fn
