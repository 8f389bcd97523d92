"""vLLM serving LoRA adapters, checked on a real engine in a process of its own:
``python -m heterorl.testing.vllm_adapter_check MODEL_DIR [TARGET ...]`` prints one JSON line.

Checks: behaviour log-probs of the engine serving an adapter (as a LoRARequest) against the learner's peft
model; a second adapter version served without restarting (generation after it matching the new adapter, not
the old one); an adapter for another base refused with the old one kept; a dead engine restarted with the
adapter it held. Times: an adapter switch, and a full merged-weight reload for comparison.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path


def _max_diff(model, tok, r) -> float:
    from heterorl.peer.model import completion_logprobs

    lp = completion_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, tok.pad_token_id, 1.0)
    return float((lp - r.logprobs).abs().max())


def _nudge(pm, seed: int, scale: float) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_" in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def run_checks(model_dir: str, targets: tuple[str, ...] = ("q_proj", "v_proj"), rows: int = 32) -> dict:
    import torch
    from peft import set_peft_model_state_dict

    from heterorl.peer.model import adapter as lora
    from heterorl.peer.model import load_model
    from heterorl.peer.model.prompts import PromptFormat
    from heterorl.peer.rollout import SamplingParams, make_backend
    from heterorl.peer.rollout.adapter import AdapterBackend
    from heterorl.peer.rollout.resilient import ResilientBackend
    from heterorl.peer.tasks import get_task
    from heterorl.protocol.settings import AdapterSettings

    torch.manual_seed(0)
    settings = AdapterSettings(rank=8, alpha=16, target_modules=targets)
    model, tok = load_model(model_dir)
    base = lora.base_state(model)
    pm = lora.wrap(model, settings)
    fmt, task, rng = PromptFormat(tok), get_task("arithmetic", digits=1), random.Random(0)
    prompts = [fmt.encode(task.sample(rng).prompt) for _ in range(rows // 4) for _ in range(4)]
    params = SamplingParams(1.0, 1.0, 6)
    work = Path(tempfile.mkdtemp(prefix="vllm-adapters-"))
    held: dict = {}
    out: dict = {}

    def adapter_backend(name: str):
        engine = {"threads": 1, "max_rows": len(prompts), "lora_rank": settings.rank}
        return AdapterBackend(make_backend(name, model_dir, tok, **engine), base, settings, work)

    t = time.perf_counter()
    backend = ResilientBackend(lambda: adapter_backend("vllm"), lambda: adapter_backend("hf"), lambda: held)
    out["engine_start_s"] = time.perf_counter() - t
    out["describe"] = backend.describe()
    out["native"] = backend.inner.native

    _nudge(pm, 1, 0.1)
    held = lora.adapter_state(pm)
    t = time.perf_counter()
    backend.load_weights(held)
    out["adapter_switch_s"] = time.perf_counter() - t
    out["max_abs_diff"] = _max_diff(pm, tok, backend.generate(prompts, params))

    old = {k: v.clone() for k, v in held.items()}
    _nudge(pm, 2, 0.1)
    held = lora.adapter_state(pm)
    backend.load_weights(held)
    r = backend.generate(prompts, params)
    out["v2_max_abs_diff"] = _max_diff(pm, tok, r)
    new = {k: v.clone() for k, v in held.items()}
    set_peft_model_state_dict(pm, old)
    out["v2_vs_v1_max_abs_diff"] = _max_diff(pm, tok, r)
    set_peft_model_state_dict(pm, new)

    bad = {k.replace("layers.0.", "layers.99."): v for k, v in held.items()}
    try:
        backend.load_weights(bad)
        out["bad_adapter_error"] = None
    except ValueError as e:
        out["bad_adapter_error"] = str(e)
    out["after_refusal_max_abs_diff"] = _max_diff(pm, tok, backend.generate(prompts, params))

    merged = lora.merge(base, held, settings)  # what a sampler without LoRA support would reload
    t = time.perf_counter()
    backend.inner.inner.load_weights(merged)
    out["full_reload_s"] = time.perf_counter() - t
    backend.inner.inner.load_lora(sorted(work.glob("adapter-*"))[-1])  # back to serving the adapter

    backend.inner.inner.llm.llm_engine.engine_core.shutdown()  # the engine dies under the sampler
    r = backend.generate(prompts, params)
    out["after_engine_death"] = {
        "restarts": backend.restarts,
        "backend": backend.name,
        "native": backend.inner.native,
        "max_abs_diff": _max_diff(pm, tok, r),
    }
    backend.close()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m heterorl.testing.vllm_adapter_check MODEL_DIR [TARGET ...]", file=sys.stderr)
        return 2
    print(json.dumps(run_checks(argv[0], tuple(argv[1:]) or ("q_proj", "v_proj"))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
