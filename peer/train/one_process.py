"""``heterorl train --local``: sample → reward → learn in one process, with an optional policy lag."""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from heterorl.protocol.settings import AdapterSettings, LearnerSettings, RunConfig, default_of
from heterorl.protocol.storage.files import atomic_write_json
from heterorl.protocol.wire.checkpoint import serialize_state_dict

from .. import objectives
from ..learner.rows import Rows
from ..learner.trainer import Trainer
from ..learner.update import StepOptions
from ..model import adapter, load_model
from ..model.prompts import CHAT_MODES, PromptFormat
from ..rollout import SamplingParams, make_backend
from ..tasks import get_task
from .policy_lag import PolicyLag

log = logging.getLogger(__name__)


def _run_default(name: str):
    """run.toml's default of setting ``name`` (:class:`RunConfig`)."""
    return default_of(RunConfig, name)


def _learner_default(name: str):
    """run.toml's default of ``[learner]`` setting ``name``."""
    return default_of(LearnerSettings, name)


@dataclass(frozen=True)
class OneProcessConfig:
    """Settings of one local run (CLI flags map one to one); the defaults are a run's (protocol.settings)."""

    model: str
    task: str = _run_default("task")
    task_params: dict = field(default_factory=lambda: _run_default("task_params"))
    objective: str = _run_default("objective")
    advantage: str | None = _run_default("advantage")  # None = the objective's own estimator
    steps: int = 200
    prompts_per_step: int = _learner_default("prompts_per_update")
    group_size: int = _learner_default("group_size")
    delay: int = 0
    lr: float = _run_default("lr")
    temperature: float = _run_default("temperature")
    top_p: float = _run_default("top_p")
    max_new_tokens: int = _run_default("max_new_tokens")
    grad_clip: float = _learner_default("grad_clip")
    seed: int = 0
    backend: str = "hf"
    engine_dtype: str = "float32"
    chat: str = _run_default("chat")
    # truncated IS against the engine/learner mismatch (Yao et al. 2025)
    tis_cap: float | None = _learner_default("tis_cap")
    micro_batch_tokens: int | None = _learner_default("micro_batch_tokens")
    gradient_checkpointing: bool = _learner_default("gradient_checkpointing")
    objective_params: dict = field(default_factory=lambda: _run_default("objective_params"))
    # LoRA on the frozen base (hf rollouts); None: full fine-tuning
    adapter: AdapterSettings | None = _run_default("adapter")
    device: str = "cpu"  # where the policy trains and the hf backend generates: cpu or cuda (vLLM: its own)

    @property
    def learner(self) -> LearnerSettings:
        """The ``[learner]`` settings this loop's update uses (:meth:`StepOptions.from_settings`)."""
        return LearnerSettings(
            prompts_per_update=self.prompts_per_step,
            group_size=self.group_size,
            grad_clip=self.grad_clip,
            micro_batch_tokens=self.micro_batch_tokens,
            gradient_checkpointing=self.gradient_checkpointing,
            tis_cap=self.tis_cap,
        )

    def __post_init__(self) -> None:
        objectives.default_advantage(self.objective)  # validates the name
        for name in ("steps", "prompts_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.learner  # noqa: B018  (validates grad_clip, tis_cap, micro_batch_tokens like run.toml's)
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend must be hf or vllm, got {self.backend!r}")
        if self.chat not in CHAT_MODES:
            raise ValueError(f"chat must be one of {', '.join(CHAT_MODES)}, got {self.chat!r}")
        if self.adapter is not None and self.backend != "hf":
            raise ValueError("adapter runs in the local loop use the hf backend (the swarm's samplers: any)")


def run_one_process(
    cfg: OneProcessConfig,
    out: str | Path,
    progress: bool = True,
    on_update: Callable[[int, torch.nn.Module, dict], None] | None = None,
    save_checkpoint: bool = True,
) -> dict:
    """Run the loop, write ``metrics.jsonl``, ``summary.json`` and ``checkpoint/``; return the summary.

    ``on_update(step, policy, stats)`` is called once before the first update (step -1, empty stats) and after
    every update (what ``heterorl bench weights`` measures checkpoints on).
    """
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    policy, tok = load_model(cfg.model, device=cfg.device)
    checkpoint_bytes = len(serialize_state_dict(adapter.base_state(policy)))
    if cfg.adapter is not None:
        policy = adapter.wrap(policy, cfg.adapter)
        checkpoint_bytes = len(adapter.adapter_bytes(policy))
    prompts_fmt = PromptFormat(tok, cfg.chat)
    behaviour = copy.deepcopy(policy) if cfg.delay and cfg.backend == "hf" else policy
    lag = PolicyLag(policy, behaviour, cfg.delay)
    task = get_task(cfg.task, **cfg.task_params)
    rows_per_step = cfg.prompts_per_step * cfg.group_size
    threads = torch.get_num_threads()
    backend = make_backend(
        cfg.backend,
        cfg.model,
        tok,
        dtype=cfg.engine_dtype,
        model=behaviour,
        threads=threads,
        max_rows=rows_per_step,
        seed=cfg.seed,
    )
    log.info("rollouts: %s; prompts: %s", backend.describe(), prompts_fmt.describe())
    engine_version = 0 if cfg.backend == "hf" or cfg.engine_dtype == "float32" else -1
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    trainer = Trainer(
        policy, StepOptions.from_settings(cfg), tok.pad_token_id, adapter=cfg.adapter is not None
    )
    trainable = [p for p in policy.parameters() if p.requires_grad]

    reward_curve: list[float] = []
    if on_update is not None:
        on_update(-1, policy, {})
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"{cfg.objective} delay={cfg.delay}", disable=not progress)
    with (out / "metrics.jsonl").open("w") as metrics:
        for step in bar:
            if backend.name == "hf":
                backend.model, version = lag.behaviour()
            else:  # the engine holds its own weights: reload them when the behaviour version moves on
                state, version = lag.behaviour_state()
                if version != engine_version:
                    backend.load_weights(state)
                    engine_version = version
            examples = [task.sample(rng) for _ in range(cfg.prompts_per_step)]
            encoded = [prompts_fmt.encode(e.prompt) for e in examples]
            roll = backend.generate([ids for ids in encoded for _ in range(cfg.group_size)], sampling)
            rewards = torch.tensor(
                [
                    task.reward(e.prompt, roll.texts[i], e.reference)
                    for i, e in enumerate(e for e in examples for _ in range(cfg.group_size))
                ]
            )
            rows = Rows(
                prompts=roll.prompt_ids,
                completions=roll.completion_ids,
                mask=roll.completion_mask,
                logq=roll.logprobs,
                rewards=rewards,
                group_ids=torch.arange(cfg.prompts_per_step).repeat_interleave(cfg.group_size),
                versions=torch.full((rows_per_step,), version),
            )
            stats = trainer.step(rows)
            lag.step()
            if on_update is not None:
                on_update(step, policy, stats)

            mean_r = stats["reward/mean"]
            reward_curve.append(mean_r)
            row = {
                "step": step,
                "behaviour_version": version,
                "completion_len/mean": float(roll.lengths.float().mean()),
                "time_s": time.perf_counter() - t0,
                **stats,
                "staleness": lag.version - 1 - version,
            }
            metrics.write(json.dumps(row) + "\n")
            bar.set_postfix(reward=f"{mean_r:.2f}", stale=row["staleness"], ess=f"{stats['is/ess']:.2f}")
    backend.close()

    if save_checkpoint:
        policy.save_pretrained(out / "checkpoint", safe_serialization=True)
        tok.save_pretrained(out / "checkpoint")
    k = min(20, len(reward_curve))
    summary = {
        "objective": cfg.objective,
        "advantage": cfg.advantage or objectives.default_advantage(cfg.objective),
        "delay": cfg.delay,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "device": cfg.device,
        "reward_curve": reward_curve,
        "reward_first20": sum(reward_curve[:k]) / k,
        "reward_last20": sum(reward_curve[-k:]) / k,
        "wall_s": time.perf_counter() - t0,
        "checkpoint_bytes": checkpoint_bytes,  # one published version (float32): adapters or all weights
        "trainable_params": sum(p.numel() for p in trainable),
        "config": asdict(cfg),
    }
    atomic_write_json(out / "summary.json", summary, indent=1)
    log.info(
        "done: reward first-20 %.3f -> last-20 %.3f in %.0f s; wrote %s",
        summary["reward_first20"],
        summary["reward_last20"],
        summary["wall_s"],
        out,
    )
    return summary
