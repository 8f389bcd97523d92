"""``heterorl train --local``: sample → reward → learn in one process, with an optional policy lag."""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import objectives
from ..model import completion_logprobs, load_model
from ..rollout import SamplingParams, make_backend
from ..tasks import get_task
from .policy_lag import PolicyLag

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalConfig:
    """Settings of one local run (CLI flags map one to one)."""

    model: str
    task: str = "arithmetic"
    task_params: dict = field(default_factory=lambda: {"digits": 1})
    objective: str = objectives.DEFAULT_OBJECTIVE
    advantage: str | None = None  # None = the objective's own estimator
    steps: int = 200
    prompts_per_step: int = 16
    group_size: int = 8
    delay: int = 0
    lr: float = 1e-3
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    grad_clip: float = 1.0
    seed: int = 0
    backend: str = "hf"
    objective_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        objectives.default_advantage(self.objective)  # validates the name
        for name in ("steps", "prompts_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay}")


def run_local(cfg: LocalConfig, out: str | Path, progress: bool = True) -> dict:
    """Run the loop, write ``metrics.jsonl``, ``summary.json`` and ``checkpoint/``; return the summary."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    policy, tok = load_model(cfg.model)
    behaviour = copy.deepcopy(policy)
    lag = PolicyLag(policy, behaviour, cfg.delay)
    task = get_task(cfg.task, **cfg.task_params)
    backend = make_backend(cfg.backend, tok)
    sampling = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
    adv_name = cfg.advantage or objectives.default_advantage(cfg.objective)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    params = {"max_len": cfg.max_new_tokens, **cfg.objective_params}

    reward_curve: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"{cfg.objective} delay={cfg.delay}", disable=not progress)
    with (out / "metrics.jsonl").open("w") as metrics:
        for step in bar:
            model_b, version = lag.behaviour()
            examples = [task.sample(rng) for _ in range(cfg.prompts_per_step)]
            prompts = [e.prompt for e in examples for _ in range(cfg.group_size)]
            refs = [e.reference for e in examples for _ in range(cfg.group_size)]
            model_b.eval()
            roll = backend.generate(model_b, prompts, sampling)
            rewards = torch.tensor(
                [task.reward(p, c, r) for p, c, r in zip(prompts, roll.texts, refs, strict=True)]
            )
            group_ids = torch.arange(cfg.prompts_per_step).repeat_interleave(cfg.group_size)
            adv = objectives.advantages(adv_name, rewards, group_ids)
            staleness = torch.full((len(prompts),), float(lag.version - version))

            policy.train()
            logp = completion_logprobs(
                policy,
                roll.prompt_ids,
                roll.completion_ids,
                roll.completion_mask,
                tok.pad_token_id,
                cfg.temperature,
            )
            loss, stats = objectives.compute(
                cfg.objective,
                logp,
                roll.logprobs,
                roll.completion_mask,
                adv,
                group_ids,
                staleness=staleness,
                **params,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip))
            opt.step()
            lag.step()

            mean_r = float(rewards.mean())
            reward_curve.append(mean_r)
            row = {
                "step": step,
                "reward/mean": mean_r,
                "behaviour_version": version,
                "staleness": lag.version - 1 - version,
                "grad_norm": grad_norm,
                "completion_len/mean": float(roll.lengths.float().mean()),
                "time_s": time.perf_counter() - t0,
                **stats,
            }
            metrics.write(json.dumps(row) + "\n")
            bar.set_postfix(reward=f"{mean_r:.2f}", stale=row["staleness"], ess=f"{stats['is/ess']:.2f}")

    policy.save_pretrained(out / "checkpoint", safe_serialization=True)
    tok.save_pretrained(out / "checkpoint")
    k = min(20, len(reward_curve))
    summary = {
        "objective": cfg.objective,
        "advantage": adv_name,
        "delay": cfg.delay,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "reward_curve": reward_curve,
        "reward_first20": sum(reward_curve[:k]) / k,
        "reward_last20": sum(reward_curve[-k:]) / k,
        "wall_s": time.perf_counter() - t0,
        "config": asdict(cfg),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log.info(
        "done: reward first-20 %.3f -> last-20 %.3f in %.0f s; wrote %s",
        summary["reward_first20"],
        summary["reward_last20"],
        summary["wall_s"],
        out,
    )
    return summary
