"""A run's settings as one tree: :class:`Run` (every section of run.toml), :class:`RunConfig` (run.toml: a run
and its identity, what the coordinator signs a RunSpec from) and :class:`RunSettings` (what a peer reads back
out of a verified RunSpec).

The coordinator reads the file once, signs a RunSpec from it and stores both in its state directory, so a
restarted coordinator keeps the same run id and spec. Every setting the RunSpec schema has no typed field for
travels in its ``hyperparameters`` JSON (:mod:`.spec`). run.toml, the RunSpec and command-line overrides are
all read by the one parser, :func:`.tree.from_dict`: a new setting is a field of its section, and its use.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import spec, toml_text
from .base import REQUIRED, check_update_fits, setting
from .lineage import LineageSettings
from .roles import AdapterSettings, LearnerSettings, SamplerSettings
from .sections import LimitsSettings, ModelSettings, ObjectiveSettings, SamplingSettings, TaskSettings
from .tree import apply_overrides, from_dict, to_dict
from .trust import TrustSettings

# tasks whose own parameter is called "dataset" (protocol/wire/dataset.py's OWN_DATASET_PARAM, which settings
# does not import): reasoning_gym names a reasoning-gym data set with it, not the id of the run's data set
OWN_DATASET_PARAM = ("reasoning_gym",)

log = logging.getLogger(__name__)

MAX_LEARNER_KEYS = 64  # the RunSpec schema's bound


def check_learner_keys(keys: tuple | list) -> None:
    """ValueError for a run that names no learner, more than :data:`MAX_LEARNER_KEYS`, or one twice. Several
    learners train one lineage of versions (the lowest key writes, ``protocol/net/lineage.py``)."""
    if not keys:
        raise ValueError("learner_keys is empty: list the public key of at least one learner")
    if len(keys) > MAX_LEARNER_KEYS:
        raise ValueError(f"learner_keys lists {len(keys)} keys; at most {MAX_LEARNER_KEYS} learners per run")
    if len(set(keys)) != len(keys):
        raise ValueError("learner_keys lists a key twice")


EXAMPLE = """\
# A HeteroRL run. `heterorl coordinator --run-config run.toml` signs a RunSpec from this file.
run_id = "my-run"                  # omit to get a random one
learner_keys = ["<64 hex chars>"]  # `heterorl keys show --key learner.key`: who may sign checkpoints

[model]
path = "tiny"                      # the offline tiny model, a hub id org/name (in every peer's HF cache),
                                   # or a directory here (peers then pass --model-dir with their copy)
chat = "auto"                      # prompts via the chat template: auto (if the tokenizer has one) | on | off

[task]
name = "arithmetic"                # arithmetic | countdown | jsonl:PATH (a file here; peers fetch it by hash)
params = { digits = 1 }            # a reward other than a built-in needs --allow-reward on every peer
# name = "reasoning_gym"           # reasoning-gym's data sets (the tasks extra), one or a weighted mixture:
# params = { dataset = "basic_arithmetic" }
# params = { datasets = [{ name = "basic_arithmetic", weight = 1 }, { name = "leg_counting", weight = 2 }] }

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

[trust]                            # how learners check what samplers send (docs/trust.md)
check_rate = 0.05                  # share of batches of authors with a record that are recomputed and checked
record_batches = 8                 # an author's first 8 batches (and 8 after a strike): checked, held
ban_strikes = 3                    # refused batches that ban an author for the run

# [lineage]                        # several learner_keys: how the learners combine each version
# exchange = "sparse"              # sparse (top-32 of 4096, 2-bit: 0.4 % of the bytes) | dense (exact)

# [adapter]                        # LoRA adapters on a frozen base; absent: full fine-tuning
# rank = 8                         # checkpoints carry only the adapters (rank × (in + out) per target)
# alpha = 16                       # scale alpha / rank; adapter runs want ~10x the full-FT lr (5e-3)
# target_modules = ["q_proj", "v_proj"]  # module-name suffixes of the model's Linear layers
"""


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run trains and how: every section of run.toml, without the run's identity. The sections check
    their own values; this checks those that span sections."""

    model: ModelSettings = setting(None, "[model]", factory=ModelSettings)
    task: TaskSettings = setting(None, "[task]", factory=TaskSettings)
    objective: ObjectiveSettings = setting(None, "[objective]", factory=ObjectiveSettings)
    sampling: SamplingSettings = setting(None, "[sampling]", factory=SamplingSettings)
    limits: LimitsSettings = setting(None, "[limits]", factory=LimitsSettings)
    learner: LearnerSettings = setting(None, "[learner]", factory=LearnerSettings)
    sampler: SamplerSettings = setting(None, "[sampler]", factory=SamplerSettings)
    trust: TrustSettings = setting(None, "[trust]", factory=TrustSettings)
    lineage: LineageSettings = setting(None, "[lineage]", factory=LineageSettings)
    adapter: AdapterSettings | None = setting(None, "[adapter]: LoRA on a frozen base; absent: full FT")

    def __post_init__(self) -> None:
        rows = self.sampler.prompts_per_batch * self.learner.group_size
        if rows > self.limits.max_batch_rows:
            raise ValueError(
                f"sampler.prompts_per_batch × learner.group_size = {rows} rows exceeds limits.max_batch_rows "
                f"({self.limits.max_batch_rows})"
            )
        ls = self.learner
        check_update_fits(ls.prompts_per_update, self.sampler.prompts_per_batch, ls.buffer_batches)

    def as_run(self) -> Run:
        """The sections alone (a :class:`RunConfig` or :class:`RunSettings` without its identity)."""
        return Run(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Run)})


