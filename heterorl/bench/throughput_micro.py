"""The micro-benchmarks of ``heterorl bench throughput`` (rollout, weight switch, learner step), side by side.

In the benchmark's own process, alternated ``repeats`` times (medians): our ``hf`` backend, a plain
``model.generate`` loop and TRL's generation path (:func:`heterorl.bench.trl_grpo.trl_generator`) on the same
encoded prompts; one learner update against a plain cross-entropy step on the same tokens. Everything on
vLLM's engine runs in a child process, ``python -m heterorl.bench.throughput_micro SPEC RESULT`` (JSON files),
after the in-process sides: vLLM's in-process engine pins torch's threads and replaces
``torch.set_num_threads`` process-wide, which would skew any side measured after it in the same process. The
child measures our ``vllm`` backend's rollouts, the weight switch (new weights into the running engine against
an engine restart) and ``heterorl train --local --backend vllm`` for the rl part.

Rates count real completion tokens: up to and including the first EOS, never padding.
"""

from __future__ import annotations

import copy
import cProfile
import io
import json
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIDES = {"vllm": "vllm_backend", "hf": "hf_backend", "plain": "plain_generate", "trl": "trl_generate"}


def encode_prompts(tok, texts: list[str], chat: str, group_size: int) -> list[list[int]]:
    """Each task prompt encoded as samplers encode it (``PromptFormat``), repeated ``group_size`` times."""
    from heterorl.peer.model.prompts import PromptFormat

    fmt = PromptFormat(tok, chat)
    return [ids for ids in (fmt.encode(t) for t in texts) for _ in range(group_size)]


def real_lengths(completions, eos_id: int):
    """Tokens up to and including the first EOS, per row (the rule every backend uses)."""
    from heterorl.peer.rollout.stops import eos_mask

    return eos_mask(completions, eos_id).sum(-1)


def alternate(fns: dict, repeats: int, profile: str | None = None) -> tuple[dict, dict, str]:
    """Call each fn (returning units done) ``repeats`` times, interleaved, after one warm-up round.

    Returns the median units per second, the mean units per call, and optionally a cProfile of one fn.
    """
    import torch

    times: dict[str, list[float]] = {k: [] for k in fns}
    units: dict[str, list[float]] = {k: [] for k in fns}
    prof = cProfile.Profile() if profile else None
    for rep in range(repeats + 1):
        for name, fn in fns.items():
            torch.manual_seed(rep)
            on = prof is not None and name == profile and rep > 0
            if on:
                prof.enable()
            t = time.perf_counter()
            n = fn()
            dt = time.perf_counter() - t
            if on:
                prof.disable()
            if rep > 0:  # the first round warms caches up
                times[name].append(dt)
                units[name].append(n)
    med = {k: statistics.median(u / t for u, t in zip(units[k], times[k], strict=True)) for k in fns}
    mean = {k: statistics.fmean(units[k]) for k in fns}
    text = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
        text = buf.getvalue()
    return med, mean, text


