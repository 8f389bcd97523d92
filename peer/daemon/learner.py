"""The learner peer: admit batches from anyone (re-scored), buffer them, update, publish signed checkpoints.

Exactly once, across kills: an accepted batch is in the ledger (on disk) before it is acknowledged; after each
update its id is marked applied at that step; model, optimizer and step are saved every ``publish_every``
updates, just before the checkpoint of that version is published. A restarted learner loads its last save
(step S) and replays every batch the ledger holds as pending or applied after S, so nothing accepted is lost
and nothing counts twice in the saved lineage. Checkpoint versions equal update steps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

import torch

from heterorl.protocol import ProtocolError, decode, encode
from heterorl.protocol.net.chunks import announce_checkpoint
from heterorl.protocol.net.trajectories import TrajectoryReceiver
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.wire.checkpoint import add_delta, manifest_body, referenced_hashes
from heterorl.protocol.wire.delta import CODEC as DELTA_CODEC
from heterorl.protocol.wire.delta import encode_delta
from heterorl.protocol.wire.staleness import STALENESS_BUCKETS, staleness_bucket

from ..learner.buffer import Buffered, TrajectoryBuffer, staleness_refusal
from ..learner.intake import RewardCheck
from ..learner.state import load_state, save_state
from ..learner.update import rows_from_bodies, update, update_options
from ..model import adapter, load_model
from ..model.prompts import PromptFormat
from ..tasks import get_task
from .announcer import Announcer
from .heartbeat import Status
from .runtime import PeerRuntime
from .weights import resolve_model, weights_bytes, weights_hash

log = logging.getLogger(__name__)

MAX_SHOWN_STRIKES = 8
ANNOUNCE_TIMEOUT_S = 60.0


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
        self.model, self.tok = load_model(resolve_model(s.model, state_dir / "models"), device=self.hw.device)
        if s.adapter is not None:  # LoRA on the frozen base the run names
            self.model = adapter.for_training(self.model, s.adapter, s.learner.checkpoint_dtype)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=s.lr, weight_decay=0.0)
        meta = load_state(state_dir / "state", self.model, self.optimizer)
        if meta is None:
            if weights_hash(self.checkpoint_bytes()) != s.initial_checkpoint:
                raise ValueError(
                    f"the weights of {s.model} here differ from the RunSpec's initial checkpoint; "
                    "the learner must start from the model the coordinator signed"
                )
            self.step = 0
            log.info("starting fresh from %s", s.model)
        else:
            self.step = int(meta["step"])
            log.info("resumed from my own state at step %d", self.step)
        self.ledger = AcceptedLog(state_dir / "accepted.sqlite")
        self.buffer = TrajectoryBuffer(s.learner.buffer_batches)
        self.reward_check = RewardCheck(
            get_task(s.task, **s.task_params), self.tok, prompts=PromptFormat(self.tok, s.chat)
        )
        self.receiver = TrajectoryReceiver(
            self.identity,
            s.run_id,
            self.ledger,
            vocab_size=s.vocab_size,
            admit=self._admit,
            on_accept=self._on_accept,
            has_room=self.buffer.has_room,
        )
        self.staleness = collections.Counter()
        self.last: dict[str, float] = {}
        self.published_version = -1
        self.announcer = Announcer(
            lambda raw, body: self.node.spawn(
                asyncio.wait_for(announce_checkpoint(self.node, raw, body), ANNOUNCE_TIMEOUT_S)
            )
        )
        self.wait_s = 0.0
        self.train_s = 0.0
        self.publish_s = collections.Counter()  # save / build / announce: seconds, cumulative
        self.delta_bytes = self.full_bytes = 0  # of the versions published with a delta
        self.replayed = self._replay()

    # ---- intake ----

    def _admit(self, body: dict, author: bytes) -> str | None:
        s = self.settings
        if len(body["rows"]) > s.max_batch_rows:
            return f"{len(body['rows'])} rows exceed the run's {s.max_batch_rows}"
        why = staleness_refusal(
            self.step, body["policy_version"], self.published_version, s.learner.max_staleness
        )
        return why or self.reward_check(body, author)

    def _on_accept(self, body: dict, author: bytes, _raw: bytes) -> None:
        self.buffer.put(Buffered(body["batch_id"], author, body, time.time()))

    def _replay(self) -> int:
        items = self.ledger.pending(applied_after=self.step)
        for it in items:
            _, body, author = decode(it.data, "TrajectoryBatch", run_id=self.settings.run_id)
            self.buffer.put(Buffered(it.batch_id, author, body, it.received_at))
        if items:
            log.info("replaying %d accepted batch(es) not in my saved state", len(items))
        return len(items)

    # ---- checkpoints ----

    def checkpoint_bytes(self) -> bytes:
        """What a checkpoint carries: the weights, or in an adapter run the adapters alone."""
        dtype = self.settings.learner.checkpoint_dtype
        if self.settings.adapter is not None:
            return adapter.adapter_bytes(self.model, dtype)
        return weights_bytes(self.model, dtype)

    def publish(self) -> None:
        s = self.settings
        t0 = time.perf_counter()
        save_state(self.state_dir / "state", self.model, self.optimizer, self.step, {"run_id": s.run_id})
        self.ledger.prune_applied(self.step)  # a restart resumes from here: older payloads are never replayed
        t1 = time.perf_counter()
        raw, body = self.store.manifest(self.step), self.store.body(self.step)
        if raw is None or body is None:
            older = [v for v in self.store.versions() if v < self.step]
            parent = self.published_version if self.published_version >= 0 else max(older, default=-1)
            data = self.checkpoint_bytes()
            body, chunks = manifest_body(s.run_id, self.step, parent, data, s.learner.checkpoint_dtype)
            if s.learner.deltas:
                chunks += self._deltas(body, older, data)
            for h, c in zip(referenced_hashes(body), chunks, strict=True):
                self.store.put(h, c)
            raw = encode("CheckpointManifest", body, self.identity)
        # else: built before a restart from these same saved weights; announce it again
        self.published_version = self.step
        t2 = time.perf_counter()
        self.store.add_manifest(raw, body)
        self.announcer.announce(raw, body)  # in the background: training goes on
        self.publish_s.update({"save": t1 - t0, "build": t2 - t1, "announce": time.perf_counter() - t2})

    def _deltas(self, body: dict, older: list[int], data: bytes) -> list[bytes]:
        """Offer version ``body`` also as sparse deltas against each of the ``learner.deltas`` most recent
        ``older`` published versions, so a peer up to that many versions behind still fetches one delta;
        returns their chunks. A base gone from the store, or a delta that would not save half the bytes, is
        skipped."""
        newest_first = sorted(older, reverse=True)
        bases = newest_first[: self.settings.learner.deltas]
        chunks: list[bytes] = []
        for base in bases:
            try:
                delta = encode_delta(self.store.assemble(base), data)
            except (KeyError, ProtocolError) as e:  # evicted, or another layout: no delta from it
                log.info("version %d: no delta against version %d: %s", body["version"], base, e)
                continue
            if len(delta) > len(data) // 2:
                continue
            if base == newest_first[0]:
                self.delta_bytes += len(delta)
                self.full_bytes += len(data)
            chunks += add_delta(body, base, delta, DELTA_CODEC)
        return chunks

    # ---- training ----

    def train_once(self, timeout: float) -> bool:
        s = self.settings
        t = time.perf_counter()
        batches = self.buffer.take_groups(s.learner.prompts_per_update, timeout)
        self.wait_s += time.perf_counter() - t
        if batches is None:
            return False
        t = time.perf_counter()
        self.status.state = f"updating (step {self.step + 1})"
        rows = rows_from_bodies([b.body for b in batches], self.tok.pad_token_id)
        stats = update(
            self.model,
            self.optimizer,
            rows,
            version=self.step,
            pad_id=self.tok.pad_token_id,
            **update_options(s),
        )
        self.step += 1
        self.ledger.mark_applied([b.batch_id for b in batches], self.step)
        hist = collections.Counter(
            staleness_bucket(self.step - 1 - b.body["policy_version"]) for b in batches
        )
        self.staleness.update(hist)
        self.train_s += time.perf_counter() - t
        self.last = stats
        row = {
            "step": self.step,
            "time": time.time(),
            "batches": [b.batch_id.hex() for b in batches],
            "authors": sorted({b.author.hex()[:16] for b in batches}),
            "staleness_hist": dict(hist),
            # which rollout engines made this update's batches ("vllm/bfloat16": 3, "hf/float32": 5)
            "engines": dict(
                collections.Counter(
                    f"{b.body.get('engine', '?')}/{b.body.get('engine_dtype', '?')}" for b in batches
                )
            ),
            "wait_s": self.wait_s,  # cumulative, so any window's wait fraction can be read off
            # compressed delta bytes over full checkpoint bytes, over the versions published with a delta
            "delta_ratio": self.delta_bytes / self.full_bytes if self.full_bytes else None,
            "train_s": self.train_s,
            **{f"publish_{k}_s": v for k, v in self.publish_s.items()},
            **stats,
        }
        self.rt.append_jsonl("metrics.jsonl", row)
        if self.step % s.learner.publish_every == 0 or self.step == self.opt.max_steps:
            self.status.state = f"publishing version {self.step}"
            self.publish()
        return True

    def refresh_status(self) -> Status:
        st = self.status
        st.policy_version = self.published_version
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
            **({"delta_ratio": self.delta_bytes / self.full_bytes} if self.full_bytes else {}),
            **{f"stale:{b}": self.staleness.get(b, 0) for b in STALENESS_BUCKETS},
        }
        for k in (
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
        ):
            if k in self.last:
                stats[k] = self.last[k]
        for who, n in recv.strikes.most_common(MAX_SHOWN_STRIKES):
            stats[f"rej:{who[:27]}"] = n
        st.stats = stats
        return st

    def _write_final_stats(self) -> None:
        recv = self.receiver
        final = {
            "step": self.step,
            "accepted": recv.accepted,
            "duplicates": recv.duplicates,
            "deferred": recv.deferred,
            "rejected": sum(recv.rejected.values()),
            "rejected_by_reason": dict(recv.rejected),
            "strikes": dict(recv.strikes),
            "rows_disagreeing": self.reward_check.rows_disagreeing,
        }
        self.rt.write_final_stats(final)

    # ---- the role ----

    def start(self) -> None:
        self.status.state = f"publishing version {self.step}"
        self.publish()  # version 0 (or the step resumed at) before anyone can sample
        self.node.call(self.receiver.attach(self.node))
        log.info(
            "learning: run %s, objective %s, step %d",
            self.settings.run_id,
            self.settings.objective,
            self.step,
        )

    def loop(self) -> None:
        waited = 0.0
        while self.rt.running():
            if self.opt.max_steps is not None and self.step >= self.opt.max_steps:
                log.info("reached %d updates; stopping", self.step)
                return
            self.status.state = "waiting for trajectories"
            if self.train_once(timeout=0.5):
                waited = 0.0
                if self.step % 10 == 0:
                    log.info(
                        "step %d: reward %.3f, staleness %.1f, ESS %.2f, buffer %d",
                        self.step,
                        self.last.get("reward/mean", 0),
                        self.last.get("staleness/mean", 0),
                        self.last.get("is/ess", 0),
                        len(self.buffer),
                    )
            else:
                self.announcer.retry_failed(self.step)
                waited += 0.5
                if waited >= self.opt.wait_log_s:
                    log.info("waiting for trajectories (buffer %d batches)", len(self.buffer))
                    waited = 0.0

    def leave(self) -> None:
        if self.published_version != self.step:
            try:
                self.publish()
            except Exception as e:
                log.warning("final checkpoint not published (my state is saved): %s", e)
        self._write_final_stats()
        # a dead daemon announces nothing: leave at once (the state is saved)
        if self.node.daemon_alive() and not self.announcer.wait_idle(ANNOUNCE_TIMEOUT_S):
            log.warning("leaving before the last checkpoint announce finished")

    def close(self) -> None:
        """After the node closed: no stream handler touches the ledger any more."""
        self.ledger.close()
