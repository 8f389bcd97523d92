"""The learner peer: the network role around a :class:`~heterorl.peer.learner.trainer.Trainer`.

A pipeline of threads, so that training waits for nothing it need not wait for:

- the node's event loop: stream handlers, chunk server, heartbeat, DHT announces;
- the intake pool (:class:`~heterorl.protocol.net.trajectories.TrajectoryReceiver`): decode, signature,
  schema, dedupe, flow control, then this role's :class:`~heterorl.peer.learner.intake.Admission` checks
  (row count, staleness, rewards re-scored, spot checks), the ledger write, and only then the Ack; a batch
  goes to the buffer once a check vouches for it (its own, or a later one of its author's), until then it
  is held (:mod:`~heterorl.peer.learner.holding`);
- the release sweep: when training is short of data or flow control is full, or an author went quiet, a
  held batch is checked (a pass releases what its author holds); records never earned expire;
- the assembler (:class:`~heterorl.peer.learner.assembler.BatchAssembler`): the next update's tensors,
  built while the current update trains;
- the training thread (:meth:`Learner.loop`): ``Trainer.step``, the batches marked applied at that step,
  metrics; when a version is due and the publisher is free, a snapshot (copies on the trainer's device);
- the publisher (:class:`~.publisher.Publisher`): the state save, chunks, deltas, signature, store, announce.

Exactly once, across kills: an accepted batch is in the ledger (on disk) before it is acknowledged; after each
update its id is marked applied at that step; the publisher saves model, optimizer and step with a published
version every ``learner.save_every_s``. A restarted learner loads its last save (step S) and replays every
batch the ledger holds as pending or applied after S, so nothing accepted is lost and nothing counts twice in
the saved lineage. Checkpoint versions are update steps; updates redone after a restart are numbered after
the newest version published before it, so a version number is never signed twice. Authors' records
(strikes, probation) and which batches were released are in the ledger too: a replayed batch that no check
vouched for is held again, as it was.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import threading
import time

from heterorl.protocol import decode
from heterorl.protocol.net.chunks import announce_checkpoint
from heterorl.protocol.net.trajectories import TrajectoryReceiver
from heterorl.protocol.storage.files import atomic_write
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.checkpoint import serialize_state_dict
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.staleness import STALENESS_BUCKETS, staleness_bucket

from ..learner.assembler import Assembled, BatchAssembler
from ..learner.buffer import Buffered, TrajectoryBuffer, staleness_refusal
from ..learner.evaluate import HeldOutEval
from ..learner.holding import HeldBatches
from ..learner.intake import Admission, RewardCheck
from ..learner.replay import ReplayIndex
from ..learner.reputation import Reputation
from ..learner.spotcheck import SpotCheck, VersionWeights
from ..learner.trainer import Trainer
from ..learner.update import StepOptions
from ..model import adapter, load_model
from ..model.prompts import PromptFormat
from ..rollout import SamplingParams
from .announcer import Announcer
from .heartbeat import Status
from .publisher import Publisher
from .runtime import PeerRuntime
from .weights import weights_hash

log = logging.getLogger(__name__)

MAX_SHOWN_STRIKES = 8
SWEEP_EVERY_S = 0.25  # the release sweep's period (it also wakes when flow control is full)
EXPIRE_EVERY_S = 30.0  # how often records never earned are looked at for expiry
ANNOUNCE_TIMEOUT_S = 60.0
# objectives whose weights bound very stale rows (defensive sampling): no staleness cut needed to 256 versions
STALE_SAFE_OBJECTIVES = ("gepo", "gepo_plus")
SHOWN_STATS = (
    "reward/mean",
    "is/ess",
    "is/var",
    "is/mean",
    "clip/frac",
    "kl/k3",
    "staleness/mean",
    "mismatch/abs_mean",
    "mismatch/abs_max",
    "mem/peak_mib",
)


def _step_of(line: str) -> float:
    """The step of a metrics row; infinity for a line a kill cut short (it goes with the lost updates)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


@dataclasses.dataclass(frozen=True)
class LearnerOptions:
    max_steps: int | None = None  # stop (cleanly) after this many updates; None: run until stopped
    wait_log_s: float = 10.0


