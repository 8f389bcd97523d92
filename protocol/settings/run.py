"""``run.toml``: what a run is (model, task, objective, sampling, learner settings) and the RunSpec it
signs to; :class:`RunSettings`, what a peer reads back out of a verified RunSpec.

The coordinator reads the file once, signs a RunSpec from it and stores both in its state directory, so a
restarted coordinator keeps the same run id and spec. Everything a peer needs that the RunSpec schema has no
field for (learner and sampler settings, objective parameters) travels in its ``hyperparameters`` JSON.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import tomllib
from pathlib import Path
from typing import Any

from .base import (
    ADVANTAGES,
    CHAT_MODES,
    OBJECTIVES,
    TINY_MODEL,
    check_int,
    check_update_fits,
    default_of,
    setting,
)
from .roles import AdapterSettings, LearnerSettings, SamplerSettings

EXAMPLE = """\
# A HeteroRL run. `heterorl coordinator --run-config run.toml` signs a RunSpec from this file.
run_id = "my-run"                  # omit to get a random one
learner_keys = ["<64 hex chars>"]  # `heterorl keys show --key learner.key`: who may sign checkpoints

[model]
path = "tiny"                      # the offline tiny model, or a local path / Hugging Face hub id
chat = "auto"                      # prompts via the chat template: auto (if the tokenizer has one) | on | off

[task]
name = "arithmetic"                # arithmetic | countdown | jsonl:PATH
params = { digits = 1 }

[objective]
name = "gepo"                      # gepo (defensive sampling on stale data) | grpo | gspo | cispo | ...
lr = 5e-4
params = {}

[sampling]
temperature = 1.0
top_p = 1.0
max_new_tokens = 6

[learner]
prompts_per_update = 16            # prompt groups per update
group_size = 8                     # completions per prompt
publish_every = 1                  # publish a signed checkpoint every K updates
max_staleness = -1                 # -1: use all data however stale; N: drop batches more than N versions old
buffer_batches = 16                # accepted batches kept waiting; beyond it samplers are told to slow down
# micro_batch_tokens = 16384       # tokens per forward pass (same gradient); absent: the whole update at once
# gradient_checkpointing = false   # recompute activations in backward: less memory, ~30% more compute
# checkpoint_dtype = "bfloat16"   # what checkpoints travel as (samplers' dtype); the learner trains float32
deltas = 4                         # offer each version as sparse deltas against the 4 versions before it
save_every_s = 300                 # save the learner's state at most this often (0: with every version)
# tis_cap = 2.0                    # truncated IS against sampler/learner mismatch (fresh rows); absent: off

[sampler]
prompts_per_batch = 2              # prompt groups per TrajectoryBatch
max_lag = 4                        # stop generating while more than 4 versions behind the newest (-1: never)