@dataclasses.dataclass(frozen=True)
class RunConfig(Run):
    """run.toml: a run and its identity, what the coordinator signs a RunSpec from."""

    run_id: str = setting("", "the run's name (run.toml: omit for a random one)")
    learner_keys: tuple[str, ...] = setting((), "hex Ed25519 public keys allowed to sign checkpoints")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.run_id:
            raise ValueError("run_id is empty")
        if not self.learner_keys:
            raise ValueError("learner_keys is empty: list the public key of at least one learner")
        for k in self.learner_keys:
            try:
                ok = len(bytes.fromhex(k)) == 32
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"learner_keys: {k[:16]!r}… is not 64 hex characters")
        check_learner_keys(self.learner_keys)
        if self.adapter is not None and self.adapter.base_hash:
            raise ValueError("adapter.base_hash is computed by the coordinator from the model, not set")

    def runspec_body(
        self, initial_checkpoint: bytes, vocab_size: int, base_hash: bytes | None = None
    ) -> dict:
        """``base_hash``: sha256 of the base weights, required for (and only for) an adapter run, whose
        ``initial_checkpoint`` is the hash of the initial adapter (version 0)."""
        if (self.adapter is None) != (base_hash is None):
            raise ValueError("base_hash goes with an adapter run, and only with one")
        run = self.as_run()
        if self.adapter is not None:
            adapter = dataclasses.replace(self.adapter, base_hash=base_hash.hex())
            run = dataclasses.replace(run, adapter=adapter)
        return {
            "run_id": self.run_id,
            "initial_checkpoint": initial_checkpoint,
            "reward": "builtin",
            "learner_keys": [bytes.fromhex(k) for k in self.learner_keys],
            "vocab_size": vocab_size,
            **spec.body_fields(to_dict(run)),
        }


def parse_run_config(data: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from parsed TOML (overrides applied); ValueError naming the bad setting. A run without a
    ``run_id`` gets a random one."""
    adapter = data.get("adapter")
    if isinstance(adapter, Mapping) and "base_hash" in adapter:
        raise ValueError("[adapter]: base_hash is computed by the coordinator from the model, not set here")
    task = data.get("task")
    if (
        isinstance(task, Mapping)
        and isinstance(task.get("params"), Mapping)
        and "dataset" in task["params"]
        and task.get("name") not in OWN_DATASET_PARAM
    ):
        raise ValueError(
            "[task] params.dataset is the id the coordinator computes from a jsonl:PATH task, not set here"
        )
    data = {**data, "run_id": data.get("run_id") or f"run-{secrets.token_hex(4)}"}
    return from_dict(RunConfig, data, strict=True)[0]


def load_run_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """run.toml at ``path``, with ``overrides`` (``{"learner.publish_every": 2}``: ``--set``) applied."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse_run_config(apply_overrides(data, overrides or {}))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def dump_run_config(cfg: RunConfig) -> str:
    """run.toml text of ``cfg``, every setting written out; checked to read back as ``cfg``."""
    data = to_dict(cfg)
    if data["adapter"] is not None:
        del data["adapter"]["base_hash"]  # the coordinator's, refused in run.toml
    text = toml_text.dumps(data)
    if parse_run_config(tomllib.loads(text)) != cfg:
        raise ValueError(f"run.toml text does not read back as the run it was written from:\n{text}")
    return text


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings(Run):
    """What a peer reads back out of a verified RunSpec body: the run, its identity, and what the
    coordinator measured of the model."""

    run_id: str = setting(REQUIRED, "the run's name")
    learner_keys: tuple[bytes, ...] = setting(REQUIRED, "Ed25519 public keys that sign checkpoints")
    vocab_size: int = setting(REQUIRED, "the model's vocabulary size")
    initial_checkpoint: bytes = setting(REQUIRED, "sha256 of version 0 (adapter runs: of the adapter)")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_learner_keys(self.learner_keys)
        if self.adapter is not None and not self.adapter.base_hash:
            raise ValueError("an adapter run's spec must name its base model's hash (adapter.base_hash)")

    @classmethod
    def read_spec(cls, body: Mapping[str, Any]) -> tuple[RunSettings, list[str]]:
        """The settings in a RunSpec body, and the dotted names of those this peer does not know (a newer
        coordinator's), which it ignores; ValueError for a format it does not read or a bad value, or a run
        with more learners than a run can have (:func:`check_learner_keys`)."""
        check_learner_keys(body["learner_keys"])
        data = spec.settings_data(body)
        data.update(
            run_id=body["run_id"],
            learner_keys=body["learner_keys"],
            vocab_size=body["vocab_size"],
            initial_checkpoint=body["initial_checkpoint"],
        )
        try:
            return from_dict(cls, data, strict=False)
        except ValueError as e:
            raise ValueError(f"RunSpec hyperparameters not understood: {e}") from None

    @classmethod
    def from_spec(cls, body: Mapping[str, Any]) -> RunSettings:
        """:meth:`read_spec`, settings it does not know logged as a warning."""
        settings, ignored = cls.read_spec(body)
        if ignored:
            log.warning(
                "run %s: ignoring RunSpec settings this peer does not know (from a newer coordinator): %s",
                settings.run_id,
                ", ".join(ignored),
            )
        return settings
