"""What the learner knows of each author (a sampler's key): its record, its strikes, its ban, its claims.

- **Record.** An author with fewer than ``record_batches`` batches that passed a check, or with a strike not
  yet worked off, has no record: all its batches are checked (``check_rate`` once it has one, and all again
  while its token choices so far lean one way, |z| > :data:`SUSPICIOUS_Z`), the learner holds what it
  accepted from it out of training until it has one (probation: a ban drops it all), and authors without a
  record share a rate
  limit and a share of the buffer (and the learner's probation share of checking time, :mod:`.budget`), so a
  flood of fresh identities cannot crowd honest samplers out (deferred, not struck: "busy, retry later"). A
  strike owes ``record_batches`` dense checks again.
- **Strikes and bans.** Every refusal of the admission chain but flow control and staleness is a strike; at
  ``ban_strikes`` strikes that are also ``ban_strike_share`` of its checked batches the author is banned for
  the run. ``on_ban(author, reason)`` then drops what it sent that is not yet trained on; bans persist in the
  ledger (``load_bans``) across restarts.
- **Version claims.** Ordered by the batches' signed timestamps, an author's claimed versions never go back: a
  batch stamped later than another of the same author may not claim an older version (out-of-order delivery
  of honest batches stays fine).
- **Holding.** Batches are trained only once vouched for: an author with a record has its unchecked batches
  held out of training until one of its later batches passes a check (the learner releases them then, and a
  strike drops them). So a sleeper, honest for a while and hostile from some batch on, has its hostile
  batches held until the next check, which is of a hostile batch. Checks come at ``check_rate``, and also
  when the author holds ``hold_batches - 1`` batches or its oldest held one waited ``hold_s``.
- **Durable.** Each record is saved (``save(author, record)``) when a check or strike changes it and loaded
  back after a restart (:meth:`load_records`); a record never earned expires after ``record_expiry_s``
  without a batch (:meth:`expire`).
- **Typicality over time.** Each checked batch's typicality sums are added to the author's (the last ~100
  checked batches weigh, :data:`Z_DECAY`), so a bias per batch (a wrong temperature) adds up to a refusal,
  and an honest engine's own small one does not over a long run.

Thread-safe: the intake pool's threads call it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import random
import threading
import time
from collections.abc import Callable

from heterorl.protocol.net.trajectories import Deferral
from heterorl.protocol.settings import TrustSettings

CLAIMS_KEPT = 64  # an author's most recent (timestamp, version) claims, for the ordering check
# |z| of an author's checked tokens taken together beyond which all its batches are checked: an honest author
# is there ~0.3 % of the time (it costs checks, nothing else); the refusal threshold is trust.max_typicality_z
SUSPICIOUS_Z = 3.0
# each checked batch's typicality sums weigh this much less per batch checked since: an author's z is over the
# last ~1 / (1 - Z_DECAY) = 100 checked batches. Honest bfloat16 engines lean by up to ~0.2 per batch (z of a
# batch; docs/trust.md), which over all of a long run's checks would cross any threshold; over 100 it is ~2
Z_DECAY = 0.99
VOUCHED_KEPT = 4096  # batch ids that passed a check and are not yet accepted (the learner takes each at once)
NEW_AUTHOR_RETRY_S = 5.0  # how long a deferred author without a record waits: a flood's retries cost intake


@dataclasses.dataclass
class AuthorRecord:
    """One author's standing; every field persists (:meth:`to_json` / :meth:`from_json`)."""

    accepted: int = 0
    checked: int = 0
    passed: int = 0
    strikes: int = 0
    dense_left: int = 0  # checks owed at rate 1 (after a strike)
    last_reason: str = ""
    banned: str | None = None
    claims: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # sorted by timestamp
    z_num: float = 0.0  # Σ (surprise - entropy) over checked tokens
    z_var: float = 0.0  # Σ variance over the same
    earned: bool = False  # had a record once (such a record never expires)
    last_seen: float = 0.0  # wall time of its last accepted batch or check

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> AuthorRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        r = cls(**{k: v for k, v in d.items() if k in known})
        r.claims = sorted((float(t), int(v)) for t, v in r.claims)
        return r


