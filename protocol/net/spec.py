"""Finding a run's RunSpec: from the DHT by run id, or by asking any peer already in the swarm.

A newcomer knows only bootstrap addresses, not the run id; every peer in a run (coordinator, learners,
samplers) therefore serves the signed RunSpec it holds over ``heterorl/spec/1``. Whatever the source, the spec
is a signed message: the caller pins the coordinator's key (:func:`check_run_key`), so a peer that serves a
different spec is refused, not believed.
"""

from __future__ import annotations

import asyncio
import logging

from heterorl.protocol.net.dht import spec_key
from heterorl.protocol.net.framing import read_frame, write_frame
from heterorl.protocol.net.node import Node
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.messages import decode

log = logging.getLogger(__name__)

PROTOCOL = "heterorl/spec/1"
MAX_SPEC_BYTES = 64 << 10
REQUEST_TIMEOUT_S = 10.0


class SpecServer:
    """Serve our RunSpec's signed bytes to whoever asks (one empty request frame, one reply frame)."""

    def __init__(self, spec_raw: bytes):
        if len(spec_raw) > MAX_SPEC_BYTES:
            raise ValueError("RunSpec larger than the spec protocol's cap")
        self.spec_raw = spec_raw
        self.served = 0

    async def attach(self, node: Node) -> None:
        await node.add_handler(PROTOCOL, self.handle)

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, 0, REQUEST_TIMEOUT_S)
        await write_frame(writer, self.spec_raw)
        self.served += 1


async def request_spec(node: Node, peer_id: str, maddrs: tuple[str, ...] = ()) -> tuple[bytes, dict, bytes]:
    """Ask one peer for its RunSpec; (raw, body, author) or ProtocolError / OSError."""
    reader, writer = await asyncio.wait_for(node.open_stream(peer_id, PROTOCOL, maddrs), REQUEST_TIMEOUT_S)
    try:
        await write_frame(writer, b"")
        raw = await read_frame(reader, MAX_SPEC_BYTES, REQUEST_TIMEOUT_S)
    finally:
        writer.close()
    _, body, author = decode(raw, "RunSpec")
    return raw, body, author


async def lookup_specs(node: Node, run_id: str) -> list[tuple[bytes, dict, bytes]]:
    """Every verified RunSpec record under ``run_id`` (normally one: the coordinator's)."""
    return [(r.raw, r.body, r.author) for r in await node.lookup(spec_key(run_id)) if r.kind == "RunSpec"]


def check_run_key(author: bytes, pinned: bytes | None) -> None:
    if pinned is not None and author != pinned:
        raise ProtocolError(
            f"RunSpec signed by {author.hex()[:16]}…, but this peer pins run key {pinned.hex()[:16]}…"
        )
