"""``python -m heterorl.bench.gpu_check``: the learner's CUDA path and checkpoint deltas at real model sizes.

For a GPU machine (no vLLM, no network, no model weights needed). Model architectures by config with random
initialisation (HF's, std 0.02): SmolLM2-135M's and a Qwen2-1.5B-sized LLaMA. Per size, on CUDA:

- the micro-batched update (two-pass cotangent method, bf16 autocast) against the single-pass one: the largest
  gradient difference relative to the largest gradient (not bit-exact under bf16: different matmul shapes);
- real AdamW updates (GEPO on rollouts the model samples itself, random 0/1 rewards: a real policy gradient of
  the right shape) at RL learning rates: seconds and peak memory per update, then per version the fraction of
  bf16 words that changed, the sparse delta's size against the full bf16 checkpoint, encode and apply seconds
  (the codec runs on the CPU), the same delta found on the GPU (``device_delta``: seconds, same bytes) and a
  bit-exact rebuild;
- the update rate with the learner's background publisher publishing every update (state save, bf16 chunks,
  deltas diffed on the GPU) against no publishing (:mod:`heterorl.bench.learner_overhead`).

Random initialisation is not a trained model: trained weights spread wider, so a step of the same size
flips fewer bf16 roundings; read the ratios as the shape of the curve, and ``heterorl bench weights`` (real
SmolLM2 weights) as the measured figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

SIZES = {
    "tiny-arch": dict(  # a smoke run on a CPU
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "smollm2-135m-arch": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "1.5b-arch": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}


def build(name: str, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES[name], max_position_embeddings=2048, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.float32)


def rollouts(model, n_prompts: int, group: int, prompt_len: int, new_tokens: int, version: int):
    """Completions sampled from the model (bf16 autocast), behaviour log-probs, random 0/1 rewards."""
    from heterorl.peer.learner.rows import Rows

    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(version)
    prompts = (
        torch.randint(10, vocab, (n_prompts, prompt_len), generator=g).repeat_interleave(group, 0).to(dev)
    )
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    comp = out.sequences[:, prompt_len:]
    logits = torch.stack(out.logits, 1).float()
    logq = torch.log_softmax(logits, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    n = comp.shape[0]
    return Rows(
        prompts=prompts.tolist(),
        completions=comp.cpu(),
        mask=torch.ones_like(comp).cpu(),
        logq=logq.clamp_max(0).cpu(),
        rewards=torch.randint(0, 2, (n,), generator=g).float(),
        group_ids=torch.arange(n_prompts).repeat_interleave(group),
        versions=torch.full((n,), version),
    )


def _trainer(model, lr: float, rows, mbt: int | None = None, optimizer=None):
    """A GEPO Trainer on ``model`` (AdamW unless ``optimizer`` is given)."""
    from heterorl.peer.learner.trainer import Trainer, adamw
    from heterorl.peer.learner.update import StepOptions

    opts = StepOptions(
        objective="gepo",
        advantage=None,
        objective_params={},
        temperature=1.0,
        max_new_tokens=rows.completions.shape[1],
        lr=lr,
        grad_clip=1.0,
        micro_batch_tokens=mbt,
    )
    return Trainer(model, opts, 0, optimizer=optimizer or adamw)


def microbatch_agreement(model, rows) -> dict:
    """Gradients of one update computed whole and in micro-batches (SGD at lr 0: nothing moves)."""
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr)  # noqa: E731
    _trainer(model, 0.0, rows, optimizer=sgd).step(rows)
    whole = [p.grad.detach().clone() for p in model.parameters()]
    width = len(rows.prompts[0]) + rows.completions.shape[1]
    stats = _trainer(model, 0.0, rows, width * 4, optimizer=sgd).step(rows)
    diff = max(float((p.grad - w).abs().max()) for p, w in zip(model.parameters(), whole, strict=True))
    scale = max(float(w.abs().max()) for w in whole)
    return {"micro_batches": stats["learner/micro_batches"], "max_grad_diff_rel": diff / scale}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def deltas(model, lr: float, updates: int, rollout_shape: tuple[int, int, int, int]) -> dict:
    from heterorl.peer.daemon.weights import checkpoint_state
    from heterorl.peer.learner.device_delta import device_delta
    from heterorl.protocol.wire.checkpoint import serialize_state_dict
    from heterorl.protocol.wire.delta import apply_delta, changed_fraction, encode_delta, file_order

    trainer = None
    prev_state = checkpoint_state(model, "bfloat16")  # the float32 master cast: a copy updates leave alone
    prev = serialize_state_dict(prev_state)
    rows_out, exact, device_same = [], True, True
    for v in range(1, updates + 1):
        rows = rollouts(model, *rollout_shape, version=v - 1)
        _sync()
        t = time.perf_counter()
        trainer = trainer or _trainer(model, lr, rows)
        stats = trainer.step(rows)
        _sync()
        upd = time.perf_counter() - t
        state = checkpoint_state(model, "bfloat16")
        data = serialize_state_dict(state)
        t = time.perf_counter()
        d = encode_delta(prev, data)
        enc = time.perf_counter() - t
        t = time.perf_counter()
        dd = device_delta(prev_state, state, hashlib.sha256(prev).digest(), file_order(data))
        dev_enc = time.perf_counter() - t
        device_same &= dd == d
        t = time.perf_counter()
        ok = apply_delta(prev, d) == data
        app = time.perf_counter() - t
        exact &= ok
        rows_out.append(
            {
                "version": v,
                "update_s": upd,
                "peak_mib": stats["mem/peak_mib"],
                "changed_frac": changed_fraction(prev, data),
                "delta_bytes": len(d),
                "ratio": len(d) / len(data),
                "encode_s": enc,
                "device_encode_s": dev_enc,  # the same delta found on the GPU (device_delta)
                "device_same_bytes": dd == d,
                "apply_s": app,
            }
        )
        print(json.dumps({"lr": lr, **rows_out[-1]}), flush=True)
        prev, prev_state = data, state
    return {
        "lr": lr,
        "full_bytes": len(prev),
        "delta_ratio": sum(r["ratio"] for r in rows_out) / len(rows_out),
        "bit_identical": exact,
        "device_same_bytes": device_same,
        "versions": rows_out,
    }


def publishing(name: str, args: argparse.Namespace) -> dict:
    """Update rate with the learner publishing every update in the background (state save, bf16 chunks, deltas
    on the GPU) against no publishing: :mod:`heterorl.bench.learner_overhead` on this architecture."""
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from .learner_overhead import run

    ns = argparse.Namespace(
        updates=args.publish_updates,
        warmup=2,
        prompts=args.prompts,
        group_size=args.group_size,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        micro_batch_tokens=None,
        checkpoint_dtype="bfloat16",
        deltas=4,
        save_every_s=300.0,
    )
    out = {}
    for side, publish in (("no_publishing", False), ("publish_every_update", "background")):
        with TemporaryDirectory() as work:
            out[side] = run(build(name, args.device), ns, publish, Path(work))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out["rate_ratio"] = out["publish_every_update"]["updates_per_s"] / out["no_publishing"]["updates_per_s"]
    print(name, "publishing", json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m heterorl.bench.gpu_check", description=__doc__)
    ap.add_argument("--sizes", nargs="+", default=[k for k in SIZES if k != "tiny-arch"], choices=list(SIZES))
    ap.add_argument("--device", default="cuda", help="cuda (what this is for) or cpu (a smoke run)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 5e-6])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument(
        "--publish-updates",
        type=int,
        default=8,
        help="updates with background publishing every update, then without (0: skip that part)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check is for a GPU machine (--device cpu for a smoke run)")
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    out = {"device": dev_name, "torch": torch.__version__, "models": {}}
    shape = (args.prompts, args.group_size, args.prompt_len, args.new_tokens)
    for name in args.sizes:
        model = build(name, args.device)
        res = {"params": sum(p.numel() for p in model.parameters())}
        res["microbatch"] = microbatch_agreement(model, rollouts(model, *shape, version=0))
        print(name, json.dumps(res), flush=True)
        res["by_lr"] = []
        for lr in args.lrs:
            model = build(name, args.device)  # each learning rate from the same start
            res["by_lr"].append(deltas(model, lr, args.updates, shape))
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if args.publish_updates:
            res["publishing"] = publishing(name, args)
        out["models"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "by_lr"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
