"""The reward sandbox: rewards run in a worker process that scores honest answers as the task does, and lets
nothing an answer (or a subverted scorer) tries get out: no file written or read outside the libraries, no
process, no connection, no inherited secret; a hang or a crash scores 0 within the limit and the next answer
is scored by a fresh worker; the caller never sees an exception."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from heterorl.peer.tasks import get_task
from heterorl.peer.tasks.confine import Refused, check_expression
from heterorl.peer.tasks.sandbox import SandboxError, SandboxLimits, TaskSpec, sandbox, sandboxed_task

LIMIT_S = 1.0
SLACK_S = 1.5  # a loaded CI machine: the answer's own limit, plus this, is when the caller has its 0


def _hostile(fn: str, **limits) -> tuple:
    reward = f"heterorl.testing.hostile_rewards:{fn}"
    spec = TaskSpec("arithmetic", {"digits": 1, "reward": reward}, (reward,))
    task = sandboxed_task(spec, SandboxLimits(time_s=LIMIT_S, **limits))
    return task, task.scorer


@pytest.fixture
def evaluating():
    task, box = _hostile("evaluates")
    yield task, box
    box.close()


def test_honest_answers_score_as_the_task_scores_them_in_a_confined_worker():
    task = get_task("arithmetic", digits=1)
    box = sandbox(task, TaskSpec("arithmetic", {"digits": 1}))
    try:
        rng = random.Random(0)
        for _ in range(20):
            ex = task.sample(rng)
            assert (
                task.reward(ex.prompt, ex.solution, ex.reference)
                == task.reward_fn(ex.prompt, ex.solution, ex.reference)
                == 1.0
            )
            assert task.reward(ex.prompt, "nope", ex.reference) == 0.0
        assert box.stats()["answers"] == 40 and box.stats()["errors"] == 0
        assert "dies with its parent" in box.isolation
    finally:
        box.close()


def test_code_in_an_answer_runs_nothing(tmp_path, evaluating):
    task, box = evaluating
    canary = tmp_path / "escaped"
    payloads = [
        f"__import__('os').system('touch {canary}')",
        f"open('{canary}', 'w').write('x')",
        "().__class__.__base__.__subclasses__()",
        "[c for c in ().__class__.__mro__]",
        "getattr(1, 'real')",
        "print('hi')",
        "exec('1')",
        "[" * 10_000 + "]" * 10_000,
        "(" * 100_000,
        "\udcff\udcfe",
    ]
    for p in payloads:
        assert task.reward("q", p, "2") == 0.0, p
    assert task.reward("q", "1+1", "2") == 1.0  # the scorer's own arithmetic still runs
    assert not canary.exists()
    assert box.stats()["crashes"] == 0


def test_the_eval_guard_refuses_private_names_and_reaching_builtins_and_passes_arithmetic():
    for ok in ("(5 - 3) * 6", "Integer (2 )*Symbol ('x' )", "[1, 2, [3]]", "0x3a >> 2"):
        check_expression(ok)
    for bad in ("__import__('os')", "x.__class__", "open('f')", "getattr(a, 'b')", "f(key=_x)"):
        with pytest.raises(Refused):
            check_expression(bad)
    with pytest.raises(Refused):
        check_expression(compile("().__class__", "<s>", "eval"))


def test_sympy_parse_runs_nothing_and_still_parses(tmp_path):
    task, box = _hostile("sympy_parses")
    try:
        canary = tmp_path / "escaped"
        assert task.reward("q", f"__import__('os').system('touch {canary}')", "x") == 0.0
        assert task.reward("q", "2*x + 1", "2*x + 1") == 1.0
        assert not canary.exists()
    finally:
        box.close()


@pytest.mark.parametrize("fn", ["writes_file", "runs_command"])
def test_a_scorer_cannot_write_or_start_a_process(tmp_path, fn):
    task, box = _hostile(fn)
    try:
        canary = tmp_path / "escaped"
        assert task.reward("q", str(canary), "") == 0.0
        assert not canary.exists()
        assert box.stats()["blocked"] >= 1 and box.stats()["restarts"] == 0
        assert task.reward("q", str(canary), "") == 0.0  # a fresh worker after a refusal
        assert box.stats()["restarts"] == 1
    finally:
        box.close()


def test_a_scorer_cannot_read_a_key_or_see_the_environment(tmp_path, monkeypatch):
    key = tmp_path / "peer.key"
    key.write_bytes(b"secret")
    monkeypatch.setenv("HETERORL_TEST_SECRET", "secret")
    reads, box1 = _hostile("reads_file")
    env, box2 = _hostile("sees_environment")
    try:
        assert reads.reward("q", str(key), "") == 0.0
        assert box1.stats()["blocked"] == 1
        assert env.reward("q", "HETERORL_TEST_SECRET", "") == 0.0
        assert env.reward("q", "PATH", "") == 1.0  # the control: the worker does see its own environment
    finally:
        box1.close()
        box2.close()


def test_a_scorer_cannot_connect():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)
    port = srv.getsockname()[1]
    task, box = _hostile("connects")
    try:
        assert task.reward("q", f"127.0.0.1:{port}", "") == 0.0
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        box.close()
        srv.close()


def test_a_hang_scores_zero_within_the_limit_and_the_next_answer_gets_a_fresh_worker(evaluating):
    task, box = evaluating
    for bomb in ("9**9**9**9", "sum(range(10**12))"):
        t0 = time.monotonic()
        assert task.reward("q", bomb, "2") == 0.0
        assert time.monotonic() - t0 < LIMIT_S + SLACK_S
    assert task.reward("q", "1+1", "2") == 1.0
    s = box.stats()
    assert s["timeouts"] == 2 and s["restarts"] == 2


def test_a_crash_or_an_allocation_past_the_limit_scores_zero_and_scoring_goes_on():
    task, box = _hostile("exits")
    try:
        assert task.reward("q", "exit", "") == 0.0
        assert task.reward("q", "exit", "") == 0.0
        assert box.stats()["crashes"] == 2 and box.stats()["restarts"] == 1
    finally:
        box.close()
    task, box = _hostile("allocates", memory_mb=64)
    try:
        assert task.reward("q", str(1 << 30), "") == 0.0  # 1 GiB past a 64 MiB headroom: MemoryError
        assert task.reward("q", str(1 << 20), "") == 1.0
        assert box.stats()["errors"] == 1 and box.stats()["crashes"] == 0
    finally:
        box.close()


def test_oversize_text_scores_zero_without_a_worker(evaluating):
    task, box = evaluating
    assert task.reward("q", "1+" * 5_000_000 + "1", "2") == 0.0
    assert box.stats()["oversize"] == 1


def test_several_threads_share_the_workers():
    task, box = _hostile("echoes")
    box.close()
    task = sandboxed_task(
        TaskSpec("arithmetic", {"digits": 1, "reward": "heterorl.testing.hostile_rewards:echoes"},
                 ("heterorl.testing.hostile_rewards:echoes",)),
        workers=2,
    )  # fmt: skip
    results: list[float] = []

    def score(i: int) -> None:
        results.append(task.reward("q", str(i), str(i)))

    threads = [threading.Thread(target=score, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert results == [1.0] * 16
        assert task.scorer.stats()["restarts"] == 1  # the second worker, started when first needed
    finally:
        task.scorer.close()


def test_a_task_the_worker_cannot_build_fails_at_start():
    with pytest.raises(SandboxError, match="could not build"):
        sandbox(get_task("arithmetic"), TaskSpec("countdown", {"no_such_param": 1}))


def test_closed_workers_are_gone():
    task, box = _hostile("echoes")
    pids = [w.proc.pid for w in box._all]
    box.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_restarted_from_a_thread_that_ends_outlives_the_thread():
    task, box = _hostile("exits")
    try:
        assert task.reward("q", "exit", "") == 0.0  # the worker dies; the next call starts another

        def restart() -> None:
            assert task.reward("q", "fine", "") == 0.0

        t = threading.Thread(target=restart)
        t.start()
        t.join()
        time.sleep(0.5)
        assert task.reward("q", "fine", "") == 0.0
        s = box.stats()
        assert s["crashes"] == 1 and s["restarts"] == 1, s  # the worker the ended thread started is alive
    finally:
        box.close()


def test_a_worker_that_cannot_be_started_again_scores_zero_and_never_raises(tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    (tmp_path / "fragile_reward.py").write_text(
        f"import os\nif os.path.exists({str(broken)!r}):\n    raise ImportError('broken on purpose')\n"
        "def score(prompt, completion, reference):\n"
        "    if completion == 'exit':\n        os._exit(3)\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = TaskSpec("arithmetic", {"digits": 1, "reward": "fragile_reward:score"}, ("fragile_reward:score",))
    task = sandboxed_task(spec, SandboxLimits(time_s=LIMIT_S))
    try:
        assert task.reward("q", "fine", "") == 1.0
        broken.touch()
        assert task.reward("q", "exit", "") == 0.0  # the worker dies
        assert task.reward("q", "fine", "") == 0.0  # and cannot be built again: 0, not an exception
        assert task.scorer.incident == "crash" and task.scorer.stats()["crashes"] == 2
        broken.unlink()
        assert task.reward("q", "fine", "") == 1.0  # the next call tries again
    finally:
        task.scorer.close()


def test_a_sampler_does_not_send_a_batch_holding_a_reward_the_worker_could_not_compute(evaluating):
    from heterorl.peer.daemon.sampler import score_rows

    task, box = evaluating
    texts = ["1+1", "1+1", "1+1", "9**9**9**9", "1+1", "3"]  # batches of 2 rows: the second holds a bomb
    rewards, unscored = score_rows(task, ["q"] * 6, texts, ["2"] * 6, per=2)
    assert rewards == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0] and unscored == {1}
    assert box.stats()["timeouts"] == 1
    rewards, unscored = score_rows(task, ["q"] * 4, ["1+1"] * 4, ["2"] * 4, per=2)  # a fresh worker
    assert rewards == [1.0] * 4 and unscored == set()
