"""Tasks loaded from JSONL question/answer records (e.g. GSM8K): a file, or a data set's bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

from ._params import check_str
from .answers import extract_answer, gsm8k
from .base import ENUMERATE_MAX, HELD_OUT_MAX, Example, RewardFn, Task, in_held_out_split
from .math_reward import math_reference, math_verify_reward


class JsonlTask(Task):
    """Samples uniformly from JSONL records, all loaded up front: ``source`` is a file's path, or the bytes
    of a data set (a run's, fetched from the swarm and verified: :mod:`heterorl.protocol.net.datasets`).

    prompt = `prompt_template` with ``{question}`` filled in; solution = the raw answer field;
    reference = `extract_answer` of the answer field (a number, GSM8K's ``####``), or with the ``math_verify``
    reward the field as it is (the text after ``####`` if it has one: :func:`~.math_reward.math_reference`),
    which math-verify parses itself.
    """

    name = "jsonl"

    def __init__(
        self,
        source: str | Path | bytes,
        question_field: str = "question",
        answer_field: str = "answer",
        prompt_template: str = "{question}\n",
        reward: RewardFn = gsm8k,
    ) -> None:
        super().__init__(reward)
        data = source if isinstance(source, bytes) else None
        self.path = Path("dataset") if data is not None else Path(source)  # names records in errors
        self.question_field = check_str(self.name, "question_field", question_field)
        self.answer_field = check_str(self.name, "answer_field", answer_field)
        self.prompt_template = check_str(self.name, "prompt_template", prompt_template)
        try:
            prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{self.name}: prompt_template may only use {{question}}: {e!r}") from e
        if "{question}" not in prompt_template:
            raise ValueError(f"{self.name}: prompt_template must contain {{question}}")
        self.examples = self._load(data)

    def _load(self, data: bytes | None) -> tuple[Example, ...]:
        try:
            raw = data if data is not None else self.path.read_bytes()
        except OSError as e:
            raise ValueError(f"{self.name}: cannot read {self.path}: {e.strerror or e}") from e
        examples = []
        for lineno, line in enumerate(raw.splitlines(), start=1):
            where = f"{self.path}:{lineno}"
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8") from e
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON: {e.msg}") from e
            examples.append(self._example(record, where))
        if not examples:
            raise ValueError(f"{self.path}: no records (file is empty)")
        return tuple(examples)

    def _example(self, record: object, where: str) -> Example:
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for field in (self.question_field, self.answer_field):
            if field not in record:
                raise ValueError(f"{where}: missing field {field!r}")
        question, answer = record[self.question_field], record[self.answer_field]
        if not isinstance(question, str):
            raise ValueError(f"{where}: field {self.question_field!r} must be a string")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: field {self.answer_field!r} must be a string or number")
        answer = str(answer)
        reference = math_reference(answer) if self.reward_fn is math_verify_reward else extract_answer(answer)
        if reference is None:
            raise ValueError(f"{where}: no final answer found in field {self.answer_field!r}")
        prompt = self.prompt_template.format(question=question)
        return Example(prompt=prompt, reference=reference, solution=answer)

    def draw(self, rng: random.Random) -> Example:
        return self.examples[rng.randrange(len(self.examples))]

    def all_examples(self) -> list[Example] | None:
        return list(self.examples) if len(self.examples) <= ENUMERATE_MAX else None

    def held_out(self) -> list[Example]:
        """The records of the held-out split, in file order (up to HELD_OUT_MAX)."""
        listed = self.all_examples()
        if listed is not None:
            return listed
        return [ex for ex in self.examples if in_held_out_split(ex.prompt)][:HELD_OUT_MAX]

    def reference_for(self, prompt: str) -> str | None:
        if not hasattr(self, "_by_prompt"):
            self._by_prompt = {ex.prompt: ex.reference for ex in self.examples}
        return self._by_prompt.get(prompt)

    def alphabet(self) -> str:
        chars = {c for ex in self.examples for c in ex.prompt + ex.reference + ex.solution}
        return "".join(sorted(chars))
