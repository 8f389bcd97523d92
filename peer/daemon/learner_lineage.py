"""A learner among several: the training loop of one lineage (:mod:`heterorl.protocol.net.lineage`).

When the run lists several learner keys, every learner takes trajectories (samplers spread over them),
keeps its own trust gate and ledger, and trains the one policy. The lowest key writes; the others are members.
Each version is one step:

- a member takes its next assembled update (or nothing, after a short wait), computes its gradient on the
  current version and sends it to the writer, then applies the writer's Commit: the same gradient bytes for
  everyone, and the batches of its own the step holds (marked applied; the others go back to its buffer);
- the writer closes a step when it or a member has data: it waits for every connected member's part (or a
  deadline), combines them (:func:`~heterorl.peer.learner.combine.combine_gradients`), signs the Commit with
  the hash of the state it was taken on, sends it, applies it, and publishes as a single learner does.

Every member keeps the weights of each version the writer publishes (the Commit says which) and checks, when
the signed manifest reaches it, that they serialise to exactly the manifest's chunks
(:class:`~.adopter.Adopter`); a match is stored and serves its trust checks, a mismatch is logged and
counted. A member also checks each Commit's parent state hash against its own weights; on a mismatch it
takes the writer's state again (a resync, counted).

Who writes: a learner that starts (or loses its writer) looks at the run's live learners' heartbeats
(:func:`~heterorl.protocol.net.lineage.find_lineage`). If one says it writes, it joins it (taking its state
when its own differs: a restart, or a newcomer). If none does and no live learner has a lower key, it writes
after :data:`ELECT_WAIT_S`, numbering its versions after the newest one any learner published. Batches a
learner marked applied are in the lineage's state (it took that state), so a restart replays only those
never applied.
"""

from __future__ import annotations

import json
import logging
import time

from heterorl.protocol import ProtocolError, encode
from heterorl.protocol.net.chunks import latest_manifest
from heterorl.protocol.net.framing import FrameError
from heterorl.protocol.net.lineage import Contributed, LineageLink, LineageWriter, LiveLearner, find_lineage
from heterorl.protocol.wire.gradients import encode_gradient, parameter_schema

from ..learner.assembler import Assembled
from ..learner.combine import combine_gradients, parts_for_step, state_sha256, weighted_lr_scale
from ..learner.state_transfer import load_state_bytes, state_bytes
from ..learner.trainer import LR_SCALE_KEY
from .adopter import Adopter
from .learner_setup import evaluate_if_due

log = logging.getLogger(__name__)

TAKE_S = 0.2  # a learner's wait for its own next update before it looks at the lineage again
START_WAIT_S = 30.0  # the writer's wait, before its first step, for the other live learners to join
# at start, no live learner says it writes and none has a lower key: this long, then this one writes (the
# lowest listed key waits the shorter time; the others give it time to appear in the DHT); after its writer
# left, a learner elects at once
ELECT_WAIT_S = 5.0
ELECT_WAIT_OTHERS_S = 30.0
CHECK_WRITERS_S = 2.0  # how often a writer looks for another writer (two elected at once: one steps down)
LOOKUP_S = 30.0  # one look in the DHT for the run's live learners
FIND_S = 120.0  # how long a learner looks for a writer to join (or the right to write) before it gives up


class WeightsDisagree(RuntimeError):
    """This learner's weights are not the lineage's."""


