"""Real vLLM engine checks in a process of their own: ``python -m heterorl.testing.vllm_check MODEL_DIR``.

vLLM's in-process engine changes process-wide state (it pins torch's thread count and replaces
``torch.set_num_threads``), so the test suite runs these checks in a child process and asserts on the JSON it
prints last. Users can run it to check their own install: every figure is measured on the real engine.

Checks: behaviour log-probs against the learner's recompute at two temperatures; EOS and max-token stops;
new weights loaded into the running engine (and generation after it matching them, not the old ones, i.e. the
prefix cache was reset); a checkpoint that does not fit refused with the old weights kept; an engine that
dies restarted by :class:`ResilientBackend` with the weights it held, and replaced by ``hf`` once its restarts
are used up.
"""

from __future__ import annotations

import json
import random
import sys
import time


def _max_diff(model, tok, r, temperature: float) -> float:
    from heterorl.peer.model import completion_logprobs

    lp = completion_logprobs(
        model, r.prompt_ids, r.completion_ids, r.completion_mask, tok.pad_token_id, temperature
    )
    return float((lp - r.logprobs).abs().max())


def _stops_ok(r, eos: int, budget: int) -> bool:
    for ids, mask, n in zip(r.completion_ids, r.completion_mask, r.lengths, strict=True):
        n = int(n)
        if not (bool(mask[:n].all()) and not bool(mask[n:].any()) and 1 <= n <= budget):
            return False
        at_eos = (ids[:n] == eos).nonzero().flatten().tolist()
        if at_eos not in ([], [n - 1]) or (not at_eos and n != budget):
            return False
    return True


def run_checks(model_dir: str) -> dict:
    import torch

    from heterorl.peer.model import load_model
    from heterorl.peer.model.prompts import PromptFormat
    from heterorl.peer.rollout import SamplingParams, make_backend
    from heterorl.peer.rollout.resilient import ResilientBackend
    from heterorl.peer.tasks import get_task

    torch.manual_seed(0)
    model, tok = load_model(model_dir)
    fmt = PromptFormat(tok)
    task = get_task("arithmetic", digits=1)
    rng = random.Random(0)
    prompts = [fmt.encode(task.sample(rng).prompt) for _ in range(8) for _ in range(4)]
    out: dict = {}
    t = time.perf_counter()
    backend = ResilientBackend(
        lambda: make_backend("vllm", model_dir, tok, threads=1, max_rows=len(prompts)),
        lambda: make_backend("hf", model_dir, tok),
        lambda: model.state_dict(),
    )
    out["engine_start_s"] = time.perf_counter() - t
    out["describe"] = backend.describe()
    budget = 6
    for temperature in (1.0, 0.7):
        r = backend.generate(prompts, SamplingParams(temperature, 1.0, budget))
        out[f"max_abs_diff_T{temperature}"] = _max_diff(model, tok, r, temperature)
        out[f"stops_ok_T{temperature}"] = _stops_ok(r, tok.eos_token_id, budget)
        out[f"eos_rows_T{temperature}"] = int((r.lengths < budget).sum())
        out[f"logprobs_nonpositive_T{temperature}"] = bool((r.logprobs <= 0).all())

    old = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    t = time.perf_counter()
    backend.load_weights(model.state_dict())
    out["reload_s"] = time.perf_counter() - t
    r = backend.generate(prompts, SamplingParams(1.0, 1.0, budget))
    out["after_reload_max_abs_diff"] = _max_diff(model, tok, r, 1.0)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(old)
    out["after_reload_vs_old_weights_max_abs_diff"] = _max_diff(model, tok, r, 1.0)
    model.load_state_dict(new)

    bad = dict(model.state_dict())
    bad["model.norm.weight"] = torch.ones(3)
    try:
        backend.load_weights(bad)
        out["bad_checkpoint_error"] = None
    except ValueError as e:
        out["bad_checkpoint_error"] = str(e)
    r = backend.generate(prompts, SamplingParams(1.0, 1.0, budget))
    out["after_refusal_max_abs_diff"] = _max_diff(model, tok, r, 1.0)

    backend.inner.llm.llm_engine.engine_core.shutdown()  # the engine dies under the sampler
    r = backend.generate(prompts, SamplingParams(1.0, 1.0, budget))
    out["after_engine_death"] = {
        "restarts": backend.restarts,
        "backend": backend.name,
        "fell_back": backend.fell_back,
        "max_abs_diff": _max_diff(model, tok, r, 1.0),
    }
    backend.max_restarts = 1  # it dies again, with its restarts used up: the sampler carries on with hf
    backend.inner.llm.llm_engine.engine_core.shutdown()
    r = backend.generate(prompts, SamplingParams(1.0, 1.0, budget))
    out["after_second_death"] = {
        "backend": backend.name,
        "fell_back": backend.fell_back,
        "max_abs_diff": _max_diff(model, tok, r, 1.0),
    }
    backend.close()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m heterorl.testing.vllm_check MODEL_DIR", file=sys.stderr)
        return 2
    print(json.dumps(run_checks(argv[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
