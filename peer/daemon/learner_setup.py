"""How the learner role gets its parts from the run's settings: the trainer (one process, or rank 0 of an
FSDP group under torchrun), the model factory its replica builds from, and the held-out eval."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.jsonlog import drop_rows_after
from heterorl.protocol.wire.checkpoint import serialize_state_dict

from ..learner.evaluate import HeldOutEval
from ..learner.ranks import init_from_env
from ..learner.trainer import Trainer, TrainerLike, adamw
from ..learner.update import StepOptions
from ..model import adapter, load_model
from ..model.prompts import PromptFormat
from ..rollout import SamplingParams
from .learner_ranks import lead
from .weights import weights_hash

log = logging.getLogger(__name__)

# objectives whose weights bound very stale rows (defensive sampling): no staleness cut needed to 256 versions
STALE_SAFE_OBJECTIVES = ("gepo", "gepo_plus")


def model_factory(settings: RunSettings, model_dir: str | Path, device: str) -> Callable[[], nn.Module]:
    """Builds the run's model afresh (an adapter run's wrapped base): what a replica loads versions into."""

    def build() -> nn.Module:
        model, _ = load_model(str(model_dir), device=device)
        if settings.adapter is not None:
            model = adapter.for_training(model, settings.adapter, settings.learner.checkpoint_dtype)
        return model

    return build


def make_trainer(
    settings: RunSettings, model_dir: str | Path, device: str, adamw_kernel: str = "auto"
) -> tuple[TrainerLike, object, int]:
    """The trainer, the tokenizer and the number of ranks. Under torchrun (``WORLD_SIZE`` > 1) this is rank
    0: the model is sharded over the group with FSDP2 and the other ranks follow its commands
    (:func:`~heterorl.peer.learner.ranks.follow`); else one :class:`Trainer` on ``device``, its AdamW the
    ``adamw_kernel`` asked for (:func:`~heterorl.peer.learner.trainer.adamw`)."""
    options = StepOptions.from_settings(settings)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if settings.adapter is not None:
            raise ValueError("adapter runs train on one device: run the learner without torchrun or --nproc")
        _, world, rank_device = init_from_env()
        model, tok = load_model(str(model_dir), device=str(rank_device))
        return lead(model, options, tok.pad_token_id, str(model_dir)), tok, world
    model, tok = load_model(str(model_dir), device=device)
    if settings.adapter is not None:  # LoRA on the frozen base the run names
        model = adapter.for_training(model, settings.adapter, settings.learner.checkpoint_dtype)
    optimizer = functools.partial(adamw, kernel=adamw_kernel)
    return (
        Trainer(model, options, tok.pad_token_id, adapter=settings.adapter is not None, optimizer=optimizer),
        tok,
        1,
    )


def held_out_eval(settings: RunSettings, task, tok) -> HeldOutEval | None:
    """The held-out eval the run asks for (``learner.eval_every``), or None."""
    s = settings
    if not s.learner.eval_every:
        return None
    sampling = SamplingParams(s.sampling.temperature, s.sampling.top_p, s.sampling.max_new_tokens)
    try:
        ev = HeldOutEval(
            task,
            PromptFormat(tok, s.model.chat),
            tok,
            sampling,
            s.learner.eval_samples,
            s.learner.eval_prompts,
        )
    except ValueError as e:
        log.warning("no held-out evaluation: %s", e)
        return None
    log.info("held-out evaluation every %d updates: %s", s.learner.eval_every, ev.describe())
    return ev


def resume(trainer: TrainerLike, settings: RunSettings, state_dir: Path, store) -> int:
    """Load the learner's last save, or check that a fresh start is the model the coordinator signed; the
    saved step. Versions published after the save (saves are every ``learner.save_every_s``) came from
    updates this restart redoes from the ledger, differently: the redone updates are numbered after the
    newest published version (``trainer.renumber``), so no version number is signed twice. Metrics rows of
    updates after the save go (those updates are redone)."""
    if trainer.restore(state_dir / "state") is None:
        snap = trainer.snapshot(settings.learner.checkpoint_dtype, with_state=False)
        if weights_hash(serialize_state_dict(snap.weights)) != settings.initial_checkpoint:
            raise ValueError(
                f"the weights of {settings.model.path} here differ from the RunSpec's initial checkpoint; "
                "the learner must start from the model the coordinator signed"
            )
        log.info("starting fresh from %s", settings.model.path)
    else:
        log.info("resumed from my own state at step %d", trainer.version)
    saved = trainer.version
    newest = max(store.versions(), default=-1)
    if newest > saved and len(settings.learner_keys) > 1:  # learner peers: the lineage settles it
        log.info("versions %d..%d were published after my last save (step %d): this learner takes the "
                 "lineage's newest state when it joins, or numbers its commits above them when it writes",
                 saved + 1, newest, saved)  # fmt: skip
    elif newest > saved:
        log.warning(
            "versions %d..%d were published after my last save (step %d): their updates are redone from the "
            "ledger as versions %d on",
            saved + 1,
            newest,
            saved,
            newest + 1,
        )
        trainer.renumber(newest)
    drop_rows_after(state_dir / "metrics.jsonl", "step", saved)  # updates after the save: redone
    return saved


def require_learner_key(key: bytes, settings: RunSettings) -> None:
    """PermissionError unless ``key`` is one of the run's learner keys."""
    if key not in settings.learner_keys:
        raise PermissionError(
            f"this peer's key {key.hex()} is not among the run's learner keys; "
            "list it in run.toml's learner_keys"
        )


def evaluate_if_due(learner) -> dict[str, float]:
    """Score ``learner``'s current version's checkpoint weights on the held-out prompts if an evaluation is
    due (every ``eval_every`` updates); it goes into the metrics row and every heartbeat until the next."""
    every, step = learner.settings.learner.eval_every, learner.step
    if learner.evaluate is None or step == 0 or step % every != 0:
        return {}
    t = time.perf_counter()
    learner.status.state = f"evaluating (step {step})"
    snap = learner.trainer.snapshot(learner.settings.learner.checkpoint_dtype, with_state=False)
    scores = learner.evaluate.of_weights(learner.replica, snap.weights, tag=("eval", snap.version))
    learner.stats.last_eval = ev = {**scores, "eval/step": float(step)}
    learner.stats.train_s += time.perf_counter() - t
    log.info(
        "held-out eval at step %d: sampled %.3f, greedy %.3f (%.1f s)",
        step,
        ev["eval/sampled"],
        ev["eval/greedy"],
        ev["eval/time_s"],
    )
    return ev


def warn_if_unbounded_staleness(settings: RunSettings) -> None:
    if settings.objective.name not in STALE_SAFE_OBJECTIVES and settings.learner.max_staleness < 0:
        log.warning(
            "objective %s trains on batches however stale (learner.max_staleness = -1); in `heterorl bench "
            "staleness` only GEPO's defensive weights kept their skill at delay 256 (CISPO and M2PO "
            "collapsed): consider a cut",
            settings.objective.name,
        )
