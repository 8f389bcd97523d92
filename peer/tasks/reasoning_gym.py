"""Tasks from reasoning-gym's procedural data sets: one (``dataset``, with its ``config``) or a weighted
mixture (``datasets``), its questions generated from the task's parameters alone.

reasoning-gym generates entry ``i`` of a data set from a random generator seeded by the data set's seed plus
``i``, so every peer that builds the task from the same parameters and the same library version has the same
``size`` entries: a prompt is the chosen instruction (one of ``reasoning_gym.utils.SYSTEM_PROMPTS``, which ask
for the answer between ``<answer>`` tags), a blank line and the entry's question; the reference is the entry's
index, as text. The default reward extracts the answer with ``reasoning_gym.utils.extract_answer`` and scores
it with the data set's own ``score_answer`` (clamped to [0, 1]); with ``extract = "last_number"`` a reply
without the tags is scored on its last number instead (small models answer "5 + 3 = 8" and ignore the tags:
SmolLM2-135M's replies carry them 2 times in 512, see docs/operations.md). Another reward gets the entry's
answer as its reference. A learner recovers the index from a prompt with a map of every entry's prompt, built
once, on first use (one entry generated per index: :data:`DEFAULT_SIZE` explains the cost).

A run pins the library's version (``version``, the installed distribution's: ``heterorl coordinator`` writes
it into the RunSpec), since another version may generate other entries. Data sets whose entries differ from
one process to another are refused (:data:`NONDETERMINISTIC`). The library comes with the ``tasks`` extra and
is imported only when such a task is built.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import random
import threading
from collections.abc import Mapping
from typing import Any

from ._params import check_int, check_str
from .answers import last_number
from .base import ENUMERATE_MAX, HELD_OUT_MAX, Example, RewardFn, Task, in_held_out_split

TASK = "reasoning_gym"
DISTRIBUTION = "reasoning-gym"  # its version, as importlib.metadata reads it (reasoning_gym.__version__ lags)
INSTALL = "pip install 'heterorl[tasks]'"
DEFAULT_SIZE = 10_000
# Entries a task holds. A learner generates each once to map prompts back to entries, on first use: at 10 000,
# 0.2 s (chain_sum, lcm) to 1.5 s (basic_arithmetic) and 6 to 9 s (simple_equations) on one core of a shared
# 2-core machine; slow generators take longer (countdown: about 20 ms an entry, over 3 minutes).
MAX_SIZE = 100_000
MAX_SEED = 2**31 - 1
DEFAULT_INSTRUCTIONS = "direct"
# How the default reward finds a reply's answer: between its last <answer> tags only, or, failing those, its
# last number (for numeric data sets and models too small to follow the tag format).
EXTRACTS = ("tags", "last_number")
MIXTURE_KEYS = ("name", "weight", "config")
# Task parameters set for the data set by the task itself, not in its config.
_OWN_CONFIG = ("seed", "size")
# Data sets whose entries differ from one process to another in reasoning-gym 0.1.25 (they follow
# PYTHONHASHSEED, or a fresh build draws other entries): refused, since every peer must generate the same
# prompts. Found by building the first 64 to 200 entries of every data set in processes with different hash
# seeds (and twice in one process); a difference that shows only in later entries would not have been seen.
# tests/test_reasoning_gym_task.py repeats the check for the data sets the tests rely on.
NONDETERMINISTIC = frozenset(
    {
        "codeio",
        "intermediate_integration",
        "isomorphic_strings",
        "knight_swap",
        "list_functions",
        "polynomial_multiplication",
        "ransom_note",
        "sokoban",
        "word_ladder",
    }
)
_CACHED_ENTRIES = 1024  # entries kept generated: a group's completions are scored against the same entry


def installed_version() -> str | None:
    """The installed reasoning-gym distribution's version, or None; reads metadata, imports nothing."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_problem(pinned: object = None) -> str | None:
    """Why a ``reasoning_gym`` task pinned to version ``pinned`` (None: whichever is installed) cannot be
    built here, with the command that fixes it; None if it can. Imports nothing."""
    installed = installed_version()
    if installed is None:
        also = f" (this run pins {pinned}: pip install 'reasoning-gym=={pinned}')" if pinned else ""
        return (
            f"task {TASK!r} needs the reasoning-gym package, which is not installed here: {INSTALL} "
            f"(or `make install` in a checkout){also}"
        )
    if pinned is not None and pinned != installed:
        return (
            f"task {TASK!r}: the run pins reasoning-gym {pinned}, this machine has {installed}: "
            f"pip install 'reasoning-gym=={pinned}'"
        )
    return None


