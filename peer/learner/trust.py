"""The learner's trust gate: which accepted batches reach training, and whose batches are refused.

One component owns all of it, with one interface to the learner role: admission (the ordered checks a batch
passes before its Ack), probation and the hold (:mod:`.holding`), authors' records and bans
(:mod:`.reputation`), the replay index (:mod:`.replay`), the spot checker (:mod:`.spotcheck`) and the checks'
share of the learner's time (:mod:`.budget`: probation's checks past theirs are deferred, held batches of
authors with a record past theirs stay held).

- Intake (the receiver's pool threads): :meth:`admit` is the admission chain, :meth:`has_room` flow control,
  :meth:`accepted` takes a batch the ledger holds: to the buffer if a check vouched for it and its author has
  a record, else held.
- The release sweep (a thread of its own, :meth:`sweep`): when training is short of data or flow control is
  full, or an author went quiet, a held batch is checked (a pass releases what its author holds); records
  never earned expire with what they hold.
- Restart: :meth:`replay` sends the ledger's pending batches through the same path as fresh ones.
- Training: :meth:`without_banned` leaves out batches whose author was banned since they were assembled.
- Publishing: :meth:`published` hands a version's weights to the spot checker.

A strike retracts what its author sent and is not trained on (held and buffered batches); a ban drops the
rest for good. The ledger hears of every drop, release and ban, so a restart holds, releases and refuses
exactly what this run did.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

from heterorl.protocol import decode
from heterorl.protocol.net.trajectories import Deferral
from heterorl.protocol.settings import RunSettings
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.errors import ProtocolError

from .budget import CheckBudget
from .buffer import Buffered, TrajectoryBuffer, staleness_refusal
from .holding import HeldBatches
from .intake import Admission, Check, Refusal
from .manifests import ManifestIndex
from .replay import ReplayIndex
from .replica import ModelReplica
from .reputation import Reputation
from .spotcheck import CHECK_RETRY_AFTER_S, SpotCheck, VersionWeights

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 0.25  # the release sweep's period (it also wakes when flow control is full)
EXPIRE_EVERY_S = 30.0  # how often records never earned are looked at for expiry
UNCHECKED_RETRY_S = 1.0  # a lineage member's wait for the writer's manifest of a version it stepped to
AHEAD_VERSIONS = 64  # a batch of a version this far beyond this learner's may wait for it to get there


class LearnerTrust:
    """The trust gate of one learner (see the module docstring).

    ``store``: the learner's chunk store (the versions it published, to check claims and spot checks
    against). ``step`` / ``published``: the trainer's version and the newest published one, read live.
    ``replica``: the model the spot checker loads versions into; None runs no spot checks (adapter runs).
    ``unchecked_versions_wait``: a lineage member's (:mod:`~heterorl.peer.daemon.learner_lineage`): a batch of
    a version it has stepped to but whose manifest from the writer it has not checked yet is deferred, not
    refused (the writer published it; the manifest is on its way). :meth:`saw_versions_from`: a lineage
    member that took the writer's state did not see the versions published while it was away, so a claim of
    one of them is not "never published" (a spot check finds it no longer held: dropped, no strike).
    """

    def __init__(
        self,
        settings: RunSettings,
        ledger: AcceptedLog,
        buffer: TrajectoryBuffer,
        store,
        *,
        step: Callable[[], int],
        published: Callable[[], int],
        reward_check: Check,
        replica: ModelReplica | None,
        pad_id: int,
        unchecked_versions_wait: bool = False,
    ):
        self.settings, self.ledger, self.buffer, self.store = settings, ledger, buffer, store
        self._step, self._published = step, published
        self._unchecked_wait = unchecked_versions_wait
        self._seen_from = -1  # versions from here on: every one published is held here (or was skipped)
        s = settings
        self.held = HeldBatches()
        self._lock = threading.RLock()  # a batch is held or released, never both
        self._release_wanted = threading.Event()  # flow control is full: the sweep releases what it can
        self.reputation = Reputation(
            s.trust,
            buffer_capacity=s.learner.buffer_batches,
            buffered_new=self._held_new,
            on_ban=self._on_ban,
            checks=replica is not None,
            held=self.held.of,
            save=ledger.save_author,
        )
        self.reputation.load_records(ledger.authors())  # records, strikes, probation: as before a restart
        self.reputation.load_bans(ledger.bans())
        self.replays = ReplayIndex()
        self.manifests = ManifestIndex(store)
        self.abandoned = 0  # batches sampled on weights this learner does not hold: dropped, no strike
        self._retry_at: dict[bytes, float] = {}  # an author whose held check failed on our side: not before
        # the checks' share of the learner's time: probation's own, and the rest for authors with a record
        self.budget = CheckBudget(s.trust.check_share, s.trust.probation_check_share)
        self.spot_check = None if replica is None else self._spot_check(replica, pad_id)
        checks: list[tuple[str, Check]] = [
            ("banned", self.reputation.check_banned),  # cheapest first
            ("busy", self._check_budget),  # before the rate: a deferred batch takes none of it
            ("rate", self.reputation.check_rate),
            ("rows", self._check_rows),
            ("version", self._check_version),
            ("staleness", self._check_staleness),
            ("replay", self.replays),
            ("reward", reward_check),
        ]
        if self.spot_check is not None:
            checks.append(("spot check", self.spot_check))
        self.admit = Admission(checks, on_strike=self._on_strike, no_strike=("banned", "staleness"))

    def _spot_check(self, replica: ModelReplica, pad_id: int) -> SpotCheck:
        s = self.settings

        def load(version: int) -> bytes | None:
            try:
                return self.store.assemble(version) if self.store.has_version(version) else None
            except (KeyError, ProtocolError):
                return None

        return SpotCheck(
            replica,
            VersionWeights(load, s.trust.check_versions),
            self.reputation,
            s.trust,
            pad_id=pad_id,
            temperature=s.sampling.temperature,
            top_p=s.sampling.top_p,
            run_id=s.run_id,
            budget=self.budget,
        )

    # ---- intake ----

    def has_room(self) -> bool:
        """Flow control: the batches accepted and not yet trained on, the buffer's and those held for
        authors with a record, within ``learner.buffer_batches`` (probation has its own bound, the new
        authors' share). Held batches count: else a sender that ignores "busy" has many accepted while
        the buffer has room, and takes the freed room from those that wait."""
        room = len(self.buffer) + self.held.count(self.reputation.has_record) < self.buffer.capacity
        if not room:
            self._release_wanted.set()  # the release sweep checks a held batch now
        return room

    def accepted(self, body: dict, author: bytes, raw: bytes = b"") -> None:
        """A batch the ledger now holds (the receiver's ``on_accept``)."""
        self.reputation.accepted(body, author)
        self.replays.add(body, author)
        item = Buffered(body["batch_id"], author, body, time.time(), hashlib.sha256(raw).digest())
        self._admit(item, vouched=self.reputation.take_vouched(item.batch_id))

    def _check_budget(self, _body: dict, author: bytes) -> Deferral | None:
        """An author without a record has every batch checked: deferred while probation's share of the
        learner's time is spent (the spot check asks the budget again as it starts: this is the cheap early
        answer, before the intake checks and the new authors' rate are spent on the batch)."""
        if self.spot_check is None or self.reputation.has_record(author):
            return None
        if self.budget.allows(probation=True):
            return None
        return Deferral(
            "busy: the checks of authors without a record have taken their share of the learner's time",
            self.budget.retry_after_s(probation=True),
        )

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

    def _check_version(self, body: dict, author: bytes) -> str | Refusal | Deferral | None:
        """The weights a batch was sampled on: the signed manifest it names (``manifest_sha256``) is the one
        this learner holds for the version it claims, and an author's claims never go back in time.

        A manifest held here under another version is a lie (a strike). A manifest not held here is weights
        this learner's lineage abandoned (a writer's last versions that its successor never held), pruned, or
        a forgery: dropped without a strike, counted (nothing of it is trained, so a lie gains nothing); a
        version this learner has not reached yet waits (deferred) while it may still get there. A batch that
        names no manifest (an older sampler) is judged by its version number alone."""
        v, named = body["policy_version"], body.get("manifest_sha256")
        if named is None:
            held = self.store.versions()
            if (
                held
                and max(held[0], self._seen_from) <= v <= self._published()
                and not self.store.has_version(v)
            ):
                return f"claims version {v}, which was never published"
            return self.reputation.check_claim(body, author)
        holds = self.manifests.version_of(named)
        if holds is not None and holds != v:
            return f"claims version {v}, but names the manifest of version {holds}"
        if holds is None:
            if self._published() < v <= self._step() + AHEAD_VERSIONS and self.manifests.hash_of(v) is None:
                return Deferral(f"version {v}: its manifest is not held here yet", UNCHECKED_RETRY_S)
            with self._lock:
                self.abandoned += 1
            return Refusal(f"sampled on weights this learner does not hold (version {v}, manifest "
                           f"{bytes(named).hex()[:16]}: abandoned by the lineage, pruned, or never signed)",
                           strike=False)  # fmt: skip
        return self.reputation.check_claim(body, author)

    def honour_ban(self, author: bytes, reason: str, by: bytes) -> None:
        """Another learner of the run banned ``author`` (its signed heartbeat says so): banned here too."""
        if self.reputation.check_banned({}, author) is None:
            self.reputation.ban(author, f"banned by learner {by.hex()[:16]}: {reason}"[:200])

    def saw_versions_from(self, version: int) -> None:
        """This learner took a lineage's state at ``version``: the versions before it that it does not hold
        were published while it was away, not skipped."""
        self._seen_from = max(self._seen_from, int(version))

    def _check_staleness(self, body: dict, _author: bytes) -> str | Deferral | None:
        v = body["policy_version"]
        if self._unchecked_wait and self._published() < v <= self._step():
            return Deferral(f"version {v}: its manifest is not checked here yet", UNCHECKED_RETRY_S)
        return staleness_refusal(
            self._step(), body["policy_version"], self._published(), self.settings.learner.max_staleness
        )

    def _on_strike(self, author: bytes, check: str, reason: str) -> None:
        banned = self.reputation.strike(author, f"{check}: {reason}", checked=check == "spot check")
        if banned is not None or self.reputation.check_banned({}, author) is not None:
            return
        # a strike retracts what the author sent and is not trained on: the batches held for it (no check
        # vouched for them) and those waiting in the buffer
        with self._lock:
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
        with self._lock:
            self.held.take(author)
            self.buffer.drop_author(author)
        dropped = self.ledger.drop(self.ledger.pending_of(author), f"author banned: {reason}", now)
        log.warning(
            "banned %s for the run (%s); dropped %d of its batches not yet trained on",
            author.hex()[:16],
            reason,
            dropped,
        )

    def _admit(self, item: Buffered, vouched: bool) -> None:
        """An accepted batch (fresh, or replayed after a restart) to training or held: released with what
        its author holds if a check of it passed and the author has a record; else held until one does."""
        author = item.author
        with self._lock:
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
        with self._lock:
            released = [*self.held.take(author), *also]
            if released:
                self.ledger.mark_released([b.batch_id for b in released])
            for b in released:
                self.buffer.put(b)

    # ---- restart ----

    def replay(self, applied_after: int) -> int:
        """Accepted batches not in the saved state (step ``applied_after``) go through the same admission
        as when they arrived: a banned author's are dropped, those released before (vouched for, or trained
        on) go to training, the rest are held again until a check vouches for them. How many there were."""
        return self.readmit(self.ledger.pending(applied_after=applied_after))

    def readmit(self, items) -> int:
        """Ledger items (accepted, pending again) through the admission of :meth:`replay`; how many."""
        held = 0
        for it in items:
            _, body, author = decode(it.data, "TrajectoryBatch", run_id=self.settings.run_id)
            self.reputation.accepted(body, author, count=False)
            self.replays.add(body, author)
            vouched = it.released or not self.reputation.checks  # (an adapter run holds nothing)
            item = Buffered(it.batch_id, author, body, it.received_at, hashlib.sha256(it.data).digest())
            self._admit(item, vouched=vouched)
            held += not it.released
        if items:
            log.info(
                "replaying %d accepted batch(es) not in my saved state (%d held until a check vouches)",
                len(items),
                held,
            )
        return len(items)

    # ---- the release sweep (a thread of its own): held batches released on demand ----

    def sweep(self, stop: threading.Event) -> None:
        """Until ``stop``: releases held batches when they are wanted (:meth:`release_on_demand`); now and
        then, records never earned expire with what they hold."""
        last_expiry = time.monotonic()
        while not stop.is_set():
            self._release_wanted.wait(SWEEP_EVERY_S)
            self._release_wanted.clear()
            try:
                self.release_on_demand()
                if time.monotonic() - last_expiry >= EXPIRE_EVERY_S:
                    last_expiry = time.monotonic()
                    self.expire()
            except Exception:  # a sweep that fails is retried; it must not take the learner down
                log.exception("release sweep failed")

    def release_on_demand(self) -> None:
        """When flow control is full, or the buffer holds less than the next update takes and the author with
        a record holding the most batches holds what it lacks, that author has its newest batch checked (a
        pass releases them all); an author whose oldest held batch waited ``trust.hold_s`` has its newest
        checked too."""
        if self.spot_check is None:
            return
        now, hold_s = time.time(), self.settings.trust.hold_s
        candidates = [
            (a, *self.held.of(a))
            for a in self.held.authors()
            if self.reputation.has_record(a)
            and self.reputation.check_banned({}, a) is None
            and self._retry_at.get(a, 0.0) <= now  # its last check failed on our side: later
        ]
        if not candidates or self.budget.wait_s(probation=False) > 0:  # their checks' share of time is spent
            return
        for author, _, oldest in candidates:  # quiet authors: nothing arrives that would be checked
            if oldest is not None and now - oldest >= hold_s:
                self.check_held(author)
        wanted = self.settings.learner.prompts_per_update
        short = wanted - self.buffer.groups()  # groups the next update lacks
        full = len(self.buffer) + sum(n for _, n, _ in candidates) >= self.buffer.capacity
        author = max(candidates, key=lambda c: (c[1], -(c[2] or now)))[0]
        # short of data: check once what is held completes the next update (one check for all of it, not one
        # per batch as it trickles in: checks cost time, and held batches wait at most hold_s anyway)
        if full or 0 < short <= self.held.groups(author):
            self.check_held(author)

    def check_held(self, author: bytes) -> None:
        """Check the newest batch ``author`` holds: a pass releases all it holds, a refusal is a strike
        (which drops them), an unverifiable one drops them without one; a check that failed on this side
        (the checker's own error) keeps them held, and the sweep leaves the author for
        ``CHECK_RETRY_AFTER_S`` (others' held batches go first)."""
        newest = self.held.newest(author)
        if newest is None:
            return
        verdict = self.spot_check.check(newest.body, author)
        if verdict.busy:  # the checks' share of time is spent: they stay held, checked later
            return
        if not verdict.retry:
            self._retry_at.pop(author, None)
        if verdict.reason is None:
            self.reputation.take_vouched(newest.batch_id)
            self._release_held(author)
            return
        if verdict.retry:  # the checker's own failure: this author's batches wait, the others go on
            self._retry_at[author] = time.time() + CHECK_RETRY_AFTER_S
            return
        self.admit.count_refusal("spot check (held)")
        if verdict.strike:  # the strike drops what the author holds, this batch with it
            self._on_strike(author, "spot check", verdict.reason)
            return
        with self._lock:  # its version is gone: too stale to check, or to train on
            gone = [b.batch_id for b in self.held.take(author)]
        self.ledger.drop(gone, f"held and no longer checkable: {verdict.reason}", time.time())
        log.info("dropped %d held batch(es) of %s: %s", len(gone), author.hex()[:16], verdict.reason)

    def expire(self) -> None:
        for author in self.reputation.expire():
            with self._lock:
                gone = [b.batch_id for b in self.held.take(author)]
            if gone:
                self.ledger.drop(gone, "its author never earned a record and went quiet", time.time())
            log.info(
                "forgot %s (no record earned, quiet); dropped %d held batch(es)", author.hex()[:16], len(gone)
            )

    # ---- training and publishing ----

    def without_banned(self, batches: list[Buffered]) -> list[Buffered]:
        """``batches`` less those of authors banned since they were assembled (the ledger drops those)."""
        bans = self.reputation.bans()
        gone = [b.batch_id for b in batches if b.author in bans]
        if not gone:
            return batches
        self.ledger.drop(gone, "author banned", time.time())
        log.info("left %d batch(es) of banned authors out of the next update", len(gone))
        return [b for b in batches if b.author not in bans]

    def published(self, version: int, weights: dict) -> None:
        """A version's weights, as published: what the spot checker checks claims of it against."""
        if self.spot_check is not None:
            self.spot_check.versions.put(version, weights)

    def wake(self) -> None:
        """Have the release sweep look now (flow control is full)."""
        self._release_wanted.set()

    def save(self) -> None:
        self.reputation.save_all()

    # ---- what it did ----

    def stats(self) -> dict[str, float]:
        """What the checks did: batches checked and refused, their cost, bans, held, deferred new authors."""
        check = {**self.spot_check.stats(), **self.budget.stats()} if self.spot_check is not None else {}
        return {
            **check,
            "trust/banned": len(self.reputation.bans()),
            "trust/held": len(self.held),  # accepted, waiting for a check to vouch for them
            "trust/deferred_new": self.reputation.deferred_new,
            "trust/abandoned_weights": self.abandoned,
        }

    def final(self) -> dict:
        """The run's trust record for ``final_stats.json``."""
        return {
            "refused_by_check": dict(self.admit.refused),
            "deferred_by_check": dict(self.admit.deferred),
            "bans": {a.hex(): reason for a, reason in self.reputation.bans().items()},
            "authors": self.reputation.summary(),
            "reproduced": self.spot_check.reproduced_by_author() if self.spot_check is not None else {},
            **self.stats(),
        }
