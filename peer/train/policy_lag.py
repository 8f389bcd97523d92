"""Simulated policy lag: rollouts come from the policy K versions old (the GEPO paper's latency setup)."""

from __future__ import annotations

from collections import deque

import torch


class PolicyLag:
    """Ring buffer of the last K+1 weight snapshots (CPU copies); ``behaviour()`` loads the oldest.

    Memory is (K+1) × model size: meant for the tiny model and simulations, not for large models.
    """

    def __init__(self, policy: torch.nn.Module, behaviour: torch.nn.Module, delay: int) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.delay = delay
        self.policy = policy
        self.behaviour_model = behaviour
        self._snapshots: deque[tuple[int, dict]] = deque(maxlen=delay + 1)
        self.version = 0
        self._push()

    def _push(self) -> None:
        if self.delay == 0:  # the policy itself is the behaviour: nothing to keep
            return
        state = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        self._snapshots.append((self.version, state))

    def step(self) -> None:
        """Record that the policy was updated (a new version exists)."""
        self.version += 1
        self._push()

    def behaviour_state(self) -> tuple[dict, int]:
        """The oldest kept version's weights (the policy's own tensors when there is no delay), its number."""
        if self.delay == 0:
            return self.policy.state_dict(), self.version
        version, state = self._snapshots[0]
        return state, version

    def behaviour(self) -> tuple[torch.nn.Module, int]:
        """The model holding the oldest kept version, and that version number."""
        if self.delay == 0:
            return self.policy, self.version
        version, state = self._snapshots[0]
        self.behaviour_model.load_state_dict(state)
        return self.behaviour_model, version
