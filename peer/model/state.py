"""Does a state dict fit a model? Names and shapes, checked before any weight is touched."""

from __future__ import annotations

from collections.abc import Mapping


def check_state_fits(expected: Mapping[str, tuple[int, ...]], state: Mapping) -> None:
    """ValueError naming what differs when ``state``'s names or shapes are not ``expected``'s."""
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state))[:3], sorted(set(state) - set(expected))[:3]
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {extra}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name]):
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(t.shape)}, model {tuple(expected[name])}"
            )
