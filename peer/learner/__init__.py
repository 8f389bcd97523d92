"""The learner peer: admit trajectories from anyone (after re-scoring them), buffer, update, publish."""

from .intake import RewardCheck

__all__ = ["RewardCheck"]