def rollout_in_process(
    model_path: str,
    prompt_ids: list[list[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    repeats: int,
    out: Path,
    profile: bool = False,
    device: str = "cpu",
) -> tuple[dict, str]:
    """Tokens/s and mean completion length of our hf backend, plain ``generate`` and TRL's generation, on
    ``device``."""
    import torch

    from heterorl.peer.model import load_model
    from heterorl.peer.model.logprobs import left_pad
    from heterorl.peer.rollout import SamplingParams, make_backend

    from .trl_grpo import trl_generator

    model, tok = load_model(model_path, device=device)
    backend = make_backend("hf", model_path, tok, model=model)
    sampling = SamplingParams(1.0, 1.0, max_new_tokens)
    trl_generate = trl_generator(
        copy.deepcopy(model),
        tok,
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        out=out / "trl-gen",
        device=device,
    )

    def hf() -> float:
        return float(backend.generate(prompt_ids, sampling).lengths.sum())

    @torch.no_grad()
    def plain() -> float:
        ids, attn, width = left_pad(prompt_ids, tok.pad_token_id)
        seq = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        return float(real_lengths(seq[:, width:], tok.eos_token_id).sum())

    def trl() -> float:
        return float(sum(len(c) for c in trl_generate(prompt_ids)))

    fns = {"hf_backend": hf, "plain_generate": plain, "trl_generate": trl}
    med, mean, prof = alternate(fns, repeats, "hf_backend" if profile else None)
    res = {}
    for k in fns:
        res[f"{k}_tokens_per_s"] = med[k]
        res[f"{k}_mean_length"] = mean[k] / len(prompt_ids)
    return res, prof


def _task_prompts(args) -> list[str]:
    from heterorl.peer.tasks import get_task

    task, rng = get_task("arithmetic", digits=1), random.Random(0)
    return [task.sample(rng).prompt for _ in range(args.prompts)]


def encoded_prompts(args, model_path: str) -> list[list[int]]:
    from heterorl.peer.model.loader import load_tokenizer

    return encode_prompts(load_tokenizer(model_path), _task_prompts(args), args.chat, args.group_size)


def rollout_and_switch(args, model: str, out: Path) -> tuple[dict, str]:
    """The ``rollout`` part (hf, plain, TRL here; vllm in the child) and the ``switch`` part (child)."""
    prompt_ids, res, prof = encoded_prompts(args, model), {}, ""
    spec: dict = {"model": model, "threads": args.threads, "prompt_ids": prompt_ids}
    if "rollout" in args.parts:
        res["rollout"], prof = rollout_in_process(
            model,
            prompt_ids,
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            out=out,
            profile=args.profile,
            device=args.device,
        )
        spec["rollout"] = {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats}
    if "switch" in args.parts:
        spec["switch"] = {"repeats": args.repeats, "out": str(out / "switch")}
    if args.no_vllm:
        spec = {}
    child = run_vllm_child(spec, out / "vllm-engine") if "rollout" in spec or "switch" in spec else {}
    skipped = "--no-vllm" if args.no_vllm else child.get("unavailable")
    if "rollout" in res:
        r = res["rollout"]
        if skipped:
            r["vllm_skipped"] = skipped
        else:
            r.update(child["rollout"], vllm_describe=child["describe"])
        pairs = [("hf", "plain"), ("hf", "trl")]
        if not skipped:
            pairs += [("vllm", "hf"), ("vllm", "plain"), ("vllm", "trl")]
        for a, b in pairs:
            r[f"ratio_{a}_vs_{b}"] = r[f"{SIDES[a]}_tokens_per_s"] / r[f"{SIDES[b]}_tokens_per_s"]
    if "switch" in args.parts:
        res["switch"] = (
            {"skipped": skipped}
            if skipped
            else {**child["switch"], "engine_start_s": child["engine_start_s"]}
        )
    return res, prof


def learner(args, model_path: str) -> tuple[dict, str]:
    import torch

    from heterorl.peer.learner.rows import Rows
    from heterorl.peer.learner.trainer import Trainer
    from heterorl.peer.learner.update import StepOptions, autocast_for, plan_micro_batches
    from heterorl.peer.model import load_model
    from heterorl.peer.model.logprobs import pack
    from heterorl.peer.rollout import SamplingParams, make_backend

    model, tok = load_model(model_path, device=args.device)
    device = model.device
    torch.manual_seed(0)
    sampling = SamplingParams(1.0, 1.0, args.max_new_tokens)
    roll = make_backend("hf", model_path, tok, model=model).generate(
        encoded_prompts(args, model_path), sampling
    )
    n = len(roll.prompt_ids)
    rows = Rows(
        prompts=roll.prompt_ids,
        completions=roll.completion_ids,
        mask=roll.completion_mask,
        logq=roll.logprobs,
        rewards=torch.rand(n),
        group_ids=torch.arange(args.prompts).repeat_interleave(args.group_size),
        versions=torch.zeros(n, dtype=torch.long),
    )
    tokens = float(roll.completion_mask.sum())
    ours_model, plain_model = model, copy.deepcopy(model)
    ours_trainer = Trainer(
        ours_model,
        StepOptions(
            objective="gepo",
            advantage=None,
            objective_params={},
            temperature=1.0,
            max_new_tokens=args.max_new_tokens,
            lr=args.lr,
            grad_clip=1.0,
            micro_batch_tokens=args.micro_batch_tokens,
        ),
        tok.pad_token_id,
    )
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=args.lr, weight_decay=0.0)
    labels = torch.where(rows.mask > 0, rows.completions, torch.full_like(rows.completions, -100)).to(device)
    spans = plan_micro_batches(
        [len(p) for p in rows.prompts], rows.completions.shape[1], args.micro_batch_tokens
    )
    stats: dict = {}

    def ours() -> float:
        stats.update(ours_trainer.step(rows))
        return tokens

    def plain() -> float:  # mean token CE over the batch, accumulated over the same micro-batches
        plain_model.train()
        plain_opt.zero_grad(set_to_none=True)
        for a, b in spans:
            ids, attn, pos, width = pack(
                rows.prompts[a:b], rows.completions[a:b], rows.mask[a:b], tok.pad_token_id
            )
            with autocast_for(device):  # bf16 on a GPU, as our update
                logits = plain_model(
                    input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device)
                ).logits.float()
            step_logits = logits[:, width - 1 : width - 1 + labels.shape[1]]
            loss = torch.nn.functional.cross_entropy(
                step_logits.reshape(-1, step_logits.shape[-1]), labels[a:b].reshape(-1), reduction="sum"
            )
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain_opt.step()
        return tokens

    med, _, prof = alternate({"ours": ours, "plain": plain}, args.repeats, "ours" if args.profile else None)
    return {
        "learner_tokens_per_s": med["ours"],
        "plain_ce_tokens_per_s": med["plain"],
        "ratio_learner_vs_plain_ce": med["ours"] / med["plain"],
        "completion_tokens_per_update": tokens,
        "rows_per_update": n,
        "micro_batches": len(spans),
        "learner_micro_batches": stats.get("learner/micro_batches", float(len(spans))),
    }, prof


