"""Task text -> prompt token ids and back, the one way samplers encode and learners decode.

An instruct model expects its chat template: the task's prompt becomes the user turn and the template's
generation prompt follows. A base model (or the tiny one, which has no template) gets BOS + the text.

The learner never trusts a sampler's prompt ids: ``decode`` gives back the task text only when the ids are
exactly what ``encode`` makes of that text (template around it, canonical tokenisation), so a sampler cannot
slip extra instructions or a system prompt around a task prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from heterorl.protocol.settings import CHAT_MODES

_SENTINEL = "\x00HETERORL-PROMPT\x00"  # stands for the task text while the template is rendered once


class PromptFormat:
    """``encode(text) -> ids`` and its strict inverse ``decode(ids) -> text | None`` for one tokenizer.

    ``chat``: "on" uses the tokenizer's chat template (an error if it has none), "off" uses BOS + text,
    "auto" uses the template when the tokenizer has one.
    """

    def __init__(self, tokenizer, chat: str = "auto") -> None:
        if chat not in CHAT_MODES:
            raise ValueError(f"chat must be one of {', '.join(CHAT_MODES)}, got {chat!r}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat == "on" and not has_template:
            raise ValueError("chat template asked for (chat = 'on'), but the tokenizer has none")
        self.tokenizer = tokenizer
        self.chat = has_template and chat != "off"
        self._prefix = self._suffix = ""
        if self.chat:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
            )
            if rendered.count(_SENTINEL) != 1:
                raise ValueError("the tokenizer's chat template does not place the user message exactly once")
            self._prefix, self._suffix = rendered.split(_SENTINEL)

    def describe(self) -> str:
        return "chat template" if self.chat else "plain (BOS + text)"

    def encode(self, text: str) -> list[int]:
        """Token ids of the prompt for ``text``."""
        tok = self.tokenizer
        if self.chat:
            return tok.encode(self._prefix + text + self._suffix, add_special_tokens=False)
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        return bos + tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str | None:
        """The task text ``ids`` were made from, or None if ``encode`` would not make exactly these ids."""
        ids = list(ids)
        tok = self.tokenizer
        if self.chat:
            rendered = tok.decode(ids, skip_special_tokens=False)
            if not (rendered.startswith(self._prefix) and rendered.endswith(self._suffix)):
                return None
            text = rendered[len(self._prefix) : len(rendered) - len(self._suffix)]
        else:
            text = tok.decode(ids, skip_special_tokens=True)
        return text if self.encode(text) == ids else None
