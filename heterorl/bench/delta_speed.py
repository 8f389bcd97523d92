"""``python -m heterorl.bench.delta_speed``: encoding one checkpoint delta, numpy on bytes against the device.

A state of a real architecture's shapes (``--arch``, :data:`heterorl.bench.gpu_check.SIZES`; tied lm_head),
random bf16 (or float32) weights, and a child in which ``--changed`` of the words moved by one ulp up or down
(what a bf16 rounding of an RL step looks like: ~0.5-1 % of words, almost all by one ulp). It times, medians
over ``--repeats``:

- ``numpy_s``: ``encode_delta(parent_bytes, child_bytes)``, the learner's CPU path (serialising not counted);
- ``device_s``: ``device_delta`` on the two state dicts on ``--device`` (synchronised), the same bytes;

and checks the two deltas are identical and rebuild the child. Figures to stdout as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch


def states(arch: str, dtype: torch.dtype, changed: float, device: str, seed: int = 0) -> tuple[dict, dict]:
    """(parent, child) state dicts of ``arch``'s shapes on ``device``, lm_head tied to the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .gpu_check import SIZES

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(LlamaConfig(**SIZES[arch])).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    parent, child = {}, {}
    for name, shape in shapes.items():
        if name == "lm_head.weight":
            continue
        p = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        step = (torch.rand(shape, generator=g) < changed).to(bits) * (
            torch.randint(0, 2, shape, generator=g, dtype=bits) * 2 - 1
        )
        parent[name], child[name] = p.to(device), (p.view(bits) + step).view(dtype).to(device)
    for s in (parent, child):
        s["lm_head.weight"] = s["model.embed_tokens.weight"]
    return parent, child


def _timed(fn, repeats: int, device: str) -> tuple[float, bytes]:
    times, out = [], b""
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    from heterorl.peer.learner.device_delta import device_delta
    from heterorl.protocol.wire.checkpoint import serialize_state_dict
    from heterorl.protocol.wire.delta import apply_delta, changed_fraction, encode_delta, file_order

    from .gpu_check import SIZES

    ap = argparse.ArgumentParser(prog="python -m heterorl.bench.delta_speed", description=__doc__)
    ap.add_argument("--arch", default="smollm2-135m-arch", choices=list(SIZES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--changed", type=float, default=0.007, help="fraction of words that move (default 0.7 %%)"
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    parent, child = states(args.arch, getattr(torch, args.dtype), args.changed, args.device)
    pa, pb = serialize_state_dict(parent), serialize_state_dict(child)
    sha, order = hashlib.sha256(pa).digest(), file_order(pb)
    numpy_s, want = _timed(lambda: encode_delta(pa, pb), args.repeats, "cpu")
    device_s, got = _timed(lambda: device_delta(parent, child, sha, order), args.repeats, args.device)
    res = {
        "arch": args.arch,
        "parameters": sum(v.numel() for k, v in parent.items() if k != "lm_head.weight"),
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else f"cpu x{torch.get_num_threads()}",
        "changed_frac": changed_fraction(pa, pb),
        "full_bytes": len(pb),
        "delta_bytes": len(got),
        "numpy_s": numpy_s,
        "device_s": device_s,
        "speedup": numpy_s / device_s,
        "identical": got == want,
        "rebuilds": apply_delta(pa, got) == pb,
    }
    print(json.dumps(res, indent=1))
    return 0 if res["identical"] and res["rebuilds"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
