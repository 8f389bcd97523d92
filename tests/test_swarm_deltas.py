"""Checkpoint deltas in the real swarm: samplers follow a chain of bf16 deltas bit for bit, a newcomer starts
from a full version, a sampler SIGKILLed while rebuilding a version from its delta keeps its last good one.

Real coordinator, learner and sampler processes on 127.0.0.1 (tiny model; the learner trains float32 and
publishes its bf16 rounding; lr low enough that most bf16 words stay put, as at real models' RL rates).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from heterorl.protocol.storage.jsonlog import read_rows
from heterorl.protocol.storage.store import ChunkStore
from heterorl.testing.swarm import Swarm

pytestmark = pytest.mark.slow


def _versions(state_dir: Path) -> list[dict]:
    return list(read_rows(state_dir / "versions.jsonl"))  # a row the sampler is writing: not yet


def _wait(cond, what: str, swarm: Swarm, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout:.0f} s\n{swarm.logs()}")
        time.sleep(0.2)


def _held(swarm: Swarm, name: str) -> list[int]:
    """Versions a (stopped) sampler's store holds whole: every chunk re-hashed against the manifest the
    learner signed (opened read-only: it never touches what another process may be writing)."""
    mine = ChunkStore(swarm.root / name / "chunks", max_bytes=1 << 40, read_only=True)
    for v in mine.versions():
        mine.assemble(v)  # ProtocolError for a missing or corrupt chunk
    return mine.versions()


def _same_as_learner(swarm: Swarm, name: str) -> list[int]:
    """After the swarm stopped: versions a sampler holds, each byte-identical to the learner's state."""
    mine = ChunkStore(swarm.root / name / "chunks", max_bytes=1 << 40, read_only=True)
    learner = ChunkStore(swarm.learner_dir / "chunks", max_bytes=1 << 40, read_only=True)
    held = mine.versions()
    for v in held:
        assert mine.body(v)["chunk_hashes"] == learner.body(v)["chunk_hashes"], (name, v)
        assert mine.assemble(v) == learner.assemble(v), (name, v)
    return held


def test_samplers_follow_deltas_bit_exact_newcomer_full_and_kill_mid_apply(tmp_path, tiny_model_dir):
    swarm = Swarm(tmp_path / "swarm", tiny_model_dir, lr=5e-5, checkpoint_dtype='"bfloat16"', deltas=4)
    try:
        swarm.start_coordinator()
        swarm.start_learner()
        swarm.start_sampler("sampler-a")
        swarm.wait_step(3)
        # sampler-c rebuilds slowly (a pause after each rebuilt chunk), so a SIGKILL lands mid-apply
        slow = swarm.start_sampler("sampler-c", wrap=["env", "HETERORL_TEST_SLOW_REBUILD_S=3"])
        log = swarm.root / "sampler-c.stderr.log"
        _wait(lambda: "rebuilt from the delta" in log.read_text(), "sampler-c never rebuilt a delta", swarm)
        slow.kill()
        before = _held(swarm, "sampler-c")  # what it held: whole versions only (the learner is still running)
        assert before, "sampler-c held no version before the kill"
        swarm.procs.remove(slow)
        swarm.start_sampler("sampler-c")  # same state dir, no pause
        swarm.start_sampler("sampler-b")  # a newcomer, many versions in
        target = swarm.step() + 8
        swarm.wait_step(target, timeout=400)
        _wait(
            lambda: all(
                len([r for r in _versions(swarm.root / n) if r.get("via") == "delta"]) >= 3
                for n in ("sampler-a", "sampler-b", "sampler-c")
            ),
            "samplers did not follow deltas",
            swarm,
        )
    finally:
        swarm.close()
    published = [r["delta_ratio"] for r in swarm.metrics() if r.get("delta_ratio")]
    assert published and 0 < published[-1] < 0.5  # the learner offered deltas much smaller than the state
    for name in ("sampler-a", "sampler-b", "sampler-c"):
        rows = _versions(swarm.root / name)
        held = _same_as_learner(swarm, name)  # bit-identical to the learner's published state
        assert held and max(held) >= rows[-1]["version"]
        vs = [r["version"] for r in rows]
        assert vs == sorted(vs), (name, vs)
    newcomer = _versions(swarm.root / "sampler-b")
    assert newcomer[0]["via"] == "full" and newcomer[0]["version"] >= 3  # started from a full version
    deltas = [r for r in newcomer if r["via"] == "delta"]
    full_bytes = newcomer[0]["fetched_bytes"]
    assert all(r["fetched_bytes"] < 0.5 * full_bytes for r in deltas)  # a delta costs a fraction of the state
    # the killed sampler came back from its last good version and went on following
    after = [r["version"] for r in _versions(swarm.root / "sampler-c")]
    assert max(after) > max(before)
