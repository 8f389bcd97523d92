"""The target registry: each name of :data:`~heterorl.bench.fuzz.config.ALL_TARGETS` and its class."""

from __future__ import annotations

from .base import _Target
from .chunk_target import ChunkRequestTarget
from .decode_targets import DecodeSignedTarget, DecodeTarget
from .dht_target import DHTRecordTarget
from .frame_target import FrameTarget
from .reward_target import RewardTarget

_TARGET_CLASSES: dict[str, type[_Target]] = {
    "decode": DecodeTarget,
    "decode_signed": DecodeSignedTarget,
    "frame": FrameTarget,
    "dht_record": DHTRecordTarget,
    "chunk_request": ChunkRequestTarget,
    "rewards": RewardTarget,
}
