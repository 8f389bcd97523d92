"""The run's settings, in one torch-free place that the coordinator, the peers and the CLI all read.

- :mod:`.base` documented fields (:func:`setting`), CLI flags made from them (:func:`add_flag`), the names a
  run may use (objectives, advantage estimators, chat modes);
- :mod:`.roles` ``[learner]``, ``[sampler]``, ``[adapter]``;
- :mod:`.run` run.toml (:class:`RunConfig`), the RunSpec it signs to, :class:`RunSettings` read back from one.

Every default is written once, on its field; everything else (run.toml parsing, flags, the one-process loop's
config) reads it from there.
"""

from .base import (
    ADVANTAGES,
    CHAT_MODES,
    CHECKPOINT_DTYPES,
    OBJECTIVES,
    TINY_MODEL,
    add_flag,
    check_update_fits,
    default_of,
    help_of,
    setting,
)
from .roles import ADAPTER_FLAG_HELP, AdapterSettings, LearnerSettings, SamplerSettings, parse_adapter_flag
from .run import EXAMPLE, RunConfig, RunSettings, load_run_config, parse_run_config

__all__ = [
    "ADAPTER_FLAG_HELP",
    "ADVANTAGES",
    "CHAT_MODES",
    "CHECKPOINT_DTYPES",
    "EXAMPLE",
    "OBJECTIVES",
    "TINY_MODEL",
    "AdapterSettings",
    "LearnerSettings",
    "RunConfig",
    "RunSettings",
    "SamplerSettings",
    "add_flag",
    "check_update_fits",
    "default_of",
    "help_of",
    "load_run_config",
    "parse_adapter_flag",
    "parse_run_config",
    "setting",
]
