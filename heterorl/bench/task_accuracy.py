"""Starting accuracy of a model on a task, before any RL: is there signal (right sometimes, not always)?

``task_accuracy(model, tokenizer, task, n=128)`` samples ``n`` prompts from the task, generates one reply per
prompt (sampled at ``temperature``, top-k and top-p off as in the rollouts; ``temperature=0`` is greedy), and
scores each with the task's reward. Instruct models get their chat template around the prompt (the prompt is
the user turn, then the generation prompt), base models BOS + the prompt: ``chat="auto" | "on" | "off"``.

    python -m heterorl.bench.task_accuracy --model runs/smollm2 --task-params '{"style": "question"}'
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

# Each reasoning-gym data set's easiest setting (``--easiest``): the fewest and smallest terms, one operator,
# the shortest words; a 135M model has signal here or nowhere.
EASIEST: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "simple_equations": {
        "min_terms": 2,
        "max_terms": 2,
        "min_value": 1,
        "max_value": 9,
        "operators": ["+"],
        "operators_weights": [1.0],
    },
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 20},
    "lcm": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 10},
    "count_bits": {"min_n": 1, "max_n": 15},
    "leg_counting": {"min_animals": 1, "max_animals": 1, "min_instances": 1, "max_instances": 1},
    "letter_counting": {"min_words": 1, "max_words": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 3},
}


def task_accuracy(
    model,
    tokenizer,
    task,
    n: int = 128,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 24,
    seed: int = 0,
    chat: str = "auto",
    batch_size: int = 32,
) -> dict[str, Any]:
    """Mean reward of one reply per prompt over ``n`` prompts of ``task`` (seeded); with every sample."""
    import torch

    from heterorl.peer.model.prompts import PromptFormat
    from heterorl.peer.model.text import completion_text

    fmt = PromptFormat(tokenizer, chat)  # the samplers' own encoding
    rng = random.Random(seed)
    examples = [task.sample(rng) for _ in range(n)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    samples = []
    truncated = 0
    model.eval()
    for start in range(0, n, batch_size):
        batch = examples[start : start + batch_size]
        prompts = [fmt.encode(ex.prompt) for ex in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad,
                **sampling,
            )
        for ex, row in zip(batch, out[:, width:].tolist(), strict=True):
            truncated += tokenizer.eos_token_id not in row
            reply = completion_text(tokenizer, row)
            reward = task.reward(ex.prompt, reply, ex.reference)
            samples.append({"prompt": ex.prompt, "reference": ex.reference, "reply": reply, "reward": reward})
    return {
        "accuracy": sum(s["reward"] for s in samples) / max(len(samples), 1),
        "n": len(samples),
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "chat": fmt.chat,
        "truncated": truncated / max(len(samples), 1),
        "samples": samples,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="HF model directory or hub id")
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--task-params", default='{"style": "question"}', help="JSON of task parameters")
    ap.add_argument("--n", type=int, default=128, help="prompts (one reply each)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0], help="0 means greedy")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--chat", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=6, help="sample replies to print per setting")
    ap.add_argument("--json", default=None, help="also write every sample to this file")
    ap.add_argument(
        "--datasets",
        nargs="+",
        default=None,
        metavar="NAME",
        help="with --task reasoning_gym: each of these data sets in turn (its 'dataset' parameter), and a "
        "table of their accuracies at the end",
    )
    ap.add_argument(
        "--easiest",
        action="store_true",
        help="with --datasets: each data set at its easiest setting (its 'config'; known for "
        + ", ".join(EASIEST)
        + ")",
    )


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from heterorl.peer.model import load_model
    from heterorl.peer.tasks import get_task, named_reward
    from heterorl.peer.tasks.sandbox import TaskSpec, sandboxed_task

    try:
        params = json.loads(args.task_params)  # the user's own: the reward they name is theirs to run
        variants = [params] if not args.datasets else [{**params, "dataset": d} for d in args.datasets]
        if args.easiest:
            unknown = [v.get("dataset") for v in variants if v.get("dataset") not in EASIEST]
            if unknown:
                raise ValueError(f"--easiest: no easiest setting known for {unknown}; known: {list(EASIEST)}")
            variants = [{**v, "config": EASIEST[v["dataset"]]} for v in variants]
        for v in variants:  # a bad parameter is refused before the model loads
            get_task(args.task, allow_rewards=named_reward(v), **v)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model, dtype=torch.float32)
    results = []
    # rewards on the model's text are computed in the reward worker, as in a run (peer/tasks/sandbox.py)
    for v in variants:
        task = sandboxed_task(TaskSpec(args.task, v, named_reward(v)))
        try:
            results += _one_task(args, model, tokenizer, task, v)
        finally:
            task.scorer.close()  # type: ignore[union-attr]
    if len(variants) > 1:
        print(
            f"\n| {args.task} | "
            + " | ".join(_label(t) for t in args.temperatures)
            + " | hit max_new_tokens |"
        )
        print("|---" * (len(args.temperatures) + 2) + "|")
        for v in variants:
            rs = [r for r in results if r["task_params"] == v]
            cells = " | ".join(f"{r['accuracy']:.3f}" for r in rs)
            print(f"| {v.get('dataset', v)} | {cells} | {max(r['truncated'] for r in rs):.0%} |")
        if args.easiest:
            print("\neasiest settings: " + json.dumps({v["dataset"]: v["config"] for v in variants}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _label(temperature: float) -> str:
    return "greedy" if temperature <= 0 else f"T={temperature:g}"


def _one_task(args: argparse.Namespace, model, tokenizer, task, params: dict) -> list[dict]:
    results = []
    for temperature in args.temperatures:
        t0 = time.time()
        r = task_accuracy(
            model,
            tokenizer,
            task,
            args.n,
            temperature=temperature,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            chat=args.chat,
        )
        label = _label(temperature)
        print(
            f"{args.task} {json.dumps(params)} {label}: accuracy {r['accuracy']:.3f} over {r['n']} prompts, "
            f"{r['truncated']:.0%} hit max_new_tokens ({time.time() - t0:.0f} s)"
        )
        for s in r["samples"][: args.show]:
            print(f"    {s['prompt']!r} -> {s['reply']!r} (ref {s['reference']}, reward {s['reward']:g})")
        results.append({"task": args.task, "task_params": params, **r})
    return results


if __name__ == "__main__":
    _ap = argparse.ArgumentParser(
        prog="python -m heterorl.bench.task_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(_ap)
    sys.exit(run_from_args(_ap.parse_args()))
