"""TRL's ``GRPOTrainer`` on the configuration of ``heterorl train --local``: the baseline people use today.

Same model, task, prompts (the chat template for instruct models, as ``PromptFormat`` encodes them: TRL
renders a conversational prompt with the same template), prompts per step, group size, completion length and
learning rate; one generation per optimiser step (``steps_per_generation=1``, ``num_iterations=1``), no
reference model (``beta=0``), no gradient checkpointing, TRL's own ``grpo`` loss, generation with
``transformers`` (no vLLM). :func:`run_trl_grpo` returns the wall-clock time at the end of every step, so the
caller measures steps per second over the same steady window as for our loop; :func:`trl_generator` is the
generation call alone.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from collections.abc import Callable
from pathlib import Path


def _config(
    out: Path,
    *,
    rows: int,
    group_size: int,
    max_new_tokens: int,
    lr: float,
    steps: int,
    seed: int,
    device: str = "cpu",
):
    """On ``device`` "cuda": bf16 mixed precision over float32 weights, as our learner's autocast."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=rows,
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
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=seed,
    )


def _dataset(tok, texts: list[str], chat: str, **columns):
    """Task prompts as TRL takes them: conversational (TRL applies the chat template) when ``PromptFormat``
    would use the template, else plain text with the BOS our backends put first (TRL tokenizes text as is)."""
    from datasets import Dataset

    from heterorl.peer.model.prompts import PromptFormat

    if PromptFormat(tok, chat).chat:
        prompts = [[{"role": "user", "content": t}] for t in texts]
    else:
        prompts = [(tok.bos_token or "") + t for t in texts]
    return Dataset.from_dict({"prompt": prompts, **columns})


def _text(x, bos: str) -> str:
    """A prompt or completion as TRL passes it to reward functions (messages or text) -> its text."""
    return x[-1]["content"] if isinstance(x, list) else x.removeprefix(bos)


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
    chat: str = "auto",
    device: str = "cpu",
) -> dict:
    """Train ``steps`` GRPO steps with TRL; returns step end times, mean completion length, rewards."""
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from heterorl.peer.model import load_model
    from heterorl.peer.tasks import get_task, named_reward

    task = get_task(task_name, allow_rewards=named_reward(task_params), **task_params)
    model, tok = load_model(model_path, device=device)
    rng = random.Random(seed)
    examples = [task.sample(rng) for _ in range(steps * prompts_per_step)]
    data = _dataset(tok, [e.prompt for e in examples], chat, reference=[e.reference for e in examples])
    bos = tok.bos_token or ""

    def task_reward(prompts, completions, reference, **_):
        return [
            task.reward(_text(p, bos), _text(c, ""), r)
            for p, c, r in zip(prompts, completions, reference, strict=True)
        ]

    task_reward.__name__ = f"{task_name}_reward"
    cfg = _config(
        out,
        rows=prompts_per_step * group_size,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        lr=lr,
        steps=steps,
        seed=seed,
        device=device,
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


def trl_generator(
    model, tok, *, group_size: int, max_new_tokens: int, out: Path, device: str = "cpu"
) -> Callable[[list[list[int]]], list[list[int]]]:
    """TRL's generation path alone: ``prompt_ids -> completion ids`` (up to and including EOS, unpadded).

    Builds a ``GRPOTrainer`` with the configuration of :func:`run_trl_grpo` around ``model`` and calls the
    method its training step generates with, ``GRPOTrainer._generate_single_turn``; without vLLM that is
    ``unwrap_model_for_generation(model, accelerator, generation_kwargs=...)`` then ``unwrapped.generate(
    input_ids, attention_mask, generation_config=GenerationConfig(do_sample, temperature, top_p, top_k,
    max_new_tokens, eos/pad ids, disable_compile))`` on left-padded prompts, and a mask after the first EOS.
    ``model`` is not trained; TRL sets its pad token id (the tokenizer's) in its configs.
    """
    from trl import GRPOTrainer

    cfg = _config(
        out,
        rows=group_size,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        lr=1e-6,
        steps=1,
        seed=0,
        device=device,
    )
    data = _dataset(tok, ["1+1="] * group_size, "off")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=cfg,
        train_dataset=data,
        processing_class=tok,
    )

    def generate(prompt_ids: list[list[int]]) -> list[list[int]]:
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, group_size)
        return [list(c) for c in completion_ids]

    return generate
