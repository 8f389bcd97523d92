"""Held-out evaluation of the current policy: what the training reward cannot say.

The training reward is the reward of rollouts from the policy that sampled them, which in an asynchronous
run is many versions old; a run with delay D sees its own progress D versions late. This scores the policy
itself, on the task's held-out prompts (:meth:`~heterorl.peer.tasks.Task.held_out`: the whole prompt space
where it is small, else a fixed split no sampler trains on), two ways:

* ``eval/sampled``: the expected reward when sampling at the run's temperature and top-p. Where the task lists
  every rewarded completion (bare arithmetic with its exact-match reward) it is exact: the summed probability
  of those completions, stop included, from one forward pass. Elsewhere it is the mean reward of
  ``samples`` draws per prompt, seeded (Gumbel-max), so two evaluations of the same weights agree and
  successive evaluations share their noise.
* ``eval/greedy``: the reward of the greedy completion.

The learner scores published weights (:meth:`HeldOutEval.of_weights`), loaded into its
:class:`~.replica.ModelReplica`, never training's own model (sharded under FSDP); a model at hand is scored by
calling the evaluator on it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Mapping

import torch
from torch import Tensor

from ..model.logprobs import completion_logits, left_pad
from ..model.prompts import PromptFormat
from ..model.sampling import nucleus_logprobs
from ..model.text import completion_text
from ..rollout import SamplingParams
from ..rollout.hf import HFBackend
from ..rollout.stops import eos_mask
from ..tasks import Example, Task
from .replica import ModelReplica

EXACT_ROWS_PER_FORWARD = 1024  # completions scored per forward pass on the exact path
EVAL_SEED = 0x4556414C  # the sampled path's seeds: fixed, so successive evaluations share their noise


class HeldOutEval:
    """Scores a policy on ``task``'s held-out prompts (at most ``prompts`` of them); see the module doc."""

    def __init__(
        self,
        task: Task,
        fmt: PromptFormat,
        tokenizer,
        sampling: SamplingParams,
        samples: int = 4,
        prompts: int | None = None,
    ) -> None:
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.task, self.fmt, self.tok = task, fmt, tokenizer
        self.sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens)
        self.samples = samples
        self.examples: list[Example] = task.held_out()[:prompts]
        if not self.examples:
            raise ValueError(f"{task.name}: the task has no held-out prompts to evaluate on")
        self.encoded = [fmt.encode(e.prompt) for e in self.examples]
        self._exact = self._exact_rows()

    @property
    def exact(self) -> bool:
        """Whether ``eval/sampled`` is the exact expected reward (else a seeded Monte Carlo estimate)."""
        return self._exact is not None

    def describe(self) -> str:
        how = (
            "expected reward computed exactly" if self.exact else f"{self.samples} seeded samples per prompt"
        )
        return f"{len(self.examples)} held-out prompts, sampled: {how}, and greedy"

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        """``eval/sampled``, ``eval/greedy``, ``eval/prompts``, ``eval/time_s`` of ``model`` (left in eval
        mode)."""
        t0 = time.perf_counter()
        model.eval()
        sampled = self._exact_score(model) if self._exact is not None else self._sampled_score(model)
        greedy = self._greedy_score(model)
        return {
            "eval/sampled": sampled,
            "eval/greedy": greedy,
            "eval/prompts": float(len(self.examples)),
            "eval/time_s": time.perf_counter() - t0,
        }

    def of_weights(
        self, replica: ModelReplica, weights: Mapping[str, Tensor], tag: Hashable | None = None
    ) -> dict[str, float]:
        """What calling the evaluator gives for a model holding ``weights`` (a published state: the full
        model's, or an adapter run's adapters), loaded into ``replica`` (skipped when ``tag`` is the one it
        holds: the published version number for a version's published weights) and held throughout."""
        with replica:
            return self(replica.load(weights, tag))

    # ---- the exact path: Σ over rewarded completions of their probability under the sampling distribution

    def _exact_rows(self) -> list[tuple[int, list[int]]] | None:
        """(example index, completion token ids, the stop included where it is sampled) of every rewarded
        completion that fits ``max_new_tokens``; None where the task cannot list them, or the tokenizer does
        not spell a listed text one way only (then the sum would not be exact)."""
        n, eos = self.sampling.max_new_tokens, self.tok.eos_token_id
        rows: list[tuple[int, list[int]]] = []
        for i, ex in enumerate(self.examples):
            texts = self.task.rewarded_completions(ex, n)
            if texts is None:
                return None
            for text in texts:
                ids = self.tok(text, add_special_tokens=False).input_ids
                if len(ids) != len(text) or self.tok.decode(ids) != text:
                    return None  # not one token per character: other spellings exist
                if len(ids) < n:
                    if eos is None:
                        return None
                    ids = [*ids, eos]  # it must stop here: the stop is a sampled token too
                if len(ids) <= n:
                    rows.append((i, ids))
        return rows

    def _exact_score(self, model) -> float:
        return sum(min(p, 1.0) for p in self.exact_probs(model)) / len(self.examples)

    def exact_probs(self, model) -> list[float]:
        """Per held-out prompt, the probability that a draw from the sampling distribution earns reward 1."""
        rows = self._exact or []
        prob = [0.0] * len(self.examples)
        for start in range(0, len(rows), EXACT_ROWS_PER_FORWARD):
            chunk = rows[start : start + EXACT_ROWS_PER_FORWARD]
            width = max(len(ids) for _, ids in chunk)
            comp = torch.full((len(chunk), width), self.tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(comp)
            for r, (_, ids) in enumerate(chunk):
                comp[r, : len(ids)] = torch.tensor(ids)
                mask[r, : len(ids)] = 1
            logits = completion_logits(
                model, [self.encoded[i] for i, _ in chunk], comp, mask, self.tok.pad_token_id
            )
            logp = nucleus_logprobs(logits, self.sampling.temperature, self.sampling.top_p)
            tok_lp = logp.gather(-1, comp.to(logp.device).unsqueeze(-1)).squeeze(-1).cpu()
            tok_lp = torch.where(mask > 0, tok_lp, torch.zeros_like(tok_lp))
            for (i, _), lp in zip(chunk, tok_lp.double().sum(-1).tolist(), strict=True):
                prob[i] += math.exp(lp)  # -inf outside the nucleus: probability 0
        return prob

    # ---- the sampled path: seeded draws, scored by the task's reward

    def _sampled_score(self, model) -> float:
        k = self.samples
        prompts = [ids for ids in self.encoded for _ in range(k)]
        seeds = tuple((EVAL_SEED * 1_000_003 + r) % (1 << 62) for r in range(len(prompts)))
        params = SamplingParams(
            self.sampling.temperature, self.sampling.top_p, self.sampling.max_new_tokens, seeds=seeds
        )
        roll = HFBackend(model, self.tok).generate(prompts, params)
        examples = [e for e in self.examples for _ in range(k)]
        rewards = [
            self.task.reward(e.prompt, t, e.reference) for e, t in zip(examples, roll.texts, strict=True)
        ]
        return sum(rewards) / len(rewards)

    def _greedy_score(self, model) -> float:
        tok = self.tok
        device = next(model.parameters()).device
        ids, attn, width = left_pad(self.encoded, tok.pad_token_id)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            do_sample=False,
            max_new_tokens=self.sampling.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        completions = out[:, width:].cpu()
        mask = eos_mask(completions, tok.eos_token_id)
        texts = [
            completion_text(tok, c[: int(n)].tolist()) for c, n in zip(completions, mask.sum(-1), strict=True)
        ]
        rewards = [
            self.task.reward(e.prompt, t, e.reference) for e, t in zip(self.examples, texts, strict=True)
        ]
        return sum(rewards) / len(rewards)
