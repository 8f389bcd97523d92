"""What the learner knows of each author (a sampler's key): its record, its strikes, its ban, its claims.

- **Record.** An author with fewer than ``record_batches`` batches that passed a check, or with a strike not
  yet worked off, has no record: all its batches are checked (``check_rate`` once it has one, and all again
  while its token choices so far lean one way, |z| > :data:`SUSPICIOUS_Z`), the learner holds what it
  accepted from it out of training until it has one (probation: a ban drops it all), and authors without a
  record share a rate
  limit and a share of the buffer, so a flood of fresh identities cannot crowd honest samplers out (deferred,
  not struck: "busy, retry later"). A strike owes ``record_batches`` dense checks again.
- **Strikes and bans.** Every refusal of the admission chain but flow control and staleness is a strike; at
  ``ban_strikes`` strikes that are also ``ban_strike_share`` of its checked batches the author is banned for
  the run. ``on_ban(author, reason)`` then drops what it sent that is not yet trained on; bans persist in the
  ledger (``load_bans``) across restarts.
- **Version claims.** Ordered by the batches' signed timestamps, an author's claimed versions never go back: a
  batch stamped later than another of the same author may not claim an older version (out-of-order delivery
  of honest batches stays fine).
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
NEW_AUTHOR_RETRY_S = 5.0  # how long a deferred author without a record waits: a flood's retries cost intake


@dataclasses.dataclass
class AuthorRecord:
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
    ):
        """``checks=False``: nothing is spot-checked (an adapter run), so no author can earn a record: every
        author counts as having one (no probation, no rate limit for new authors)."""
        self.checks = checks
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
        with self._lock:
            r = self._authors.get(author) or AuthorRecord()
            dense = not self._has_record(r) or self._suspicious(r)
            rate = 1.0 if dense else self.trust.check_rate
        return rate >= 1.0 or self.rng.random() < rate

    def typicality_z(self, author: bytes, num: float, var: float) -> float:
        """The author's typicality z over its checked batches so far and this one (not yet added)."""
        with self._lock:
            r = self._authors.get(author) or AuthorRecord()
            total = Z_DECAY * r.z_var + var
            return (Z_DECAY * r.z_num + num) / math.sqrt(total) if total > 0 else 0.0

    def passed_check(self, author: bytes, num: float, var: float) -> None:
        with self._lock:
            r = self._authors[author]
            r.checked += 1
            r.passed += 1
            r.dense_left = max(0, r.dense_left - 1)
            r.z_num = Z_DECAY * r.z_num + num  # a window of ~100 checked batches, not all of them:
            r.z_var = Z_DECAY * r.z_var + var  # an engine's own small bias must not add up over a long run

    def accepted(self, body: dict, author: bytes) -> None:
        with self._lock:
            r = self._authors[author]
            r.accepted += 1
            bisect.insort(r.claims, (float(body["timestamp"]), int(body["policy_version"])))
            del r.claims[:-CLAIMS_KEPT]

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
            share = r.strikes / max(1, r.checked)
            if r.strikes < t.ban_strikes or share < t.ban_strike_share:
                return None
            r.banned = f"{r.strikes} refused batches of {r.checked} checked; last: {reason}"[:200]
            banned = r.banned
        self.on_ban(author, banned)
        return banned
