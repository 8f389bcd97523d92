"""What a run may ask of a volunteer's peer, and what the volunteer allowed on its own command line.

The RunSpec is signed by the run's host, not by the volunteer: it chooses what the peer computes, never what
code the peer runs or which of its files it opens. :func:`check_runspec` refuses, at join, a RunSpec naming:

- a reward that is not built in (``package.module:function``: importing it runs code), unless the volunteer
  passed ``--allow-reward package.module:function``;
- a task that reads a file on the peer's disk (``jsonl:PATH``): a run's data set travels from the swarm by
  the id the RunSpec names (task ``jsonl`` with ``params.dataset``: :mod:`heterorl.protocol.net.datasets`);
- a model that is a filesystem path (absolute, ``./``, ``../``, ``~``, anything but ``tiny`` and a plain
  ``org/name`` hub id), unless the volunteer passed ``--model-dir DIR``: its own copy of the model;
- a task library this machine does not have in the version the run pins (``reasoning_gym``: reasoning-gym,
  whose version chooses the prompts), or the ``math_verify`` reward without math-verify: the reason says what
  to install.

Which directory is then loaded, and what it may hold (no custom code, safetensors only), is
:func:`~.weights.resolve_model`. Pure checks on the settings: no network, no files.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from heterorl.protocol.settings import TINY_MODEL, Run
from heterorl.protocol.wire.dataset import dataset_id_of

from ..tasks import REWARDS, math_reward, reasoning_gym, task_names
from ..tasks.rewards import is_custom_reward

ALLOW_REWARD_FLAG = "--allow-reward"
MODEL_DIR_FLAG = "--model-dir"
# a hub repo id, org/name: what huggingface_hub accepts, less the legacy ids without an org
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


class RunSpecRefused(ValueError):
    """A RunSpec asks this peer for something the volunteer did not allow; the message says what and how to
    allow it."""


@dataclasses.dataclass(frozen=True)
class Consent:
    """What the volunteer allowed on its own command line, beyond what every run may ask."""

    rewards: tuple[str, ...] = ()  # --allow-reward: custom rewards ("package.module:function") it may import
    model_dir: Path | None = (
        None  # --model-dir: its own copy of the run's model, loaded whatever the run names
    )

    def __post_init__(self) -> None:
        bad = [r for r in self.rewards if not is_custom_reward(r)]
        if bad:
            raise ValueError(f"{ALLOW_REWARD_FLAG} takes 'package.module:function', got {bad[0]!r}")


def model_kind(name: str) -> str:
    """How a RunSpec's ``model`` is found: "tiny" (built here), "hub" (a plain ``org/name`` id, from the local
    Hugging Face cache) or "path" (anything else: a directory on the run host's machine)."""
    if name == TINY_MODEL:
        return "tiny"
    if HUB_ID.fullmatch(name) and ".." not in name and "--" not in name:
        return "hub"
    return "path"


def model_path_refusal(name: str) -> str:
    return (
        f"model {name[:200]!r} is a path on the run host's machine, which this peer does not open: pass "
        f"{MODEL_DIR_FLAG} DIR with your own copy of that model"
    )


def refusals(run: Run, consent: Consent) -> list[str]:
    """Why this peer may not do what ``run`` asks (empty: it may)."""
    reasons = []
    if model_kind(run.model.path) == "path" and consent.model_dir is None:
        reasons.append(model_path_refusal(run.model.path))
    name, params = run.task.name, run.task.params
    if name.startswith("jsonl:"):
        reasons.append(
            f"task {name[:200]!r} would read a file on this machine; a run's data set comes from the swarm "
            "by the id the RunSpec names (a coordinator of this version hosts its jsonl file that way)"
        )
    elif name not in task_names():
        reasons.append(f"unknown task {name[:80]!r}; this peer runs {', '.join(task_names())}")
    else:
        try:
            if dataset_id_of(name, params) is None and name == "jsonl":
                reasons.append("task 'jsonl' names no data set (task.params.dataset)")
        except ValueError as e:
            reasons.append(str(e))
    if name == reasoning_gym.TASK:
        reasons += _library_refusals(params.get("version"))
    reward = params.get("reward")
    if reward is not None:
        reasons += _reward_refusals(reward, consent)
    if reward == "math_verify" and math_reward.missing():
        reasons.append(math_reward.missing())
    return reasons


def _library_refusals(version: object) -> list[str]:
    """A ``reasoning_gym`` run pins reasoning-gym's version (the host writes it): this peer must have that
    one, or it would generate other prompts. Installed metadata only: nothing is imported."""
    if not isinstance(version, str) or not version:
        return [
            f"task {reasoning_gym.TASK!r} pins no reasoning-gym version (task.params.version), so this peer "
            "cannot tell whether it would generate the run's prompts"
        ]
    problem = reasoning_gym.version_problem(version)
    return [problem] if problem else []


def _reward_refusals(reward: object, consent: Consent) -> list[str]:
    builtins = ", ".join(sorted(REWARDS))
    if not isinstance(reward, str) or not (reward in REWARDS or is_custom_reward(reward)):
        return [
            f"reward {str(reward)[:80]!r} is neither a built-in ({builtins}) nor 'package.module:function'"
        ]
    if reward in REWARDS or reward in consent.rewards:
        return []
    return [
        f"reward {reward[:200]!r} is code the run wants this peer to import and run, not a built-in "
        f"({builtins}): pass {ALLOW_REWARD_FLAG} {reward[:200]} if you trust it and have it installed"
    ]


def check_runspec(run: Run, consent: Consent, run_id: str = "") -> None:
    """RunSpecRefused naming every reason why this peer may not join ``run`` as it stands."""
    reasons = refusals(run, consent)
    if reasons:
        raise RunSpecRefused(f"refused the RunSpec of run {run_id or '?'}: " + "; ".join(reasons))
