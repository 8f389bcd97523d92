"""TRL's ``GRPOTrainer`` on the configuration of ``heterorl train --local``: the baseline people use today.

Same model, task, prompts per step, group size, completion length and learning rate; one generation per
optimiser step (``steps_per_generation=1``, ``num_iterations=1``), no reference model (``beta=0``), no
gradient checkpointing, TRL's own ``grpo`` loss. Returns the wall-clock time at the end of every step, so
the caller measures steps per second over the same steady window as for our loop.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from pathlib import Path


def run_trl_grpo(
    model_path: str,
    *,
    task_name: str,
    task_params: dict,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    max_new_tokens: int,
    lr: float,
    seed: int,
    out: Path,
) -> dict:
    """Train ``steps`` GRPO steps with TRL; returns step end times, mean completion length, rewards."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from heterorl.peer.model import load_model
    from heterorl.peer.tasks import get_task

    task = get_task(task_name, **task_params)
    model, tok = load_model(model_path)
    rng = random.Random(seed)
    examples = [task.sample(rng) for _ in range(steps * prompts_per_step)]
    # our backend puts BOS before every prompt; TRL tokenizes the text as given, so the BOS goes in the text
    bos = tok.bos_token or ""
    data = Dataset.from_dict(
        {"prompt": [bos + e.prompt for e in examples], "reference": [e.reference for e in examples]}
    )

    def task_reward(prompts, completions, reference, **_):
        return [
            task.reward(p.removeprefix(bos), c, r)
            for p, c, r in zip(prompts, completions, reference, strict=True)
        ]

    task_reward.__name__ = f"{task_name}_reward"
    cfg = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=prompts_per_step * group_size,
        num_generations=group_size,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=seed,
    )

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append(dict(logs))

    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints every step's log dict
        trainer.train()
    lengths = [r["completions/mean_length"] for r in clock.logs if "completions/mean_length" in r]
    rewards = [r["reward"] for r in clock.logs if "reward" in r]
    return {
        "step_end_s": clock.ends,
        "mean_length": sum(lengths) / len(lengths) if lengths else float("nan"),
        "reward": rewards,
    }
