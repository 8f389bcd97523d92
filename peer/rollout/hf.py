"""The ``hf`` rollout backend: batched sampling with ``transformers`` ``generate``.

Behaviour log-probs are taken from the raw logits generate returns, divided by the temperature,
so they equal what the learner recomputes with :func:`heterorl.peer.model.completion_logprobs`.
"""

from __future__ import annotations

import torch

from ..model.logprobs import left_pad
from ..model.text import completion_text
from .base import Rollouts, SamplingParams


class HFBackend:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(self, model, prompts: list[str], params: SamplingParams) -> Rollouts:
        tok = self.tokenizer
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        # a group repeats its prompt: encode each distinct prompt once
        encoded = {p: bos + tok.encode(p, add_special_tokens=False) for p in dict.fromkeys(prompts)}
        prompt_ids = [list(encoded[p]) for p in prompts]
        ids, attn, width = left_pad(prompt_ids, tok.pad_token_id)
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        completions = out.sequences[:, width:]
        logits = torch.stack(out.logits, 1).float()[:, : completions.shape[1]] / params.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        is_eos = completions == tok.eos_token_id
        # a token is real up to and including the first EOS
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        mask = (~after_eos).long()
        lengths = mask.sum(-1)
        logp = torch.where(mask > 0, logp, torch.zeros_like(logp))
        completions = torch.where(mask > 0, completions, torch.full_like(completions, tok.pad_token_id))
        texts = [completion_text(tok, c[:n].tolist()) for c, n in zip(completions, lengths, strict=True)]
        return Rollouts(prompt_ids, completions, mask, logp, lengths, texts)
