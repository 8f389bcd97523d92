"""The volunteer sampler: fetch the newest checkpoint, generate scored rollouts, send them, repeat.

Between batches it looks for a newer checkpoint and switches to it without stopping; it serves every chunk it
holds; its outbox on disk keeps unsent batches across learner outages and its own restarts. A slow peer is
welcome: its batches carry the policy version they were sampled with, and the learner uses stale data.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import random
import threading
import time
from pathlib import Path

import torch

from heterorl.coordinator.runconfig import RunSettings
from heterorl.protocol import Identity, encode
from heterorl.protocol.checkpoint import deserialize_state_dict
from heterorl.protocol.chunks import ChunkServer, fetch_checkpoint, latest_manifest
from heterorl.protocol.outbox import Outbox
from heterorl.protocol.store import ChunkStore
from heterorl.protocol.trajectories import TrajectorySender, new_batch_id

from ..model.loader import load_config, load_tokenizer
from ..model.prompts import PromptFormat
from ..rollout import SamplingParams, make_backend
from ..rollout.resilient import ResilientBackend, is_oom
from ..tasks import get_task
from .hardware import Hardware, rows_that_fit
from .heartbeat import Heartbeat, Status
from .join import Joined
from .weights import resolve_model, weights_hash

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplerOptions:
    slowdown: float = 1.0  # >1 sleeps (slowdown-1)× each batch's generation time: a slower peer, on purpose
    max_pending: int = 4  # batches waiting in the outbox before generation pauses
    max_batches: int | None = None  # stop after this many (tests); None: run until stopped
    store_bytes: int = 2 << 30
    check_every_s: float = 0.5
    drain_s: float = 5.0  # on shutdown, how long to keep sending what is queued
    backend: str = "auto"  # rollout engine: auto | hf | vllm
    engine_dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on a CPU
    threads: int | None = None  # the engine's CPU threads (None: its default)
    engine_restarts: int = 2  # a dead vLLM engine is restarted this often, then the sampler falls back to hf


MAX_PROMPT_TOKENS = 1024  # the engine's context: prompt + max_new_tokens, within the model's own limit


class Sampler:
    def __init__(
        self,
        joined: Joined,
        identity: Identity,
        state_dir: Path,
        hardware: Hardware,
        options: SamplerOptions = SamplerOptions(),
    ):
        self.joined, self.node, self.identity = joined, joined.node, identity
        self.settings = RunSettings.from_spec(joined.spec)
        self.state_dir, self.hw, self.opt = state_dir, hardware, options
        self.status = Status()
        self.version: int | None = None
        self.batches = 0
        self.tokens = 0
        self.loaded: list[int] = []
        s = self.settings
        self.model_dir = resolve_model(s.model, state_dir / "models")
        self.tok = load_tokenizer(self.model_dir)
        config = load_config(self.model_dir)
        if config.vocab_size != s.vocab_size:
            raise ValueError(f"model {s.model} has vocab {config.vocab_size}, the run says {s.vocab_size}")
        self.prompts = PromptFormat(self.tok, s.chat)
        self.task = get_task(s.task, **s.task_params)
        self.sampling = SamplingParams(s.temperature, s.top_p, s.max_new_tokens)
        rows = s.sampler.prompts_per_batch * s.learner.group_size
        self.gen_rows = min(rows, rows_that_fit(hardware, config, 64 + s.max_new_tokens))
        self.engine_dtype = (
            options.engine_dtype
            if options.engine_dtype != "auto"
            else "bfloat16"
            if hardware.device == "cuda"
            else "float32"
        )
        max_len = getattr(config, "max_position_embeddings", None) or MAX_PROMPT_TOKENS + s.max_new_tokens
        self._engine = {
            "device": hardware.device,
            "dtype": self.engine_dtype,
            "memory_bytes": hardware.memory_bytes,
            "threads": options.threads,
            "max_rows": rows,
            "max_model_len": min(max_len, MAX_PROMPT_TOKENS + s.max_new_tokens),
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
        self.rng = random.Random(int.from_bytes(identity.public_key[:8], "big") ^ time.time_ns())
        self.outbox = Outbox(state_dir / "outbox.sqlite")
        self.store = ChunkStore(state_dir / "chunks", max_bytes=options.store_bytes)
        self.server = ChunkServer(self.store)
        self.sender = TrajectorySender(self.node, self.outbox, s.run_id, s.learner_keys)
        self._last_check = 0.0
        self._refused: set[bytes] = set()  # manifests whose weights we refused: not fetched again
        self._stop = threading.Event()

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
        if time.monotonic() - self._last_check < self.opt.check_every_s and self.version is not None:
            return
        self._last_check = time.monotonic()
        s = self.settings
        newer = self.version + 1 if self.version is not None else 0
        try:
            found = self._interruptible(latest_manifest(self.node, s.run_id, s.learner_keys, newer), 30)
        except Exception as e:
            log.warning("checkpoint lookup failed: %s", e)
            return
        if found is None:
            return
        raw, body = found
        v = body["version"]
        if hashlib.sha256(raw).digest() in self._refused:
            return
        self.status.state = f"fetching version {v}"
        level = logging.INFO if not self.loaded or v % 10 == 0 else logging.DEBUG  # logs stay bounded
        log.log(level, "fetching checkpoint version %d (%d bytes)", v, body["total_size"])
        try:
            fetch = fetch_checkpoint(
                self.node, self.store, raw, run_id=s.run_id, learner_keys=s.learner_keys, timeout=120
            )
            report = self._interruptible(fetch, 130)
            data = self.store.assemble(v)
        except Exception as e:  # a network or disk failure: try again at the next check
            log.warning("could not switch to version %d: %s", v, e)
            return
        try:
            if v == 0 and weights_hash(data) != s.initial_checkpoint:
                raise ValueError("version 0 does not match the RunSpec's initial checkpoint hash")
            self.backend.load_weights(deserialize_state_dict(data))
        except Exception as e:  # these signed bytes will never do: refuse this manifest for good
            self._refused.add(hashlib.sha256(raw).digest())
            held = "no checkpoint yet" if self.version is None else f"keeping version {self.version}"
            log.error("refused checkpoint version %d: %s; %s", v, e, held)
            self.status.state = f"refused checkpoint version {v}"
            return
        self.version = v
        self.loaded.append(v)
        with (self.state_dir / "versions.jsonl").open("a") as f:
            f.write(
                json.dumps(
                    {
                        "version": v,
                        "time": time.time(),
                        "fetched_bytes": report.fetched_bytes,
                        "reused_bytes": report.reused_bytes,
                    }
                )
                + "\n"
            )
        log.log(
            level,
            "now sampling with version %d (fetched %d bytes, reused %d from the parent)",
            v,
            report.fetched_bytes,
            report.reused_bytes,
        )

    def _interruptible(self, coro, timeout: float):
        """Run ``coro`` on the network loop; give up (cancelling it) on timeout, when asked to stop, or when
        the libp2p daemon has died (nothing on the network can succeed any more)."""
        fut = self.node.spawn(coro)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                why = (
                    "stopped"
                    if self._stop.is_set()
                    else "the libp2p daemon died"
                    if not self.node.daemon_alive()
                    else f"no result in {timeout:.0f} s"
                    if time.monotonic() > deadline
                    else None
                )
                if why is not None:
                    fut.cancel()
                    raise TimeoutError(why) from None

    # ---- rollouts ----

    def _generate(self, prompt_ids: list[list[int]]):
        while True:
            try:
                return [
                    self.backend.generate(prompt_ids[i : i + self.gen_rows], self.sampling)
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

    def _held_weights(self):
        """The weights of the version held, from the chunk store (for an engine that restarted)."""
        return None if self.version is None else deserialize_state_dict(self.store.assemble(self.version))

    def make_batch(self) -> tuple[bytes, bytes, int]:
        """Generate one TrajectoryBatch with the current policy; returns (batch id, signed bytes, tokens)."""
        s = self.settings
        g = s.learner.group_size
        examples = [self.task.sample(self.rng) for _ in range(s.sampler.prompts_per_batch)]
        prompts = [e.prompt for e in examples for _ in range(g)]
        encoded = {p: self.prompts.encode(p) for p in dict.fromkeys(prompts)}  # a group repeats its prompt
        rows, tokens, i = [], 0, 0
        for roll in self._generate([encoded[p] for p in prompts]):
            for j in range(len(roll.texts)):
                n = int(roll.lengths[j])
                reward = self.task.reward(prompts[i], roll.texts[j], examples[i // g].reference)
                rows.append(
                    {
                        "group": i // g,
                        "prompt_ids": list(roll.prompt_ids[j]),
                        "completion_ids": roll.completion_ids[j, :n].tolist(),
                        "logprobs": [min(0.0, x) for x in roll.logprobs[j, :n].tolist()],
                        "reward": float(reward),
                    }
                )
                tokens += n
                i += 1
        bid = new_batch_id()
        body = {
            "run_id": s.run_id,
            "batch_id": bid,
            "policy_version": self.version,
            "timestamp": time.time(),
            "rows": rows,
            "engine": self.backend.name,
            "engine_dtype": self.backend.dtype,
        }
        return bid, encode("TrajectoryBatch", body, self.identity), tokens

    # ---- the loop ----

    def _status(self) -> Status:
        st = self.status
        st.policy_version = -1 if self.version is None else self.version
        st.stats = {
            "batches_made": self.batches,
            "outbox": len(self.outbox),
            "loaded_versions": len(self.loaded),
            "gen_rows": self.gen_rows,
            **{k.split("/")[-1]: v for k, v in self.sender.stats().items()},
            **{k.split("/")[-1]: v for k, v in self.server.stats().items()},
        }
        return st

    def run(self, stop: threading.Event) -> None:
        self._stop = stop
        self.node.call(self.server.attach(self.node))
        sender_task = self.node.spawn(self.sender.run())
        hb = Heartbeat(
            self.node, self.settings.run_id, "sampler", self.hw.describe(), self._status, self.state_dir
        )
        hb_task = self.node.spawn(hb.run())
        try:
            self._loop(stop)
        finally:
            if self.node.daemon_alive():  # else nothing can be sent: leave at once
                self._drain()
                self.status.state = "leaving"
                try:
                    self.node.call(hb.publish_once(), timeout=10)
                except Exception as e:
                    log.debug("last heartbeat: %s", e)
            hb_task.cancel()
            sender_task.cancel()
            queued = len(self.outbox)
            self.node.close()  # nothing may touch the outbox after this
            self.outbox.close()
            self.backend.close()
            log.info("left: %d batches made, %d left queued for next time", self.batches, queued)

    def _loop(self, stop: threading.Event) -> None:
        ema = 0.0
        while not stop.is_set():
            self.node.check_daemon()
            if self.opt.max_batches is not None and self.batches >= self.opt.max_batches:
                return
            self._maybe_switch()
            if self.version is None:
                self.status.state = "waiting for a checkpoint"
                stop.wait(0.5)
                continue
            if len(self.outbox) >= self.opt.max_pending:
                self.status.state = f"waiting for the learner ({self.sender.state})"
                stop.wait(0.2)
                continue
            self.status.state = f"generating with version {self.version}"
            t = time.perf_counter()
            bid, data, tokens = self.make_batch()
            dt = time.perf_counter() - t
            self.outbox.put(bid, data, self.version)
            self.sender.notify()
            self.batches += 1
            self.tokens += tokens
            rate = tokens / max(dt, 1e-6) / self.opt.slowdown
            ema = rate if ema == 0 else 0.8 * ema + 0.2 * rate
            self.status.tokens_per_s = ema
            if self.opt.slowdown > 1:
                self.status.state = "throttled (--sampler-slowdown)"
                stop.wait(dt * (self.opt.slowdown - 1))

    def _drain(self) -> None:
        deadline = time.monotonic() + self.opt.drain_s
        if len(self.outbox):
            self.status.state = "sending what is queued before leaving"
            log.info("sending %d queued batch(es) before leaving", len(self.outbox))
        while len(self.outbox) and time.monotonic() < deadline:
            time.sleep(0.1)
