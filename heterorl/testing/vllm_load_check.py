"""Does vLLM load a model directory as it is? ``python -m heterorl.testing.vllm_load_check MODEL_DIR``.

For what ``heterorl export`` writes: a vLLM engine (in this process: run it as a child, vLLM changes
process-wide torch settings) serves the directory with no extra arguments, samples a few completions, and
their behaviour log-probs are compared with transformers' recompute on the same directory, so the engine ran
these weights and not others. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys


def run_check(model_dir: str, dtype: str = "float32") -> dict:
    import torch

    from heterorl.peer.model import completion_logprobs, load_model
    from heterorl.peer.rollout import SamplingParams, make_backend

    torch.manual_seed(0)
    model, tok = load_model(model_dir, dtype=getattr(torch, dtype))
    backend = make_backend("vllm", model_dir, tok, dtype=dtype, threads=1, max_rows=8)
    try:
        prompts = [tok.encode(f"{i}+{j}=") for i in range(2) for j in range(4)]
        r = backend.generate(prompts, SamplingParams(1.0, 1.0, 4))
        lp = completion_logprobs(
            model, r.prompt_ids, r.completion_ids, r.completion_mask, tok.pad_token_id, 1.0
        )
        return {
            "describe": backend.describe(),
            "tokens": int(r.lengths.sum()),
            "max_abs_diff": float((lp - r.logprobs).abs().max()),
        }
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    print(json.dumps(run_check(*args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
