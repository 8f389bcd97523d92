"""The run's settings, in one torch-free place that the coordinator, the peers and the CLI all read.

One tree of typed, documented dataclasses: :class:`Run` holds the sections of run.toml; :class:`RunConfig`
adds run.toml's identity (``run_id``, ``learner_keys``) and :class:`RunSettings` what a peer reads back from
a verified RunSpec. One parser (:func:`.tree.from_dict`) reads it from run.toml, from the RunSpec's JSON and
from command-line overrides.

- :mod:`.base` documented fields (:func:`setting`), value checks, the names a run may use (objectives,
  advantage estimators, chat modes);
- :mod:`.sections` ``[model]``, ``[task]``, ``[objective]``, ``[sampling]``, ``[limits]``;
- :mod:`.roles` ``[learner]``, ``[sampler]``, ``[adapter]``;
- :mod:`.trust` ``[trust]``; :mod:`.lineage` ``[lineage]``;
- :mod:`.run` :class:`Run`, :class:`RunConfig` (run.toml), :class:`RunSettings`;
- :mod:`.spec` where settings travel in a RunSpec body; :mod:`.tree` the parser; :mod:`.flags` CLI flags
  made from settings; :mod:`.toml_text` run.toml written from a tree.

Every default and help text is written once, on its field; everything else reads it from there.
"""

from .base import (
    ADVANTAGES,
    CHAT_MODES,
    CHECKPOINT_DTYPES,
    OBJECTIVES,
    TINY_MODEL,
    check_update_fits,
    default_of,
    help_of,
    setting,
)
from .flags import add_adapter_flag, add_flag, add_set_flag, overrides_of
from .lineage import EXCHANGES, LineageSettings
from .roles import ADAPTER_FLAG_HELP, AdapterSettings, LearnerSettings, SamplerSettings, parse_adapter_flag
from .run import (
    EXAMPLE,
    MAX_LEARNER_KEYS,
    Run,
    RunConfig,
    RunSettings,
    check_learner_keys,
    dump_run_config,
    load_run_config,
    parse_run_config,
)
from .sections import (
    TIS_PARAMS,
    LimitsSettings,
    ModelSettings,
    ObjectiveSettings,
    SamplingSettings,
    TaskSettings,
)
from .spec import SPEC_FORMAT
from .tree import UNSET, apply_overrides, from_dict, from_overrides, paths, to_dict
from .trust import TrustSettings

__all__ = [
    "ADAPTER_FLAG_HELP",
    "ADVANTAGES",
    "CHAT_MODES",
    "CHECKPOINT_DTYPES",
    "EXAMPLE",
    "MAX_LEARNER_KEYS",
    "OBJECTIVES",
    "SPEC_FORMAT",
    "TINY_MODEL",
    "TIS_PARAMS",
    "UNSET",
    "AdapterSettings",
    "LearnerSettings",
    "LimitsSettings",
    "ModelSettings",
    "ObjectiveSettings",
    "Run",
    "RunConfig",
    "RunSettings",
    "SamplerSettings",
    "TrustSettings",
    "LineageSettings",
    "EXCHANGES",
    "SamplingSettings",
    "TaskSettings",
    "add_adapter_flag",
    "add_flag",
    "add_set_flag",
    "apply_overrides",
    "check_learner_keys",
    "check_update_fits",
    "default_of",
    "dump_run_config",
    "from_dict",
    "from_overrides",
    "help_of",
    "load_run_config",
    "overrides_of",
    "parse_adapter_flag",
    "parse_run_config",
    "paths",
    "setting",
    "to_dict",
]
