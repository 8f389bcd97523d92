"""Rank 0 drives the other ranks (peer/learner/ranks.py): commands and Rows cross exactly, STOP ends a
follower, and a follower whose leader dies or hangs exits non-zero within the process group's timeout.

The ranks are real processes on the CPU (gloo, 127.0.0.1, a free port), started by :func:`launch` as torchrun
would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); each runs this file as a script with a
scenario name. :func:`launch` also serves tests/test_fsdp_trainer.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from heterorl.peer.learner.rows import Rows

pytestmark = pytest.mark.slow  # rank processes: 5-15 s a test

RANK_TIMEOUT_S = 6.0  # the process group's timeout in the hang scenario


# ---- launching ranks ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, scenario: str, out: Path, world: int = 2) -> list[subprocess.Popen]:
    """``world`` CPU ranks running ``python script scenario out``, each logging to ``out/rank<r>.log``."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU, also on a machine with a GPU
        }
        log = open(out / f"rank{r}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, str(script), scenario, str(out)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        log.close()
    return procs


def logs(out: Path) -> str:
    tails = (f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(out.glob("*.log")))
    return "\n".join(tails)


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float = 120.0) -> list[int]:
    """Every rank's exit status; kills them all and fails (with their logs) past ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {timeout} s\n{logs(out)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- what the ranks exchange ----


def wire_rows(with_sources: bool = True) -> Rows:
    """Ragged prompts (one empty), ragged completions, arbitrary float bits; authors and batch ids or none."""
    g = torch.Generator().manual_seed(3)
    n, t = 5, 4
    prompts = [torch.randint(0, 50_000, (k,), generator=g).tolist() for k in (3, 0, 7, 1, 2)]
    mask = (torch.arange(t)[None] < torch.tensor([4, 1, 2, 3, 0])[:, None]).long()
    return Rows(
        prompts=prompts,
        completions=torch.randint(0, 50_000, (n, t), generator=g) * mask,
        mask=mask,
        logq=torch.randn(n, t, generator=g) * mask,
        rewards=torch.tensor([1.0, -0.5, 1e-30, float("inf"), 0.25]),
        group_ids=torch.tensor([0, 0, 1, 1, 7]),
        versions=torch.tensor([3, 3, 2**40, 0, 1]),
        authors=[bytes([i]) * 32 for i in range(n)] if with_sources else [],
        batch_ids=[b"\x00\xff" * 8 for _ in range(n)] if with_sources else [],
    )


class Recorder:
    """A TrainerLike that records each call (the followers' side of the round trip)."""

    def __init__(self):
        self.version, self.device, self.calls = 0, torch.device("cpu"), []

    def step(self, rows: Rows) -> dict[str, float]:
        self.calls.append(("step", rows))
        self.version += 1
        return {"loss": 0.0}

    def snapshot(self, dtype: str, with_state: bool = True):
        self.calls.append(("snapshot", dtype, with_state))
        return None

    @staticmethod
    def save(root, snapshot, meta):
        raise AssertionError("not a collective: never sent")

    def restore(self, root: Path) -> dict | None:
        self.calls.append(("restore", str(root)))
        return None

    def renumber(self, version: int) -> None:
        self.calls.append(("renumber", version))
        self.version = version


def assert_rows_equal(a: Rows, b: Rows) -> None:
    assert a.prompts == b.prompts and a.authors == b.authors and a.batch_ids == b.batch_ids
    for name in ("completions", "mask", "logq", "rewards", "group_ids", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


# ---- the scenarios (run in the rank processes) ----


def scenario(name: str, out: Path) -> int:
    from heterorl.peer.learner.ranks import RankLeader, follow, init_from_env
    from heterorl.peer.learner.trainer import TrainerLike

    torch.set_num_threads(1)
    timeout = RANK_TIMEOUT_S if name in ("leader_hangs", "idle_then_broken") else 60.0
    rank, world, device = init_from_env(timeout_s=timeout)
    assert world == 2 and device == torch.device("cpu")
    recorder = Recorder()
    if rank > 0:
        rc = follow(recorder)
        torch.save({"rc": rc, "calls": recorder.calls}, out / f"rank{rank}.pt")
        return rc
    leader = RankLeader(recorder)
    assert isinstance(leader, TrainerLike)
    if name == "round_trip":
        leader.step(wire_rows())
        leader.step(wire_rows(with_sources=False))
        assert leader.snapshot("bfloat16", with_state=False) is None
        leader.restore(out / "state")
        leader.renumber(7)
        with contextlib.suppress(ValueError):
            leader.renumber(3)  # refused on rank 0, never sent
        leader.stop()
        leader.stop()  # once only
        assert leader.version == 7
        return 0
    if name == "idle_then_broken":
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5 * RANK_TIMEOUT_S:  # idle past the timeout: kept alive
            leader.keepalive()
            time.sleep(0.5)
        leader.step(wire_rows())  # the follower is still there

        def fails(rows):
            raise RuntimeError("out of memory (simulated)")

        recorder.step = fails
        with contextlib.suppress(RuntimeError):
            leader.step(wire_rows())  # sent, then failed here: the ranks may be out of step
        try:
            leader.renumber(9)
        except RuntimeError as e:
            assert "out of step" in str(e)
        else:
            raise AssertionError("a broken leader sent a command")
        leader.stop()  # nothing sent: the follower learns of it when this process ends
        return 3
    leader.renumber(1)
    if name == "leader_dies":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # leader_hangs: alive, silent; the test kills it
    return 0


# ---- the tests ----


def test_commands_and_rows_round_trip_exactly_and_stop_ends_the_follower(tmp_path):
    procs = launch(Path(__file__), "round_trip", tmp_path)
    assert wait_all(procs, tmp_path) == [0, 0], logs(tmp_path)
    got = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert got["rc"] == 0
    calls = got["calls"]
    assert [c[0] for c in calls] == ["step", "step", "snapshot", "restore", "renumber"]
    assert_rows_equal(calls[0][1], wire_rows())
    assert_rows_equal(calls[1][1], wire_rows(with_sources=False))
    assert calls[2] == ("snapshot", "bfloat16", False)
    assert calls[3] == ("restore", str((tmp_path / "state").resolve()))
    assert calls[4] == ("renumber", 7)  # renumber(3) was refused on rank 0 and never sent


def test_a_follower_whose_leader_is_killed_exits_non_zero(tmp_path):
    procs = launch(Path(__file__), "leader_dies", tmp_path)
    t0 = time.monotonic()
    rcs = wait_all(procs, tmp_path, timeout=60)
    assert rcs[0] == -signal.SIGKILL and rcs[1] == 1, logs(tmp_path)
    assert time.monotonic() - t0 < 45
    got = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert got["rc"] == 1 and got["calls"] == [("renumber", 1)]


def test_a_follower_whose_leader_hangs_exits_non_zero_after_the_timeout(tmp_path):
    procs = launch(Path(__file__), "leader_hangs", tmp_path)
    try:
        t0 = time.monotonic()
        rc = procs[1].wait(timeout=60)
        waited = time.monotonic() - t0
    finally:
        procs[0].kill()
        wait_all(procs, tmp_path)
    assert rc == 1, logs(tmp_path)
    assert waited >= RANK_TIMEOUT_S  # it waited the timeout (plus start-up), not forever
    got = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert got["rc"] == 1 and got["calls"] == [("renumber", 1)]


if __name__ == "__main__":
    import torch.distributed as dist

    code = scenario(sys.argv[1], Path(sys.argv[2]))
    dist.destroy_process_group()  # without it gloo aborts the process at exit (SIGABRT)
    sys.exit(code)


def test_keepalives_hold_an_idle_follower_and_a_leader_whose_command_failed_sends_nothing_more(tmp_path):
    procs = launch(Path(__file__), "idle_then_broken", tmp_path)
    rcs = wait_all(procs, tmp_path, timeout=90)
    assert rcs == [3, 1], logs(tmp_path)  # the follower outlived its timeout while idle, then saw rank 0 go
    got = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert [c[0] for c in got["calls"]] == ["step", "step"]  # no renumber, no stop reached it
