"""The sampler's checkpoint follower: its DHT watch backs off while nothing changes (0.5 s doubling to 5 s
once a version is held; every 0.5 s while none is, so that the first one is picked up quickly), and while the
main thread holds a prepared version it waits for ``swapped()`` on an event, polling neither a flag nor
the DHT.

No network: the lookups, the fetch and the node are stand-ins; sleeps are recorded, not slept.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest
import torch

from heterorl.peer.daemon import follower as follower_mod
from heterorl.peer.daemon.follower import CheckpointFollower
from heterorl.protocol.net.fetch import FetchReport
from heterorl.protocol.wire.checkpoint import serialize_state_dict

pytestmark = pytest.mark.fast

SETTINGS = types.SimpleNamespace(run_id="watch-run", learner_keys=[b"k" * 32])


class RecordedSleeps:
    """Stands in for the follower module's ``asyncio``: records every sleep; after ``stop_after`` of them
    cancels the follower (so a test sees its schedule without waiting it out), else sleeps for real."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.delays: list[float] = []
        self.stop_after = stop_after

    async def sleep(self, delay: float) -> None:
        self.delays.append(delay)
        if self.stop_after is not None and len(self.delays) >= self.stop_after:
            raise asyncio.CancelledError
        await asyncio.sleep(delay if self.stop_after is None else 0)

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


@pytest.mark.parametrize(
    "held, expected",
    [(3, [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]), (None, [0.5] * 7)],
    ids=["holding-a-version", "holding-none"],
)
def test_the_idle_watch_backs_off_once_a_version_is_held(monkeypatch, held, expected):
    sleeps, lookups = RecordedSleeps(stop_after=len(expected)), []

    async def nothing_newer(node, run_id, learner_keys, min_version):
        lookups.append(min_version)
        return None

    monkeypatch.setattr(follower_mod, "asyncio", sleeps)
    monkeypatch.setattr(follower_mod, "latest_manifest", nothing_newer)
    f = CheckpointFollower(None, None, SETTINGS, held=lambda: held, batches=lambda: 0)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(f.run())
    assert sleeps.delays == expected  # seconds between DHT lookups
    assert lookups == [(-1 if held is None else held) + 1] * len(expected)


def test_while_the_main_thread_holds_a_prepared_version_the_follower_waits_on_an_event(monkeypatch):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    node = types.SimpleNamespace(call_soon=lambda cb, *args: loop.call_soon_threadsafe(cb, *args))
    data = serialize_state_dict({"w": torch.zeros(4)})
    body = {"version": 1, "total_size": len(data)}
    looked_up = threading.Event()
    sleeps = RecordedSleeps()
    held: dict[str, int | None] = {"v": None}

    async def latest(node_, run_id, learner_keys, min_version):
        looked_up.set()
        return (b"manifest v1", body) if min_version <= 1 else None

    async def fetch(node_, store, raw, **kwargs):
        return FetchReport(version=1, total_bytes=len(data))

    monkeypatch.setattr(follower_mod, "asyncio", sleeps)
    monkeypatch.setattr(follower_mod, "latest_manifest", latest)
    monkeypatch.setattr(follower_mod, "fetch_checkpoint", fetch)
    store = types.SimpleNamespace(assemble=lambda v: data)
    f = CheckpointFollower(node, store, SETTINGS, held=lambda: held["v"], batches=lambda: 0)
    run = asyncio.run_coroutine_threadsafe(f.run(), loop)
    try:
        deadline, ready = time.monotonic() + 30, None
        while ready is None and time.monotonic() < deadline:
            ready = f.take()
            time.sleep(0.01)
        assert ready is not None and ready.version == 1 and torch.equal(ready.state["w"], torch.zeros(4))
        sleeps.delays.clear()
        looked_up.clear()
        time.sleep(0.5)  # the main thread is "loading" the weights
        assert sleeps.delays == [] and not looked_up.is_set()  # no flag polls, no DHT lookups meanwhile
        held["v"] = 1
        f.swapped()
        assert looked_up.wait(10)  # woken at once: the next lookup (for version 2) follows the swap
    finally:
        run.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_follower_signals_each_change_the_generating_thread_waits_for(monkeypatch):
    # what the sampler's stop rule reads, at each on_change(): (newest known, fetching, prepared, retry due)
    data = serialize_state_dict({"w": torch.zeros(4)})
    body = {"version": 1, "total_size": len(data)}
    answers = iter([RuntimeError("the DHT is down"), None])  # a failed lookup, then an empty one, then v1

    async def latest(node_, run_id, learner_keys, min_version):
        answer = next(answers, (b"manifest v1", body))
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def fetch(node_, store, raw, **kwargs):
        return FetchReport(version=1, total_bytes=len(data))

    monkeypatch.setattr(follower_mod, "latest_manifest", latest)
    monkeypatch.setattr(follower_mod, "fetch_checkpoint", fetch)
    monkeypatch.setattr(follower_mod, "RETRY_MIN_S", 0.01)
    seen: list[tuple[int, int | None, bool, bool]] = []

    async def go():
        ready = asyncio.Event()

        def changed() -> None:
            seen.append((f.newest, f.fetching, f._ready is not None, f.retry_at > time.monotonic()))
            if f.fetching is None and f._ready is not None:
                ready.set()

        store = types.SimpleNamespace(assemble=lambda v: data)
        f = CheckpointFollower(
            None, store, SETTINGS, held=lambda: None, batches=lambda: 0, check_every_s=0.01, on_change=changed
        )
        task = asyncio.create_task(f.run())
        await asyncio.wait_for(ready.wait(), 30)
        task.cancel()

    asyncio.run(go())
    assert seen[0] == (-1, None, False, True)  # the failed lookup: a retry is due (the rule's "retry in")
    # the empty lookup changes nothing the thread waits for: no signal; then v1 known and fetched, prepared,
    # the fetch over
    assert seen[1:] == [(1, 1, False, False), (1, 1, True, False), (1, None, True, False)]
