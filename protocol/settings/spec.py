"""Where a run's settings travel in a RunSpec body: the few the RunSpec schema has a typed field for
(protocol/wire/messages.py), and every other one in its ``hyperparameters`` JSON, the settings tree's own
data (:func:`.tree.to_dict`) under a format number. A peer reads the formats it knows and refuses others;
within its format it ignores (and reports) settings a newer coordinator added.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .tree import apply_overrides

SPEC_FORMAT = 2  # of the hyperparameters JSON; 1 was the flat bag before the settings tree (no "format" key)

# setting path -> its field in the RunSpec body (a nested field as a key path)
TYPED: dict[str, tuple[str, ...]] = {
    "model.path": ("model",),
    "task.name": ("task",),
    "objective.name": ("objective",),
    "sampling.temperature": ("sampling", "temperature"),
    "sampling.top_p": ("sampling", "top_p"),
    "sampling.max_new_tokens": ("sampling", "max_new_tokens"),
    "limits.max_batch_rows": ("max_batch_rows",),
}


def body_fields(run: Mapping[str, Any]) -> dict[str, Any]:
    """The RunSpec fields that carry the settings ``run`` (a run's settings data: sections only, no
    identity): the typed fields, and ``hyperparameters`` holding the rest with the format number."""
    rest = json.loads(json.dumps(run))  # a deep copy, and proof that it is JSON
    body: dict[str, Any] = {}
    for path, where in TYPED.items():
        section, name = path.split(".")
        node = body
        for key in where[:-1]:
            node = node.setdefault(key, {})
        node[where[-1]] = rest[section].pop(name)
        if not rest[section]:
            del rest[section]
    body["hyperparameters"] = json.dumps({"format": SPEC_FORMAT, **rest}, sort_keys=True)
    return body


def settings_data(body: Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings data back from the RunSpec fields :func:`body_fields` wrote (to parse with
    :func:`.tree.from_dict`); ValueError if the hyperparameters are not JSON of a format this peer reads."""
    try:
        hp = json.loads(body["hyperparameters"])
    except json.JSONDecodeError as e:
        raise ValueError(f"RunSpec hyperparameters not understood: not JSON ({e})") from None
    if not isinstance(hp, dict):
        raise ValueError(f"RunSpec hyperparameters not understood: a JSON object expected, got {hp!r:.80}")
    fmt = hp.pop("format", 1)
    if fmt != SPEC_FORMAT:
        raise ValueError(
            f"RunSpec hyperparameters are in format {fmt!r}; this peer reads format {SPEC_FORMAT}: the run "
            "was signed by a coordinator of another version (run a peer of that version, or a new run)"
        )
    typed = {}
    for path, where in TYPED.items():
        value: Any = body
        for key in where:
            value = value[key]
        typed[path] = value
    return apply_overrides(hp, typed)
