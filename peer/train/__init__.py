"""Training loops: the single-process local loop (``heterorl train --local``)."""

from .local import LocalConfig, run_local
from .policy_lag import PolicyLag

__all__ = ["LocalConfig", "PolicyLag", "run_local"]
