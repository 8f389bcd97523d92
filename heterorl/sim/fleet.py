"""The simulated volunteers: hardware classes (speed, bandwidth, latency) and how peers are drawn from them.

The default fleet is an assumption, not a measurement: rough batched-generation rates for a 1.5B-parameter
model and typical home / cloud links. Pass ``--fleet FILE.json`` (a list of objects with the fields of
:class:`HardwareClass`) to model another one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class HardwareClass:
    name: str
    share: float  # fraction of the fleet
    tokens_per_s: float  # batched generation throughput of the run's model
    down_mbit: float  # link rates, megabits per second
    up_mbit: float
    rtt_ms: float  # round trip to the learner
    session_h: float  # mean hours online before leaving (exponential); inf: never leaves
    offline_h: float  # mean hours away before coming back

    def __post_init__(self) -> None:
        for f in ("share", "tokens_per_s", "down_mbit", "up_mbit"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware class {self.name!r}: {f} must be > 0")
        if self.rtt_ms < 0 or not self.session_h > 0 or not self.offline_h > 0:
            raise ValueError(f"hardware class {self.name!r}: rtt_ms >= 0, session_h and offline_h > 0")


DEFAULT_FLEET = (
    HardwareClass("cpu", 0.10, 25, 50, 10, 60, 1.0, 2.0),
    HardwareClass("rtx3060", 0.30, 600, 100, 20, 40, 3.0, 3.0),
    HardwareClass("rtx4090", 0.35, 2000, 300, 50, 30, 4.0, 2.0),
    HardwareClass("a100-cloud", 0.20, 4000, 1000, 1000, 20, 12.0, 1.0),
    HardwareClass("h100-cloud", 0.05, 7000, 2000, 2000, 15, math.inf, 1.0),
)


def load_fleet(path: str | Path | None) -> tuple[HardwareClass, ...]:
    """The default fleet, or the classes listed in a JSON file (shares are normalised)."""
    if path is None:
        return DEFAULT_FLEET
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON list of hardware classes")
    classes = []
    for i, item in enumerate(raw):
        try:
            item = {**item}
            for k in ("session_h", "offline_h"):
                item[k] = math.inf if item.get(k) in (None, "inf") else float(item[k])
            classes.append(HardwareClass(**item))
        except TypeError as e:
            raise ValueError(f"{path}: class {i}: {e}") from None
    return tuple(classes)


@dataclasses.dataclass
class PeerSpec:
    cls: HardwareClass
    tokens_per_s: float  # this peer's own rate: the class rate times a log-normal factor
    down_Bps: float
    up_Bps: float
    rtt_s: float


def draw_peers(
    fleet: tuple[HardwareClass, ...], n: int, rng: random.Random, spread: float = 0.3
) -> list[PeerSpec]:
    """``n`` peers, classes by share, each with its own speed and link factors (log-normal, ``spread``)."""
    total = sum(c.share for c in fleet)
    weights = [c.share / total for c in fleet]
    peers = []
    for cls in rng.choices(fleet, weights, k=n):
        f = rng.lognormvariate(0.0, spread)
        link = rng.lognormvariate(0.0, spread)
        peers.append(
            PeerSpec(
                cls=cls,
                tokens_per_s=cls.tokens_per_s * f,
                down_Bps=cls.down_mbit * 1e6 / 8 * link,
                up_Bps=cls.up_mbit * 1e6 / 8 * link,
                rtt_s=cls.rtt_ms / 1e3 * rng.lognormvariate(0.0, spread),
            )
        )
    return peers
