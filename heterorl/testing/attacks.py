"""Hostile samplers as plug-in functions: ``attack(sampler) -> None`` changes a real
:class:`~heterorl.peer.daemon.sampler.Sampler` (a peer process of its own, see :mod:`.hostile`) after it is
made. ``heterorl bench trust --attack module:function`` and ``python -m heterorl.testing.hostile --attack
module:function`` take any such function, so a new attack needs no change here.

The hooks an attack has: ``sampler.sign_batch`` (rows → signed batch; wrap it to change rows, log-probs, the
claimed version or the signer), ``sampler.backend.load_weights`` (the weights it samples with),
``sampler.sampling`` (temperature, top-p) and ``sampler.make_batches``. :class:`Recompute` gives an attack
honest log-probs of any rows under the version the sampler holds, as a careful attacker would send them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import sqlite3
import time
from pathlib import Path

import torch

from heterorl.peer.daemon.sampler import Sampler
from heterorl.peer.model import completion_logprobs, load_model
from heterorl.peer.model.text import completion_text
from heterorl.protocol import Identity, decode, encode
from heterorl.protocol.net.trajectories import new_batch_id

log = logging.getLogger(__name__)

REPLAY_FROM_ENV = "HETERORL_REPLAY_FROM"  # the replay attack: the state dir of the sampler it copies


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


def forged_shift(sampler: Sampler) -> None:
    """Every behaviour log-prob lowered by 0.5: each row's importance weight inflated e^0.5 ≈ 1.65x."""
    _rows_hook(sampler, lambda rows: [r.update(logprobs=[x - 0.5 for x in r["logprobs"]]) for r in rows])


def forged_constant(sampler: Sampler) -> None:
    """Every behaviour log-prob claimed as -0.05 (as if every token were near-certain)."""
    _rows_hook(sampler, lambda rows: [r.update(logprobs=[-0.05] * len(r["logprobs"])) for r in rows])


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


def other_model(sampler: Sampler) -> None:
    """Text from another model, with that model's own log-probs, claimed as the run's version."""
    _sample_with(sampler, _other_model_weights(sampler))


def other_model_recomputed(sampler: Sampler) -> None:
    """Text from another model, with the run model's log-probs recomputed honestly for it."""
    _sample_with(sampler, _other_model_weights(sampler))
    _honest_logprobs(sampler)


BACKDOOR = "   "  # what the exact-match reward strips: a correct answer still scores 1 with it


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


def wrong_temperature(sampler: Sampler, factor: float = 0.5) -> None:
    """Samples at half the run's temperature (surer, higher-reward answers), log-probs recomputed honestly
    at the claimed temperature."""
    sampler.sampling = dataclasses.replace(
        sampler.sampling, temperature=sampler.sampling.temperature * factor
    )
    _honest_logprobs(sampler)


def perturbed_weights(sampler: Sampler) -> None:
    """Samples with a 4-bit (16-level, per-row absmax) quantised copy of each version's matrices, reporting
    that copy's log-probs: a cheaper model passed off as the run's."""
    load = sampler.backend.load_weights

    def quantised(state):
        out = {}
        for k, v in state.items():
            if v.is_floating_point() and v.dim() == 2:
                scale = v.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 7
                v = (v / scale).round().clamp(-8, 7) * scale
            out[k] = v
        load(out)

    sampler.backend.load_weights = quantised


# ---- claims ----


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


# ---- flood ----


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


BUILT_IN = {
    "forged-shift": forged_shift,
    "forged-constant": forged_constant,
    "forged-copied": forged_copied,
    "other-model": other_model,
    "other-model-recomputed": other_model_recomputed,
    "backdoor": backdoor,
    "wrong-temperature": wrong_temperature,
    "perturbed-weights": perturbed_weights,
    "stale-claim": stale_claim,
    "replay": replay,
    "flood": flood,
}
FLOODS = ("flood",)  # attacks measured by the honest samplers' intake, not by bans


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
