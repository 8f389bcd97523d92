"""``run.toml``: what a run is (model, task, objective, sampling, learner settings) and the RunSpec it
signs to.

The coordinator reads the file once, signs a RunSpec from it and stores both in its state directory, so a
restarted coordinator keeps the same run id and spec. Everything a peer needs that the RunSpec schema has no
field for (learner and sampler settings, objective parameters) travels in its ``hyperparameters`` JSON.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

TINY_MODEL = "tiny"  # the offline tiny model, built where it is missing
CHAT_MODES = ("auto", "on", "off")  # heterorl.peer.model.prompts.CHAT_MODES (kept torch-free here)

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
class LearnerSettings:
    """``[learner]``. micro_batch_tokens: token budget of one forward pass (rows × padded prompt+completion
    width), the gradient staying the full update's; ``None``: one forward for the whole update.
    gradient_checkpointing: recompute activations in backward (HF models). tis_cap: C of truncated
    importance sampling against the sampler/learner mismatch on fresh rows (Yao et al. 2025); ``None``: off.
    checkpoint_dtype: what published checkpoints hold (the samplers' dtype; bf16 for real models on GPUs):
    the learner keeps training its float32 copy and publishes its rounding. deltas: offer each version also
    as sparse lossless deltas (protocol/wire/delta.py) against each of this many most recent published
    versions
    (0: full only); a peer holding one of them fetches the smallest delta, everyone else the full state,
    which every manifest still signs.
    """

    prompts_per_update: int = 16
    group_size: int = 8
    publish_every: int = 1
    max_staleness: int = -1
    buffer_batches: int = 16
    grad_clip: float = 1.0
    micro_batch_tokens: int | None = None
    gradient_checkpointing: bool = False
    tis_cap: float | None = None
    checkpoint_dtype: str = "float32"
    deltas: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.deltas, bool) or not isinstance(self.deltas, int) or not 0 <= self.deltas <= 8:
            raise ValueError(f"learner.deltas must be an integer in [0, 8], got {self.deltas!r}")
        if self.checkpoint_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"learner.checkpoint_dtype must be float32 or bfloat16, got {self.checkpoint_dtype!r}"
            )
        mbt = self.micro_batch_tokens
        if mbt is not None and (isinstance(mbt, bool) or not isinstance(mbt, int) or mbt < 1):
            raise ValueError(f"learner.micro_batch_tokens must be an integer >= 1 (or absent), got {mbt!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(
                f"learner.gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}"
            )
        cap = self.tis_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"learner.tis_cap must be a number > 0 (or absent), got {cap!r}")


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    """``[adapter]``: LoRA on a frozen base (W = W0 + alpha/rank · B A on each target Linear layer).

    target_modules: module-name suffixes (``q_proj`` matches ``model.layers.0.self_attn.q_proj``), checked
    against the model where it is loaded. base_hash: sha256 (hex) of the base weights in the checkpoint dtype,
    filled in by the coordinator, never by run.toml. An adapter run typically wants ~10x full FT's lr.
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    base_hash: str = ""

    def __post_init__(self) -> None:
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"adapter.rank must be an integer >= 1, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0:
            raise ValueError(f"adapter.alpha must be a number > 0, got {a!r}")
        t = self.target_modules
        if isinstance(t, str) or not isinstance(t, (list, tuple)) or not t:
            raise ValueError(f"adapter.target_modules must be a non-empty list of module names, got {t!r}")
        if not all(isinstance(x, str) and x and x.strip() == x for x in t):
            raise ValueError(f"adapter.target_modules must hold non-empty module names, got {list(t)!r}")
        object.__setattr__(self, "target_modules", tuple(t))
        object.__setattr__(self, "alpha", float(a))
        if not isinstance(self.base_hash, str) or (
            self.base_hash and (len(self.base_hash) != 64 or set(self.base_hash) - set("0123456789abcdef"))
        ):
            raise ValueError("adapter.base_hash must be 64 lowercase hex characters")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


ADAPTER_FLAG_HELP = (
    "LoRA adapters on the frozen base instead of full fine-tuning, e.g. "
    "rank=8,alpha=16,targets=q_proj,v_proj (targets: module-name suffixes); "
    "adapter runs want ~10x the full-FT lr"
)


def parse_adapter_flag(text: str) -> AdapterSettings:
    """``rank=8,alpha=16,targets=q_proj,v_proj`` (a bare name after ``targets=`` is one more target)."""
    fields: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        if "=" in part:
            key, value = (x.strip() for x in part.split("=", 1))
            if key not in ("rank", "alpha", "targets") or key in fields:
                raise ValueError(f"--adapter: unknown or repeated field {key!r} (rank, alpha, targets)")
            fields[key] = [value]
        elif key == "targets" and part:
            fields[key].append(part)
        else:
            raise ValueError(f"--adapter: {part!r} is not field=value (e.g. rank=8,alpha=16,targets=q_proj)")
    try:
        kw: dict[str, Any] = {"rank": int(fields["rank"][0])} if "rank" in fields else {}
        if "alpha" in fields:
            kw["alpha"] = float(fields["alpha"][0])
    except ValueError:
        raise ValueError(f"--adapter: rank must be an integer and alpha a number, got {text!r}") from None
    if "targets" in fields:
        kw["target_modules"] = tuple(fields["targets"])
    return AdapterSettings(**kw)


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """``[sampler]``. max_lag: a sampler stops generating while the newest published version is more than
    this many published versions ahead of the one it holds (it fetches in the background meanwhile; data it
    made now would arrive stale); 0: generate only with the newest version known; -1: never stop. Samplers
    also stop while the learner says it is busy."""

    prompts_per_batch: int = 2
    max_lag: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int) or self.max_lag < -1:
            raise ValueError(f"sampler.max_lag must be an integer >= -1, got {self.max_lag!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    run_id: str
    learner_keys: tuple[str, ...]
    model: str = TINY_MODEL
    chat: str = "auto"
    task: str = "arithmetic"
    task_params: dict = dataclasses.field(default_factory=lambda: {"digits": 1})
    objective: str = "gepo"
    objective_params: dict = dataclasses.field(default_factory=dict)
    advantage: str | None = None
    lr: float = 5e-4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 6
    max_batch_rows: int = 256
    learner: LearnerSettings = LearnerSettings()
    sampler: SamplerSettings = SamplerSettings()
    adapter: AdapterSettings | None = None  # None: full fine-tuning

    def __post_init__(self) -> None:
        from heterorl.peer import objectives
        from heterorl.peer.learner.buffer import check_update_fits

        objectives.default_advantage(self.objective)  # ValueError naming the valid objectives
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
        for name in ("prompts_per_update", "group_size", "publish_every", "buffer_batches"):
            if getattr(ls, name) < 1:
                raise ValueError(f"learner.{name} must be >= 1")
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
        model=str(model.get("path", TINY_MODEL)),
        chat=str(model.get("chat", "auto")),
        task=str(task.get("name", "arithmetic")),
        task_params=dict(task.get("params", {"digits": 1})),
        objective=str(obj.get("name", "gepo")),
        objective_params=dict(obj.get("params", {})),
        advantage=obj.get("advantage"),
        lr=float(obj.get("lr", 5e-4)),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        max_new_tokens=int(sampling.get("max_new_tokens", 6)),
        max_batch_rows=int(limits.get("max_batch_rows", 256)),
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
                chat=str(hp.get("chat", "auto")),
                task=body["task"],
                task_params=dict(hp.get("task_params", {})),
                objective=body["objective"],
                objective_params=dict(hp.get("objective_params", {})),
                advantage=hp.get("advantage"),
                lr=float(hp.get("lr", 1e-3)),
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