# [adapter]                        # LoRA adapters on a frozen base; absent: full fine-tuning
# rank = 8                         # checkpoints carry only the adapters (rank × (in + out) per target)
# alpha = 16                       # scale alpha / rank; adapter runs want ~10x the full-FT lr (5e-3)
# target_modules = ["q_proj", "v_proj"]  # module-name suffixes of the model's Linear layers
"""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    run_id: str = setting("", "the run's name (run.toml: omit for a random one)")
    learner_keys: tuple[str, ...] = setting((), "hex Ed25519 public keys allowed to sign checkpoints")
    model: str = setting(TINY_MODEL, "model path or hub id; 'tiny' is the offline tiny model")
    chat: str = setting("auto", "prompts via the chat template: auto (if the tokenizer has one) | on | off")
    task: str = setting("arithmetic", "arithmetic | countdown | jsonl:PATH")
    task_params: dict = setting(None, "task parameters", factory=lambda: {"digits": 1})
    objective: str = setting(
        "gepo", "gepo (defensive sampling on stale data) | " + " | ".join(list(OBJECTIVES)[1:])
    )
    objective_params: dict = setting(None, 'objective parameters, e.g. {"clip": 0.3}', factory=dict)
    advantage: str | None = setting(None, "grpo | dr_grpo | bnpo | rloo (default: the objective's)")
    lr: float = setting(5e-4, "learning rate (AdamW)")
    temperature: float = setting(1.0, "sampling temperature")
    top_p: float = setting(1.0, "nucleus sampling mass")
    max_new_tokens: int = setting(6, "completion length cap (tokens)")
    max_batch_rows: int = setting(256, "most rows one TrajectoryBatch may carry")
    learner: LearnerSettings = setting(LearnerSettings(), "[learner]")
    sampler: SamplerSettings = setting(SamplerSettings(), "[sampler]")
    adapter: AdapterSettings | None = setting(None, "[adapter]; absent: full fine-tuning")

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("run_id is empty")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; valid: {', '.join(sorted(OBJECTIVES))}")
        if self.advantage is not None and self.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {self.advantage!r}; valid: {', '.join(ADVANTAGES)}")
        for name in ("lr", "temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("limits.max_batch_rows", self.max_batch_rows, 1)
        if self.chat not in CHAT_MODES:
            raise ValueError(f"model.chat must be one of {', '.join(CHAT_MODES)}, got {self.chat!r}")
        learners = sorted({"tis_cap", "tis_logp", "tis_rows"} & set(self.objective_params))
        if learners:
            raise ValueError(f"objective params {', '.join(learners)} are the learner's: use learner.tis_cap")
        if not self.learner_keys:
            raise ValueError("learner_keys is empty: list the public key of at least one learner")
        for k in self.learner_keys:
            if len(bytes.fromhex(k)) != 32:
                raise ValueError(f"learner key {k[:16]}… is not 64 hex characters")
        ls = self.learner
        if self.sampler.prompts_per_batch * ls.group_size > self.max_batch_rows:
            raise ValueError("sampler.prompts_per_batch × learner.group_size exceeds limits.max_batch_rows")
        check_update_fits(ls.prompts_per_update, self.sampler.prompts_per_batch, ls.buffer_batches)

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "chat": self.chat,
            "task_params": self.task_params,
            "objective_params": self.objective_params,
            "advantage": self.advantage,
            "lr": self.lr,
            "learner": dataclasses.asdict(self.learner),
            "sampler": dataclasses.asdict(self.sampler),
        }

    def runspec_body(
        self, initial_checkpoint: bytes, vocab_size: int, base_hash: bytes | None = None
    ) -> dict:
        """``base_hash``: sha256 of the base weights, required for (and only for) an adapter run, whose
        ``initial_checkpoint`` is the hash of the initial adapter (version 0)."""
        hp = self.hyperparameters()
        if (self.adapter is None) != (base_hash is None):
            raise ValueError("base_hash goes with an adapter run, and only with one")
        if self.adapter is not None:
            hp["adapter"] = {**dataclasses.asdict(self.adapter), "base_hash": base_hash.hex()}
        return {
            "run_id": self.run_id,
            "model": self.model,
            "initial_checkpoint": initial_checkpoint,
            "task": self.task,
            "reward": "builtin",
            "objective": self.objective,
            "hyperparameters": json.dumps(hp, sort_keys=True),
            "sampling": {
                "temperature": self.temperature,
                "top_p": self.top_p,
                "max_new_tokens": self.max_new_tokens,
            },
            "learner_keys": [bytes.fromhex(k) for k in self.learner_keys],
            "vocab_size": vocab_size,
            "max_batch_rows": self.max_batch_rows,
        }


def _pick(section: dict, cls: type, where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(section) - names
    if unknown:
        raise ValueError(
            f"[{where}]: unknown setting(s) {', '.join(sorted(unknown))}; known: {sorted(names)}"
        )
    return cls(**section)


def parse_run_config(data: dict) -> RunConfig:
    """A RunConfig from parsed TOML; ValueError naming the bad setting."""
    data = dict(data)
    known = {
        "run_id",
        "learner_keys",
        "model",
        "task",
        "objective",
        "sampling",
        "learner",
        "sampler",
        "limits",
        "adapter",
    }
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown section(s) or key(s) {', '.join(sorted(unknown))}")
    model, task, obj = data.get("model", {}), data.get("task", {}), data.get("objective", {})
    sampling, limits = data.get("sampling", {}), data.get("limits", {})
    return RunConfig(
        run_id=str(data.get("run_id") or f"run-{secrets.token_hex(4)}"),
        learner_keys=tuple(data.get("learner_keys", ())),
        model=str(model.get("path", default_of(RunConfig, "model"))),
        chat=str(model.get("chat", default_of(RunConfig, "chat"))),
        task=str(task.get("name", default_of(RunConfig, "task"))),
        task_params=dict(task.get("params", default_of(RunConfig, "task_params"))),
        objective=str(obj.get("name", default_of(RunConfig, "objective"))),
        objective_params=dict(obj.get("params", {})),
        advantage=obj.get("advantage"),
        lr=float(obj.get("lr", default_of(RunConfig, "lr"))),
        temperature=float(sampling.get("temperature", default_of(RunConfig, "temperature"))),
        top_p=float(sampling.get("top_p", default_of(RunConfig, "top_p"))),
        max_new_tokens=int(sampling.get("max_new_tokens", default_of(RunConfig, "max_new_tokens"))),
        max_batch_rows=int(limits.get("max_batch_rows", default_of(RunConfig, "max_batch_rows"))),
        learner=_pick(data.get("learner", {}), LearnerSettings, "learner"),
        sampler=_pick(data.get("sampler", {}), SamplerSettings, "sampler"),
        adapter=_adapter(data["adapter"]) if "adapter" in data else None,
    )


def _adapter(section: dict) -> AdapterSettings:
    if "base_hash" in section:
        raise ValueError("[adapter]: base_hash is computed by the coordinator from the model, not set here")
    return _pick(section, AdapterSettings, "adapter")


def load_run_config(path: str | Path) -> RunConfig:
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse_run_config(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What a peer reads back out of a verified RunSpec body."""

    run_id: str
    model: str
    chat: str
    task: str
    task_params: dict
    objective: str
    objective_params: dict
    advantage: str | None
    lr: float
    temperature: float
    top_p: float
    max_new_tokens: int
    learner: LearnerSettings
    sampler: SamplerSettings
    learner_keys: tuple[bytes, ...]
    vocab_size: int
    max_batch_rows: int
    initial_checkpoint: bytes
    adapter: AdapterSettings | None = None  # an adapter run: checkpoints hold LoRA adapters, not weights

    @classmethod
    def from_spec(cls, body: dict) -> RunSettings:
        """ValueError if the hyperparameters JSON does not hold what this version needs."""
        try:
            hp = json.loads(body["hyperparameters"])
            return cls(
                run_id=body["run_id"],
                model=body["model"],
                chat=str(hp.get("chat", default_of(RunConfig, "chat"))),
                task=body["task"],
                task_params=dict(hp.get("task_params", {})),
                objective=body["objective"],
                objective_params=dict(hp.get("objective_params", {})),
                advantage=hp.get("advantage"),
                lr=float(hp.get("lr", default_of(RunConfig, "lr"))),
                temperature=body["sampling"]["temperature"],
                top_p=body["sampling"]["top_p"],
                max_new_tokens=body["sampling"]["max_new_tokens"],
                learner=LearnerSettings(**hp.get("learner", {})),
                sampler=SamplerSettings(**hp.get("sampler", {})),
                learner_keys=tuple(body["learner_keys"]),
                vocab_size=body["vocab_size"],
                max_batch_rows=body["max_batch_rows"],
                initial_checkpoint=body["initial_checkpoint"],
                adapter=_spec_adapter(hp.get("adapter")),
            )
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"RunSpec hyperparameters not understood: {e}") from None


def _spec_adapter(section: Any) -> AdapterSettings | None:
    if section is None:
        return None
    adapter = AdapterSettings(**section)
    if not adapter.base_hash:
        raise ValueError("an adapter run's spec must name its base model's hash")
    return adapter
