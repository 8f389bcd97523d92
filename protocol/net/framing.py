"""Length-prefixed frames over a libp2p stream, with the length capped *before* anything is read.

hivemind's ``P2P.receive_raw_data`` reads whatever length the remote peer announces; a hostile peer could make
it allocate gigabytes. Here every read names its own cap and deadline: a header announcing more than the cap,
a stream that ends mid-frame, or a peer that stops sending is refused with :class:`FrameError`.

Frame: 4-byte big-endian unsigned length, then that many bytes. An empty frame (length 0) is allowed.
"""

from __future__ import annotations

import asyncio

from heterorl.protocol.wire.errors import ProtocolError

HEADER_BYTES = 4
MAX_FRAME_BYTES = (1 << 32) - 1
WRITE_CHUNK_BYTES = 1 << 16


class FrameError(ProtocolError):
    """A frame was refused; ``kind`` is ``"oversized"``, ``"truncated"`` or ``"timeout"``.

    Only an oversized frame proves bad intent: a truncated one may be a crashed peer, a timeout a slow link.
    """

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind


async def write_frame(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> None:
    """Write one frame and wait until the transport has taken it (back-pressure)."""
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte format limit")
    writer.write(len(data).to_bytes(HEADER_BYTES, "big"))
    view = memoryview(data)
    for offset in range(0, len(view), WRITE_CHUNK_BYTES):
        writer.write(view[offset : offset + WRITE_CHUNK_BYTES])
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes:
    """Read one frame of at most ``max_bytes`` within ``timeout`` seconds, or raise :class:`FrameError`.

    Returns ``b""`` for an empty frame. A stream closed cleanly *between* frames raises ``EOFError`` so that
    callers can tell a finished conversation from a broken one.
    """
    try:
        return await asyncio.wait_for(_read(reader, max_bytes), timeout)
    except TimeoutError:
        raise FrameError(f"no complete frame within {timeout:g} s", "timeout") from None


async def _read(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise EOFError("stream closed") from None
        got = len(e.partial)
        raise FrameError(f"truncated frame header ({got} of {HEADER_BYTES} bytes)", "truncated") from None
    length = int.from_bytes(header, "big")
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes announced, the cap here is {max_bytes}", "oversized")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise FrameError(f"truncated frame: {len(e.partial)} of {length} bytes", "truncated") from None
