"""Peer roles and what they run: objectives, rollout backends, tasks, models, training loops."""

__all__: list[str] = []
