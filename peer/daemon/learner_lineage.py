"""A learner among several: its part in one lineage of versions (:mod:`heterorl.protocol.net.lineage`).

When the run lists several learner keys, every learner takes trajectories (samplers spread over them), keeps
its own trust gate and ledger, and trains the one policy. :class:`LineageRole` is the strategy
:meth:`~.learner.Learner.loop` calls for each step (``step(got)``), whichever part this learner plays:

- a **member** computes its gradient on the current version from its next assembled update (or sends an empty
  part), sends it to the writer, and applies the writer's Commit: the parameter update every learner adds, the
  combined gradient its optimiser moments take, and the batches of its own the step holds (marked applied;
  the ones the writer refused are dropped, never resent; the others go back to its buffer). It checks the
  commit's parent state against its own weights and its own weights after the step against the commit's
  state; a mismatch takes the writer's state again (a resync, counted);
- the **writer** closes a step when it or a member has data: it waits for every connected member's part (or
  a deadline), adds its own, takes the step (:meth:`~heterorl.peer.learner.trainer.Trainer.commit_update`),
  signs the Commit and publishes as a single learner does, but only within its lease and reservation
  (:class:`~heterorl.peer.learner.election.Lease`): a version is signed once, by a learner that holds it.

Who writes (:func:`~heterorl.peer.learner.election.elect`, on the view a thread of its own keeps:
:class:`~.lineage_view.LineageView`): a learner joins the live writer of the highest term; with no live
writer, the live learner holding the newest state writes, in a term above any seen, numbering its first commit
above every version any learner published or reserved. A writer that sees a higher term stops before it signs
again, and joins. A learner that joins takes the writer's state when its own differs, and makes its ledger
agree with it (:meth:`~heterorl.protocol.storage.ledger.AcceptedLog.adopt_lineage`): what the lineage trained
is never trained here again, what only an abandoned branch trained is replayed.

Every learner saves its state as the writer does (``learner.save_every_s``); after every learner restarts at
once, the one holding the newest saved state writes and the others take it.

``lineage.jsonl`` (one row per event, each with ``event`` and ``time``): ``state`` (the weights this learner
holds now: at start, restored, offered), ``writer`` (it writes, a term), ``commit`` (a step applied: term,
versions, parent and new state, batches), ``published`` (a version it signed, with the manifest's sha256) and
``checked`` (a member's own weights against the writer's manifest). ``heterorl bench chaos`` checks the
lineage's invariants from these files.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import threading
import time

import torch

from heterorl.protocol import ProtocolError, encode
from heterorl.protocol.net.lineage import (
    Exchange,
    LineageLink,
    LineageWriter,
    NamedBatch,
    Part,
    StateForJoiner,
    WriterGone,
)
from heterorl.protocol.storage.files import atomic_write_json
from heterorl.protocol.storage.jsonlog import append_row
from heterorl.protocol.wire.gradients import encode_gradient, parameter_schema
from heterorl.protocol.wire.messages import MAX_TRAINED_IDS
from heterorl.protocol.wire.sparse_gradient import decode_part, flat_size

from ..learner.assembler import Assembled
from ..learner.combine import Accumulator, part_refusal, state_sha256
from ..learner.compress import ErrorFeedback, flatten, unflatten
from ..learner.election import FRESH_S, Decision, Lease, Me, elect, lead
from ..learner.trainer import LR_SCALE_KEY, LineageTrainer
from .adopter import Adopter
from .lineage_view import LineageView

log = logging.getLogger(__name__)

TAKE_S = 0.2  # a learner's wait for its own next update before it looks at the lineage again
ELECT_AFTER_S = 5.0  # at start, a learner looks at the swarm this long before it decides who writes
SETTLE_S = 120.0  # a learner that found no writer to join (nor the right to write) for this long says so
LEASE_WAIT_S = 0.25  # a writer whose lease does not cover its next version waits this long, and looks again
STATES_KEPT = 64  # version -> state hash of the newest versions (a published row names its version's state)
TRAINED_KEPT = MAX_TRAINED_IDS  # the lineage table's window: what a joiner reconciles against
DROPPED_ELSEWHERE = "trained by another learner of the lineage"
CHAOS_ENV = "HETERORL_CHAOS"  # a fault campaign's hooks (heterorl bench chaos): commit frames lost or delayed
CHAOS_FILE = "chaos-fault"


@dataclasses.dataclass
class _Part:
    """A member's part of a step: its batches, the frame (None: no batches), the frame's SHA-256, a sparse
    part's undo (step − sent), its lr scale and the objective's stats."""

    batches: list
    data: bytes | None
    sha: bytes | None
    undo: torch.Tensor | None
    lr_scale: float
    stats: dict


@dataclasses.dataclass
class _InFlight:
    """A part sent, and the future of the writer's answer to it (a :class:`Reply`)."""

    part: _Part
    future: concurrent.futures.Future


class WeightsDisagree(RuntimeError):
    """This learner's weights are not the lineage's."""


