"""The run's settings: which targets exist, how the inputs are shared out, the hang limits, the DHT clock.

The harness and the frame target read :data:`HANG_S`, :data:`ABORT_S` and :data:`FRAME_GUARD_S` from this
module at run time (``config.HANG_S``), so a test that wants a shorter limit patches it here, once. A target
may set its own limits instead (``_Target.hang_s`` / ``abort_s``: the ``rewards`` target does).
"""

from __future__ import annotations

# The protocol decoders: microseconds an input, what a run fuzzes unless --targets says otherwise.
DEFAULT_TARGETS: tuple[str, ...] = ("decode", "decode_signed", "frame", "dht_record", "chunk_request")
# ``rewards`` (hostile answers through the reward sandbox) costs milliseconds an answer and seconds for each
# answer that kills its worker, so it runs when named: ``--targets rewards``.
ALL_TARGETS: tuple[str, ...] = (*DEFAULT_TARGETS, "rewards")
# Share of the requested inputs each target gets (normalised over the targets selected).
TARGET_WEIGHTS = {
    "decode": 0.30,
    "decode_signed": 0.30,
    "frame": 0.15,
    "dht_record": 0.15,
    "chunk_request": 0.10,
    "rewards": 0.03,  # with every target named, 100 000 inputs give it about 2900
}
HANG_S = 1.0  # one input slower than this is a hang
ABORT_S = 10.0  # one input still running after this is interrupted (main thread only)
MAX_EXAMPLES = 10  # distinct failure signatures kept per target and failure kind
NOW = 1.7e9  # the DHT validator's clock
FRAME_GUARD_S = 3.0  # a read_frame loop (every call has its own short deadline) still running is a hang