class Learner:
    """The learner role on a :class:`~.runtime.PeerRuntime` (which serves its chunk store and beats)."""

    STORE_BYTES = 8 << 30  # the chunk store's cap

    def __init__(self, runtime: PeerRuntime, options: LearnerOptions = LearnerOptions()):
        self.rt, self.opt, self.node, self.identity = runtime, options, runtime.node, runtime.identity
        self.settings = s = runtime.settings
        if self.identity.public_key not in s.learner_keys:
            raise PermissionError(
                f"this peer's key {self.identity.public_key.hex()} is not among the run's learner keys; "
                "list it in run.toml's learner_keys"
            )
        state_dir = self.state_dir = runtime.state_dir
        self.hw, self.status, self.store = runtime.hw, runtime.status, runtime.store
        model, self.tok = load_model(runtime.model_dir(), device=self.hw.device)
        if s.adapter is not None:  # LoRA on the frozen base the run names
            model = adapter.for_training(model, s.adapter, s.learner.checkpoint_dtype)
        self.trainer = Trainer(
            model, StepOptions.from_settings(s), self.tok.pad_token_id, adapter=s.adapter is not None
        )
        if self.trainer.restore(state_dir / "state") is None:
            if weights_hash(self.checkpoint_bytes()) != s.initial_checkpoint:
                raise ValueError(
                    f"the weights of {s.model.path} here differ from the RunSpec's initial checkpoint; "
                    "the learner must start from the model the coordinator signed"
                )
            log.info("starting fresh from %s", s.model.path)
        else:
            log.info("resumed from my own state at step %d", self.step)
        saved_step = self.step
        self._continue_after_published(saved_step)
        self.ledger = AcceptedLog(state_dir / "accepted.sqlite")
        self.buffer = TrajectoryBuffer(s.learner.buffer_batches)
        self.reward_check = RewardCheck(
            runtime.task(), self.tok, prompts=PromptFormat(self.tok, s.model.chat)
        )
        self.evaluate = self._held_out_eval(runtime)
        self.last_eval: dict[str, float] = {}
        # accepted batches (in the ledger) held out of training until a check vouches for them: all of an
        # author's until it has a record (probation), then those since its last passed check; a strike or a
        # ban drops them (peer/learner/holding.py)
        self.held = HeldBatches()
        self._hold_lock = threading.RLock()  # a batch is held or released, never both
        self._release_wanted = threading.Event()  # flow control is full: the sweep releases what it can
        self.reputation = Reputation(
            s.trust,
            buffer_capacity=s.learner.buffer_batches,
            buffered_new=self._held_new,
            on_ban=self._on_ban,
            checks=s.adapter is None,  # adapter runs are not spot-checked (_make_spot_check)
            held=self.held.of,
            save=self.ledger.save_author,
        )
        self.reputation.load_records(
            self.ledger.authors()
        )  # records, strikes, probation: as before a restart
        self.reputation.load_bans(self.ledger.bans())
        self.replays = ReplayIndex()
        self.spot_check = self._make_spot_check()
        checks = [
            ("banned", self.reputation.check_banned),  # cheapest first
            ("rate", self.reputation.check_rate),
            ("rows", self._check_rows),
            ("version", self._check_version),
            ("staleness", self._check_staleness),
            ("replay", self.replays),
            ("reward", self.reward_check),
        ]
        if self.spot_check is not None:
            checks.append(("spot check", self.spot_check))
        self.admission = Admission(checks, on_strike=self._on_strike, no_strike=("banned", "staleness"))
        self.trained_rows: collections.Counter[bytes] = collections.Counter()  # rows trained on, per author
        self.receiver = TrajectoryReceiver(
            self.identity,
            s.run_id,
            self.ledger,
            vocab_size=s.vocab_size,
            admit=self.admission,
            on_accept=self._on_accept,
            has_room=self._has_room,
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
            state_root=state_dir / "state",
            checkpoint_dtype=s.learner.checkpoint_dtype,
            deltas=s.learner.deltas,
            save_every_s=s.learner.save_every_s,
            on_published=self._published,
        )
        self.staleness: collections.Counter[str] = collections.Counter()
        self.last: dict[str, float] = {}
        self.wait_s = 0.0
        self.train_s = 0.0
        self.blocked_s = 0.0  # the training thread's time spent on publishing (snapshots, the last version)
        self._due = False  # a version is due and waits for the publisher to be free
        self.replayed = self._replay(saved_step)

    @property
    def step(self) -> int:
        """Updates applied so far: the trainer's version."""
        return self.trainer.version

    @property
    def model(self):
        return self.trainer.model

    # ---- intake (the receiver's pool threads) ----

    def _published(self, version: int, weights: dict) -> None:
        if self.spot_check is not None:
            self.spot_check.versions.put(version, weights)

    def _make_spot_check(self) -> SpotCheck | None:
        s = self.settings
        if s.adapter is not None:  # its checkpoints hold adapters, not the model's state: not yet checked
            log.warning("adapter run: sampled rollouts are not spot-checked (full fine-tuning runs only)")
            return None

        def load(version: int) -> bytes | None:
            try:
                return self.store.assemble(version) if self.store.has_version(version) else None
            except (KeyError, ProtocolError):
                return None

        return SpotCheck(
            self.trainer.model,
            VersionWeights(load, s.trust.check_versions),
            self.reputation,
            s.trust,
            pad_id=self.tok.pad_token_id,
            temperature=s.sampling.temperature,
            top_p=s.sampling.top_p,
            run_id=s.run_id,
        )

    def _has_room(self) -> bool:
        """Flow control: the batches accepted and not yet trained on, the buffer's and those held for
        authors with a record, within ``learner.buffer_batches`` (probation has its own bound, the new
        authors' share). Held batches count: else a sender that ignores "busy" has many accepted while
        the buffer has room, and takes the freed room from those that wait."""
        room = len(self.buffer) + self.held.count(self.reputation.has_record) < self.buffer.capacity
        if not room:
            self._release_wanted.set()  # the release sweep checks a held batch now
        return room

    def _held_new(self) -> int:
        """Batches of authors without a record, held on probation (bounded in all)."""
        return self.held.count(lambda author: not self.reputation.has_record(author))

    def _check_rows(self, body: dict, _author: bytes) -> str | None:
        s = self.settings
        n, most = len(body["rows"]), s.limits.max_batch_rows
        if n > most:
            return f"{n} rows exceed the run's {most}"
        longest = max(len(r["completion_ids"]) for r in body["rows"])
        if longest > s.sampling.max_new_tokens:
            return f"a completion of {longest} tokens exceeds the run's {s.sampling.max_new_tokens}"
        return None

    def _check_version(self, body: dict, author: bytes) -> str | None:
        """A claimed version is one this learner published (or older than any it still holds), and an
        author's claims never go back in time."""
        v = body["policy_version"]
        held = self.store.versions()
        if held and v >= held[0] and v <= self.publisher.published_version and not self.store.has_version(v):
            return f"claims version {v}, which was never published"
        return self.reputation.check_claim(body, author)

    def _on_strike(self, author: bytes, check: str, reason: str) -> None:
        banned = self.reputation.strike(author, f"{check}: {reason}", checked=check == "spot check")
        if banned is not None or self.reputation.check_banned({}, author) is not None:
            return
        # a strike retracts what the author sent and is not trained on: the batches held for it (no check
        # vouched for them) and those waiting in the buffer
        with self._hold_lock:
            gone = [b.batch_id for b in self.held.take(author)] + self.buffer.drop_author(author)
        if gone:
            self.ledger.drop(gone, f"not yet trained on when its author was struck: {reason}", time.time())
        log.info(
            "strike against %s (%s: %s)%s",
            author.hex()[:16],
            check,
            reason,
            f"; dropped its {len(gone)} batch(es) not yet trained on" if gone else "",
        )

    def _on_ban(self, author: bytes, reason: str) -> None:
        """Ban ``author`` for the run: what it sent and is not trained on yet goes; the ledger says so."""
        now = time.time()
        self.ledger.ban(author, reason, now)
        with self._hold_lock:
            self.held.take(author)
            self.buffer.drop_author(author)
        dropped = self.ledger.drop(self.ledger.pending_of(author), f"author banned: {reason}", now)
        log.warning(
            "banned %s for the run (%s); dropped %d of its batches not yet trained on",
            author.hex()[:16],
            reason,
            dropped,
        )

    def _check_staleness(self, body: dict, _author: bytes) -> str | None:
        return staleness_refusal(
            self.step,
            body["policy_version"],
            self.publisher.published_version,
            self.settings.learner.max_staleness,
        )

    def _on_accept(self, body: dict, author: bytes, _raw: bytes) -> None:
        self.reputation.accepted(body, author)
        self.replays.add(body, author)
        item = Buffered(body["batch_id"], author, body, time.time())
        self._admit(item, vouched=self.reputation.take_vouched(item.batch_id))

    def _admit(self, item: Buffered, vouched: bool) -> None:
        """An accepted batch (fresh, or replayed after a restart) to training or held: released with what
        its author holds if a check of it passed and the author has a record; else held until one does."""
        author = item.author
        with self._hold_lock:
            if self.reputation.check_banned(item.body, author) is not None:  # banned while it was checked
                self.ledger.drop([item.batch_id], "author banned", time.time())
                return
            if not (vouched and self.reputation.has_record(author)):
                self.held.hold(item)
                return
            self._release_held(author, item)

    def _release_held(self, author: bytes, *also: Buffered) -> None:
        """What ``author`` holds (and ``also``) to training, the ledger told first (a restart replays them
        to training too)."""
        with self._hold_lock:
            released = [*self.held.take(author), *also]
            if released:
                self.ledger.mark_released([b.batch_id for b in released])
            for b in released:
                self.buffer.put(b)

    # ---- the release sweep (a thread of its own): held batches released on demand ----

    def _sweep(self) -> None:
        """Releases held batches when they are wanted: when the buffer holds less than the next update
        takes, or flow control is full, the author with a record holding the most batches has its newest
        one checked (a pass releases them all); an author whose oldest held batch waited ``trust.hold_s``
        has its newest checked too. Now and then, records never earned expire with what they hold."""
        last_expiry = time.monotonic()
        while not self.rt.stop.is_set():
            self._release_wanted.wait(SWEEP_EVERY_S)
            self._release_wanted.clear()
            try:
                self._release_on_demand()
                if time.monotonic() - last_expiry >= EXPIRE_EVERY_S:
                    last_expiry = time.monotonic()
                    self._expire()
            except Exception:  # a sweep that fails is retried; it must not take the learner down
                log.exception("release sweep failed")

    def _release_on_demand(self) -> None:
        if self.spot_check is None:
            return
        candidates = [
            (a, *self.held.of(a))
            for a in self.held.authors()
            if self.reputation.has_record(a) and self.reputation.check_banned({}, a) is None
        ]
        if not candidates:
            return
        now, hold_s = time.time(), self.settings.trust.hold_s
        for author, _, oldest in candidates:  # quiet authors: nothing arrives that would be checked
            if oldest is not None and now - oldest >= hold_s:
                self._check_held(author)
        starving = self.buffer.groups() < self.settings.learner.prompts_per_update
        full = len(self.buffer) + sum(n for _, n, _ in candidates) >= self.buffer.capacity
        if starving or full:
            author = max(candidates, key=lambda c: (c[1], -(c[2] or now)))[0]
            self._check_held(author)

    def _check_held(self, author: bytes) -> None:
        """Check the newest batch ``author`` holds: a pass releases all it holds, a refusal is a strike
        (which drops them), an unverifiable one drops them without one."""
        newest = self.held.newest(author)
        if newest is None:
            return
        verdict = self.spot_check.check(newest.body, author)
        if verdict.reason is None:
            self.reputation.take_vouched(newest.batch_id)
            self._release_held(author)
            return
        self.admission.count_refusal("spot check (held)")
        if verdict.strike:  # the strike drops what the author holds, this batch with it
            self._on_strike(author, "spot check", verdict.reason)
            return
        with self._hold_lock:  # its version is gone: too stale to check, or to train on
            gone = [b.batch_id for b in self.held.take(author)]
        self.ledger.drop(gone, f"held and no longer checkable: {verdict.reason}", time.time())
        log.info("dropped %d held batch(es) of %s: %s", len(gone), author.hex()[:16], verdict.reason)

    def _expire(self) -> None:
        for author in self.reputation.expire():
            with self._hold_lock:
                gone = [b.batch_id for b in self.held.take(author)]
            if gone:
                self.ledger.drop(gone, "its author never earned a record and went quiet", time.time())
            log.info(
                "forgot %s (no record earned, quiet); dropped %d held batch(es)", author.hex()[:16], len(gone)
            )

    def _continue_after_published(self, saved_step: int) -> None:
        """Versions published after the last save (saves are every ``learner.save_every_s``) were made from
        updates this restart redoes from the ledger, differently: the redone updates are numbered after the
        newest published version, so no version number is signed twice; their old metrics rows go."""
        newest = max(self.store.versions(), default=-1)
        if newest <= saved_step:
            return
        log.warning(
            "versions %d..%d were published after my last save (step %d): their updates are redone from the "
            "ledger as versions %d on",
            saved_step + 1,
            newest,
            saved_step,
            newest + 1,
        )
        self.trainer.version = newest
        path = self.state_dir / "metrics.jsonl"
        if path.exists():  # the lineage: rows of updates after the save are not in it any more
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= saved_step]
            atomic_write(path, "".join(line + "\n" for line in kept))

    def _replay(self, saved_step: int) -> int:
        """Accepted batches not in the saved state go through the same admission as when they arrived: a
        banned author's are dropped, those released before (vouched for, or trained on) go to training,
        the rest are held again until a check vouches for them (the records came back with the ledger)."""
        items = self.ledger.pending(applied_after=saved_step)
        held = 0
        for it in items:
            _, body, author = decode(it.data, "TrajectoryBatch", run_id=self.settings.run_id)
            self.reputation.accepted(body, author, count=False)
            self.replays.add(body, author)
            vouched = it.released or not self.reputation.checks  # (an adapter run holds nothing)
            self._admit(Buffered(it.batch_id, author, body, it.received_at), vouched=vouched)
            held += not it.released
        if items:
            log.info(
                "replaying %d accepted batch(es) not in my saved state (%d held until a check vouches)",
                len(items),
                held,
            )
        return len(items)

    # ---- checkpoints ----

    def checkpoint_bytes(self) -> bytes:
        """What a checkpoint of the current version carries: the weights, or an adapter run's adapters."""
        snap = self.trainer.snapshot(self.settings.learner.checkpoint_dtype, with_state=False)
        return serialize_state_dict(snap.weights)

    def _publish_now(self, with_state: bool) -> None:
        """Publish the current version on this thread (at start and when leaving)."""
        t = time.perf_counter()
        snap = self.trainer.snapshot(self.settings.learner.checkpoint_dtype, with_state=with_state)
        self.publisher.publish_now(snap)
        self.blocked_s += time.perf_counter() - t

    def _offer_version(self) -> None:
        """Hand the current version to the publisher if it is free; else it stays due (the next update's
        version is offered then: a publisher that falls behind skips to the newest)."""
        t = time.perf_counter()
        dtype = self.settings.learner.checkpoint_dtype
        if self.publisher.offer(lambda: self.trainer.snapshot(dtype, with_state=self.publisher.save_due())):
            self._due = False
        self.blocked_s += time.perf_counter() - t

    # ---- held-out evaluation (the main thread, between updates) ----

    def _held_out_eval(self, runtime: PeerRuntime) -> HeldOutEval | None:
        s = self.settings
        if not s.learner.eval_every:
            return None
        sampling = SamplingParams(s.sampling.temperature, s.sampling.top_p, s.sampling.max_new_tokens)
        try:
            ev = HeldOutEval(
                runtime.task(),
                PromptFormat(self.tok, s.model.chat),
                self.tok,
                sampling,
                s.learner.eval_samples,
                s.learner.eval_prompts,
            )
        except ValueError as e:
            log.warning("no held-out evaluation: %s", e)
            return None
        log.info("held-out evaluation every %d updates: %s", s.learner.eval_every, ev.describe())
        return ev

    def evaluate_now(self) -> dict[str, float]:
        """Score the current policy on the held-out prompts if an evaluation is due (every ``eval_every``
        updates); it goes into the metrics row and every heartbeat until the next one."""
        every = self.settings.learner.eval_every
        if self.evaluate is None or self.step == 0 or self.step % every != 0:
            return {}
        t = time.perf_counter()
        self.status.state = f"evaluating (step {self.step})"
        self.last_eval = {**self.evaluate(self.trainer.model), "eval/step": float(self.step)}
        self.train_s += time.perf_counter() - t
        log.info(
            "held-out eval at step %d: sampled %.3f, greedy %.3f (%.1f s)",
            self.step,
            self.last_eval["eval/sampled"],
            self.last_eval["eval/greedy"],
            self.last_eval["eval/time_s"],
        )
        return self.last_eval

    # ---- training (the main thread) ----

    def train(self, got: Assembled) -> None:
        s = self.settings
        got = self._without_banned(got)
        if got is None:
            return
        t = time.perf_counter()
        self.status.state = f"updating (step {self.step + 1})"
        stats = self.trainer.step(got.rows)
        for b in got.batches:
            self.trained_rows[b.author] += len(b.body["rows"])
        step = self.step
        self.ledger.mark_applied([b.batch_id for b in got.batches], step)
        hist = collections.Counter(staleness_bucket(step - 1 - b.body["policy_version"]) for b in got.batches)
        self.staleness.update(hist)
        self.train_s += time.perf_counter() - t
        self.last = stats
        if step % s.learner.publish_every == 0 or step == self.opt.max_steps:
            self._due = True
        if self._due:
            self._offer_version()
        row = {
            "step": step,
            "time": time.time(),
            "batches": [b.batch_id.hex() for b in got.batches],
            "authors": sorted({b.author.hex()[:16] for b in got.batches}),
            "rows_by_author": self._rows_by_author(got.batches),
            "staleness_hist": dict(hist),
            # which rollout engines made this update's batches ("vllm/bfloat16": 3, "hf/float32": 5)
            "engines": dict(
                collections.Counter(
                    f"{b.body.get('engine', '?')}/{b.body.get('engine_dtype', '?')}" for b in got.batches
                )
            ),
            # cumulative, so any window's shares can be read off: waiting for data, training, and the
            # training thread blocked by publishing; publish_{save,build,announce}_s are the publisher's own
            "wait_s": self.wait_s,
            "train_s": self.train_s,
            "publish_blocked_s": self.blocked_s,
            **self.publisher.stats(),
            **self.trust_stats(),
            **stats,
            **self.evaluate_now(),
        }
        self.rt.append_jsonl("metrics.jsonl", row)

    @staticmethod
    def _rows_by_author(batches: list[Buffered]) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter()
        for b in batches:
            out[b.author.hex()[:16]] += len(b.body["rows"])
        return dict(out)

    def _without_banned(self, got: Assembled) -> Assembled | None:
        """The update's batches less those of authors banned since they were assembled (None: none left)."""
        bans = self.reputation.bans()
        if not any(b.author in bans for b in got.batches):
            return got
        kept = [b for b in got.batches if b.author not in bans]
        gone = [b.batch_id for b in got.batches if b.author in bans]
        self.ledger.drop(gone, "author banned", time.time())
        log.info("left %d batch(es) of banned authors out of the next update", len(gone))
        if not kept:
            return None
        return Assembled(kept, self.assembler.rows(kept))

    def refresh_status(self) -> Status:
        st = self.status
        st.policy_version = self.publisher.published_version
        recv = self.receiver
        stats = {
            "step": self.step,
            "buffer": len(self.buffer),
            "accepted": recv.accepted,
            "rejected": sum(recv.rejected.values()),
            "duplicates": recv.duplicates,
            "deferred": recv.deferred,
            "replayed": self.replayed,
            "publish_failures": self.announcer.failures,
            "wait_frac": self.wait_s / max(1e-9, self.wait_s + self.train_s),
            **({"delta_ratio": r} if (r := self.publisher.stats()["delta_ratio"]) is not None else {}),
            **{f"stale:{b}": self.staleness.get(b, 0) for b in STALENESS_BUCKETS},
        }
        stats.update({k: self.last[k] for k in SHOWN_STATS if k in self.last})
        stats.update(self.trust_stats())
        stats.update(
            {k: v for k, v in self.last_eval.items() if k in ("eval/step", "eval/sampled", "eval/greedy")}
        )
        for who, n in recv.strikes.most_common(MAX_SHOWN_STRIKES):
            stats[f"rej:{who[:27]}"] = n
        st.stats = stats
        st.bans = self.reputation.bans()
        return st

    def trust_stats(self) -> dict[str, float]:
        """What the checks did: batches checked and refused, their cost, bans, deferred new authors."""
        check = self.spot_check.stats() if self.spot_check is not None else {}
        return {
            **check,
            "trust/banned": len(self.reputation.bans()),
            "trust/held": len(self.held),  # accepted, waiting for a check to vouch for them
            "trust/deferred_new": self.reputation.deferred_new,
        }

    def _write_final_stats(self) -> None:
        recv = self.receiver
        final = {
            "step": self.step,
            "published_version": self.publisher.published_version,
            "accepted": recv.accepted,
            "duplicates": recv.duplicates,
            "deferred": recv.deferred,
            "rejected": sum(recv.rejected.values()),
            "rejected_by_reason": dict(recv.rejected),
            "refused_by_check": dict(self.admission.refused),
            "strikes": dict(recv.strikes),
            "rows_disagreeing": self.reward_check.rows_disagreeing,
            "deferred_by_check": dict(self.admission.deferred),
            "bans": {a.hex(): reason for a, reason in self.reputation.bans().items()},
            "authors": self.reputation.summary(),
            "reproduced": self.spot_check.reproduced_by_author() if self.spot_check is not None else {},
            "trained_rows": {a.hex(): n for a, n in self.trained_rows.items()},
            "train_s": self.train_s,
            "wait_s": self.wait_s,
            "eval": self.last_eval,
            **self.trust_stats(),
        }
        self.rt.write_final_stats(final)

    # ---- the role ----

    def start(self) -> None:
        s = self.settings
        if s.objective.name not in STALE_SAFE_OBJECTIVES and s.learner.max_staleness < 0:
            log.warning(
                "objective %s trains on batches however stale (learner.max_staleness = -1); in `heterorl "
                "bench staleness` only GEPO's defensive weights kept their skill at delay 256 (CISPO and "
                "M2PO collapsed): consider a cut",
                s.objective.name,
            )
        self.status.state = f"publishing version {self.step}"
        self._publish_now(with_state=False)  # version 0 (or the step resumed at) before anyone can sample
        self.rt.start_thread("checkpoint publisher", self.publisher.run)
        self.rt.start_thread("batch assembler", self.assembler.run)
        if self.spot_check is not None:
            self.rt.start_thread("release sweep", self._sweep)
        self.rt.stop.on_set(self.assembler.close)  # wakes the training thread waiting for its next batch
        self.node.call(self.receiver.attach(self.node))
        log.info(
            "learning: run %s, objective %s, step %d",
            self.settings.run_id,
            self.settings.objective.name,
            self.step,
        )

    def loop(self) -> None:
        waited = 0.0
        while self.rt.running():
            if self.opt.max_steps is not None and self.step >= self.opt.max_steps:
                log.info("reached %d updates; stopping", self.step)
                return
            self.status.state = "waiting for trajectories"
            t = time.perf_counter()
            got = self.assembler.take(timeout=self.opt.wait_log_s)
            self.wait_s += time.perf_counter() - t
            if got is None:
                waited += time.perf_counter() - t
                if waited >= self.opt.wait_log_s and not self.rt.stop.is_set():
                    log.info("waiting for trajectories (buffer %d batches)", len(self.buffer))
                    waited = 0.0
                continue
            waited = 0.0
            self.train(got)
            if self.step % 10 == 0:
                log.info(
                    "step %d: reward %.3f, staleness %.1f, ESS %.2f, buffer %d",
                    self.step,
                    self.last.get("reward/mean", 0),
                    self.last.get("staleness/mean", 0),
                    self.last.get("is/ess", 0),
                    len(self.buffer),
                )

    def leave(self) -> None:
        self.assembler.close()
        self.publisher.close()  # it publishes what it holds, then ends
        self.publisher.wait_idle()
        try:  # the last version, published and saved (a restart then redoes nothing)
            pub = self.publisher
            if pub.published_version != self.step or pub.saved_version != self.step:
                self.status.state = f"publishing version {self.step}"
                self._publish_now(with_state=True)
        except Exception as e:
            log.warning("final checkpoint not published: %s", e)
        self.reputation.save_all()
        self._write_final_stats()
        # a dead daemon announces nothing: leave at once (the state is saved)
        if self.node.daemon_alive() and not self.announcer.wait_idle(ANNOUNCE_TIMEOUT_S):
            log.warning("leaving before the last checkpoint announce finished")

    def close(self) -> None:
        """After the node closed: no stream handler touches the ledger any more."""
        self.receiver.close()
        self.ledger.close()
