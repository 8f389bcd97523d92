"""Length-capped frames: the cap is enforced from the header, before the payload is read."""

import asyncio

import pytest

from heterorl.protocol.net.framing import FrameError, read_frame, write_frame

pytestmark = pytest.mark.fast  # in `make test-fast`


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


def run(coro):
    return asyncio.run(coro)


async def _read(data: bytes, cap: int, timeout: float, eof: bool = True) -> bytes:
    return await read_frame(_reader(data, eof), cap, timeout)


class _Sink:
    def __init__(self):
        self.buf = bytearray()

    def write(self, b):
        self.buf += b

    async def drain(self):
        pass


@pytest.mark.parametrize("payload", [b"", b"x", bytes(range(256)) * 1000])
def test_round_trip(payload):
    sink = _Sink()
    run(write_frame(sink, payload))
    assert len(sink.buf) == 4 + len(payload)
    assert run(_read(bytes(sink.buf), len(payload), 1)) == payload


def test_two_frames_then_clean_eof():
    sink = _Sink()
    run(write_frame(sink, b"a"))
    run(write_frame(sink, b"bc"))

    async def go():
        r = _reader(bytes(sink.buf))
        got = [await read_frame(r, 10, 1), await read_frame(r, 10, 1)]
        with pytest.raises(EOFError):
            await read_frame(r, 10, 1)
        return got

    assert run(go()) == [b"a", b"bc"]


def test_oversized_header_refused_without_reading_payload():
    # announces 4 GiB - 1 but sends only 3 bytes: must be refused from the header alone, at once
    with pytest.raises(FrameError, match="announced") as e:
        run(_read(b"\xff\xff\xff\xff" + b"abc", 1 << 20, 5, eof=False))
    assert e.value.kind == "oversized"


def test_cap_is_inclusive():
    assert run(_read(b"\x00\x00\x00\x03abc", 3, 1)) == b"abc"
    with pytest.raises(FrameError):
        run(_read(b"\x00\x00\x00\x03abc", 2, 1))


@pytest.mark.parametrize("data", [b"\x00\x00", b"\x00\x00\x00\x05ab"])
def test_truncated(data):
    with pytest.raises(FrameError, match="truncated") as e:
        run(_read(data, 100, 1))
    assert e.value.kind == "truncated"


def test_silent_peer_times_out():
    with pytest.raises(FrameError, match="no complete frame") as e:
        run(_read(b"\x00\x00\x00\x05ab", 100, 0.05, eof=False))
    assert e.value.kind == "timeout"
