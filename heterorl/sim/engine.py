"""The discrete-event simulation of one run: one or more learners and many heterogeneous, churning samplers.

Each sampler behaves as ``peer/daemon/sampler.py`` does: between batches it switches to the newest published
checkpoint, generates a batch, puts it in its durable outbox (generation pauses at ``max_pending`` queued
batches) and sends the oldest queued batch; a "busy" reply is retried after the real full-jitter backoff
(``protocol.outbox.backoff_ceiling``). A sampler that leaves loses the batch it was generating, keeps its
outbox and resends it when it comes back.

What a checkpoint switch costs (``_fetch_bytes``), one of two models:

- ``delta_ratio`` (sparse lossless bf16 deltas, ``protocol/wire/delta.py``; the
  ratio ``heterorl bench weights``
  measures is one learner update's compressed delta over the full checkpoint): a sampler holding version ``h``
  that wants ``t`` fetches the deltas in between, ``delta_ratio × (t - h)`` of the checkpoint (versions are
  learner steps, so a version published every ``publish_every`` updates costs that many updates' deltas: an
  upper bound, a word changed twice travels once), or the full checkpoint when that is not smaller, or when
  more than ``delta_bases`` published versions behind (the run's ``learner.deltas``; None: no limit). A
  newcomer fetches the full checkpoint.
- ``changed_frac`` (the older chunk model): each update changes each chunk with this probability; a switch
  fetches the chunks that changed since the held version.

By default a sampler fetches between batches and waits for the fetch (``background_fetch`` off). With
``background_fetch`` it keeps generating with the version it holds while the next one downloads, and the stop
rule applies: it does not start a batch while the newest published version is more than ``max_lag`` published
versions (as the daemon counts: learner steps / ``publish_every``) ahead of the one it holds ("paused
(behind)"; -1: never), nor while the learner's last answer was "busy" and its retry time has not come ("paused
(busy)", ``busy_pause``); it resumes when it caught up.

The learner behaves as ``peer/daemon/learner.py`` does: it admits a batch by the real staleness rule
(``staleness_refusal``), holds it in the real bounded ``TrajectoryBuffer`` ("busy" when full), takes
``prompts_per_update`` prompt groups per update, buckets staleness with the real ``staleness_bucket``, and
publishes a checkpoint every ``publish_every`` updates (training pauses while it publishes).

Learner peers (``learners`` > 1) train one lineage as ``peer/daemon/learner_lineage.py`` does. Each sampler
sends to one learner, the first in the real rendezvous order (``rendezvous_order``) of its index's key; each
learner has its own buffer and "busy" replies, and the staleness rule uses the lineage's version, which every
learner holds. A version is one collaborative step: when any learner has a full update, every learner that
has one takes it (so a version trains on up to ``learners`` updates of ``prompts_per_update`` groups each: N
learners consume up to N times the data per version, as in the real code, where each learner contributes a
whole update of its own); each computes its gradient in parallel (``update_s`` with its own jitter) and the
exchange starts when the slowest of them is done. Every learner has a link of its own,
``learner_link_bytes_per_s`` each way (full duplex); the writer's is the bottleneck: the members upload at
once, but the writer's downlink takes every part, and its uplink sends the commit to each of the N - 1
members. With n members holding an update (the writer aside) and ``G = gradient_bytes`` (float32, 4 bytes a
parameter), a version's exchange (``SimConfig.exchange_s``) takes:

- ``exchange="dense"``: ``(n + 2 (N - 1)) G / link + rtt``: a float32 gradient in
  from each member with data,
  and out to every member the commit's parameter update and combined gradient (``3 (N - 1) G`` when all have
  data); no codec time.
- ``exchange="sparse"`` (the default, as the run's): ``codec_s + n P / link + (N - 1) P / link + rtt`` with
  ``P = exchange_ratio × G`` (what ``heterorl bench exchange`` measures): a compressed part in from each
  member with data, and the writer's commit, the combined update compressed again to one part's size, out to
  every member. ``codec_s = 2 × codec_s_per_gb × G / 1e9``: two encode + decode pairs on the critical path (a
  member's part, then the writer's commit).

Without ``overlap`` the round closes when its exchange is done and the next one opens then. With ``overlap``
the exchange runs while the next update is computed: a round's exchange starts when its slowest gradient is
done and the exchange before it has completed (one in flight), and the learners start the next round at once
if they have data; a round computed while the exchange before it is still in flight waits for it, and so do
the learners. The version advances when its exchange completes; rows' staleness is counted then, either way. A
learner without data takes no part and waits for the commit; data that arrives during a round waits for the
next one. The writer alone publishes, at the version boundary, and serves checkpoints; training pauses while
it publishes, as above (with ``overlap``: a round computing stops for ``publish_s``, and no exchange or round
starts). Not modelled: hashing and combining the parts, links of different speeds, learners leaving, and a
sampler's failover to another learner. With one learner there is no exchange (the exchange settings and
``overlap`` do nothing) and the run is the single learner's above, event for event.

Links are modelled per peer: a fetch takes ``rtt + bytes / downlink`` and its bytes (full or delta alike) are
served by the learner and up to ``providers - 1`` random peers that already hold the whole target version,
which is where upload bytes are charged. Two stated simplifications: a peer serves a version only once it
holds all of it (real peers re-serve chunks while still downloading), and provider uplinks are not a
bottleneck.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
import random

from heterorl.peer.learner.buffer import Buffered, staleness_refusal
from heterorl.protocol.net.trajectories import LearnerAddress, rendezvous_order
from heterorl.protocol.storage.outbox import backoff_ceiling
from heterorl.protocol.wire.staleness import staleness_bucket

from .config import Batch, SimConfig, SimLearner, SimSampler
from .fleet import HardwareClass, draw_peers
from .results import summarise


def label(cfg: SimConfig) -> str:
    """``1000 samplers``, or ``1000 samplers, 4 learners``."""
    return f"{cfg.samplers} samplers" + (f", {cfg.learners} learners" if cfg.learners > 1 else "")


def spread_samplers(samplers: int, learners: int) -> list[int]:
    """The learner each sampler sends to: the first in the real rendezvous order of a key made of its index,
    over learner keys whose order is their index (learner 0, the lowest key, writes). Deterministic, and an
    even split up to the hash's spread."""
    if learners == 1:
        return [0] * samplers
    addresses = [LearnerAddress(j.to_bytes(32, "big"), f"learner-{j}", ()) for j in range(learners)]
    return [
        int.from_bytes(rendezvous_order(i.to_bytes(32, "big"), addresses)[0].key, "big")
        for i in range(samplers)
    ]


