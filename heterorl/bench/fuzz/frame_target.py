"""The ``frame`` target: :func:`protocol.net.framing.read_frame` in a loop over one adversarial stream.

Streams carry hostile length prefixes, truncation and trailing bytes, arrive in pieces, with or without EOF;
a counting reader records the largest read asked for, so reading past the cap is caught (``over_read``).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

from heterorl.protocol.net import framing

from . import config
from .base import _Crash, _Hang, _Outcome, _Target
from .oracle import _oracle_frames
from .report import _short

if TYPE_CHECKING:
    from .harness import _Harness


class FrameTarget(_Target):
    """read_frame() in a loop over one adversarial stream."""

    name = "frame"
    MAX_FRAMES = 8

    def __init__(self, h: _Harness):
        super().__init__(h)
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def generate(self, rng: random.Random) -> tuple:
        max_bytes = rng.choice([0, 1, 3, 4, 100, 608, 65536, 1 << 24, (1 << 32) - 1, rng.randint(0, 1 << 20)])
        r = rng.random()
        if r < 0.15:
            stream = rng.randbytes(rng.choice([0, 1, 3, 4, 5, 8, 64, rng.randint(0, 512)]))
        else:
            stream = b""
            for _ in range(rng.choice([0, 1, 1, 2, 3, 5, 9])):
                cap = min(max_bytes, 4096 if rng.random() < 0.98 else 1 << 17)
                n = rng.choice([0, 1, cap, rng.randint(0, min(cap, 300))])
                header = rng.choice([n] * 6 + [max_bytes, max_bytes + 1, (1 << 32) - 1, 1 << 31, n + 1])
                header = min(header, (1 << 32) - 1)
                stream += header.to_bytes(4, "big") + rng.randbytes(n)
            if rng.random() < 0.3 and stream:
                stream = stream[: rng.randrange(len(stream))]
            if rng.random() < 0.1:
                stream += rng.randbytes(rng.randint(1, 6))
        eof = rng.random() < 0.93
        cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.choice([0, 1, 3]))) if eof else []
        return stream, eof, max_bytes, tuple(cuts)

    def strategy(self) -> Any:
        from hypothesis import strategies as st

        frame = st.tuples(st.one_of(st.none(), st.integers(0, (1 << 32) - 1)), st.binary(max_size=64))

        def build(args: tuple) -> tuple:
            max_bytes, frames, tail, cut, eof = args
            stream = b"".join((len(p) if h is None else h).to_bytes(4, "big") + p for h, p in frames) + tail
            if cut is not None:
                stream = stream[:cut]
            return stream, eof, max_bytes, ()

        return st.tuples(
            st.one_of(st.sampled_from([0, 1, 4, 608, 65536]), st.integers(0, (1 << 32) - 1)),
            st.lists(frame, max_size=5),
            st.binary(max_size=6),
            st.none() | st.integers(0, 400),
            st.sampled_from([True] * 9 + [False]),
        ).map(build)

    def from_bytes(self, data: bytes) -> tuple:
        head = data[:5].ljust(5, b"\x00")
        return data[5:], bool(head[4] & 1), int.from_bytes(head[:4], "big") >> (head[4] >> 3), ()

    def describe(self, case: tuple) -> tuple[bytes, dict]:
        stream, eof, max_bytes, cuts = case
        return stream, {"eof": eof, "max_bytes": max_bytes, "cuts": list(cuts)}

    def execute(self, case: tuple) -> _Outcome:
        stream, eof, max_bytes, cuts = case
        box: dict = {"max_request": 0}
        t0 = time.perf_counter()
        try:
            got = self.loop.run_until_complete(
                asyncio.wait_for(self._read_all(stream, eof, max_bytes, cuts, box), config.FRAME_GUARD_S)
            )
        except TimeoutError:  # read_frame's own deadline did not hold
            raise _Hang(f"read_frame loop still running after {config.FRAME_GUARD_S:g} s") from None
        except _Crash as c:
            c.seconds = time.perf_counter() - t0
            raise
        except _Hang:
            self._cancel_pending()
            raise
        dt = time.perf_counter() - t0
        want = _oracle_frames(stream, eof, max_bytes, self.MAX_FRAMES)
        refused, must_refuse = (bool(x) and x[-1] in _FRAME_REFUSALS for x in (got, want))
        if box["max_request"] > max(max_bytes, framing.HEADER_BYTES):
            return _Outcome(
                not refused,
                dt,
                (
                    "over_read",
                    "read past the cap",
                    f"asked for {box['max_request']} bytes under a {max_bytes} cap",
                ),
            )
        if got != want:
            if must_refuse and not refused:
                kind = "accepted_but_should_not"
            elif refused and not must_refuse:
                kind = "rejected_but_should_not"
            else:
                kind = "wrong_result"
            tail = want[-1] if want and isinstance(want[-1], str) else "frame"
            return _Outcome(
                not refused, dt, (kind, f"want ...{tail}", f"got {_short(got, 40)}, want {_short(want, 40)}")
            )
        return _Outcome(not refused, dt)

    def _cancel_pending(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    async def _read_all(self, stream: bytes, eof: bool, max_bytes: int, cuts: tuple, box: dict) -> list:
        reader = _CountingReader()
        loop = asyncio.get_running_loop()
        bounds = [0, *cuts, len(stream)]
        parts = [stream[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        if parts[0]:
            reader.feed_data(parts[0])
        if len(parts) == 1:
            if eof:
                reader.feed_eof()
        else:  # the rest arrives while read_frame waits (EOF cases only, so timeouts stay deterministic)

            def feed(i: int) -> None:
                if parts[i]:
                    reader.feed_data(parts[i])
                if i + 1 < len(parts):
                    loop.call_soon(feed, i + 1)
                else:
                    reader.feed_eof()

            loop.call_soon(feed, 1)
        timeout = 2.0 if eof else 0.005  # with EOF every read ends at once: 2 s is never waited for
        out: list = []
        try:
            for _ in range(self.MAX_FRAMES):
                try:
                    frame = await framing.read_frame(reader, max_bytes, timeout)
                except EOFError:
                    out.append("eof")
                    break
                except framing.FrameError as e:
                    out.append(e.kind)
                    break
                except Exception as e:
                    raise _Crash(e, 0.0) from e
                if not isinstance(frame, bytes):
                    raise _Crash(TypeError(f"read_frame returned {type(frame).__name__}"), 0.0)
                out.append(frame)
        finally:
            box["max_request"] = reader.max_request
        return out


_FRAME_REFUSALS = ("truncated", "oversized", "timeout")


class _CountingReader(asyncio.StreamReader):
    """A StreamReader that remembers the largest read it was asked for (the 'allocation' a peer can force)."""

    max_request = 0

    async def readexactly(self, n: int) -> bytes:
        self.max_request = max(self.max_request, n)
        return await super().readexactly(n)

    async def read(self, n: int = -1) -> bytes:
        self.max_request = max(self.max_request, n if n >= 0 else 1 << 62)
        return await super().read(n)

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        self.max_request = 1 << 62
        return await super().readuntil(separator)