class LineageRole:
    """The lineage half of a :class:`~.learner.Learner` whose run lists several learner keys."""

    def __init__(self, learner):
        self.l = learner
        s = learner.settings
        if learner.world_size > 1 or s.adapter is not None:
            raise ValueError(
                "several learner keys: each learner runs on one device (no --nproc) and trains all the "
                "weights (no adapter run) for now"
            )
        self.key = learner.identity.public_key
        self.schema = parameter_schema(learner.trainer.named_trainable())
        self.writer = LineageWriter(learner.identity, s.run_id, s.learner_keys, self.schema)
        self.link: LineageLink | None = None
        self.writer_key = b""
        self.adopter = Adopter(
            s.run_id,
            b"",
            learner.store,
            s.learner.checkpoint_dtype,
            on_adopted=learner.trust.published,
            log_path=learner.state_dir / "lineage.jsonl",
        )
        self.steps_led = 0  # versions this learner's data went into
        self.resyncs = self.takeovers = self.conflicts = 0
        self.dropped_trained = 0  # batches this learner held that another learner trained
        self._checked_writers = 0.0
        self.link_bytes = [0, 0]  # sent, received over links to writers closed since
        self.round_s = 0.0
        self.state = b""  # sha256 of the float32 weights at the current version

    @property
    def is_writer(self) -> bool:
        return self.writer.active

    # ---- who writes ----

    def start(self) -> None:
        l = self.l
        l.node.call(self.writer.attach(l.node))
        self.state = state_sha256(l.trainer.named_trainable())
        self._join_or_write()

    def _join_or_write(self, gone: frozenset = frozenset()) -> None:
        """Join the live writer, or write if none is live and no live learner has a lower key (``gone``:
        learners known to have left, whose heartbeats may not have expired yet)."""
        l, s = self.l, self.l.settings
        started = end = time.monotonic()
        end += FIND_S
        wait = ELECT_WAIT_S if self.key == min(s.learner_keys) else ELECT_WAIT_OTHERS_S
        while l.rt.running() and time.monotonic() < end:
            found = self._live()  # None: the DHT did not answer; never elect on no view
            if not l.rt.running():  # told to stop while it looked (a Ctrl-C ends the writer's daemon too)
                return
            live = [x for x in found or () if x.address.key != self.key and x.address.key not in gone]
            writing = [x for x in live if x.writes]
            if found is None:
                pass
            elif writing:
                try:
                    self._join(writing[0])
                    return
                except (ConnectionError, ProtocolError, TimeoutError) as e:
                    log.info("lineage: could not join %s: %s", writing[0].address.key.hex()[:16], e)
            elif not any(x.address.key < self.key for x in live) and (
                gone or time.monotonic() - started >= wait  # a writer left: no one to wait for
            ):
                try:
                    self._write()
                    return
                except TimeoutError as e:  # the newest published version not known: never sign one twice
                    log.warning("lineage: %s; looking again", e)
            l.status.state = "looking for the lineage's writer"
            l.rt.stop.wait(1.0)
        if l.rt.running():
            raise ConnectionError(f"found no lineage writer to join in {FIND_S:g} s")

    def _write(self) -> None:
        """Become the writer at this learner's version (after the newest any learner published)."""
        l, s = self.l, self.l.settings
        found = l.node.call(latest_manifest(l.node, s.run_id, s.learner_keys), timeout=60)
        newest = found[1]["version"] if found else -1
        if newest > l.step:  # a writer that left published further: never sign a version twice
            l.trainer.renumber(newest)
        if self.link is not None:
            self._drop_link()
            self.takeovers += 1
        self.writer.activate(l.step, self.state)
        self.writer_key = self.key
        if self.published_version() < l.step:  # samplers need this version before anyone steps
            l.status.state = f"publishing version {l.step}"
            l._publish_now(with_state=False)
            self._log_published(l.step)
        log.info("lineage: this learner writes, from version %d", l.step)

    def _live(self) -> list[LiveLearner] | None:
        """The run's live learners (heartbeats in the DHT); None when the DHT did not answer in time (a
        loaded machine, a peer that just died): the caller looks again rather than acting on no view."""
        l, s = self.l, self.l.settings
        try:
            live = l.node.call(find_lineage(l.node, s.run_id, s.learner_keys), timeout=LOOKUP_S)
        except TimeoutError as e:
            log.warning("lineage: the run's learners not found in the DHT (%s); looking again", e)
            live = None
        return live

    def _join(self, writer: LiveLearner) -> None:
        """Join ``writer``'s lineage: the hellos, its state if this learner's differs, then the manifests
        published so far (checked)."""
        l, s = self.l, self.l.settings
        key = writer.address.key
        link = LineageLink(l.node, l.identity, s.run_id, key, self.schema)
        offered = link.open(writer.address.peer_id, writer.address.maddrs, l.step, self.state)
        if offered is not None:
            load_state_bytes(l.trainer, offered.version, offered.weights, offered.optimizer)
            self.state = state_sha256(l.trainer.named_trainable())
            if self.state != offered.state:
                raise ProtocolError("the offered weights, loaded, do not hash to the offered state")
            log.info("lineage: took %s's state at version %d", key.hex()[:16], l.step)
            self._trained(offered.trained, offered.version, "by")
            l.trust.saw_versions_from(offered.version)  # those published while it was away: not held here
        self._drop_link()
        self.link, self.writer_key, self.adopter.writer_key = link, key, key
        self.adopter.keep(l.step, l.trainer.snapshot(s.learner.checkpoint_dtype, with_state=False))
        for raw in link.manifests:
            self.adopter.adopt(raw)
        log.info("lineage: member of %s's lineage at version %d", key.hex()[:16], l.step)

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link_bytes[0] += self.link.bytes_sent
            self.link_bytes[1] += self.link.bytes_received
            self.link.close()
            self.link = None

    def published(self, version: int) -> None:
        """This learner published ``version``: its manifest goes to every member with their next reply."""
        raw = self.l.store.manifest(version)
        if raw is not None and self.is_writer:
            self.writer.add_manifest(version, raw)

    def published_version(self) -> int:
        return max(self.adopter.published_version, self.l.publisher.published_version)

    # ---- the loop ----

    def loop(self) -> None:
        l = self.l
        if self.is_writer:
            self._wait_for_members()
        while l.rt.running():
            if l.opt.max_steps is not None and l.step >= l.opt.max_steps:
                log.info("reached %d updates; stopping", l.step)
                return
            l.status.state = "waiting for trajectories"
            t = time.perf_counter()
            got = l.assembler.take(timeout=TAKE_S)
            l.stats.wait_s += time.perf_counter() - t
            if self.is_writer:
                self._serve_state()
                self._write_step(got)
                self._yield_to_another_writer()
                continue
            try:
                self._member_step(got)
            except (ConnectionError, EOFError, ProtocolError, TimeoutError, WeightsDisagree) as e:
                if l.rt.stop.is_set():
                    return
                # a stream cut mid-frame or gone silent is a writer that left (killed, or its link died),
                # not a disagreement: elect without it rather than resync with it
                gone = isinstance(e, (ConnectionError, EOFError, TimeoutError)) or (
                    isinstance(e, FrameError) and e.kind in ("truncated", "timeout")
                )
                log.warning("lineage: %s (%s); %s", type(e).__name__, e, "electing" if gone else "resyncing")
                self.resyncs += not gone
                self._join_or_write(frozenset({self.writer_key}) if gone else frozenset())

    def _yield_to_another_writer(self) -> None:
        """Two learners that elected themselves at once (a heartbeat not yet seen): the one further behind
        (lower published version; on a tie the higher key) stops writing and joins the other."""
        if time.monotonic() - self._checked_writers < CHECK_WRITERS_S:
            return
        self._checked_writers = time.monotonic()
        live = self._live() or []
        mine = (self.published_version(), -int.from_bytes(self.key, "big"))
        ahead = [x for x in live if x.writes and x.address.key != self.key
                 and (x.version, -int.from_bytes(x.address.key, "big")) > mine]  # fmt: skip
        if not ahead:
            return
        log.warning(
            "lineage: %s writes too (version %d, this learner %d); this learner steps down",
            ahead[0].address.key.hex()[:16],
            ahead[0].version,
            mine[0],
        )
        self.writer.deactivate()
        self.conflicts += 1
        try:
            self._join(ahead[0])
        except (ConnectionError, ProtocolError, TimeoutError) as e:
            log.info("lineage: could not join %s (%s); electing", ahead[0].address.key.hex()[:16], e)
            self._join_or_write()

    def _wait_for_members(self) -> None:
        """Before the first step: the live learners join (or :data:`START_WAIT_S` passes)."""
        l = self.l
        end = time.monotonic() + START_WAIT_S
        while l.rt.running() and time.monotonic() < end:
            live = self._live()
            want = {x.address.key for x in live or ()} - {self.key}
            if live is not None and want <= set(self.writer.members()):
                return
            self._serve_state()
            l.status.state = f"waiting for learners ({len(self.writer.members())} of {len(want)} joined)"
            l.rt.stop.wait(0.5)

    def _serve_state(self) -> None:
        """A joining learner waits for this writer's state: a snapshot between two steps."""
        if not self.writer.state_wanted():
            return
        l = self.l
        snap = l.trainer.snapshot(l.settings.learner.checkpoint_dtype, with_state=True)
        named = [(n, snap.model_state[n]) for n, _ in l.trainer.named_trainable()]
        weights, optimizer = state_bytes(named, snap.optimizer_state)
        self.writer.offer_state(snap.version, self.state, weights, optimizer, l.ledger.lineage_since)

    def _own_part(self, got: Assembled | None):
        """This learner's batches (less banned authors'), their gradient, stats and tokens; or Nones."""
        l = self.l
        batches = l.trust.without_banned(got.batches) if got is not None else []
        elsewhere = l.ledger.in_lineage(b.batch_id for b in batches)
        if elsewhere:  # trained by another learner (a sampler resent it there): dropped when that was heard
            batches = [b for b in batches if b.batch_id not in elsewhere]
        if not batches:
            return [], None, {}, 0
        rows = got.rows if len(batches) == len(got.batches) else l.assembler.rows(batches)
        l.status.state = f"computing a gradient (step {l.step + 1})"
        grads, stats = l.trainer.gradients(rows)
        return batches, grads, stats, int(rows.mask.sum())

    def _write_step(self, got: Assembled | None) -> None:
        l, s = self.l, self.l.settings
        if got is None and not self.writer.wait_for_data(0.0):
            return
        t = time.perf_counter()
        batches, grads, stats, tokens = self._own_part(got)
        lr = float(stats.get(LR_SCALE_KEY, 1.0))
        own = Contributed(self.key, l.step, [b.batch_id for b in batches], tokens, lr, grads)
        parts = self.writer.gather(deadline_s=max(2.0, 2 * self.round_s) + 1.0)
        combined = parts_for_step([own, *parts], l.ledger.in_lineage)
        if not combined:  # a member's data was withdrawn meanwhile: nothing to step on
            self.writer.reopen()
            return
        applied = [{"learner": p.learner, "batch_ids": p.batch_ids} for p in combined]
        gradient, norm = combine_gradients(
            [(p.learner, p.tokens, p.grads) for p in combined], s.learner.grad_clip
        )
        lr_scale = weighted_lr_scale([(p.tokens, p.lr_scale) for p in combined])
        data, sha = encode_gradient(gradient)
        version = l.step + 1
        due = l._due or version % s.learner.publish_every == 0 or version == l.opt.max_steps
        publish = due and l.publisher.idle()
        fields = {
            "version": version,
            "parent_state": self.state,
            "applied": applied,
            "tokens": sum(p.tokens for p in combined),
            "lr_scale": lr_scale,
            "grad_sha256": sha,
            "publish": publish,
        }
        # marked before the commit goes out: a writer killed in between loses these batches, never trains
        # them twice (its restart replays only batches never marked)
        l.ledger.mark_applied([b.batch_id for b in batches], version)
        self._trained([i for a in applied for i in a["batch_ids"]], version, "at")
        self.writer.commit(fields, data)
        l.trainer.apply(gradient, lr_scale)
        self.state = state_sha256(l.trainer.named_trainable())
        self.writer.set_state(version, self.state)
        l.stats.train_s += time.perf_counter() - t
        self.round_s = (
            0.8 * self.round_s + 0.2 * (time.perf_counter() - t) if self.round_s else time.perf_counter() - t
        )
        l._due = due and not publish
        if publish:
            l._offer_version()
            self._log_published(version)
        self._record(version, batches if tokens else [], {**stats, "grad_norm": norm}, len(combined))

    def _member_step(self, got: Assembled | None) -> None:
        l, s = self.l, self.l.settings
        t = time.perf_counter()
        batches, grads, stats, tokens = self._own_part(got)
        data = sha = None
        if tokens:
            data, sha = encode_gradient(grads)
        body = {
            "run_id": s.run_id,
            "version": l.step,
            "batch_ids": [b.batch_id for b in batches] if tokens else [],
            "tokens": tokens,
            "lr_scale": float(stats.get(LR_SCALE_KEY, 1.0)),
            "grad_sha256": sha or b"",
        }
        l.status.state = f"waiting for the writer (step {l.step + 1})"
        try:
            kind, reply, gradient = self.link.exchange(encode("Contribution", body, l.identity), data)
        except BaseException:
            for b in batches:  # not in any commit this learner heard of: the next step takes them
                l.buffer.put(b)
            raise
        for raw in reply["manifests"]:
            self.adopter.adopt(raw)
        if kind == "LineageWait":
            return
        version = reply["version"]
        if version != l.step + 1 or reply["parent_state"] != self.state:
            for b in batches:
                l.buffer.put(b)
            self.adopter.mismatched += reply["parent_state"] != self.state
            raise WeightsDisagree(f"the writer's commit {version} is not on this learner's version {l.step}")
        mine = {bytes(i) for a in reply["applied"] if a["learner"] == self.key for i in a["batch_ids"]}
        used = [b for b in batches if b.batch_id in mine]
        l.ledger.mark_applied([b.batch_id for b in used], version)  # the lineage holds them now
        trained = [bytes(i) for a in reply["applied"] for i in a["batch_ids"]]
        dropped = set(self._trained(trained, version, "at"))  # resent to another learner, trained there
        l.trainer.apply(gradient, reply["lr_scale"])
        self.state = state_sha256(l.trainer.named_trainable())
        for b in batches:
            if b.batch_id not in mine | dropped:  # the step closed without this part: the next one takes it
                l.buffer.put(b)
        if reply["publish"]:
            self.adopter.keep(version, l.trainer.snapshot(s.learner.checkpoint_dtype, with_state=False))
        l.stats.train_s += time.perf_counter() - t
        self._record(version, used, stats if used else {}, len(reply["applied"]))

    def _trained(self, batch_ids: list[bytes], version: int, how: str) -> list[bytes]:
        """The lineage trained ``batch_ids`` (``how`` "at" or "by" ``version``): recorded; this learner's own
        pending copies of them (a sampler resent one whose Ack it lost) are dropped, never trained twice."""
        dropped = self.l.ledger.record_lineage(
            batch_ids, version, f"trained by another learner of the lineage {how} version {version}"
        )
        if dropped:
            self.dropped_trained += len(dropped)
            log.info("lineage: %d batches this learner holds were trained by another learner %s version %d;"
                     " dropped", len(dropped), how, version)  # fmt: skip
        return dropped

    def _log_published(self, version: int) -> None:
        """The versions every member keeps and checks (``lineage.jsonl``; a member's says what it found)."""
        with (self.l.state_dir / "lineage.jsonl").open("a") as f:
            f.write(json.dumps({"version": version, "published": True, "time": time.time()}) + "\n")

    def _record(self, version: int, batches: list, stats: dict, parts: int) -> None:
        l = self.l
        self.steps_led += bool(batches)
        row = l.stats.updated(version, batches, {**stats, "lineage/parts": parts})
        l.rt.append_jsonl("metrics.jsonl", {**row, **(evaluate_if_due(l) if self.is_writer else {})})

    # ---- what it did ----

    def stats(self) -> dict[str, float]:
        out = {
            "lineage/writer": float(self.is_writer),
            "lineage/steps_with_my_data": self.steps_led,
            "lineage/resyncs": self.resyncs,
            "lineage/takeovers": self.takeovers,
            "lineage/writer_conflicts": self.conflicts,
            "lineage/dropped_trained_elsewhere": self.dropped_trained,
            **self.writer.stats(),
        }
        now = (self.link.bytes_sent, self.link.bytes_received) if self.link is not None else (0, 0)
        out["lineage/link_bytes_sent"] = self.link_bytes[0] + now[0]
        out["lineage/link_bytes_received"] = self.link_bytes[1] + now[1]
        if self.adopter is not None:
            out.update(self.adopter.stats())
        return out

    def close(self) -> None:
        self._drop_link()