def _library() -> Any:
    """The ``reasoning_gym`` package (imported now); ValueError with the install command without it."""
    try:
        import reasoning_gym
        import reasoning_gym.composite
        import reasoning_gym.utils
    except ImportError as e:
        raise ValueError(version_problem() or f"{TASK}: cannot import reasoning_gym: {e}") from e
    return reasoning_gym


@dataclasses.dataclass(frozen=True)
class _Source:
    name: str
    weight: float
    config: dict


class ReasoningGymTask(Task):
    """Prompts from one reasoning-gym data set (``dataset``, ``config``) or a mixture (``datasets``: a list of
    ``{name, weight, config}`` tables, reasoning-gym's ``composite`` data set); see the module doc.

    ``seed``, ``size``: which entries (0 to size - 1); ``instructions``: a key of
    ``reasoning_gym.utils.SYSTEM_PROMPTS``; ``version``: the reasoning-gym version the run pins (None: the
    installed one); ``extract``: one of :data:`EXTRACTS`, how the data set's scorer finds the answer;
    ``reward``: None for the data set's own scorer. ValueError naming the bad parameter.
    """

    name = TASK

    def __init__(
        self,
        dataset: str | None = None,
        datasets: list | None = None,
        config: Mapping[str, Any] | None = None,
        seed: int = 0,
        size: int = DEFAULT_SIZE,
        instructions: str = DEFAULT_INSTRUCTIONS,
        version: str | None = None,
        extract: str = "tags",
        reward: RewardFn | None = None,
    ) -> None:
        if reward is not None and not callable(reward):
            raise ValueError(f"{TASK}: reward must be callable, got {reward!r:.80}")
        super().__init__(self.score if reward is None else _on_answer(self, reward))
        self.seed = check_int(TASK, "seed", seed, 0, MAX_SEED)
        self.size = check_int(TASK, "size", size, 1, MAX_SIZE)
        check_str(TASK, "instructions", instructions)
        if extract not in EXTRACTS:
            raise ValueError(f"{TASK}: extract must be one of {', '.join(EXTRACTS)}, got {extract!r:.80}")
        if extract != "tags" and reward is not None:
            raise ValueError(f"{TASK}: extract is for the data set's own scorer, not for another reward")
        self.extract = extract
        if version is not None:
            check_str(TASK, "version", version)
        problem = version_problem(version)
        if problem:
            raise ValueError(problem)
        if (dataset is None) == (datasets is None):
            raise ValueError(
                f"{TASK}: name exactly one of dataset (a reasoning-gym data set) and datasets (a mixture: a "
                "list of {name, weight, config} tables)"
            )
        if datasets is not None and config is not None:
            raise ValueError(f"{TASK}: config goes with dataset; in a mixture each of datasets has its own")
        rg = _library()
        self.version = installed_version()
        prompts = rg.utils.SYSTEM_PROMPTS
        if instructions not in prompts:
            raise ValueError(
                f"{TASK}: instructions must be one of {', '.join(prompts)}, got {instructions!r:.80}"
            )
        self.instructions = instructions
        self.prefix = prompts[instructions].rstrip() + "\n\n"
        registry = rg.factory.DATASETS
        self.mixture = datasets is not None
        if dataset is not None:
            name = _check_name("dataset", dataset, registry)
            self.sources = (_Source(name, 1.0, _check_config(config, name, registry)),)
        else:
            self.sources = _check_mixture(datasets, registry)
        self.dataset = self._build(rg)
        self._entry = functools.lru_cache(maxsize=_CACHED_ENTRIES)(self._generate)
        self._lock = threading.Lock()
        self._by_prompt: dict[str, int] | None = None
        self._held: list[int] = []
        self._alphabet = ""
        self._listed: list[Example] | None = None

    def _build(self, rg: Any) -> Any:
        try:
            if not self.mixture:
                (src,) = self.sources
                dataset = rg.create_dataset(src.name, **src.config, seed=self.seed, size=self.size)
            else:
                specs = [rg.composite.DatasetSpec(s.name, s.weight, dict(s.config)) for s in self.sources]
                dataset = rg.create_dataset("composite", seed=self.seed, size=self.size, datasets=specs)
            dataset[0]  # a config the generator cannot draw from fails here, not at a run's first prompt
            return dataset
        except (AssertionError, TypeError, ValueError, KeyError, IndexError) as e:
            which = "datasets" if self.mixture else f"dataset {self.sources[0].name!r}"
            raise ValueError(f"{TASK}: reasoning-gym refused {which}: {type(e).__name__}: {e}") from e

    # ---- entries ----

    def _generate(self, index: int) -> dict:
        return self.dataset[index]

    def _example(self, index: int, entry: dict | None = None) -> Example:
        entry = self._entry(index) if entry is None else entry
        answer = entry.get("answer")
        solution = "" if answer is None else f"<answer>{answer}</answer>"
        return Example(prompt=self.prefix + entry["question"], reference=str(index), solution=solution)

    def _index(self) -> dict[str, int]:
        """Every entry's prompt -> the first index with it (built once: ``size`` entries generated)."""
        with self._lock:
            if self._by_prompt is None:
                by_prompt: dict[str, int] = {}
                held: list[int] = []
                chars = set(self.prefix + "<answer></answer>")
                for i in range(self.size):
                    ex = self._example(i, self._generate(i))
                    chars.update(ex.prompt + ex.solution)
                    if ex.prompt not in by_prompt:
                        by_prompt[ex.prompt] = i
                        if in_held_out_split(ex.prompt):
                            held.append(i)
                self._held, self._alphabet = held, "".join(sorted(chars))
                self._by_prompt = by_prompt
            return self._by_prompt

    def entry_for(self, reference: str, prompt: str | None = None) -> dict | None:
        """The entry ``reference`` (an index, as :meth:`reference_for` writes it) names, or None if it names
        none, or (given ``prompt``) one whose prompt is not ``prompt``."""
        if not isinstance(reference, str) or not reference.isdecimal() or len(reference) > len(str(MAX_SIZE)):
            return None
        if reference != str(int(reference)):  # one spelling per index: no leading zeros, ASCII digits
            return None
        index = int(reference)
        if index >= self.size:
            return None
        entry = self._entry(index)
        if prompt is not None and self.prefix + entry["question"] != prompt:
            return None
        return entry

    # ---- the Task interface ----

    def draw(self, rng: random.Random) -> Example:
        return self._example(rng.randrange(self.size))

    def all_examples(self) -> list[Example] | None:
        """Every entry where ``size`` is at most ENUMERATE_MAX; else, where the entries hold at most
        ENUMERATE_MAX distinct prompts (two one-digit terms: 200), each distinct prompt once (its first
        entry), so that a small prompt space is evaluated whole, as the built-in tasks' are; else None.
        Deciding costs up to ``size`` entries once (a large space stops after ENUMERATE_MAX + 1 distinct
        prompts), the same on every peer."""
        if self._listed is None:
            if self.size <= ENUMERATE_MAX:
                self._listed = [self._example(i) for i in range(self.size)]
            else:
                self._listed = self._distinct_if_few() or []
        return self._listed or None

    def _distinct_if_few(self) -> list[Example] | None:
        distinct: dict[str, Example] = {}
        for i in range(self.size):
            ex = self._example(i, self._generate(i))
            distinct.setdefault(ex.prompt, ex)
            if len(distinct) > ENUMERATE_MAX:
                return None
        return list(distinct.values())

    def held_out(self) -> list[Example]:
        """The held-out split's entries, in index order (up to HELD_OUT_MAX); a small task's every entry."""
        listed = self.all_examples()
        if listed is not None:
            return listed
        self._index()
        return [self._example(i) for i in self._held[:HELD_OUT_MAX]]

    def reference_for(self, prompt: str) -> str | None:
        if not isinstance(prompt, str) or not prompt.startswith(self.prefix):
            return None
        index = self._index().get(prompt)
        return None if index is None else str(index)

    def alphabet(self) -> str:
        """Every character of every entry's prompt and solution (the prompt map is built for it)."""
        self._index()
        return self._alphabet

    def score(self, prompt: str, completion: str, reference: str) -> float:
        """The default reward: the data set's ``score_answer`` of the answer between the completion's last
        ``<answer>`` tags (``extract = "last_number"``: else of its last number), in [0, 1]; 0.0 without such
        an answer, for a reference that is not this prompt's entry, and where the scorer fails on the
        answer."""
        entry = self.entry_for(reference, prompt)
        if entry is None:
            return 0.0
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(completion)
        if answer is None and self.extract == "last_number":
            answer = last_number(completion)
        if answer is None:
            return 0.0
        try:
            value = float(self.dataset.score_answer(answer, entry))
        except Exception:  # a scorer failing on a model's answer: no reward, not a failed peer
            return 0.0
        return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def _on_answer(task: ReasoningGymTask, reward: RewardFn) -> RewardFn:
    """``reward`` given the entry's answer as its reference (an index means nothing to it)."""

    def scored(prompt: str, completion: str, reference: str) -> float:
        entry = task.entry_for(reference, prompt)
        if entry is None:
            return 0.0
        answer = entry.get("answer")
        return reward(prompt, completion, "" if answer is None else str(answer))

    scored.__name__ = getattr(reward, "__name__", "reward")
    return scored


