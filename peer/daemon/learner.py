"""The learner peer: the network role that wires a trainer to the swarm. Each part owns one thing:

- the trainer (:class:`~heterorl.peer.learner.trainer.TrainerLike`): step, snapshot, save, restore, renumber;
  one process (:class:`~heterorl.peer.learner.trainer.Trainer`) or rank 0 of an FSDP group driving the others
  (:mod:`~heterorl.peer.learner.ranks`), the role cannot tell which;
- the trust gate (:class:`~heterorl.peer.learner.trust.LearnerTrust`): admission, probation and the hold,
  records and bans, the replay index, the spot checker, the release sweep;
- intake (:class:`~heterorl.protocol.net.trajectories.TrajectoryReceiver`): decode, signature, schema, dedupe,
  flow control, the trust gate's admission, the ledger write, and only then the Ack;
- the assembler (:class:`~heterorl.peer.learner.assembler.BatchAssembler`): the next update's tensors, built
  while the current update trains;
- the publisher (:class:`~.publisher.Publisher`): the state save, chunks, deltas, signature, store, announce;
- the stats (:class:`~.learner_stats.LearnerStats`): heartbeat, ``metrics.jsonl``, ``final_stats.json``;
- the held-out eval and the spot checker score published weights on a replica built from the model factory
  (:class:`~heterorl.peer.learner.replica.ModelReplica`), never the live (perhaps sharded) model.

The training thread (:meth:`Learner.loop`) takes an assembled update, steps, marks its batches applied at that
step, and offers the publisher a snapshot when a version is due.

Exactly once, across kills: an accepted batch is in the ledger (on disk) before it is acknowledged; after each
update its id is marked applied at that step; the publisher saves model, optimizer and step with a published
version every ``learner.save_every_s``. A restarted learner loads its last save (step S) and replays every
batch the ledger holds as pending or applied after S, so nothing accepted is lost and nothing counts twice in
the saved lineage. Updates redone after a restart are numbered after the newest version published before it,
so a version number is never signed twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from heterorl.protocol.net.chunks import announce_checkpoint
from heterorl.protocol.net.trajectories import TrajectoryReceiver
from heterorl.protocol.storage.ledger import AcceptedLog

from ..learner.assembler import Assembled, BatchAssembler
from ..learner.buffer import TrajectoryBuffer
from ..learner.intake import RewardCheck
from ..learner.replica import ModelReplica
from ..learner.trainer import TrainerLike
from ..learner.trust import LearnerTrust
from ..model.prompts import PromptFormat
from . import learner_setup as setup
from .announcer import Announcer
from .heartbeat import Status
from .learner_lineage import LineageRole
from .learner_stats import LearnerStats
from .publisher import Publisher
from .runtime import PeerRuntime

log = logging.getLogger(__name__)

ANNOUNCE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class LearnerOptions:
    max_steps: int | None = None  # stop (cleanly) after this many updates; None: run until stopped
    wait_log_s: float = 10.0
    adamw: str = "auto"  # the AdamW kernel (peer/learner/trainer.py adamw): this machine's choice


class SoloSteps:
    """One learner's own steps (a run with one learner key): train on each assembled update."""

    def __init__(self, learner: Learner):
        self.l = learner
        self.wait_s = learner.opt.wait_log_s
        self._waited = 0.0

    def step(self, got: Assembled | None) -> None:
        l = self.l
        if got is not None:
            self._waited = 0.0
            l.train(got)
            return
        keepalive = getattr(l.trainer, "keepalive", None)  # a rank leader's followers wait
        if keepalive is not None and not l.rt.stop.is_set():
            keepalive()
        self._waited += self.wait_s
        if self._waited >= l.opt.wait_log_s and not l.rt.stop.is_set():
            log.info("waiting for trajectories (buffer %d batches)", len(l.buffer))
            self._waited = 0.0


