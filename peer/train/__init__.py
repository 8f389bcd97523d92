"""Training in one process (``heterorl train --local``): sample, reward and learn in a loop, no network."""

from .one_process import OneProcessConfig, run_one_process
from .policy_lag import PolicyLag

__all__ = ["OneProcessConfig", "PolicyLag", "run_one_process"]