# ---- the vLLM sides, in a child process ----


def run_vllm_child(spec: dict, out: Path, timeout: float = 3600) -> dict:
    """Run :func:`vllm_sides` on ``spec`` in a fresh Python process, its log in ``out/vllm-child.log``."""
    out.mkdir(parents=True, exist_ok=True)
    spec_file, result_file, log_file = (
        out / "vllm-spec.json",
        out / "vllm-result.json",
        out / "vllm-child.log",
    )
    spec_file.write_text(json.dumps(spec))
    result_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "heterorl.bench.throughput_micro", str(spec_file), str(result_file)]
    with log_file.open("w") as log:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0 or not result_file.exists():
        tail = log_file.read_text()[-2000:]
        raise RuntimeError(f"the vLLM side failed (rc {done.returncode}); log {log_file}:\n{tail}")
    return json.loads(result_file.read_text())


def vllm_sides(spec: dict) -> dict:
    """``spec``: model, threads, prompt_ids, and any of ``rollout`` (max_new_tokens, repeats), ``switch``
    (repeats, out) and ``rl`` (local: :func:`~.throughput.local_config`, out, warmup).
    ``{"unavailable": reason}`` if vLLM cannot serve the model here."""
    import torch

    from heterorl.peer.rollout.vllm import unsupported_reason

    torch.set_num_threads(spec["threads"])
    reason = unsupported_reason(spec["model"], "cpu")
    if reason is not None:
        return {"unavailable": reason}
    res: dict = {}
    if "rollout" in spec or "switch" in spec:
        res.update(_engine_sides(spec))
    if "rl" in spec:
        from .throughput import ours_local

        rl = spec["rl"]
        rate, length = ours_local(rl["local"], Path(rl["out"]), rl["warmup"])
        res["rl"] = {"steps_per_s": rate, "mean_length": length}
    return res