class Learner:
    """The learner role on a :class:`~.runtime.PeerRuntime` (which serves its chunk store and beats)."""

    STORE_BYTES = 8 << 30  # the chunk store's cap

    def __init__(self, runtime: PeerRuntime, options: LearnerOptions = LearnerOptions()):
        self.rt, self.opt, self.node, self.identity = runtime, options, runtime.node, runtime.identity
        self.settings = s = runtime.settings
        setup.require_learner_key(self.identity.public_key, s)
        self.state_dir, self.status, self.store = runtime.state_dir, runtime.status, runtime.store
        self.trainer: TrainerLike
        self.trainer, self.tok, self.world_size = setup.make_trainer(
            s, runtime.model_dir(), runtime.hw.device, options.adamw
        )
        self.saved_step = setup.resume(self.trainer, s, self.state_dir, self.store)
        self.ledger = AcceptedLog(self.state_dir / "accepted.sqlite")
        self.buffer = TrajectoryBuffer(s.learner.buffer_batches)
        self.reward_check = RewardCheck(
            runtime.task(), self.tok, prompts=PromptFormat(self.tok, s.model.chat)
        )
        factory = setup.model_factory(s, runtime.model_dir(), runtime.hw.device)
        self.replica = ModelReplica(factory)  # the spot checker's and the eval's model, never training's
        self.evaluate = setup.held_out_eval(s, runtime.task(), self.tok)
        self.trust = LearnerTrust(
            s,
            self.ledger,
            self.buffer,
            self.store,
            step=lambda: self.step,
            published=self._published_version,
            reward_check=self.reward_check,
            replica=self.replica if s.adapter is None else None,  # adapter runs: not yet spot-checked
            pad_id=self.tok.pad_token_id,
            unchecked_versions_wait=len(s.learner_keys) > 1,
        )
        if s.adapter is not None:
            log.warning("adapter run: sampled rollouts are not spot-checked (full fine-tuning runs only)")
        if self.evaluate is not None or self.trust.spot_check is not None:
            self.replica.model  # built now, from the model directory as it was checked at start  # noqa: B018
        self.receiver = TrajectoryReceiver(
            self.identity,
            s.run_id,
            self.ledger,
            vocab_size=s.vocab_size,
            admit=self.trust.admit,
            on_accept=self.trust.accepted,
            has_room=self.trust.has_room,
        )
        self.assembler = BatchAssembler(
            self.buffer, lambda: s.learner.prompts_per_update, self.tok.pad_token_id, self.trainer.device
        )
        self.announcer = Announcer(
            lambda raw, body: self.node.spawn(
                asyncio.wait_for(announce_checkpoint(self.node, raw, body), ANNOUNCE_TIMEOUT_S)
            )
        )
        self.publisher = Publisher(
            run_id=s.run_id,
            identity=self.identity,
            store=self.store,
            ledger=self.ledger,
            announcer=self.announcer,
            state_root=self.state_dir / "state",
            checkpoint_dtype=s.learner.checkpoint_dtype,
            deltas=s.learner.deltas,
            save_every_s=s.learner.save_every_s,
            on_published=self._on_published,
            may_sign=lambda v: self.lineage.may_sign(v) if self.lineage is not None else None,
            term=lambda: self.lineage.term_of_manifest() if self.lineage is not None else None,
        )
        self.stats = LearnerStats(
            step=lambda: self.step,
            published=self._published_version,
            receiver=self.receiver,
            publisher=self.publisher,
            announcer=self.announcer,
            trust=self.trust,
            buffer=self.buffer,
            world_size=self.world_size,
            rewards=getattr(runtime.task().scorer, "stats", dict),
        )
        self.publish_due = False  # a version is due and waits for the publisher to be free
        # several learner keys: one lineage of versions, one writer per term (learner_lineage.py)
        self.lineage = LineageRole(self) if len(s.learner_keys) > 1 else None
        # what a step of this learner is: its own update, or its part in the lineage's
        self.steps = self.lineage if self.lineage is not None else SoloSteps(self)
        # a lineage learner replays now only batches never applied: those applied after its save wait until
        # it knows the lineage's state (it may hold them: learner_lineage.py reconciles on join)
        self.stats.replayed = self.trust.replay(self.saved_step if self.lineage is None else None)

    @property
    def step(self) -> int:
        """Updates applied so far: the trainer's version."""
        return self.trainer.version

    def _published_version(self) -> int:
        """The newest version this learner holds as published: signed here, or checked against the lineage
        writer's manifest."""
        if self.lineage is not None:
            return self.lineage.published_version()
        return self.publisher.published_version

    def _on_published(self, version: int, weights: dict) -> None:
        self.trust.published(version, weights)
        if self.lineage is not None:
            self.lineage.published(version)

    # ---- checkpoints ----

    def publish_now(self, with_state: bool) -> None:
        """Publish the current version on this thread (at start and when leaving)."""
        t = time.perf_counter()
        snap = self.trainer.snapshot(self.settings.learner.checkpoint_dtype, with_state=with_state)
        self.publisher.publish_now(snap)
        self.stats.blocked_s += time.perf_counter() - t

    def offer_version(self) -> None:
        """Hand the current version to the publisher if it is free; else it stays due (the next update's
        version is offered then: a publisher that falls behind skips to the newest)."""
        t = time.perf_counter()
        dtype = self.settings.learner.checkpoint_dtype
        if self.publisher.offer(lambda: self.trainer.snapshot(dtype, with_state=self.publisher.save_due())):
            self.publish_due = False
        self.stats.blocked_s += time.perf_counter() - t

    def save_if_due(self) -> None:
        """A lineage member's save (it publishes nothing): the state, when ``learner.save_every_s`` has passed
        and the publisher is free."""
        if not self.publisher.save_due():
            return
        t = time.perf_counter()
        dtype = self.settings.learner.checkpoint_dtype
        snap = lambda: dataclasses.replace(self.trainer.snapshot(dtype, with_state=True), publish=False)  # noqa: E731
        self.publisher.offer(snap)
        self.stats.blocked_s += time.perf_counter() - t

    # ---- training (the main thread) ----

    def train(self, got: Assembled) -> None:
        batches = self.trust.without_banned(got.batches)
        if not batches:
            return
        rows = got.rows if len(batches) == len(got.batches) else self.assembler.rows(batches)
        t = time.perf_counter()
        self.status.state = f"updating (step {self.step + 1})"
        stats = self.trainer.step(rows)
        step = self.step
        self.ledger.mark_applied([b.batch_id for b in batches], step)
        self.stats.train_s += time.perf_counter() - t
        if step % self.settings.learner.publish_every == 0 or step == self.opt.max_steps:
            self.publish_due = True
        if self.publish_due:
            self.offer_version()
        self.record_update(step, batches, stats)

    def record_update(self, step: int, batches: list, stats: dict, evaluate: bool = True) -> None:
        """The metrics row of update ``step`` (and the held-out eval, when due and ``evaluate``)."""
        row = self.stats.updated(step, batches, stats)
        self.rt.append_jsonl("metrics.jsonl", {**row, **(setup.evaluate_if_due(self) if evaluate else {})})

    def refresh_status(self) -> Status:
        lineage = self.lineage.stats() if self.lineage is not None else {}
        self.status.update(
            policy_version=self._published_version(),
            stats={**self.stats.heartbeat(), **lineage},
            bans=self.trust.reputation.bans(),
            lineage=self.lineage.lineage_status() if self.lineage is not None else None,
        )
        return self.status

    def heartbeat_stored(self, started: float, snapshot) -> None:
        """The runtime stored a heartbeat (a lineage writer's lease counts from it)."""
        if self.lineage is not None:
            self.lineage.heartbeat_stored(started, snapshot)

    # ---- the role ----

    def start(self) -> None:
        s = self.settings
        setup.warn_if_unbounded_staleness(s)
        if self.lineage is None:  # a lineage's writer publishes once it knows it writes (learner_lineage.py)
            self.status.state = f"publishing version {self.step}"
            self.publish_now(with_state=False)  # version 0 (or the step resumed at) before anyone samples
        self.rt.start_thread("checkpoint publisher", self.publisher.run)
        self.rt.start_thread("batch assembler", self.assembler.run)
        if self.trust.spot_check is not None:
            self.rt.start_thread("release sweep", lambda: self.trust.sweep(self.rt.stop))
        self.rt.stop.on_set(self.assembler.close)  # wakes the training thread waiting for its next batch
        self.node.call(self.receiver.attach(self.node))
        if self.lineage is not None:  # after intake: a member's early batches wait for its first check
            self.lineage.start()
        log.info(
            "learning: run %s, objective %s, step %d, %d rank(s)", s.run_id, s.objective.name, self.step,
            self.world_size,
        )  # fmt: skip

    def loop(self) -> None:
        """Take the next assembled update (or nothing, after ``steps.wait_s``) and hand it to this learner's
        steps: its own update, or its part in the lineage's."""
        while self.rt.running():
            if self.opt.max_steps is not None and self.step >= self.opt.max_steps:
                log.info("reached %d updates; stopping", self.step)
                return
            self.status.state = "waiting for trajectories"
            t = time.perf_counter()
            got = self.assembler.take(timeout=self.steps.wait_s)
            self.stats.wait_s += time.perf_counter() - t
            before = self.step
            self.steps.step(got)
            if self.step != before and self.step % 10 == 0:
                last = self.stats.last
                log.info(
                    "step %d: reward %.3f, staleness %.1f, ESS %.2f, buffer %d",
                    self.step,
                    last.get("reward/mean", 0),
                    last.get("staleness/mean", 0),
                    last.get("is/ess", 0),
                    len(self.buffer),
                )

    def leave(self) -> None:
        self.assembler.close()
        self.publisher.close()  # it publishes what it holds, then ends
        self.publisher.wait_idle()
        try:  # the last version published and saved (a lineage member's: saved): a restart redoes nothing
            pub = self.publisher
            member = self.lineage is not None and not self.lineage.is_writer  # signs nothing
            if not member and (pub.published_version != self.step or pub.saved_version != self.step):
                self.status.state = f"publishing version {self.step}"
                self.publish_now(with_state=True)
            elif member and pub.saved_version != self.step:
                snap = self.trainer.snapshot(self.settings.learner.checkpoint_dtype, with_state=True)
                pub.publish_now(dataclasses.replace(snap, publish=False))
        except Exception as e:
            log.warning("final checkpoint not published: %s", e)
        if self.lineage is not None:
            self.lineage.leave()
        self.trust.save()
        lineage = {"lineage": self.lineage.stats()} if self.lineage is not None else {}
        self.rt.write_final_stats({**self.stats.final(self.reward_check.rows_disagreeing), **lineage})
        # a dead daemon announces nothing: leave at once (the state is saved)
        if self.node.daemon_alive() and not self.announcer.wait_idle(ANNOUNCE_TIMEOUT_S):
            log.warning("leaving before the last checkpoint announce finished")

    def close(self) -> None:
        """After the node closed: no stream handler touches the ledger any more; the other ranks stop."""
        if self.lineage is not None:
            self.lineage.close()
        self.receiver.close()
        self.ledger.close()
        stop = getattr(self.trainer, "stop", None)  # a rank leader: its followers end
        if stop is not None:
            try:
                stop()
            except Exception as e:  # a follower gone: the process group fails, and torchrun says so
                log.error("could not stop the other ranks: %s", e)