@dataclasses.dataclass
class _Round:
    """A round of learner peers in the overlap model: from its learners' computing to its commit."""

    parts: list[tuple[SimLearner, list[Buffered]]]
    compute: dict[int, float]  # learner index -> seconds of its gradient
    start: float
    nbytes: int  # through the writer's link
    exchange_s: float
    due: float  # when the slowest gradient is done (later if a publish paused the computing)
    publish_at: float | None = None  # the writer's publish before its exchange (at most one), if any
    paused: bool = False  # that publish paused its computing
    computed: float | None = None
    handoff: float = 0.0  # when its exchange started


class Simulation:
    """``Simulation(cfg, fleet, batch_bytes, chunk_sizes).run(progress)`` -> result dict."""

    def __init__(
        self, cfg: SimConfig, fleet: tuple[HardwareClass, ...], batch_bytes: int, chunk_sizes: list[int]
    ) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.batch_bytes = batch_bytes
        self.chunk_sizes = chunk_sizes
        self.chunk_mean = sum(chunk_sizes) / len(chunk_sizes)
        self.samplers = [
            SimSampler(i, s) for i, s in enumerate(draw_peers(fleet, cfg.samplers, self.rng, cfg.spread))
        ]
        self.events: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.t_start = cfg.warmup_h * 3600
        self.t_end = cfg.hours * 3600
        # learner(s): the lineage's version, state and counters; each learner's intake
        self.learners = [SimLearner(j, cfg.buffer_batches) for j in range(cfg.learners)]
        for s, j in zip(self.samplers, spread_samplers(cfg.samplers, cfg.learners), strict=True):
            s.learner = j
            self.learners[j].samplers += 1
        self.step = 0
        self.parts = 0  # learner updates trained (inside the window): one per version with one learner
        self.exchange_bytes = 0  # through the writer's link (inside the window)
        self.exchange_s = 0.0  # seconds of exchanges, from their start to the commit (inside the window)
        self.round_time = collections.Counter()  # "computing", "exchanging": the lineage's rounds
        # overlap (learner peers only): the round computing or waiting for its exchange; the one exchanging
        self.pipelined = cfg.overlap and cfg.learners > 1
        self.computing: _Round | None = None
        self.exchanging: _Round | None = None
        self.publishing = False
        self.published = 0  # newest version samplers can find
        self.learner_state, self.learner_since = "waiting", 0.0
        self.learner_time = collections.Counter()
        self.learner_up = 0
        self.holders: dict[int, list[int]] = {0: []}  # version -> sampler indices that hold it
        self.stale = collections.Counter()
        self.stale_values: list[int] = []
        self.gen_lag: list[int] = []  # newest published minus held version, when a batch starts
        self.counts = collections.Counter()

    # ---- event queue ----

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn, args))

    def _in_window(self) -> bool:
        return self.now >= self.t_start

    def _set_state(self, s: SimSampler, state: str) -> None:
        lo = max(s.state_since, self.t_start)
        if self.now > lo:
            s.time[s.state] += self.now - lo
        s.state, s.state_since = state, self.now

    def _set_learner(self, state: str) -> None:
        lo = max(self.learner_since, self.t_start)
        if self.now > lo:
            self.learner_time[self.learner_state] += self.now - lo
        self.learner_state, self.learner_since = state, self.now

    # ---- samplers ----

    def join(self, s: SimSampler) -> None:
        s.online = True
        self._set_state(s, "joining")
        self.at(self.now + self.cfg.join_s, self.ready, s, s.epoch)
        if self.cfg.churn and math.isfinite(s.spec.cls.session_h):
            self.at(
                self.now + self.rng.expovariate(1 / (s.spec.cls.session_h * 3600)), self.leave, s, s.epoch
            )
        if s.outbox:
            self._send(s)

    def leave(self, s: SimSampler, epoch: int) -> None:
        if epoch != s.epoch:
            return
        if s.state == "generating":
            self.counts["generations_lost_to_churn"] += self._in_window()
        s.online, s.sending, s.waiting, s.fetching = False, False, False, False
        s.epoch += 1
        self._set_state(s, "offline")
        self.at(self.now + self.rng.expovariate(1 / (s.spec.cls.offline_h * 3600)), self.join, s)

    def _fetch_bytes(self, held: int | None, target: int) -> int:
        """Bytes to fetch from version ``held`` to ``target`` (see the module docstring for both models)."""
        n = len(self.chunk_sizes)
        full = sum(self.chunk_sizes)
        if held is None:
            return full
        if self.cfg.delta_ratio is not None:
            behind = (target - held) / self.cfg.publish_every  # published versions
            if self.cfg.delta_bases is not None and behind > self.cfg.delta_bases:
                return full
            deltas = self.cfg.delta_ratio * (target - held) * self.cfg.model_bytes
            return int(deltas) if deltas < full else full
        # a chunk is unchanged over k versions with probability (1 - changed_frac) ** k
        p = 1 - (1 - self.cfg.changed_frac) ** (target - held)
        if p >= 1:
            return sum(self.chunk_sizes)
        # binomial(n, p), by its normal approximation
        changed = round(min(n, max(0.0, self.rng.gauss(n * p, math.sqrt(n * p * (1 - p))))))
        return int(changed * self.chunk_mean)

    def _charge_providers(self, version: int, nbytes: int) -> None:
        holders = self.holders.get(version, [])
        picks: list[int | None] = [None]  # the learner always serves
        for _ in range(min(self.cfg.providers - 1, len(holders))):
            i = holders[self.rng.randrange(len(holders))]
            if self.samplers[i].online:
                picks.append(i)
        share = nbytes / len(picks)
        if not self._in_window():
            return
        for i in picks:
            if i is None:
                self.learner_up += share
            else:
                self.samplers[i].up_bytes += share

    def _start_fetch(self, s: SimSampler) -> None:
        """Fetch the newest published version if it is newer than what the sampler holds (one at a time)."""
        if s.fetching or (s.version is not None and self.published <= s.version):
            return
        target = self.published
        nbytes = self._fetch_bytes(s.version, target)
        s.fetching = True
        if self._in_window():
            s.down_bytes += nbytes
            self.counts["fetched_full" if nbytes >= sum(self.chunk_sizes) else "fetched_delta"] += 1
        self._charge_providers(target, nbytes)
        self.at(self.now + s.spec.rtt_s + nbytes / s.spec.down_Bps, self.fetched, s, s.epoch, target)

    def _lag(self, s: SimSampler) -> int:
        """Published versions between the held one and the newest (versions are learner steps)."""
        return (self.published - s.version) // self.cfg.publish_every

    def _pause(self, s: SimSampler) -> str | None:
        """The stop rule (background fetch only): why not to start a batch now, or None."""
        cfg = self.cfg
        if not cfg.background_fetch:
            return None
        if cfg.max_lag >= 0 and self._lag(s) > cfg.max_lag:
            return "paused (behind)"
        if cfg.busy_pause and self.now < s.busy_until:
            return "paused (busy)"
        return None

    def _wake(self, s: SimSampler, epoch: int) -> None:
        """What a paused sampler waits for happened: look again (a generating one looks when done)."""
        if epoch == s.epoch and s.state in ("fetching", "paused (behind)", "paused (busy)"):
            self.ready(s, epoch)

    def ready(self, s: SimSampler, epoch: int) -> None:
        """Between batches: switch checkpoint if a newer one is published, else generate (or pause)."""
        if epoch != s.epoch:
            return
        self._start_fetch(s)
        if s.fetching and (s.version is None or not self.cfg.background_fetch):
            self._set_state(s, "fetching")
            return
        pause = self._pause(s)
        if pause is not None:
            self._set_state(s, pause)
            if pause == "paused (busy)":
                self.at(s.busy_until, self._wake, s, epoch)
            return
        if len(s.outbox) >= self.cfg.max_pending:
            s.waiting = True
            self._set_state(s, "outbox full")
            return
        self._set_state(s, "generating")
        if self._in_window():
            self.gen_lag.append(self._lag(s))
        rows = self.cfg.prompts_per_batch * self.cfg.group_size
        tokens = rows * self.cfg.completion_tokens * self.rng.lognormvariate(0.0, 0.15)
        self.at(self.now + tokens / s.spec.tokens_per_s, self.generated, s, epoch, s.version)

    def fetched(self, s: SimSampler, epoch: int, version: int) -> None:
        if epoch != s.epoch:
            return
        s.fetching = False
        s.version = version
        self.holders.setdefault(version, []).append(s.idx)
        self.counts["checkpoint_switches"] += self._in_window()
        if self.cfg.background_fetch and s.state != "joining":
            self._start_fetch(s)  # the daemon's watcher goes straight on to a newer version
        self._wake(s, epoch)

    def generated(self, s: SimSampler, epoch: int, version: int) -> None:
        if epoch != s.epoch:
            return
        s.outbox.append(Batch(version, self.cfg.prompts_per_batch, self.batch_bytes))
        self.counts["batches_generated"] += self._in_window()
        self._send(s)
        self.ready(s, epoch)

    def _send(self, s: SimSampler) -> None:
        if s.sending or not s.outbox or not s.online:
            return
        s.sending = True
        b = s.outbox[0]
        if self._in_window():
            s.up_bytes += b.nbytes
        self.at(self.now + s.spec.rtt_s / 2 + b.nbytes / s.spec.up_Bps, self.arrive, s, s.epoch, b)

    def arrive(self, s: SimSampler, epoch: int, b: Batch) -> None:
        if epoch != s.epoch:  # it left mid-send: the batch stays in its durable outbox
            return
        reply = self.offer(b, self.learners[s.learner])
        self.at(self.now + s.spec.rtt_s / 2, self.replied, s, epoch, b, reply)

    def replied(self, s: SimSampler, epoch: int, b: Batch, reply: str) -> None:
        if epoch != s.epoch:
            return
        s.sending = False
        if reply == "busy":
            b.attempts += 1
            retry = self.now + self.rng.uniform(0, backoff_ceiling(b.attempts))
            s.busy_until = retry
            self.at(retry, self._retry, s, epoch)
            return
        s.outbox.popleft()
        if reply == "accepted":
            s.busy_until = 0.0  # as the daemon's sender: an Ack ends the learner's "busy"
        if s.waiting:
            s.waiting = False
            self.ready(s, epoch)
        elif s.state == "paused (busy)" and not s.busy_until:
            self.ready(s, epoch)
        self._send(s)

    def _retry(self, s: SimSampler, epoch: int) -> None:
        if epoch == s.epoch:
            self._send(s)

    # ---- learner ----

    def offer(self, b: Batch, learner: SimLearner) -> str:
        win = self._in_window()
        if staleness_refusal(self.step, b.version, self.published, self.cfg.max_staleness):
            self.counts["batches_refused_stale"] += win
            return "refused"
        if not learner.buffer.has_room():
            self.counts["busy_replies"] += win
            return "busy"
        self.counts["batches_accepted"] += win
        body = {"policy_version": b.version, "rows": [{"group": g} for g in range(b.groups)]}
        learner.buffer.put(Buffered(b"", b"", body, self.now))
        if self.pipelined:
            self._open_round()
        elif self.learner_state == "waiting":
            self._train()
        return "accepted"

    def _charge(self, counter: collections.Counter, state: str, t0: float, t1: float) -> None:
        """Add the part of ``[t0, t1]`` inside the measured window to ``counter[state]``."""
        lo, hi = max(t0, self.t_start), min(t1, self.t_end)
        if hi > lo:
            counter[state] += hi - lo

    def _train(self) -> None:
        """Open a round if any learner has a full update: each that has one takes it and computes."""
        parts = []
        for ln in self.learners:
            batches = ln.buffer.take_groups(self.cfg.prompts_per_update, timeout=0)
            if batches is not None:
                ln.in_update = batches
                parts.append((ln, batches))
        if not parts:
            self._set_learner("waiting")
            return
        self._set_learner("training")
        compute = {ln.idx: self.cfg.update_s * self.rng.lognormvariate(0.0, 0.05) for ln, _ in parts}
        done = computed = self.now + max(compute.values())
        nbytes = self.cfg.exchange_bytes(sum(ln.idx != 0 for ln, _ in parts))  # learner 0 writes
        if self.cfg.learners > 1:  # SimConfig.exchange_s (codec_s is 0.0 dense: today's sum, bit for bit)
            link = self.cfg.learner_link_bytes_per_s
            done = computed + self.cfg.codec_s + nbytes / link + self.cfg.learner_rtt_s
        for ln in self.learners:
            d = compute.get(ln.idx, 0.0)
            self._charge(ln.time, "computing", self.now, self.now + d)
            self._charge(ln.time, "in round", self.now + d, done)
        self._charge(self.round_time, "computing", self.now, computed)
        self._charge(self.round_time, "exchanging", computed, done)
        self.at(done, self._trained, parts, nbytes, done - computed)

    def _trained(
        self, parts: list[tuple[SimLearner, list[Buffered]]], nbytes: int, exchange_s: float
    ) -> None:
        self._commit(parts, nbytes, exchange_s)
        if self.step % self.cfg.publish_every == 0:
            self._set_learner("publishing")
            self.at(self.now + self.cfg.publish_s, self._published, self.step)
        else:
            self._train()

    def _commit(self, parts: list[tuple[SimLearner, list[Buffered]]], nbytes: int, exchange_s: float) -> None:
        """A version is committed: its rows' staleness is counted against the version they trained on."""
        win = self._in_window()
        for ln, batches in parts:
            if self.pipelined:
                del ln.in_update[: len(batches)]  # the next round's batches, taken since, stay
            else:
                ln.in_update = []
            for b in batches:
                lag = self.step - b.body["policy_version"]
                if win:
                    self.stale[staleness_bucket(lag)] += 1
                    self.stale_values.append(lag)
            ln.parts += win
            self.parts += win
        self.step += 1
        self.counts["updates"] += win
        if win:
            self.exchange_bytes += nbytes
            self.exchange_s += exchange_s

    def _published(self, version: int) -> None:
        self.holders.setdefault(version, [])
        self.at(self.now + self.cfg.announce_s, self._announced, version)
        if self.pipelined:
            self.publishing = False
            self._start_exchange()
            self._open_round()
        else:
            self._train()

    # ---- learner peers with overlap: a version's exchange runs while the next update is computed ----

    def _open_round(self) -> None:
        """Start computing a round if no round is computing or waiting for its exchange, the writer is not
        publishing, and any learner has a full update."""
        if self.computing is None and not self.publishing:
            parts = []
            for ln in self.learners:
                batches = ln.buffer.take_groups(self.cfg.prompts_per_update, timeout=0)
                if batches is not None:
                    ln.in_update.extend(batches)
                    parts.append((ln, batches))
            if parts:
                compute = {ln.idx: self.cfg.update_s * self.rng.lognormvariate(0.0, 0.05) for ln, _ in parts}
                members = sum(ln.idx != 0 for ln, _ in parts)  # learner 0 writes
                nbytes, exchange_s = self.cfg.exchange_bytes(members), self.cfg.exchange_s(members)
                due = self.now + max(compute.values())
                self.computing = _Round(parts, compute, self.now, nbytes, exchange_s, due)
                self.at(due, self._round_computed, self.computing)
        self._lineage_state()

    def _less_publish(self, rnd: _Round, t0: float, t1: float) -> list[tuple[float, float]]:
        """``[t0, t1]`` less the writer's publish during the round, if any."""
        if rnd.publish_at is None:
            return [(t0, t1)]
        p0, p1 = rnd.publish_at, rnd.publish_at + self.cfg.publish_s
        return [(a, b) for a, b in ((t0, min(t1, p0)), (max(t0, p1), t1)) if b > a]

    def _computed_at(self, rnd: _Round, ln: SimLearner) -> float:
        """When a learner's gradient of the round was done (at the start for one without data)."""
        done = rnd.start + rnd.compute.get(ln.idx, 0.0)
        return done + self.cfg.publish_s if rnd.paused and done > rnd.publish_at else done

    def _round_computed(self, rnd: _Round) -> None:
        if self.now < rnd.due:  # a publish paused the computing: the event at the new time stands
            return
        rnd.computed = self.now
        for ln in self.learners:
            for t0, t1 in self._less_publish(rnd, rnd.start, self._computed_at(rnd, ln)):
                self._charge(ln.time, "computing", t0, t1)
        for t0, t1 in self._less_publish(rnd, rnd.start, self.now):
            self._charge(self.round_time, "computing", t0, t1)
        self._start_exchange()

    def _start_exchange(self) -> None:
        """Hand the computed round to the exchange if none is in flight and the writer is not publishing; the
        learners go on to the next round at once."""
        rnd = self.computing
        if rnd is None or rnd.computed is None or self.exchanging is not None or self.publishing:
            return
        for ln in self.learners:  # after its gradient: waiting for the slowest, then for the exchange slot
            for t0, t1 in self._less_publish(rnd, self._computed_at(rnd, ln), self.now):
                self._charge(ln.time, "in round", t0, t1)
        rnd.handoff = self.now
        self.computing, self.exchanging = None, rnd
        self._charge(self.round_time, "exchanging", self.now, self.now + rnd.exchange_s)
        self.at(self.now + rnd.exchange_s, self._exchanged, rnd)
        self._open_round()

    def _exchanged(self, rnd: _Round) -> None:
        # the learners waited for this exchange only while no next round was computing (one started at or
        # after the handoff)
        until = self.computing.start if self.computing is not None else self.now
        for ln in self.learners:
            self._charge(ln.time, "in round", rnd.handoff, until)
        self.exchanging = None
        self._commit(rnd.parts, rnd.nbytes, rnd.exchange_s)
        if self.step % self.cfg.publish_every == 0:
            self.publishing = True
            self.at(self.now + self.cfg.publish_s, self._published, self.step)
            nxt = self.computing
            if nxt is not None:
                nxt.publish_at = self.now
                if nxt.computed is None:  # training pauses while the writer publishes
                    nxt.paused, nxt.due = True, nxt.due + self.cfg.publish_s
                    self.at(nxt.due, self._round_computed, nxt)
            self._lineage_state()
        else:
            self._start_exchange()
            self._open_round()

    def _lineage_state(self) -> None:
        """The lineage's state with overlap: publishing, else training while a round computes or exchanges."""
        busy = self.computing is not None or self.exchanging is not None
        state = "publishing" if self.publishing else "training" if busy else "waiting"
        if state != self.learner_state:
            self._set_learner(state)

    def _announced(self, version: int) -> None:
        self.published = max(self.published, version)
        if self.cfg.background_fetch:  # the daemon's watcher finds the manifest while the sampler generates
            for s in self.samplers:
                if s.online and s.state != "joining" and not s.fetching:
                    self.at(self.now + self.rng.uniform(0, self.cfg.watch_s), self._watched, s, s.epoch)

    def _watched(self, s: SimSampler, epoch: int) -> None:
        if epoch == s.epoch and s.state != "joining":
            self._start_fetch(s)

    # ---- run ----

    def run(self, progress: bool = False) -> dict:
        from tqdm import tqdm

        for s in self.samplers:
            self.at(self.rng.uniform(0, self.cfg.ramp_s), self.join, s)
        bar = tqdm(total=int(self.t_end), unit="sim-s", disable=not progress, desc=label(self.cfg))
        events = 0
        while self.events and self.events[0][0] <= self.t_end:
            t, _, fn, args = heapq.heappop(self.events)
            if int(t) > bar.n:
                bar.update(int(t) - bar.n)
            self.now = t
            fn(*args)
            events += 1
        bar.close()
        self.now = self.t_end
        for s in self.samplers:
            self._set_state(s, s.state)
        self._set_learner(self.learner_state)
        return summarise(self, events)
