"""``heterorl train --local``: sample → reward → learn in one process, with an optional policy lag."""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from heterorl.protocol.settings import TINY_MODEL, Run, to_dict
from heterorl.protocol.storage.files import atomic_write_json
from heterorl.protocol.wire.checkpoint import serialize_state_dict

from .. import objectives
from ..learner.evaluate import HeldOutEval
from ..learner.rows import Rows
from ..learner.trainer import Trainer
from ..learner.update import StepOptions
from ..model import TINY_MODEL_DIR, adapter, ensure_model, load_model
from ..model.prompts import PromptFormat
from ..rollout import SamplingParams, make_backend
from ..tasks import named_reward
from ..tasks.sandbox import TaskSpec, sandboxed_task
from .lineage_local import LocalLineage
from .policy_lag import PolicyLag

log = logging.getLogger(__name__)

FINAL_EVALS = 5  # ``final_eval``: the mean of the last this many evaluations of the current policy (noise)


@dataclass(frozen=True)
class OneProcessConfig:
    """One local run: the run's settings (the swarm's tree, :class:`~heterorl.protocol.settings.Run`) and the
    loop's own. ``run.model.path`` "tiny" is the offline tiny model, built where it is missing."""

    run: Run = field(default_factory=Run)
    steps: int = 200  # learner updates
    delay: int = 0  # rollouts come from the policy this many versions old
    seed: int = 0
    backend: str = "hf"  # rollout engine: hf | vllm
    engine_dtype: str = "float32"  # the rollout engine's dtype (the learner trains a float32 master)
    device: str = "cpu"  # where the policy trains and the hf backend generates: cpu or cuda (vLLM: its own)
    learners: int = 1  # > 1: learner peers of one lineage, each on its own rows, as run.lineage says

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend must be hf or vllm, got {self.backend!r}")
        if self.learners < 1 or (self.learners > 1 and self.run.adapter is not None):
            raise ValueError(f"learners must be >= 1 (and 1 in an adapter run), got {self.learners}")
        if self.run.adapter is not None and self.backend != "hf":
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
    run = cfg.run
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model_path = ensure_model(TINY_MODEL_DIR if run.model.path == TINY_MODEL else run.model.path, cfg.seed)
    policy, tok = load_model(model_path, device=cfg.device)
    checkpoint_bytes = len(serialize_state_dict(adapter.base_state(policy)))
    if run.adapter is not None:
        policy = adapter.wrap(policy, run.adapter)
        checkpoint_bytes = len(adapter.adapter_bytes(policy))
    prompts_fmt = PromptFormat(tok, run.model.chat)
    behaviour = copy.deepcopy(policy) if cfg.delay and cfg.backend == "hf" else policy
    lag = PolicyLag(policy, behaviour, cfg.delay)
    params = run.task.params  # the user's own settings: the reward they name is theirs to run
    # rewards on sampled text run in a worker process (peer/tasks/sandbox.py), as they do on a peer
    task = sandboxed_task(TaskSpec(run.task.name, params, named_reward(params)))
    prompts, group = run.learner.prompts_per_update, run.learner.group_size
    rows_per_step = prompts * group
    threads = torch.get_num_threads()
    backend = make_backend(
        cfg.backend,
        model_path,
        tok,
        dtype=cfg.engine_dtype,
        model=behaviour,
        threads=threads,
        max_rows=rows_per_step,
        seed=cfg.seed,
    )
    log.info("rollouts: %s; prompts: %s", backend.describe(), prompts_fmt.describe())
    engine_version = 0 if cfg.backend == "hf" or cfg.engine_dtype == "float32" else -1
    sampling = SamplingParams(run.sampling.temperature, run.sampling.top_p, run.sampling.max_new_tokens)
    trainer = Trainer(
        policy, StepOptions.from_settings(run), tok.pad_token_id, adapter=run.adapter is not None
    )
    trainable = [p for p in policy.parameters() if p.requires_grad]
    lineage = None
    if cfg.learners > 1:  # each version: every learner's update of its own rows, combined as the swarm does
        lineage = LocalLineage(trainer, cfg.learners, run.lineage, StepOptions.from_settings(run))

    every = run.learner.eval_every
    if every and cfg.steps < every:  # a run shorter than one evaluation period (a smoke run): no evaluations,
        log.info(  # which would cost more than the run (200 prompts x 5 generations, at the start and end)
            "held-out evaluation off: %d updates, fewer than learner.eval_every (%d)", cfg.steps, every
        )
        every = 0
    evaluate = None
    if every:
        evaluate = HeldOutEval(
            task, prompts_fmt, tok, sampling, run.learner.eval_samples, run.learner.eval_prompts
        )
        log.info("held-out evaluation every %d updates: %s", every, evaluate.describe())
    eval_curve: list[list[float]] = []  # [update, sampled, greedy]

    def evaluated(updates: int) -> dict[str, float]:
        if evaluate is None or not (updates % every == 0 or updates == cfg.steps):
            return {}
        e = evaluate(policy)
        eval_curve.append([updates, e["eval/sampled"], e["eval/greedy"]])
        return {**e, "eval/step": float(updates)}

    reward_curve: list[float] = []
    if on_update is not None:
        on_update(-1, policy, {})
    first_eval = evaluated(0)
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"{run.objective.name} delay={cfg.delay}", disable=not progress)
    with (out / "metrics.jsonl").open("w") as metrics:
        for step in bar:
            if backend.name == "hf":
                backend.model, version = lag.behaviour()
            else:  # the engine holds its own weights: reload them when the behaviour version moves on
                state, version = lag.behaviour_state()
                if version != engine_version:
                    backend.load_weights(state)
                    engine_version = version
            parts, lengths = [], []
            for _ in range(cfg.learners):
                examples = [task.sample(rng) for _ in range(prompts)]
                encoded = [prompts_fmt.encode(e.prompt) for e in examples]
                roll = backend.generate([ids for ids in encoded for _ in range(group)], sampling)
                rewards = torch.tensor(
                    [
                        task.reward(e.prompt, roll.texts[i], e.reference)
                        for i, e in enumerate(e for e in examples for _ in range(group))
                    ]
                )
                parts.append(
                    Rows(
                        prompts=roll.prompt_ids,
                        completions=roll.completion_ids,
                        mask=roll.completion_mask,
                        logq=roll.logprobs,
                        rewards=rewards,
                        group_ids=torch.arange(prompts).repeat_interleave(group),
                        versions=torch.full((rows_per_step,), version),
                    )
                )
                lengths.append(roll.lengths.float().mean())
            stats = trainer.step(parts[0]) if lineage is None else lineage.step(parts)
            lag.step()
            if on_update is not None:
                on_update(step, policy, stats)

            mean_r = stats["reward/mean"]
            reward_curve.append(mean_r)
            row = {
                "step": step,
                "behaviour_version": version,
                "completion_len/mean": float(sum(lengths) / len(lengths)),
                "time_s": time.perf_counter() - t0,
                **stats,
                "staleness": lag.version - 1 - version,
                **first_eval,
                **evaluated(step + 1),
            }
            first_eval = {}
            metrics.write(json.dumps(row) + "\n")
            held = {"eval": f"{eval_curve[-1][1]:.2f}"} if eval_curve else {}
            bar.set_postfix(
                reward=f"{mean_r:.2f}", **held, stale=row["staleness"], ess=f"{stats['is/ess']:.2f}"
            )
    backend.close()
    rewards = task.scorer.stats()  # type: ignore[union-attr]
    task.scorer.close()  # type: ignore[union-attr]

    if save_checkpoint:
        policy.save_pretrained(out / "checkpoint", safe_serialization=True)
        tok.save_pretrained(out / "checkpoint")
    k = min(20, len(reward_curve))
    summary = {
        "objective": run.objective.name,
        "advantage": run.objective.advantage or objectives.default_advantage(run.objective.name),
        "delay": cfg.delay,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "device": cfg.device,
        "reward_curve": reward_curve,
        "reward_first20": sum(reward_curve[:k]) / k,
        "reward_last20": sum(reward_curve[-k:]) / k,
        # the current policy on held-out prompts: [update, sampled, greedy] and the last evaluations' mean
        "eval_curve": eval_curve,
        "final_eval": (
            sum(e[1] for e in eval_curve[-FINAL_EVALS:]) / len(eval_curve[-FINAL_EVALS:])
            if eval_curve
            else None
        ),
        "final_eval_greedy": (
            sum(e[2] for e in eval_curve[-FINAL_EVALS:]) / len(eval_curve[-FINAL_EVALS:])
            if eval_curve
            else None
        ),
        "wall_s": time.perf_counter() - t0,
        "checkpoint_bytes": checkpoint_bytes,  # one published version (float32): adapters or all weights
        "trainable_params": sum(p.numel() for p in trainable),
        "rewards": rewards,  # the reward worker's counts: answers, timeouts, crashes, errors, ...
        "config": to_dict(cfg),
    }
    atomic_write_json(out / "summary.json", summary, indent=1)
    log.info(
        "done: reward first-20 %.3f -> last-20 %.3f, held-out %s, in %.0f s; wrote %s",
        summary["reward_first20"],
        summary["reward_last20"],
        "-" if summary["final_eval"] is None else f"{summary['final_eval']:.3f}",
        summary["wall_s"],
        out,
    )
    return summary