class LineageRole:
    """The lineage half of a :class:`~.learner.Learner` whose run lists several learner keys; the strategy
    its loop calls (see the module docstring). Uses the learner's public parts only."""

    wait_s = TAKE_S  # the learner loop's wait for its next update before it calls step(None)

    def __init__(self, learner):
        s = learner.settings
        if learner.world_size > 1 or s.adapter is not None:
            raise ValueError(
                "several learner keys: each learner runs on one device (no --nproc) and trains all the "
                "weights (no adapter run) for now"
            )
        if not isinstance(learner.trainer, LineageTrainer):
            raise TypeError(f"{type(learner.trainer).__name__} cannot train in a lineage")
        self.l, self.s, self.trainer = learner, s, learner.trainer
        self.key = learner.identity.public_key
        self.schema = parameter_schema(self.trainer.named_trainable())
        self.batch_tokens = s.limits.max_batch_rows * s.sampling.max_new_tokens
        lx = s.lineage
        self.exchange = Exchange(self.schema, sparse=lx.exchange == "sparse", k=lx.k)
        self.numel = flat_size(self.schema)
        # a part's clip: the run's gradient norm (dense), or lx.update_clip × the norm of a step that moves
        # every weight by lr (sparse: parts are AdamW steps, not gradients)
        self.part_clip = (
            lx.update_clip * s.objective.lr * self.numel**0.5 if self.exchange.sparse else s.learner.grad_clip
        )
        self.sent_feedback: ErrorFeedback | None = None  # sparse: what this learner's parts have not sent yet
        self.commit_feedback: ErrorFeedback | None = None  # sparse: what its commits (as writer) held back
        self.acc = Accumulator(self.part_clip)
        # sparse: a member's share of the commits that took its parts (its tokens over theirs): its residual,
        # scaled by it, is where its unsent steps will put the lineage
        self.share = 1.0 / len(s.learner_keys)
        self.writer = LineageWriter(
            learner.identity,
            s.run_id,
            s.learner_keys,
            self.schema,
            refusal=lambda batches, lr, grad: part_refusal(batches, lr, grad, self.batch_tokens),
            vet=self._vet,
            accumulate=lambda part, grads: self.acc.add(part.tokens, grads, part.lr_scale),
            exchange=self.exchange,
        )
        self.view = LineageView(
            learner.node, s.run_id, s.learner_keys, self.key, on_look=self._looked, on_bans=self._peer_bans
        )
        self.adopter = Adopter(
            s.run_id, b"", learner.store, s.learner.checkpoint_dtype, on_adopted=self._adopted,
            log=self._log_row, on_signed=learner.trust.manifests.note,
        )  # fmt: skip
        self._meta_path = learner.state_dir / "lineage.json"
        meta = _read_json(self._meta_path)
        self.term = int(meta.get("term", 0))  # the highest term this learner knows
        self.reserved_seen = int(meta.get("reserved", -1))  # the highest version any writer reserved
        self.link: LineageLink | None = None
        self.writer_key = b""
        self.lease: Lease | None = None  # while this learner writes
        self.first_version = 0  # a new writer's first commit number (above every reservation it saw)
        self.rival_floor = 0  # a writer of the same term seen: commit above its reservation
        self._reserved = -1
        self._pace: collections.deque[float] = collections.deque(maxlen=32)  # commit times (versions/s)
        self._initial_publish = False
        self.states: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self.state = b""  # sha256 of the float32 weights at the current version
        self.steps_led = self.resyncs = self.takeovers = self.conflicts = self.fenced = 0
        self.dropped_trained = self.replayed = self.lost = self.abandoned_parts = 0
        self.link_bytes = [0, 0]  # sent, received over links to writers closed since
        self.round_s = 0.0
        self.wait_s = 0.0  # a member's seconds waiting for the writer's answers
        self._inflight: _InFlight | None = None  # a member's part sent, its answer not heard yet
        self._lock = threading.Lock()

    # ---- what others see ----

    @property
    def is_writer(self) -> bool:
        return self.writer.active

    def lineage_status(self) -> dict:
        """The heartbeat's ``lineage`` field: this learner's term, whether it writes, the version it holds and
        (a writer) the highest version it may commit before the next heartbeat."""
        applied = self.trainer.version
        if self.is_writer:
            rate = len(self._pace) / max(1e-3, self._pace[-1] - self._pace[0]) if len(self._pace) > 1 else 0.0
            nxt = max(applied + 1, self.first_version, self.rival_floor)
            self._reserved = max(self._reserved, nxt - 1 + lead(rate, 2.0))
            reserved = self._reserved
        else:
            reserved = applied
        return {"term": self.term, "writes": self.is_writer, "applied": applied, "reserved": reserved}

    def heartbeat_stored(self, started: float, snapshot) -> None:
        """A heartbeat of this learner's was stored (the runtime's hook): a writer's lease counts from it."""
        lin, lease = snapshot.lineage, self.lease
        if lin is not None and lin["writes"] and lease is not None and lin["term"] == lease.term:
            lease.stored(started, lin["reserved"])

    def _looked(self, started: float, changed: bool) -> None:
        """After each look at the swarm (the view's thread): learn the terms and reservations seen; a writer
        is fenced by a higher term, holds back while a rival of its own term is live, or confirms its lease.
        """
        seen = self.view.seen()
        top_term = max([self.term, *(x.term for x in seen)])
        reserved = max([self.reserved_seen, *(x.reserved for x in seen if x.writes)])
        if (top_term, reserved) != (self.term, self.reserved_seen):
            self.term, self.reserved_seen = top_term, reserved
            self._save_meta()
        lease = self.lease
        if lease is None or lease.fenced is not None:
            return
        me = (lease.term, -int.from_bytes(self.key, "big"))
        rivals = [x for x in seen if x.fresh and x.writes and x.term >= lease.term and not x.leaving]
        above = [x for x in rivals if (x.term, -int.from_bytes(x.key, "big")) > me]
        if above or top_term > lease.term:
            lease.fence(f"a writer in term {top_term} ({above[0].key.hex()[:16] if above else 'seen'})")
            return
        if rivals:  # a rival of this term that has not seen this writer yet: commit above its reservation
            self.rival_floor = max(self.rival_floor, *(x.reserved + 1 for x in rivals))
            return
        if changed and self.view.live():
            lease.confirmed(started)

    def _peer_bans(self, learner: bytes, bans: dict[bytes, str]) -> None:
        """Bans another learner of the run signed into its heartbeat: honoured here (one ban for the run)."""
        for author, reason in bans.items():
            self.l.trust.honour_ban(author, reason, by=learner)

    # ---- start, elect, join, write ----

    def start(self) -> None:
        l = self.l
        l.node.call(self.writer.attach(l.node))
        l.rt.start_thread("lineage view", lambda: self.view.run(l.rt.stop))
        self.state = state_sha256(self.trainer.named_trainable())
        self._keep_state(self.trainer.version, self.state)
        how = "restore" if l.saved_step is not None else "start"
        self._log_row({"event": "state", "term": self.term, "version": self.trainer.version,
                       "state": self.state.hex(), "how": how})  # fmt: skip
        self._settled = False  # the first step settles (the heartbeat runs by then: others see this learner)

    def settle(self, first: bool = False) -> None:
        """Join the live writer, or write: loop on :func:`elect` until one of them is done (``first``: at
        start, look at the swarm for :data:`ELECT_AFTER_S` before deciding anything)."""
        l = self.l
        self._drop_inflight()
        self._drop_link()
        self.view.fast.set()
        started = told = time.monotonic()
        try:
            while l.rt.running():
                if time.monotonic() - told >= SETTLE_S:  # its intake goes on meanwhile: keep looking
                    told = time.monotonic()
                    log.warning("lineage: no writer to join, nor the right to write, for %.0f s (%s)",
                                told - started, l.status.state)  # fmt: skip
                self.view.wake()
                l.rt.stop.wait(0.5)
                if first and (time.monotonic() - started < ELECT_AFTER_S or self.view.looks < 2):
                    l.status.state = "looking at the swarm"
                    continue
                d = self._decide()
                if d.action == "join":
                    l.status.state = f"joining {d.key.hex()[:16]}'s lineage"
                    if self._join(d.key):
                        return
                elif d.action == "write":
                    self._write(d)
                    return
                else:
                    who = f" for {d.key.hex()[:16]}" if d.key else ""
                    l.status.state = f"waiting{who}: {d.reason}"[:64]
        finally:
            self.view.fast.clear()

    def _decide(self) -> Decision:
        me = Me(
            self.key,
            self.trainer.version,
            self.term,
            self.is_writer,
            newest_known=max(self.view.newest_published(), self.reserved_seen, *self.l.store.versions(), -1),
        )
        return elect(self.view.seen(), me, self.view.live())

    def _write(self, d: Decision) -> None:
        """Write in term ``d.term`` from the state this learner holds; its first commit is
        ``d.first_version``."""
        l = self.l
        was_member = self.link is not None or self.writer_key not in (b"", self.key)
        self._drop_link()
        self.term, self.first_version, self.rival_floor, self._reserved = d.term, d.first_version, 0, -1
        self._save_meta()
        self._replay(l.ledger.unapply_after(self.trainer.version))  # (a restart: what its state lacks)
        self.lease = Lease(d.term, held=self.trainer.version)
        self.writer.activate(d.term, self.trainer.version, self.state)
        self.writer_key = self.adopter.writer_key = self.key
        self.takeovers += was_member
        # version 0 of a fresh run is every learner's: the first writer publishes it, once nobody has
        self._initial_publish = self.trainer.version == 0 and d.first_version == 1 and not l.store.versions()
        self._log_row({"event": "writer", "term": d.term, "first_version": d.first_version,
                       "held": self.trainer.version})  # fmt: skip
        l.rt.kick_heartbeat()
        log.info("lineage: this learner writes in term %d, from version %d (first commit %d)", d.term,
                 self.trainer.version, d.first_version)  # fmt: skip

    def _step_down(self, why: str) -> None:
        if self.lease is not None:
            self.lease.fence(why)
        self.writer.deactivate(why)
        self.lease = None
        self.fenced += 1
        self.l.rt.kick_heartbeat()
        log.warning("lineage: this learner stops writing: %s", why)

    def _join(self, key: bytes) -> bool:
        """Join ``key``'s lineage: the hellos, its state if this learner's differs (and the ledger made to
        agree with it), then the manifests published so far (checked). False if it could not."""
        l, s = self.l, self.s
        address = self.view.address(key)
        if address is None:
            return False
        link = LineageLink(l.node, l.identity, s.run_id, key, self.schema, self.exchange)
        try:
            offered = link.open(address.peer_id, address.maddrs, self.trainer.version, self.state, self.term)
        except Exception as e:  # a dead or unreachable writer (libp2p's dial errors have types of their own)
            log.info("lineage: could not join %s: %s: %s", key.hex()[:16], type(e).__name__, str(e)[:200])
            link.close()
            return False
        if offered is not None:
            try:
                self.trainer.load_state_bytes(offered.version, offered.weights, offered.optimizer)
                self.state = state_sha256(self.trainer.named_trainable())
                if self.state != offered.state:
                    raise ProtocolError("the offered weights, loaded, do not hash to the offered state")
            except ProtocolError as e:
                log.warning("lineage: %s's state refused: %s", key.hex()[:16], e)
                link.close()
                return False
            self._keep_state(offered.version, self.state)
            self._log_row({"event": "state", "term": link.term, "version": offered.version,
                           "state": self.state.hex(), "how": "offer"})  # fmt: skip
            items, dropped, lost = l.ledger.adopt_lineage(
                offered.trained, offered.version, offered.trained_from, DROPPED_ELSEWHERE
            )
            self.dropped_trained += len(dropped)
            self.lost += lost
            self._replay(items)
            l.trust.saw_versions_from(offered.version)  # those published while it was away: not held here
            log.info(
                "lineage: took %s's state at version %d (of this learner's batches, %d dropped: trained "
                "there; %d replayed: only an abandoned branch trained them; %d lost: pruned)",
                key.hex()[:16], offered.version, len(dropped), len(items), lost,
            )  # fmt: skip
        else:
            self._replay(l.ledger.unapply_after(self.trainer.version))
        self.link, self.writer_key, self.adopter.writer_key = link, key, key
        self.term = max(self.term, link.term)
        self._save_meta()
        self.adopter.keep(
            self.trainer.version, self.trainer.snapshot(s.learner.checkpoint_dtype, with_state=False)
        )
        for raw in link.manifests:
            self._adopt(raw)
        log.info("lineage: member of %s's lineage (term %d) at version %d", key.hex()[:16], link.term,
                 self.trainer.version)  # fmt: skip
        return True

    def _replay(self, items) -> None:
        if items:
            self.replayed += len(items)
            self.l.trust.readmit(items)

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link_bytes[0] += self.link.bytes_sent
            self.link_bytes[1] += self.link.bytes_received
            self.link.close()
            self.link = None

    # ---- the steps (the training thread) ----

    def step(self, got: Assembled | None) -> None:
        """One step of this learner's part in the lineage (the learner loop's strategy)."""
        if not self._settled:
            self._return(got)
            self.settle(first=True)
            self._settled = True
            return
        if self.is_writer:
            self._write_step(got)
            return
        try:
            self._member_step(got)
        except (ConnectionError, EOFError, ProtocolError, TimeoutError, WeightsDisagree) as e:
            if self.l.rt.stop.is_set():
                return
            log.warning("lineage: %s (%s); %s", type(e).__name__, e,
                        "resyncing" if isinstance(e, WeightsDisagree) else "electing")  # fmt: skip
            self.resyncs += isinstance(e, WeightsDisagree)
            if isinstance(e, WeightsDisagree):  # take the writer's state again
                self.state = b"resync"
            self.settle()

    def _own_part(self, got: Assembled | None, leave_out: set[bytes] = frozenset()):
        """This learner's batches (less banned authors', those the lineage trained and those in
        ``leave_out``), their gradient and stats; or ([], None, {})."""
        l = self.l
        batches = l.trust.without_banned(got.batches) if got is not None else []
        elsewhere = l.ledger.in_lineage(b.batch_id for b in batches)
        if elsewhere or leave_out:  # trained by another learner (a sampler resent it there), or named already
            for b in batches:
                if b.batch_id in leave_out and b.batch_id not in elsewhere:
                    l.buffer.put(b)
            batches = [b for b in batches if b.batch_id not in elsewhere and b.batch_id not in leave_out]
        if not batches:
            return [], None, {}
        rows = got.rows if len(batches) == len(got.batches) else l.assembler.rows(batches)
        l.status.state = f"computing a gradient (step {self.trainer.version + 1})"
        grads, stats = self.trainer.gradients(rows, self._unsent_offset())
        if not all(bool(torch.isfinite(g).all()) for g in grads.values()):
            log.error("lineage: this learner's own gradient is not finite; its %d batches wait", len(batches))
            for b in batches:
                l.buffer.put(b)
            return [], None, {}
        return batches, grads, stats

    def _unsent_offset(self) -> dict[str, torch.Tensor] | None:
        """Sparse exchange: what this learner's steps have not yet put into the lineage's weights, where its
        next gradient is taken (:meth:`~..learner.trainer.Trainer.gradients`' ``offset``): a writer's commits'
        residual, or a member's parts' residual times its share of a commit. Without it each learner's AdamW
        steps on weights that error feedback holds behind its own steps, and the run learns half as much a
        row (docs/benchmarks.md). None: dense, or nothing held back yet."""
        if not self.exchange.sparse:
            return None
        if self.is_writer:
            held = None if self.commit_feedback is None else self.commit_feedback.residual
        else:
            held = None if self.sent_feedback is None else self.sent_feedback.residual * self.share
        return None if held is None else unflatten(held, self.schema)

    def _write_step(self, got: Assembled | None) -> None:
        l, s = self.l, self.s
        d = self._decide()
        if d.action == "join" or (self.lease is not None and self.lease.fenced is not None):
            self._return(got)
            self._step_down(d.reason if d.action == "join" else self.lease.fenced)
            self.settle()
            return
        self._serve_state()
        version = max(self.trainer.version + 1, self.first_version, self.rival_floor)
        if self._initial_publish and self.lease.why_not(self.trainer.version) is None:
            self._initial_publish = False
            l.status.state = "publishing version 0"
            l.publish_now(with_state=False)
        why = self.lease.why_not(version)
        if why is not None:
            self._return(got)
            l.status.state = "waiting for the writer's lease"
            l.rt.stop.wait(LEASE_WAIT_S)
            return
        if got is None and not self.writer.wait_for_data(0.0):
            return
        t = time.perf_counter()
        batches, grads, stats = self._own_part(got, leave_out=self.writer.named())
        gathered = self.writer.gather(deadline_s=max(2.0, 2 * self.round_s) + 1.0)
        if batches and gathered.named & {b.batch_id for b in batches}:  # a member named one meanwhile
            self._return_batches(batches)
            batches, grads, stats = [], None, {}
        own: list[NamedBatch] = [(b.batch_id, b.sha256, b.tokens) for b in batches]
        if self.lease.why_not(version) is not None:  # it ran out meanwhile: members' parts wait in the sum
            self._return_batches(batches)
            self.writer.reopen()
            return
        if batches:
            lr_scale = min(1.0, float(stats.get(LR_SCALE_KEY, 1.0)))
            if self.exchange.sparse:  # its own AdamW step, whole: only members' parts travel compressed
                grads = self.trainer.local_update(grads, lr_scale)
            self.acc.add(sum(t for _, _, t in own), grads, lr_scale)
        if not len(self.acc):  # nothing to step on
            self.writer.reopen()
            return
        try:
            combined, norm, lr_scale = self.acc.result()
        except ValueError as e:
            self._return_batches(batches)
            self._abandon_round(str(e))
            return
        parts = [*gathered.parts, *([Part(self.key, self.trainer.version, own, 1.0)] if own else [])]
        applied = [
            {"learner": p.learner, "batches": [{"batch_id": b, "sha256": h} for b, h, _ in p.batches]}
            for p in parts
        ]
        parent, parent_state = self.trainer.version, self.state
        self.trainer.renumber(version - 1)  # a new writer's first commit may skip numbers: never signed
        if self.exchange.sparse:
            update_bytes, update_sha = self._sparse_commit(combined, version)
            grad_bytes, grad_sha = b"", hashlib.sha256(b"").digest()
        else:
            update = self.trainer.commit_update(combined, lr_scale)
            update = {n: u.to("cpu", torch.float32) for n, u in update.items()}
            update_bytes, update_sha = encode_gradient(update)
            grad_bytes, grad_sha = encode_gradient(combined)
        self.state = state_sha256(self.trainer.named_trainable())
        self._keep_state(version, self.state)
        due = l.publish_due or version % s.learner.publish_every == 0 or version == l.opt.max_steps
        publish = due and l.publisher.idle()
        fields = {
            "term": self.lease.term,
            "version": version,
            "parent_version": parent,
            "parent_state": parent_state,
            "state": self.state,
            "applied": applied,
            "tokens": self.acc.tokens,
            "lr_scale": lr_scale,
            "update_sha256": update_sha,
            "grad_sha256": grad_sha,
            "publish": publish,
        }
        trained = [(b, h) for p in parts for b, h, _ in p.batches]
        self._log_commit(fields, trained, "writer")
        # marked before the commit goes out: a writer killed in between replays them after its restart unless
        # the lineage it rejoins trained them (the ledger reconciles on join)
        l.ledger.mark_applied([b.batch_id for b in batches], version)
        self._trained(trained, version)
        self.acc = Accumulator(self.part_clip)  # before the next round opens: members' parts go there
        self._chaos_hook(parent, parent_state)
        self.writer.commit(fields, update_bytes, grad_bytes)
        self._pace.append(time.monotonic())
        l.stats.train_s += time.perf_counter() - t
        took = time.perf_counter() - t
        self.round_s = 0.8 * self.round_s + 0.2 * took if self.round_s else took
        l.publish_due = due and not publish
        if publish:
            l.offer_version()
        self._record(version, batches, {**stats, "grad_norm": norm}, len(parts))

    def _sparse_commit(self, combined: dict, version: int) -> tuple[bytes, bytes]:
        """The writer's sparse commit of the parts' combined step: the top-k of it plus what its earlier
        commits left out (its own error feedback), applied here exactly as every member applies it (decoded
        from the frame's own bytes). Returns the frame and its SHA-256."""
        if self.commit_feedback is None:
            self.commit_feedback = ErrorFeedback(self.numel, self.exchange.k)
        frame = self.commit_feedback.step(flatten(combined, self.schema)).frame()
        sha = hashlib.sha256(frame).digest()
        self.trainer.apply_update(decode_part(frame, sha, self.schema, self.exchange.k), None, version)
        return frame, sha

    def _sparse_part(self, grads: dict, lr_scale: float) -> tuple[bytes, bytes, torch.Tensor]:
        """A member's sparse part: its own AdamW step on ``grads``, plus what its earlier parts left out,
        compressed. Returns the frame, its SHA-256 and its undo (step − sent: taken back out of the residual
        when no commit takes the part, whose batches then train again, and the step with them)."""
        if self.sent_feedback is None:
            self.sent_feedback = ErrorFeedback(self.numel, self.exchange.k)
        step = flatten(self.trainer.local_update(grads, lr_scale), self.schema)
        sent = self.sent_feedback.step(step)
        return sent.frame(), hashlib.sha256(sent.frame()).digest(), step.sub_(sent.dense)

    def _abandon_round(self, why: str) -> None:
        """The step's sum cannot be committed: members waiting hear it (their streams close: they rejoin)."""
        log.error("lineage: step abandoned: %s", why)
        self.acc = Accumulator(self.part_clip)
        term, version, state = self.lease.term, self.trainer.version, self.state
        self.writer.deactivate(f"the step was abandoned: {why}")
        self.writer.activate(term, version, state)

    def _return(self, got: Assembled | None) -> None:
        if got is not None:
            self._return_batches(got.batches)

    def _return_batches(self, batches) -> None:
        for b in batches:
            self.l.buffer.put(b)

    def _member_step(self, got: Assembled | None) -> None:
        """Compute this learner's part on the weights it holds, then hear the writer's answer to the part in
        flight (with ``[lineage] overlap``: the one sent last step, so the exchange ran while this part was
        computed, and the part is one version stale when it joins a step), and send this one."""
        link = self.link
        if link is None:
            raise WriterGone("no writer")
        higher = [
            x for x in self.view.seen() if x.fresh and x.writes and x.term > link.term and not x.leaving
        ]
        if higher:
            self._return(got)
            raise WriterGone(f"a writer in term {higher[0].term} fences this one's ({link.term})")
        t = time.perf_counter()
        batches, grads, stats = self._own_part(got)
        lr_scale = min(1.0, float(stats.get(LR_SCALE_KEY, 1.0)))
        data = sha = undo = None
        if batches and self.exchange.sparse:
            data, sha, undo = self._sparse_part(grads, lr_scale)
        elif batches:
            data, sha = encode_gradient(grads)
        del grads
        self.l.stats.train_s += time.perf_counter() - t
        part = _Part(batches, data, sha, undo, lr_scale, stats)
        if not self.s.lineage.overlap:
            self._hear(self._send(link, part))
            return
        previous, self._inflight = self._inflight, None
        if previous is not None:
            try:
                self._hear(previous)
            except BaseException:
                self._withdraw(part)
                raise
        self._inflight = self._send(link, part)

    def _send(self, link: LineageLink, part: _Part) -> _InFlight:
        """``part`` for the lineage's next step (the version this learner holds now), sent off this thread."""
        s = self.s
        body = {
            "run_id": s.run_id,
            "term": link.term,
            "version": self.trainer.version,
            "batches": [
                {"batch_id": b.batch_id, "sha256": b.sha256, "tokens": b.tokens} for b in part.batches
            ],
            "lr_scale": part.lr_scale,
            "grad_sha256": part.sha or b"",
        }
        message = encode("Contribution", body, self.l.identity)
        return _InFlight(part, link.send(message, part.data))

    def _hear(self, inflight: _InFlight) -> None:
        """Wait for the writer's answer to ``inflight`` and take it: a commit is applied (checked against the
        state it names), a LineageWait leaves the part's batches to a later step (or drops those refused)."""
        l, s, part = self.l, self.s, inflight.part
        batches, undo = part.batches, part.undo
        l.status.state = f"waiting for the writer (step {self.trainer.version + 1})"
        waited = time.perf_counter()
        try:
            try:
                reply = inflight.future.result()
            except concurrent.futures.CancelledError:  # the node closed under it
                raise WriterGone("the exchange was cancelled: the node is closing") from None
        except BaseException:
            self._withdraw(part)  # not in any commit this learner heard of: the next step takes them
            raise
        finally:
            self.wait_s += time.perf_counter() - waited
        t = time.perf_counter()
        for raw in reply.body["manifests"]:
            self._adopt(raw)
        if reply.kind == "LineageWait":
            self._refused(batches, reply.body.get("refused"))
            self._unsent(undo)
            return
        c = reply.body
        if c["parent_version"] != self.trainer.version or c["parent_state"] != self.state:
            self._withdraw(part)
            self.adopter.mismatched += c["parent_state"] != self.state
            raise WeightsDisagree(
                f"the writer's commit {c['version']} is on version {c['parent_version']}, this learner holds "
                f"{self.trainer.version}{'' if c['parent_state'] == self.state else ' with other weights'}"
            )
        trained = [(bytes(b["batch_id"]), bytes(b["sha256"])) for a in c["applied"] for b in a["batches"]]
        self._log_commit(c, trained, "member")
        mine = {bytes(b["batch_id"]) for a in c["applied"] if a["learner"] == self.key for b in a["batches"]}
        used = [b for b in batches if b.batch_id in mine]
        if not used:
            self._unsent(undo)  # the commit came without this learner's part
        else:
            self.share = min(1.0, sum(b.tokens for b in used) / max(1, int(c["tokens"])))
        l.ledger.mark_applied([b.batch_id for b in used], c["version"])  # the lineage holds them now
        dropped = set(self._trained(trained, c["version"]))  # resent to another learner, trained there
        self.trainer.apply_update(reply.update, reply.gradient, c["version"])
        self.state = state_sha256(self.trainer.named_trainable())
        self._keep_state(c["version"], self.state)
        self._return_batches(b for b in batches if b.batch_id not in mine | dropped)
        if self.state != c["state"]:
            raise WeightsDisagree(f"after commit {c['version']} this learner's weights are not the writer's")
        if c["publish"]:
            self.adopter.keep(
                c["version"], self.trainer.snapshot(s.learner.checkpoint_dtype, with_state=False)
            )
        l.stats.train_s += time.perf_counter() - t
        l.save_if_due()
        self._record(c["version"], used, part.stats if used else {}, len(c["applied"]))

    def _withdraw(self, part: _Part) -> None:
        """A part no commit this learner heard of took: its batches wait for a later step."""
        self._return_batches(part.batches)
        self._unsent(part.undo)

    def _drop_inflight(self) -> None:
        """Leave the part in flight unheard (the link is closing, or this learner writes now): withdrawn."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.future.cancel()
            self._withdraw(inflight.part)

    def _unsent(self, undo: torch.Tensor | None) -> None:
        """A sparse part that no commit took: its step leaves the residual (None: nothing to undo)."""
        if undo is not None and self.sent_feedback is not None:
            self.sent_feedback.residual.sub_(undo)

    def _refused(self, batches, refused: dict | None) -> None:
        """The writer left this learner's part out for good (its reason): those batches are dropped, never
        resent; the others go back to the buffer."""
        ids = {bytes(b) for b in (refused or {}).get("batch_ids", [])}
        if ids:
            reason = f"the lineage's writer refused them: {refused['reason']}"
            self.l.ledger.drop(ids, reason, time.time())
            self.abandoned_parts += 1
            log.warning("lineage: %d batches dropped: %s", len(ids), reason)
        self._return_batches(b for b in batches if b.batch_id not in ids)

    def _trained(self, batches: list[tuple[bytes, bytes]], version: int) -> list[bytes]:
        """The lineage trained ``batches`` at ``version``: recorded; this learner's own pending copies of them
        (a sampler resent one whose Ack it lost) are dropped, never trained twice."""
        dropped = self.l.ledger.record_lineage(batches, version, f"{DROPPED_ELSEWHERE} at version {version}")
        if dropped:
            self.dropped_trained += len(dropped)
            log.info("lineage: %d batches this learner holds were trained by another learner at version %d; "
                     "dropped", len(dropped), version)  # fmt: skip
        if version % 64 == 0:
            self.l.ledger.prune_lineage(TRAINED_KEPT)
        return dropped

    def _vet(self, learner: bytes, batches: list[NamedBatch]) -> str | None:
        """The writer's own judgement of the batches a member's part names (the network's worker thread)."""
        ledger = self.l.ledger
        if ledger.in_lineage(b for b, _, _ in batches):
            return "it names batches the lineage trained"
        for b, h, tokens in batches:
            item = ledger.get(b)
            if item is None or not item.data:
                continue
            if hashlib.sha256(item.data).digest() != h:
                return f"it names batch {b.hex()[:16]} with other bytes than this learner's copy"
            mine = sum(len(r["completion_ids"]) for r in _rows(item.data, self.s.run_id))
            if mine != tokens:
                return f"it says batch {b.hex()[:16]} holds {tokens} tokens; it holds {mine}"
        return None

    def _serve_state(self) -> None:
        """A joining learner waits for this writer's state: a snapshot between two steps."""
        if not self.writer.state_wanted():
            return
        weights, optimizer = self.trainer.state_bytes()
        window, trained_from = self.l.ledger.lineage_window(TRAINED_KEPT)
        state = StateForJoiner(self.lease.term, self.trainer.version, self.state, weights, optimizer, window,
                               trained_from)  # fmt: skip
        self.writer.offer_state(lambda _since: state)

    # ---- publishing ----

    def may_sign(self, version: int) -> str | None:
        """Why this learner may not sign ``version`` now (the publisher asks just before it signs), or None:
        only the writer, within its lease and reservation, for a version whose state it holds."""
        lease = self.lease
        if lease is None or not self.is_writer:
            return "this learner does not write the lineage"
        if version != self.trainer.version and version not in self.states:
            return f"version {version} is not a state this writer committed"
        return lease.why_not(version)

    def term_of_manifest(self) -> int | None:
        return self.lease.term if self.lease is not None else None

    def published(self, version: int) -> None:
        """This learner signed ``version``: its manifest goes to every member with their next reply."""
        raw = self.l.store.manifest(version)
        if raw is None:
            return
        if self.is_writer:
            self.writer.add_manifest(version, raw)
        self._log_row({"event": "published", "term": self.term_of_manifest() or self.term, "version": version,
                       "manifest": hashlib.sha256(raw).hexdigest(),
                       "state": self.states.get(version, b"").hex()})  # fmt: skip

    def published_version(self) -> int:
        """The newest version this learner holds as published: signed here, checked against the writer's
        manifest, or in its chunk store from before a restart."""
        held = self.l.store.versions()
        return max(
            self.adopter.published_version, self.l.publisher.published_version, held[-1] if held else -1
        )

    def _adopt(self, raw: bytes) -> None:
        self.adopter.adopt(raw)

    def _adopted(self, version: int, weights: dict) -> None:
        self.l.trust.published(version, weights)

    # ---- records ----

    def _keep_state(self, version: int, state: bytes) -> None:
        self.states[version] = state
        while len(self.states) > STATES_KEPT:
            self.states.popitem(last=False)

    def _log_commit(self, c: dict, trained: list[tuple[bytes, bytes]], role: str) -> None:
        row = {
            "event": "commit",
            "term": c["term"],
            "version": c["version"],
            "parent_version": c["parent_version"],
        }
        row |= {"parent_state": c["parent_state"].hex(), "state": c["state"].hex(), "role": role}
        self._log_row({**row, "batches": [b.hex() for b, _ in trained], "writer": self.writer_key.hex()})

    def _log_row(self, row: dict) -> None:
        append_row(self.l.state_dir / "lineage.jsonl", {**row, "time": time.time()})

    def _save_meta(self) -> None:
        atomic_write_json(self._meta_path, {"term": self.term, "reserved": self.reserved_seen})

    def _record(self, version: int, batches: list, stats: dict, parts: int) -> None:
        self.steps_led += bool(batches)
        self.l.record_update(version, batches, {**stats, "lineage/parts": parts}, evaluate=self.is_writer)

    def _chaos_hook(self, parent: int, parent_state: bytes) -> None:
        """``heterorl bench chaos``: a commit frame lost (every member's stream cut as the commit goes out) or
        delayed, once, when the campaign asks (only under :data:`CHAOS_ENV`)."""
        import os

        if not os.environ.get(CHAOS_ENV):
            return
        path = self.l.state_dir / CHAOS_FILE
        try:
            fault = json.loads(path.read_text())
            path.unlink()
        except (OSError, ValueError):
            return
        log.warning("chaos: %s", fault)
        if fault.get("kind") == "delay":
            time.sleep(float(fault.get("s", 3.0)))
        elif fault.get("kind") == "drop":  # the members' streams close before the commit reaches them
            self.writer.deactivate("chaos: the commit frame is lost")
            self.writer.activate(self.lease.term, parent, parent_state)

    # ---- leaving ----

    def leave(self) -> None:
        """The learner leaves: a writer stops writing (its members elect at once), after it published."""
        if self.is_writer:
            self.writer.deactivate("this learner leaves")
            self.lease = None

    def stats(self) -> dict[str, float]:
        out = {
            "lineage/writer": float(self.is_writer),
            "lineage/term": self.term,
            "lineage/steps_with_my_data": self.steps_led,
            "lineage/resyncs": self.resyncs,
            "lineage/takeovers": self.takeovers,
            "lineage/fenced": self.fenced,
            "lineage/dropped_trained_elsewhere": self.dropped_trained,
            "lineage/replayed_from_abandoned": self.replayed,
            "lineage/lost_pruned": self.lost,
            "lineage/parts_dropped": self.abandoned_parts,
            "lineage/member_wait_s": round(self.wait_s, 3),
            **self.writer.stats(),
        }
        now = (self.link.bytes_sent, self.link.bytes_received) if self.link is not None else (0, 0)
        out["lineage/link_bytes_sent"] = self.link_bytes[0] + now[0]
        out["lineage/link_bytes_received"] = self.link_bytes[1] + now[1]
        out.update(self.adopter.stats())
        return out

    def close(self) -> None:
        self._drop_inflight()
        self._drop_link()


def _rows(data: bytes, run_id: str) -> list[dict]:
    from heterorl.protocol import decode

    return decode(data, "TrajectoryBatch", run_id=run_id)[1]["rows"]


def _read_json(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


_ = FRESH_S  # documented above: how long a silent writer is waited for
