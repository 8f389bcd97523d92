"""The ``hf`` rollout backend: batched sampling with ``transformers`` ``generate``.

Behaviour log-probs are taken from the raw logits generate returns, divided by the temperature (before top-p
truncation), so they equal what the learner recomputes with :func:`heterorl.peer.model.completion_logprobs`.
With ``SamplingParams.seeds`` each row is drawn by Gumbel-max from its seed (:mod:`.seeded`): reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import LogitsProcessorList

from ..model.logprobs import left_pad
from ..model.state import check_state_fits
from ..model.text import completion_text
from .base import Rollouts, SamplingParams
from .seeded import GumbelDraw
from .stops import eos_mask


class HFBackend:
    name = "hf"

    def __init__(self, model, tokenizer) -> None:
        self.model = model  # the local loop swaps in a lagged copy; the sampler loads new weights into it
        self.tokenizer = tokenizer

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def describe(self) -> str:
        device = next(self.model.parameters()).device
        return f"hf generate, {self.dtype}, {device.type}"

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        check_state_fits({k: tuple(v.shape) for k, v in self.model.state_dict().items()}, state)
        self.model.load_state_dict(dict(state))

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollouts:
        tok, model = self.tokenizer, self.model
        model.eval()
        device = next(model.parameters()).device
        ids, attn, width = left_pad(prompt_ids, tok.pad_token_id)
        if params.seeds is not None:  # Gumbel-max with each row's seed: greedy over the processor's scores
            if len(params.seeds) != len(prompt_ids):
                raise ValueError(f"{len(params.seeds)} seeds for {len(prompt_ids)} prompts")
            draw = GumbelDraw(list(params.seeds), width, params.temperature, params.top_p)
            how = {"do_sample": False, "logits_processor": LogitsProcessorList([draw])}
        else:
            how = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            **how,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        completions = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, 1).float()[:, : completions.shape[1]].cpu() / params.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        mask = eos_mask(completions, tok.eos_token_id)
        lengths = mask.sum(-1)
        logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
        completions = torch.where(mask > 0, completions, torch.full_like(completions, tok.pad_token_id))
        texts = [completion_text(tok, c[:n].tolist()) for c, n in zip(completions, lengths, strict=True)]
        return Rollouts([list(p) for p in prompt_ids], completions, mask, logp, lengths, texts)
