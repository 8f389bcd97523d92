"""The volunteer sampler: follow the newest checkpoint, generate scored rollouts, send them, repeat.

A background fetcher on the network loop watches the DHT for newer checkpoints, downloads the newest into the
chunk store and prepares its tensors while the main thread keeps generating with the version it holds; the
main thread swaps the prepared version in between batches (the engine lives there). Two rules keep that from
filling the outbox with data nobody wants (``heterorl simulate --background-fetch`` found outboxes full of
batches ~80 versions old without them): generation pauses while the sampler is more than ``sampler.max_lag``
versions behind the newest it knows of, and while the learner answers "busy"; the heartbeat's state says
which, and ``paused_behind_s`` / ``paused_busy_s`` count it (:mod:`.stop_rule`). While it may not generate
the main thread sleeps on a wake-up that the follower and the sender set whenever what it waits for changes
(and the stop event too), not on a poll. The sampler serves every chunk it holds; its outbox on disk keeps
unsent batches across learner outages and its own restarts. A slow peer is welcome: its batches carry the
policy version they were sampled with, and the learner uses stale data.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from heterorl.protocol import encode
from heterorl.protocol.net.trajectories import TrajectorySender, new_batch_id
from heterorl.protocol.storage.outbox import Outbox
from heterorl.protocol.wire.checkpoint import deserialize_state_dict
from heterorl.protocol.wire.seeds import row_seed

from ..model.loader import load_config, load_tokenizer
from ..model.prompts import PromptFormat
from ..rollout import SamplingParams, make_backend
from ..rollout.resilient import ResilientBackend, is_oom
from .follower import CheckpointFollower
from .hardware import rows_that_fit
from .heartbeat import Status
from .runtime import PeerRuntime
from .stop_rule import Limits, SamplerView, StopRule, lag

if TYPE_CHECKING:
    from ..tasks import Task

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplerOptions:
    slowdown: float = 1.0  # >1 sleeps (slowdown-1)× each batch's generation time: a slower peer, on purpose
    max_pending: int = 4  # batches waiting in the outbox before generation pauses
    max_batches: int | None = None  # stop after this many (tests); None: run until stopped
    check_every_s: float = 0.5  # checkpoint lookups: this often after a change, doubling while none comes
    check_max_s: float = 5.0  # ... up to this
    drain_s: float = 5.0  # on shutdown, how long to keep sending what is queued
    backend: str = "auto"  # rollout engine: auto | hf | vllm
    engine_dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on a CPU
    threads: int | None = None  # the engine's CPU threads (None: its default)
    engine_restarts: int = 2  # a dead vLLM engine is restarted this often, then the sampler falls back to hf


MAX_PROMPT_TOKENS = 1024  # the engine's context: prompt + max_new_tokens, within the model's own limit


def score_rows(
    task: Task, prompts: list[str], texts: list[str], references: list[str], per: int
) -> tuple[list[float], set[int]]:
    """Each row's reward (in the task's reward worker), and the batches (``per`` rows each, in order)
    holding a row whose reward the worker could not compute: a timeout or a crash scores 0 here and may
    not on the learner, so such a batch is not sent."""
    rewards, unscored = [], set()
    for i, (prompt, text, reference) in enumerate(zip(prompts, texts, references, strict=True)):
        rewards.append(float(task.reward(prompt, text, reference)))
        if getattr(task.scorer, "incident", None) is not None:
            unscored.add(i // per)
    return rewards, unscored


class Sampler:
    """The sampler role on a :class:`~.runtime.PeerRuntime` (which serves its chunk store and beats)."""

    STORE_BYTES = 2 << 30  # the chunk store's cap
    SENDER = TrajectorySender  # what sends the outbox (a test's faulty sampler swaps in a broken one)

    def __init__(self, runtime: PeerRuntime, options: SamplerOptions = SamplerOptions()):
        self.rt, self.opt, self.node, self.identity = runtime, options, runtime.node, runtime.identity
        self.settings, self.state_dir, self.hw = runtime.settings, runtime.state_dir, runtime.hw
        self.status, self.store = runtime.status, runtime.store
        self.version: int | None = None
        self.manifest_sha256: bytes | None = None  # of the signed manifest of the version held
        self.batches = 0
        self.tokens = 0
        self.loaded: list[int] = []
        s = self.settings
        self.model_dir = runtime.model_dir()
        self.tok = load_tokenizer(self.model_dir)
        config = load_config(self.model_dir)
        if config.vocab_size != s.vocab_size:
            raise ValueError(
                f"model {s.model.path} has vocab {config.vocab_size}, the run says {s.vocab_size}"
            )
        self.prompts = PromptFormat(self.tok, s.model.chat)
        self.task = runtime.task()
        self.sampling = SamplingParams(s.sampling.temperature, s.sampling.top_p, s.sampling.max_new_tokens)
        rows = s.sampler.prompts_per_batch * s.learner.group_size
        self.gen_rows = min(rows, rows_that_fit(self.hw, config, 64 + s.sampling.max_new_tokens))
        self.engine_dtype = (
            options.engine_dtype
            if options.engine_dtype != "auto"
            else "bfloat16"
            if self.hw.device == "cuda"
            else "float32"
        )
        max_len = (
            getattr(config, "max_position_embeddings", None) or MAX_PROMPT_TOKENS + s.sampling.max_new_tokens
        )
        self._engine = {
            "device": self.hw.device,
            "dtype": self.engine_dtype,
            "memory_bytes": self.hw.memory_bytes,
            "threads": options.threads,
            "max_rows": rows,
            "max_model_len": min(max_len, MAX_PROMPT_TOKENS + s.sampling.max_new_tokens),
        }
        wrap = self._adapter_wrapper()
        self.backend = ResilientBackend(
            lambda: wrap(make_backend(options.backend, self.model_dir, self.tok, **self._engine)),
            lambda: wrap(make_backend("hf", self.model_dir, self.tok, **self._engine)),
            self._held_weights,
            restarts=options.engine_restarts,
        )
        self.status.backend = self.backend.describe()
        log.info("rollouts: %s; prompts: %s", self.status.backend, self.prompts.describe())
        self.rng = random.Random(int.from_bytes(self.identity.public_key[:8], "big") ^ time.time_ns())
        self.outbox = Outbox(self.state_dir / "outbox.sqlite")
        self._wake = runtime.wakeup()  # set by the sender and the follower on every change the loop waits for
        self.sender = self.SENDER(
            self.node,
            self.outbox,
            s.run_id,
            s.learner_keys,
            on_change=self._wake.set,
            author=self.identity.public_key,
        )
        self.follower = CheckpointFollower(
            self.node,
            self.store,
            s,
            lambda: self.version,
            lambda: self.batches,
            options.check_every_s,
            options.check_max_s,
            on_change=self._wake.set,
        )
        self.rule = StopRule(Limits(s.sampler.max_lag, s.learner.publish_every, options.max_pending))
        self.gen_lag_max = 0  # the most versions behind the newest known that any batch was started
        self._sender_task = self._follower_task = None

    # ---- checkpoints ----

    def _adapter_wrapper(self):
        """For an adapter run, backends that take adapters (on this peer's base, checked against the run's
        hash: ValueError if it differs); else backends as they are."""
        s = self.settings
        if s.adapter is None:
            return lambda backend: backend
        from ..model.adapter import load_base
        from ..rollout.adapter import AdapterBackend

        base = load_base(self.model_dir, s.adapter, s.learner.checkpoint_dtype)
        self._engine["lora_rank"] = s.adapter.rank  # a vLLM engine serves the adapters as LoRA
        log.info("adapter run: LoRA rank %d on base sha256 %s…", s.adapter.rank, s.adapter.base_hash[:16])
        return lambda backend: AdapterBackend(backend, base, s.adapter, self.state_dir / "adapters")

    def _maybe_switch(self) -> None:
        """Swap in the version the follower prepared, if any (main thread: the engine is used here)."""
        ready = self.follower.take()
        if ready is None:
            return
        v = ready.version
        try:
            self.backend.load_weights(ready.state)
        except Exception as e:  # these signed bytes will never do: refuse this manifest for good
            self.follower.refuse(ready.digest, v, e)
            self.follower.swapped()
            return
        previous, self.version, self.manifest_sha256 = self.version, v, ready.digest
        self.follower.swapped()
        self.loaded.append(v)
        r = ready.report
        row = {
            "version": v,
            "manifest": ready.digest.hex(),  # the signed manifest its batches name
            "time": time.time(),
            "fetched_bytes": r.fetched_bytes,
            "reused_bytes": r.reused_bytes,
            "via": r.via,
            "fetch_s": round(ready.fetch_s, 3),
            "prepare_s": round(ready.prepare_s, 3),
            "fetch_started": ready.started,
            "held": ready.held,  # the version generated with while this one was fetched
            "batches_during_fetch": ready.batches_during_fetch,
            "after_batch": self.batches,  # swapped in after this many batches, never during one
        }
        self.rt.append_jsonl("versions.jsonl", row)
        level = logging.INFO if previous is None or v % 10 == 0 else logging.DEBUG  # logs stay bounded
        log.log(
            level,
            "now sampling with version %d (%s: fetched %d bytes, reused %d, in %.1f s; "
            "%d batch(es) made with version %s meanwhile)",
            v,
            r.via,
            r.fetched_bytes,
            r.reused_bytes,
            ready.fetch_s + ready.prepare_s,
            ready.batches_during_fetch,
            previous,
        )

    # ---- rollouts ----

    def _generate(self, prompt_ids: list[list[int]], seeds: list[int] | None = None):
        while True:
            try:
                return [
                    self.backend.generate(prompt_ids[i : i + self.gen_rows], self._params(seeds, i))
                    for i in range(0, len(prompt_ids), self.gen_rows)
                ]
            except Exception as e:
                if not is_oom(e) or self.gen_rows == 1:
                    raise
                self.gen_rows = max(1, self.gen_rows // 2)
                if self.hw.device == "cuda":
                    torch.cuda.empty_cache()
                log.warning("out of memory: generating %d rows at a time from now on", self.gen_rows)
            finally:
                self.status.backend = self.backend.describe()  # it may have restarted or fallen back

    def _params(self, seeds: list[int] | None, start: int) -> SamplingParams:
        if seeds is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seeds=tuple(seeds[start : start + self.gen_rows]))

    @property
    def seeded(self) -> bool:
        """Whether rows are drawn reproducibly from derived seeds a verifier can recompute (the hf engine's
        Gumbel-max; vLLM's seeded sampler is deterministic but its noise is its own)."""
        return self.backend.name == "hf"

    def _held_weights(self):
        """The weights of the version held, from the chunk store (for an engine that restarted)."""
        return None if self.version is None else deserialize_state_dict(self.store.assemble(self.version))

    def make_batch(self) -> tuple[bytes, bytes, int]:
        """Generate one TrajectoryBatch with the current policy; returns (batch id, signed bytes, tokens)."""
        for _ in range(8):  # a batch whose reward could not be computed is not made: another is
            made = self.make_batches(1)
            if made:
                return made[0]
        raise RuntimeError("8 batches in a row had a reward the worker could not compute (see the log)")

    def make_batches(self, n: int) -> list[tuple[bytes, bytes, int]]:
        """Generate ``n`` TrajectoryBatches with the current policy in one engine call (split only where
        memory asks: ``gen_rows``): an engine's cost per call, not per row, dominates small batches (the tiny
        model's 16-row batches; vLLM batches what it is given). Each is signed on its own
        (:meth:`sign_batch`); returns (batch id, signed bytes, tokens) of each, leaving out any batch with a
        reward the reward worker could not compute (a timeout or a crash there is not the rollout's reward).
        """
        s = self.settings
        g, k = s.learner.group_size, s.sampler.prompts_per_batch
        examples = [self.task.sample(self.rng) for _ in range(n * k)]
        prompts = [e.prompt for e in examples for _ in range(g)]
        encoded = {p: self.prompts.encode(p) for p in dict.fromkeys(prompts)}  # a group repeats its prompt
        bids = [new_batch_id() for _ in range(n)]
        per = k * g
        seeds = [
            row_seed(s.run_id, self.identity.public_key, bids[b], self.version, r)
            for b in range(n)
            for r in range(per)
        ]
        rolls = self._generate([encoded[p] for p in prompts], seeds)
        rolled = [(roll, j) for roll in rolls for j in range(len(roll.texts))]
        references = [examples[i // g].reference for i in range(len(prompts))]
        texts = [roll.texts[j] for roll, j in rolled]
        rewards, unscored = score_rows(self.task, prompts, texts, references, per)
        rows = []
        for i, (roll, j) in enumerate(rolled):
            length = int(roll.lengths[j])
            rows.append(
                {
                    "group": (i // g) % k,  # each batch numbers its own groups
                    "prompt_ids": list(roll.prompt_ids[j]),
                    "completion_ids": roll.completion_ids[j, :length].tolist(),
                    "logprobs": [min(0.0, x) for x in roll.logprobs[j, :length].tolist()],
                    "reward": rewards[i],
                }
            )
        if unscored:  # a reward the worker could not compute is 0 here and maybe not on the learner
            log.warning(
                "%d batch(es) not sent: a reward could not be computed (see the reward log)", len(unscored)
            )
        return [
            self.sign_batch(rows[b * per : (b + 1) * per], batch_id=bids[b])
            for b in range(n)
            if b not in unscored
        ]

    def sign_batch(self, rows: list[dict], batch_id: bytes | None = None) -> tuple[bytes, bytes, int]:
        """``rows`` as a signed TrajectoryBatch of the held version: (batch id, signed bytes, tokens); with
        ``batch_id`` (the id their seeds were derived from) the batch says its rows are reproducible."""
        bid = batch_id or new_batch_id()
        body = {
            "run_id": self.settings.run_id,
            "batch_id": bid,
            "policy_version": self.version,
            "timestamp": time.time(),
            "rows": rows,
            "engine": self.backend.name,
            "engine_dtype": self.backend.dtype,
            **({"seeded": True} if batch_id is not None and self.seeded else {}),
            **({"manifest_sha256": self.manifest_sha256} if self.manifest_sha256 is not None else {}),
        }
        tokens = sum(len(r["completion_ids"]) for r in rows)
        return bid, encode("TrajectoryBatch", body, self.identity), tokens

    # ---- the role ----

    def view(self) -> SamplerView:
        """This sampler, its follower and its sender now, as the stop rule reads them."""
        f, snd = self.follower, self.sender
        return SamplerView(
            held=self.version,
            newest=f.newest,
            fetching=f.fetching,
            retry_in=max(0.0, f.retry_at - time.monotonic()),
            last_refused=f.last_refused,
            busy_replies=snd.deferred,
            other_outcomes=snd.acked + snd.rejected + snd.failures,
            busy_for=snd.learner_busy_for(),
            sender_state=snd.state,
            outbox=len(self.outbox),
        )

    def refresh_status(self) -> Status:
        f = self.follower
        stats = {
            "batches_made": self.batches,
            "outbox": len(self.outbox),
            "loaded_versions": len(self.loaded),
            "gen_rows": self.gen_rows,
            "newest_version": f.newest,
            "fetching_version": -1 if f.fetching is None else f.fetching,
            "fetch_failures": f.failures,
            "lag": lag(self.view(), self.rule.limits.publish_every),
            "gen_lag_max": self.gen_lag_max,
            "paused_behind_s": round(self.rule.paused_s["behind"], 1),
            "paused_busy_s": round(self.rule.paused_s["busy"], 1),
            **{k.split("/")[-1]: v for k, v in self.sender.stats().items()},
            **{k.split("/")[-1]: v for k, v in self.rt.server.stats().items()},
        }
        self.status.update(policy_version=-1 if self.version is None else self.version, stats=stats)
        return self.status

    def start(self) -> None:
        self._sender_task = self.rt.spawn(self.sender.run(), "trajectory sender")
        self._follower_task = self.rt.spawn(self.follower.run(), "checkpoint follower")

    def leave(self) -> None:
        if self._follower_task is not None:  # a download in progress stops here; its chunks serve a restart
            self._follower_task.cancel()
        self._write_final_stats()  # now, in case leaving is cut short; again in close() with the drain's acks
        if self.node.daemon_alive():  # else nothing can be sent: leave at once
            self._drain()

    def close(self) -> None:
        """After the node closed: nothing sends from the outbox any more."""
        queued = len(self.outbox)
        self._write_final_stats()
        self.outbox.close()
        self.backend.close()
        log.info(
            "left: %d batches made, %d left queued for next time; paused %.0f s behind, %.0f s busy",
            self.batches,
            queued,
            self.rule.paused_s["behind"],
            self.rule.paused_s["busy"],
        )

    def loop(self) -> None:
        ema, stop = 0.0, self.rt.stop
        while self.rt.running():
            if self.opt.max_batches is not None and self.batches >= self.opt.max_batches:
                return
            self._wake.clear()  # before looking: a change signalled from now on ends the wait below
            self._maybe_switch()
            view = self.view()
            decision = self.rule.decide(view)
            if decision.wait is not None:  # no checkpoint yet, behind, learner busy, outbox full
                self.status.state = decision.state
                self.rule.wait(decision, self._wake.wait)
                continue
            self.rule.resume()
            fetching = self.follower.fetching
            self.status.state = f"generating with version {self.version}" + (
                f"; fetching {fetching}" if fetching is not None else ""
            )
            self.gen_lag_max = max(self.gen_lag_max, lag(view, self.rule.limits.publish_every))
            t = time.perf_counter()
            # as many batches as the outbox has room for, in one engine call (the stop rule waits while full)
            n = max(1, self.opt.max_pending - len(self.outbox))
            if self.opt.max_batches is not None:
                n = min(n, self.opt.max_batches - self.batches)
            made = self.make_batches(n)
            dt = time.perf_counter() - t
            for bid, data, _ in made:
                self.outbox.put(bid, data, self.version)
            self.sender.notify()
            self.batches += len(made)
            tokens = sum(t for _, _, t in made)
            self.tokens += tokens
            rate = tokens / max(dt, 1e-6) / self.opt.slowdown
            ema = rate if ema == 0 else 0.8 * ema + 0.2 * rate
            self.status.tokens_per_s = ema
            if self.opt.slowdown > 1:
                self.status.state = "throttled (--sampler-slowdown)"
                stop.wait(dt * (self.opt.slowdown - 1))

    def _write_final_stats(self) -> None:
        """What this session did, for `heterorl local`'s summary and for tests (the heartbeat's stats)."""
        try:
            stats = {**self.refresh_status().stats, "tokens": self.tokens, "versions": self.loaded[-1000:]}
            stats["rewards"] = getattr(self.task.scorer, "stats", dict)()  # the reward worker's counts
            self.rt.write_final_stats(stats)
        except Exception as e:  # leaving must not fail on it
            log.warning("final stats not written: %s", e)

    def _drain(self) -> None:
        """Give the sender up to ``drain_s`` to send what is queued (woken at each outcome) unless it died."""
        deadline = time.monotonic() + self.opt.drain_s
        sender = self._sender_task
        if sender is None or sender.done() or not len(self.outbox):
            return
        self.status.state = "sending what is queued before leaving"
        log.info("sending %d queued batch(es) before leaving", len(self.outbox))
        while not sender.done():
            self._wake.clear()
            left = deadline - time.monotonic()
            if not len(self.outbox) or left <= 0:
                return
            self._wake.wait(left, stoppable=False)  # the stop event is set: the peer is leaving