def _check_name(where: str, name: object, registry: Mapping[str, Any]) -> str:
    if not isinstance(name, str) or name not in registry or name == "composite":
        raise ValueError(
            f"{TASK}: {where} must name a reasoning-gym data set (reasoning_gym.factory.DATASETS; a mixture "
            f"goes in datasets), got {str(name)[:80]!r}"
        )
    if name in NONDETERMINISTIC:
        raise ValueError(
            f"{TASK}: {where} {name!r} is refused: its entries differ from one process to another, so peers "
            "would not agree on its prompts"
        )
    return name


def _check_config(config: object, name: str, registry: Mapping[str, Any], where: str = "config") -> dict:
    """``config`` as data set ``name``'s parameters; its values are checked when the data set is built."""
    if config is None:
        return {}
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise ValueError(f"{TASK}: {where} must be a table of {name}'s parameters, got {config!r:.80}")
    for key in _OWN_CONFIG:
        if key in config:
            raise ValueError(f"{TASK}: {where}.{key} is not {name}'s to set: it is the task's {key}")
    accepted = [f.name for f in dataclasses.fields(registry[name][1]) if f.name not in _OWN_CONFIG]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        raise ValueError(
            f"{TASK}: {where}: {name} has no parameter(s) {', '.join(unknown)}; its parameters: "
            f"{', '.join(accepted)}"
        )
    return dict(config)


def _check_mixture(datasets: object, registry: Mapping[str, Any]) -> tuple[_Source, ...]:
    if not isinstance(datasets, (list, tuple)) or not datasets:
        raise ValueError(
            f"{TASK}: datasets must be a non-empty list of {{name, weight, config}} tables, got "
            f"{datasets!r:.80}"
        )
    sources: list[_Source] = []
    for k, item in enumerate(datasets):
        where = f"datasets[{k}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{TASK}: {where} must be a {{name, weight, config}} table, got {item!r:.80}")
        unknown = sorted(map(str, set(item) - set(MIXTURE_KEYS)))
        if unknown:
            raise ValueError(
                f"{TASK}: {where} has unknown key(s) {', '.join(unknown)}; a mixture's table has "
                f"{', '.join(MIXTURE_KEYS)}"
            )
        name = _check_name(f"{where}.name", item.get("name"), registry)
        if any(s.name == name for s in sources):
            raise ValueError(f"{TASK}: {where}.name {name!r} is in the mixture twice")
        weight = item.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ValueError(f"{TASK}: {where}.weight must be a positive number, got {weight!r}")
        config = _check_config(item.get("config"), name, registry, f"{where}.config")
        sources.append(_Source(name, float(weight), config))
    return tuple(sources)