class Reputation:
    def __init__(
        self,
        trust: TrustSettings,
        *,
        buffer_capacity: int,
        buffered_new: Callable[[], int] = lambda: 0,
        on_ban: Callable[[bytes, str], None] = lambda author, reason: None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        checks: bool = True,
        held: Callable[[bytes], tuple[int, float | None]] = lambda author: (0, None),
        save: Callable[[bytes, dict | None], None] = lambda author, record: None,
        wall: Callable[[], float] = time.time,
    ):
        """``checks=False``: nothing is spot-checked (an adapter run), so no author can earn a record: every
        author counts as having one (no probation, no rate limit for new authors, nothing held).
        ``held(author)``: how many of its batches the learner holds and the oldest one's wall time;
        ``save(author, record or None)`` persists a record (None: forget it)."""
        self.checks, self.held, self.save, self.wall = checks, held, save, wall
        self._vouched: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.trust, self.buffer_capacity, self.buffered_new = trust, buffer_capacity, buffered_new
        self.on_ban, self.clock = on_ban, clock
        self.rng = rng or random.SystemRandom()  # unpredictable: a sampler cannot tell which batch is checked
        self._lock = threading.Lock()
        self._authors: dict[bytes, AuthorRecord] = collections.defaultdict(AuthorRecord)
        rate = trust.new_author_batches_per_s
        # a burst of two records' worth: samplers starting together earn theirs at full speed; a flood of
        # fresh keys gets the rate once it is spent
        self._bucket_capacity = max(1.0, 2 * rate, 2.0 * trust.record_batches)
        self._bucket, self._bucket_at = self._bucket_capacity, clock()
        self.deferred_new = 0

    # ---- reading ----

    def record(self, author: bytes) -> AuthorRecord:
        with self._lock:
            return dataclasses.replace(self._authors.get(author) or AuthorRecord())

    def has_record(self, author: bytes) -> bool:
        with self._lock:
            return self._has_record(self._authors.get(author) or AuthorRecord())

    def _has_record(self, r: AuthorRecord) -> bool:
        """Enough passed checks, and none owed after a strike."""
        return not self.checks or (r.passed >= self.trust.record_batches and r.dense_left == 0)

    @staticmethod
    def _suspicious(r: AuthorRecord) -> bool:
        return r.z_var > 0 and abs(r.z_num / math.sqrt(r.z_var)) > SUSPICIOUS_Z

    def bans(self) -> dict[bytes, str]:
        with self._lock:
            return {a: r.banned for a, r in self._authors.items() if r.banned is not None}

    def strikes(self) -> dict[bytes, int]:
        with self._lock:
            return {a: r.strikes for a, r in self._authors.items() if r.strikes}

    def summary(self) -> dict[str, dict]:
        """Per author (hex key): batches accepted, checked, passed, strikes and the ban's reason (or None)."""
        with self._lock:
            return {
                a.hex(): {
                    "accepted": r.accepted,
                    "checked": r.checked,
                    "passed": r.passed,
                    "strikes": r.strikes,
                    "banned": r.banned,
                }
                for a, r in self._authors.items()
            }

    def load_records(self, records: dict[bytes, dict]) -> None:
        """Records saved before a restart (bans are loaded from the ledger's own table)."""
        with self._lock:
            for author, d in records.items():
                banned = self._authors[author].banned if author in self._authors else None
                self._authors[author] = AuthorRecord.from_json(d)
                self._authors[author].banned = self._authors[author].banned or banned

    def save_all(self) -> None:
        """Persist every record (on leaving: the accepted counts and claims saved with the checks lag)."""
        with self._lock:
            records = [(a, r.to_json()) for a, r in self._authors.items()]
        for a, d in records:
            self.save(a, d)

    def expire(self) -> list[bytes]:
        """Forget authors that never earned a record, are not banned and sent nothing for
        ``record_expiry_s`` (throw-away keys); returns them (the learner drops what it holds of theirs)."""
        cutoff = self.wall() - self.trust.record_expiry_s
        with self._lock:
            gone = [
                a
                for a, r in self._authors.items()
                if not r.earned and r.banned is None and r.last_seen < cutoff
            ]
            for a in gone:
                del self._authors[a]
        for a in gone:
            self.save(a, None)
        return gone

    def _saved(self, author: bytes, r: AuthorRecord) -> None:
        """Persist ``r`` (called under the lock: the save is the ledger's short transaction)."""
        self.save(author, r.to_json())

    def load_bans(self, bans: dict[bytes, str]) -> None:
        """Bans recorded before a restart."""
        with self._lock:
            for author, reason in bans.items():
                self._authors[author].banned = reason

    # ---- admission checks (each ``(body, author) -> None | reason | Deferral``) ----

    def check_banned(self, _body: dict, author: bytes) -> str | None:
        with self._lock:
            r = self._authors.get(author)
            reason = None if r is None else r.banned
        return None if reason is None else f"author banned for this run: {reason}"

    def check_rate(self, _body: dict, author: bytes) -> Deferral | None:
        """Authors without a record: a shared token bucket and a share of the buffer (flow control)."""
        if self.has_record(author):
            return None
        t = self.trust
        most = max(2 * t.record_batches, int(t.new_author_buffer_share * self.buffer_capacity), 1)
        if self.buffered_new() >= most:  # (outside the lock: it asks has_record of the buffer's authors)
            with self._lock:
                self.deferred_new += 1
            return Deferral("the learner holds all the new authors' batches it takes", NEW_AUTHOR_RETRY_S)
        with self._lock:
            now = self.clock()
            rate = self.trust.new_author_batches_per_s
            self._bucket = min(self._bucket_capacity, self._bucket + (now - self._bucket_at) * rate)
            self._bucket_at = now
            if self._bucket < 1.0:
                self.deferred_new += 1
                wait = max(NEW_AUTHOR_RETRY_S, (1.0 - self._bucket) / rate)
                return Deferral("new authors' intake is at its rate limit", wait)
            self._bucket -= 1.0
            return None

    def check_claim(self, body: dict, author: bytes) -> str | None:
        """A later-stamped batch may not claim an older version than the same author's earlier ones."""
        t, v = float(body["timestamp"]), int(body["policy_version"])
        with self._lock:
            claims = list((self._authors.get(author) or AuthorRecord()).claims)
            i = bisect.bisect_right(claims, (t, math.inf))
            earlier_max = max((cv for _, cv in claims[:i]), default=-1)
            later_min = min((cv for _, cv in claims[i:]), default=math.inf)
        if v < earlier_max:
            return f"claims version {v}, older than the version {earlier_max} it claimed in an earlier batch"
        if v > later_min:
            return f"claims version {v}, newer than the version {later_min} of a batch it stamped later"
        return None

    # ---- outcomes ----

    def should_check(self, author: bytes) -> bool:
        """Whether the author's next batch is checked: all of them while it has no record or leans one
        way; else at ``check_rate``, and always when the batches held for it are many or old enough
        (its held batches are released only by a check that passes)."""
        with self._lock:
            r = self._authors.get(author) or AuthorRecord()
            dense = not self._has_record(r) or self._suspicious(r)
            rate = 1.0 if dense else self.trust.check_rate
        if rate >= 1.0:
            return True
        n, oldest = self.held(author)
        t = self.trust
        if n >= t.hold_batches - 1 or (oldest is not None and self.wall() - oldest >= t.hold_s):
            return True
        return self.rng.random() < rate

    def take_vouched(self, batch_id: bytes) -> bool:
        """Whether ``batch_id`` passed a check (once: the learner asks as it accepts the batch). Always
        True without checks."""
        if not self.checks:
            return True
        with self._lock:
            if bytes(batch_id) not in self._vouched:
                return False
            del self._vouched[bytes(batch_id)]
            return True

    def typicality_z(self, author: bytes, num: float, var: float) -> float:
        """The author's typicality z over its checked batches so far and this one (not yet added)."""
        with self._lock:
            r = self._authors.get(author) or AuthorRecord()
            total = Z_DECAY * r.z_var + var
            return (Z_DECAY * r.z_num + num) / math.sqrt(total) if total > 0 else 0.0

    def passed_check(self, author: bytes, num: float, var: float, batch_id: bytes | None = None) -> None:
        """A check of ``batch_id`` passed: it vouches for the author's batches held before it."""
        with self._lock:
            r = self._authors[author]
            r.checked += 1
            r.passed += 1
            r.dense_left = max(0, r.dense_left - 1)
            r.z_num = Z_DECAY * r.z_num + num  # a window of ~100 checked batches, not all of them:
            r.z_var = Z_DECAY * r.z_var + var  # an engine's own small bias must not add up over a long run
            r.earned = r.earned or self._has_record(r)
            r.last_seen = self.wall()
            if batch_id is not None:
                self._vouched[bytes(batch_id)] = None
                while len(self._vouched) > VOUCHED_KEPT:
                    self._vouched.popitem(last=False)
            self._saved(author, r)

    def accepted(self, body: dict, author: bytes, *, count: bool = True) -> None:
        """A batch of the author's was accepted (``count=False``: replayed after a restart, counted then)."""
        with self._lock:
            r = self._authors[author]
            r.accepted += int(count)
            r.last_seen = self.wall()
            claim = (float(body["timestamp"]), int(body["policy_version"]))
            if claim not in r.claims:
                bisect.insort(r.claims, claim)
                del r.claims[:-CLAIMS_KEPT]

    def ban(self, author: bytes, reason: str) -> None:
        """Ban ``author`` for the run for ``reason`` (another learner of the run decided it)."""
        with self._lock:
            r = self._authors[author]
            if r.banned is not None:
                return
            r.banned = reason[:200]
            r.last_seen = self.wall()
            self._saved(author, r)
        self.on_ban(author, reason[:200])

    def strike(self, author: bytes, reason: str, *, checked: bool = True) -> str | None:
        """Count a refused batch; returns the ban's reason if this strike banned the author."""
        t = self.trust
        with self._lock:
            r = self._authors[author]
            if r.banned is not None:
                return None
            r.strikes += 1
            r.checked += int(checked)
            r.dense_left = t.record_batches
            r.last_reason = reason
            r.last_seen = self.wall()
            share = r.strikes / max(1, r.checked)
            if r.strikes < t.ban_strikes or share < t.ban_strike_share:
                self._saved(author, r)
                return None
            r.banned = f"{r.strikes} refused batches of {r.checked} checked; last: {reason}"[:200]
            banned = r.banned
            self._saved(author, r)
        self.on_ban(author, banned)
        return banned
