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
(:class:`~.adopter.Adopter`); a match is stored and serves its trust checks, a mismatch is logged, counted
and stops the member. A member also checks each Commit's parent state hash against its own weights.
"""

from __future__ import annotations

import json
import logging
import time

from heterorl.protocol import encode
from heterorl.protocol.net.lineage import LineageLink, LineageWriter
from heterorl.protocol.net.trajectories import find_learners
from heterorl.protocol.wire.gradients import encode_gradient, parameter_schema

from ..learner.assembler import Assembled
from ..learner.combine import combine_gradients, state_sha256, weighted_lr_scale
from ..learner.trainer import LR_SCALE_KEY
from .adopter import Adopter

log = logging.getLogger(__name__)

TAKE_S = 0.2  # a learner's wait for its own next update before it looks at the lineage again
START_WAIT_S = 60.0  # the writer's wait, before its first step, for every listed learner to connect
FIND_WRITER_S = 120.0  # a member's wait for the writer's heartbeat


class WeightsDisagree(RuntimeError):
    """This learner's weights are not the lineage's: it stops (a state transfer comes later)."""


def writer_of(keys) -> bytes:
    """The lineage's writer: the lowest of the run's learner keys."""
    return min(bytes(k) for k in keys)


class LineageRole:
    """The lineage half of a :class:`~.learner.Learner` whose run lists several learner keys."""

    def __init__(self, learner):
        self.l = learner
        s = learner.settings
        self.key = learner.identity.public_key
        self.writer_key = writer_of(s.learner_keys)
        self.is_writer = self.key == self.writer_key
        self.schema = parameter_schema(learner.trainer.named_trainable())
        self.writer: LineageWriter | None = None
        self.link: LineageLink | None = None
        self.adopter: Adopter | None = None
        self.steps_led = 0  # versions this learner's data went into
        self.round_s = 0.0
        if not self.is_writer:
            self.adopter = Adopter(
                s.run_id,
                self.writer_key,
                learner.store,
                s.learner.checkpoint_dtype,
                on_adopted=learner.trust.published,
                log_path=learner.state_dir / "lineage.jsonl",
            )

    # ---- start ----

    def start(self) -> None:
        s, l = self.l.settings, self.l
        if self.is_writer:
            self.writer = LineageWriter(l.identity, s.run_id, s.learner_keys, self.schema, l.trainer.version)
            l.node.call(self.writer.attach(l.node))
            self.published(l.publisher.published_version)  # published at start, before the first step
            self._log_published(l.trainer.version)
            log.info("lineage: this learner writes (%d learner keys in the run)", len(s.learner_keys))
            return
        self.adopter.keep(l.trainer.version, l.trainer.snapshot(s.learner.checkpoint_dtype, with_state=False))
        peer = self._find_writer()
        self.link = LineageLink(l.node, l.identity, s.run_id, self.writer_key, self.schema)
        self.link.open(peer.peer_id, peer.maddrs, l.trainer.version)
        for raw in self.link.manifests:
            self.adopter.adopt(raw)
        log.info(
            "lineage: member of %s's lineage at version %d", self.writer_key.hex()[:16], l.trainer.version
        )

    def _find_writer(self):
        l, end = self.l, time.monotonic() + FIND_WRITER_S
        while l.rt.running() and time.monotonic() < end:
            found = l.node.call(find_learners(l.node, l.settings.run_id, [self.writer_key]), timeout=30)
            if found:
                return found[0]
            l.status.state = "looking for the lineage's writer"
            l.rt.stop.wait(2.0)
        raise ConnectionError(
            f"no heartbeat of the writer {self.writer_key.hex()[:16]} in {FIND_WRITER_S:g} s"
        )

    def published(self, version: int) -> None:
        """The writer published ``version``: its manifest goes to every member with their next reply."""
        if self.writer is not None:
            raw = self.l.store.manifest(version)
            if raw is not None:
                self.writer.add_manifest(version, raw)

    def published_version(self) -> int:
        return (
            self.adopter.published_version if self.adopter is not None else self.l.publisher.published_version
        )

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
                self._write_step(got)
                continue
            try:
                self._member_step(got)
            except (ConnectionError, EOFError) as e:
                if not l.rt.stop.is_set():
                    log.error("lineage: the writer is gone (%s); this learner stops", e)
                    raise
                return

    def _wait_for_members(self) -> None:
        want = set(self.l.settings.learner_keys) - {self.key}
        end = time.monotonic() + START_WAIT_S
        while self.l.rt.running() and time.monotonic() < end and not want <= set(self.writer.members()):
            self.l.status.state = f"waiting for learners ({len(self.writer.members())} of {len(want)} joined)"
            self.l.rt.stop.wait(0.5)
        missing = want - set(self.writer.members())
        if missing:
            log.warning("lineage: starting without %d listed learner(s) that did not connect", len(missing))

    def _own_part(self, got: Assembled | None):
        """This learner's batches (less banned authors'), their gradient, stats and tokens; or Nones."""
        l = self.l
        batches = l.trust.without_banned(got.batches) if got is not None else []
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
        parts = self.writer.gather(deadline_s=max(2.0, 2 * self.round_s) + 1.0)
        taken: set[bytes] = set()
        applied, combined = [], []
        if tokens:
            taken.update(b.batch_id for b in batches)
            applied.append({"learner": self.key, "batch_ids": [b.batch_id for b in batches]})
            combined.append((self.key, tokens, grads, float(stats.get(LR_SCALE_KEY, 1.0))))
        for p in parts:
            if not p.tokens or taken & set(p.batch_ids):  # a batch in two parts: the later part waits
                continue
            taken.update(p.batch_ids)
            applied.append({"learner": p.learner, "batch_ids": p.batch_ids})
            combined.append((p.learner, p.tokens, p.grads, p.lr_scale))
        if not combined:  # a member's data was withdrawn meanwhile: nothing to step on
            self.writer.reopen()
            return
        gradient, norm = combine_gradients([(k, n, g) for k, n, g, _ in combined], s.learner.grad_clip)
        lr_scale = weighted_lr_scale([(n, x) for _, n, _, x in combined])
        data, sha = encode_gradient(gradient)
        version = l.step + 1
        due = l._due or version % s.learner.publish_every == 0 or version == l.opt.max_steps
        publish = due and l.publisher.idle()
        fields = {
            "version": version,
            "parent_state": state_sha256(l.trainer.named_trainable()),
            "applied": applied,
            "tokens": sum(n for _, n, _, _ in combined),
            "lr_scale": lr_scale,
            "grad_sha256": sha,
            "publish": publish,
        }
        self.writer.commit(fields, data)
        l.trainer.apply(gradient, lr_scale)
        l.ledger.mark_applied([b.batch_id for b in batches], version)
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
        kind, reply, gradient = self.link.exchange(encode("Contribution", body, l.identity), data)
        for raw in reply["manifests"]:
            self.adopter.adopt(raw)
        if kind == "LineageWait":
            return
        version = reply["version"]
        if version != l.step + 1:
            raise WeightsDisagree(
                f"the writer's commit is for version {version}, this learner is at {l.step}"
            )
        if reply["parent_state"] != state_sha256(l.trainer.named_trainable()):
            self.adopter.mismatched += 1
            raise WeightsDisagree(
                f"this learner's weights at version {l.step} are not the writer's (state hash)"
            )
        mine = {bytes(i) for a in reply["applied"] if a["learner"] == self.key for i in a["batch_ids"]}
        l.trainer.apply(gradient, reply["lr_scale"])
        used = [b for b in batches if b.batch_id in mine]
        for b in batches:
            if b.batch_id not in mine:  # the step closed without this part: the next one takes it
                l.buffer.put(b)
        l.ledger.mark_applied([b.batch_id for b in used], version)
        if reply["publish"]:
            self.adopter.keep(version, l.trainer.snapshot(s.learner.checkpoint_dtype, with_state=False))
        l.stats.train_s += time.perf_counter() - t
        self._record(version, used, stats if used else {}, len(reply["applied"]))

    def _log_published(self, version: int) -> None:
        """The versions every member keeps and checks (``lineage.jsonl``; a member's says what it found)."""
        with (self.l.state_dir / "lineage.jsonl").open("a") as f:
            f.write(json.dumps({"version": version, "published": True, "time": time.time()}) + "\n")

    def _record(self, version: int, batches: list, stats: dict, parts: int) -> None:
        l = self.l
        self.steps_led += bool(batches)
        row = l.stats.updated(version, batches, {**stats, "lineage/parts": parts})
        l.rt.append_jsonl("metrics.jsonl", {**row, **(l.evaluate_now() if self.is_writer else {})})

    # ---- what it did ----

    def stats(self) -> dict[str, float]:
        out = {"lineage/writer": float(self.is_writer), "lineage/steps_with_my_data": self.steps_led}
        if self.writer is not None:
            out.update(self.writer.stats())
        if self.link is not None:
            out.update(
                {
                    "lineage/bytes_sent": self.link.bytes_sent,
                    "lineage/bytes_received": self.link.bytes_received,
                }
            )
        if self.adopter is not None:
            out.update(self.adopter.stats())
        return out

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
