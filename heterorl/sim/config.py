"""What a simulated run is made of: its settings (:class:`SimConfig`), a batch in flight, a sampler, a
learner peer."""

from __future__ import annotations

import collections
import dataclasses
import math

from heterorl.peer.learner.buffer import Buffered, TrajectoryBuffer
from heterorl.protocol.settings import LineageSettings, check_update_fits
from heterorl.protocol.wire.messages import MAX_LEARNERS

from .fleet import PeerSpec


@dataclasses.dataclass(frozen=True)
class SimConfig:
    samplers: int = 1000
    hours: float = 2.0
    warmup_h: float = 0.25  # statistics leave this first stretch out
    ramp_s: float = 600.0  # samplers join uniformly over this window
    join_s: float = 20.0  # start-up of a (re)joining sampler: model load, DHT join
    # the run
    prompts_per_update: int = 16
    group_size: int = 8
    prompts_per_batch: int = 2
    prompt_tokens: int = 100
    completion_tokens: int = 300  # mean; each batch's mean is drawn around it
    buffer_batches: int = 16
    max_staleness: int = -1
    publish_every: int = 1
    # the learner
    learner_tokens_per_s: float = 20_000.0  # training tokens (prompt + completion) per second, fwd+bwd
    publish_s: float = 3.0  # serialise, chunk, sign, announce
    announce_s: float = 2.0  # until a published manifest is found in the DHT
    # learner peers training one lineage (the lowest key writes; see the engine's docstring)
    learners: int = 1
    learner_link_bytes_per_s: float = 1.25e9  # every learner's own link, each direction (10 Gbit/s)
    learner_rtt_s: float = 0.05  # a round trip between a member and the writer
    exchange: str = LineageSettings().exchange  # the run's default: "sparse" (compressed) | "dense" (float32)
    exchange_ratio: float = 0.0039  # sparse: one part's bytes / the float32 gradient's (bench exchange)
    codec_s_per_gb: float = 0.05  # sparse: one encode + one decode of a float32 GB (an estimate, GPU)
    overlap: bool = True  # the exchange of a version runs while the next update is computed (the daemon's)
    # the checkpoint
    model_bytes: int = 3_087_000_000  # 1.54B parameters in bfloat16
    changed_frac: float = 1.0  # chunk model: fraction of chunks one update changes (1: full fine-tuning)
    delta_ratio: float | None = None  # one update's bf16 delta / full checkpoint (None: chunk model)
    delta_bases: int | None = None  # a peer more published versions behind than this fetches in full
    providers: int = 8
    # samplers
    max_pending: int = 4
    spread: float = 0.3
    churn: bool = True
    background_fetch: bool = False  # generate with the held version while fetching, with the stop rule:
    max_lag: int = 4  # no new batch while more than this many published versions behind (-1: never)
    busy_pause: bool = True  # no new batch until the learner's "busy" retry time
    watch_s: float = 5.0  # a new manifest is found within this (the daemon's watcher polls every 0.5-5 s)
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("samplers", "prompts_per_update", "group_size", "prompts_per_batch", "buffer_batches"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")
        check_update_fits(self.prompts_per_update, self.prompts_per_batch, self.buffer_batches)
        if not 0 <= self.warmup_h < self.hours:
            raise ValueError("warmup_h must lie in [0, hours)")
        if not 0 < self.changed_frac <= 1:
            raise ValueError("changed_frac must lie in (0, 1]")
        if self.delta_ratio is not None:
            if not 0 < self.delta_ratio <= 1:
                raise ValueError(f"delta_ratio must lie in (0, 1], got {self.delta_ratio}")
            if self.changed_frac != 1.0:
                raise ValueError("delta_ratio and changed_frac are two models of a switch: give one")
        if self.delta_bases is not None and self.delta_bases < 1:
            raise ValueError("delta_bases must be >= 1 (or None: no limit)")
        if self.max_lag < -1:
            raise ValueError("max_lag must be >= -1 (-1: never stop)")
        if self.learner_tokens_per_s <= 0 or self.publish_s < 0 or self.announce_s < 0:
            raise ValueError("learner_tokens_per_s must be > 0; publish_s and announce_s >= 0")
        if not 1 <= self.learners <= MAX_LEARNERS:
            raise ValueError(f"learners must lie in [1, {MAX_LEARNERS}] (the most keys a RunSpec lists)")
        if not self.learner_link_bytes_per_s > 0 or self.learner_rtt_s < 0:
            raise ValueError("learner_link_bytes_per_s must be > 0 and learner_rtt_s >= 0")
        if self.exchange not in ("dense", "sparse"):
            raise ValueError(f'exchange must be "dense" or "sparse", got {self.exchange!r}')
        if not (math.isfinite(self.exchange_ratio) and 0 < self.exchange_ratio <= 1):
            raise ValueError(f"exchange_ratio must lie in (0, 1], got {self.exchange_ratio}")
        if not (math.isfinite(self.codec_s_per_gb) and self.codec_s_per_gb >= 0):
            raise ValueError(f"codec_s_per_gb must be a number >= 0, got {self.codec_s_per_gb}")

    @property
    def update_s(self) -> float:
        """Seconds of one learner update: its tokens over the learner's training rate."""
        rows = self.prompts_per_update * self.group_size
        return rows * (self.prompt_tokens + self.completion_tokens) / self.learner_tokens_per_s

    @property
    def gradient_bytes(self) -> int:
        """One learner's float32 gradient: 4 bytes a parameter, ``model_bytes`` being a bf16 checkpoint."""
        return 2 * self.model_bytes

    @property
    def part_bytes(self) -> int:
        """Sparse exchange: one compressed part (a commit's size too), ``exchange_ratio`` of the gradient."""
        return round(self.exchange_ratio * self.gradient_bytes)

    @property
    def codec_s(self) -> float:
        """Seconds of encoding and decoding on a round's critical path: none dense; sparse, two encode +
        decode pairs of one gradient (a member's part, then the writer's commit)."""
        if self.exchange == "dense":
            return 0.0
        return 2 * self.codec_s_per_gb * self.gradient_bytes / 1e9

    def exchange_bytes(self, members_with_data: int) -> int:
        """Bytes through the writer's link for one version (0 with one learner). Dense: a float32 gradient
        from each member with data, and to every member the commit's two frames of that size, the parameter
        update and the combined gradient (``3 (N - 1) G`` when all have data). Sparse: a part from each
        member with data, and the compressed commit (one part's size) to every member (``2 (N - 1) P``)."""
        if self.learners == 1:
            return 0
        if self.exchange == "dense":
            return (members_with_data + 2 * (self.learners - 1)) * self.gradient_bytes
        return (members_with_data + self.learners - 1) * self.part_bytes

    def exchange_s(self, members_with_data: int) -> float:
        """Seconds of a version's exchange after the slowest gradient (0 with one learner): the codec, the
        bytes through the writer's link (in: every member's upload runs at once, but the writer's downlink
        takes them all; out: the writer's uplink sends to each member), one round trip."""
        if self.learners == 1:
            return 0.0
        nbytes = self.exchange_bytes(members_with_data)
        return self.codec_s + nbytes / self.learner_link_bytes_per_s + self.learner_rtt_s


@dataclasses.dataclass
class Batch:
    version: int
    groups: int
    nbytes: int
    attempts: int = 0


class SimSampler:
    def __init__(self, idx: int, spec: PeerSpec) -> None:
        self.idx, self.spec = idx, spec
        self.online = False
        self.epoch = 0  # bumped when it leaves: events of an older epoch are void
        self.version: int | None = None
        self.outbox: collections.deque[Batch] = collections.deque()
        self.sending = False
        self.fetching = False
        self.waiting = False  # generation paused on a full outbox
        self.learner = 0  # the learner it sends to (rendezvous order of its key)
        self.busy_until = 0.0  # the learner said "busy": its retry time (the stop rule waits for it)
        self.time = collections.Counter()  # state -> seconds (inside the measured window)
        self.state, self.state_since = "offline", 0.0
        self.down_bytes = 0
        self.up_bytes = 0


class SimLearner:
    """A learner peer: its own intake (the real bounded buffer) and, inside the measured window, the seconds
    it computed its gradient and the seconds it spent in a round without computing (waiting for slower
    learners, the exchange through the writer, the round trip; with overlap, a computed update waiting for
    the exchange in flight, and an exchange in flight while it computes nothing)."""

    def __init__(self, idx: int, buffer_batches: int) -> None:
        self.idx = idx  # 0: the lowest key, the writer
        self.buffer = TrajectoryBuffer(buffer_batches)
        self.in_update: list[Buffered] = []  # batches of rounds not yet committed (up to two with overlap)
        self.samplers = 0  # samplers whose rendezvous order puts this learner first
        self.parts = 0  # updates of its own that went into versions (inside the window)
        self.time = collections.Counter()  # "computing", "in round" -> seconds (inside the window)