def _engine_sides(spec: dict) -> dict:
    from heterorl.peer.model import load_model
    from heterorl.peer.rollout import SamplingParams, make_backend

    model_dir, res = spec["model"], {}
    model, tok = load_model(model_dir)
    prompt_ids = spec["prompt_ids"]
    t = time.perf_counter()
    backend = make_backend("vllm", model_dir, tok, threads=spec["threads"], max_rows=len(prompt_ids), seed=0)
    res["engine_start_s"] = time.perf_counter() - t
    res["describe"] = backend.describe()
    if "rollout" in spec:
        r = spec["rollout"]
        sampling = SamplingParams(1.0, 1.0, r["max_new_tokens"])

        def gen() -> float:
            # the RL loop loads new weights before every batch, which resets the prefix cache: no batch reuses
            # the KV cache of the previous one (rows of one group still share their prompt's)
            backend.llm.reset_prefix_cache()
            return float(backend.generate(prompt_ids, sampling).lengths.sum())

        med, mean, _ = alternate({"vllm": gen}, r["repeats"])
        res["rollout"] = {
            "vllm_backend_tokens_per_s": med["vllm"],
            "vllm_backend_mean_length": mean["vllm"] / len(prompt_ids),
        }
    if "switch" in spec:
        sw = spec["switch"]
        res["switch"] = _switch(backend, model, prompt_ids[0], sw["repeats"], Path(sw["out"]))
    backend.close()
    return res


def _switch(backend, model, prompt: list[int], repeats: int, out: Path) -> dict:
    """Seconds to put new weights into the running engine (``load_weights``: reload + prefix-cache reset)
    against restarting the engine, and writing the weights as safetensors (what a restart reads)."""
    import torch
    from safetensors.torch import save_file

    from heterorl.peer.rollout import SamplingParams

    old = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {k: (v + 0.01 * torch.randn(v.shape, generator=g)).contiguous() for k, v in old.items()}
    loads = []
    for rep in range(repeats + 1):
        t = time.perf_counter()
        backend.load_weights(new if rep % 2 == 0 else old)
        if rep > 0:  # the first call warms the reload path up
            loads.append(time.perf_counter() - t)
    tokens_after_load = int(backend.generate([prompt], SamplingParams(1.0, 1.0, 2)).lengths.sum())
    restarts = []
    for _ in range(repeats):
        t = time.perf_counter()
        backend.restart()
        restarts.append(time.perf_counter() - t)
    tokens_after_restart = int(backend.generate([prompt], SamplingParams(1.0, 1.0, 2)).lengths.sum())
    saves = []
    out.mkdir(parents=True, exist_ok=True)
    tied = getattr(model.config, "tie_word_embeddings", False)  # a tied head is not saved
    files = {k: v for k, v in new.items() if not (tied and k == "lm_head.weight")}
    for _ in range(repeats):
        t = time.perf_counter()
        save_file(files, str(out / "model.safetensors"))
        saves.append(time.perf_counter() - t)
    (out / "model.safetensors").unlink(missing_ok=True)
    load_s, restart_s = statistics.median(loads), statistics.median(restarts)
    return {
        "load_weights_s": load_s,
        "restart_s": restart_s,
        "save_safetensors_s": statistics.median(saves),
        "ratio_restart_vs_load_weights": restart_s / load_s,
        "load_weights_all_s": loads,
        "restart_all_s": restarts,
        "weight_bytes": sum(v.numel() * v.element_size() for v in files.values()),
        "generates_after_switch": tokens_after_load > 0 and tokens_after_restart > 0,
    }


def main(argv: list[str] | None = None) -> int:

    from heterorl.protocol.logs import configure_logging

    configure_logging("INFO")
    spec_file, result_file = argv or sys.argv[1:]
    res = vllm_sides(json.loads(Path(spec_file).read_text()))
    Path(result_file).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
