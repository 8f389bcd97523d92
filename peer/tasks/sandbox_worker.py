"""The reward worker: one process that builds the run's task and scores answers, confined (:mod:`.confine`).

Started by :class:`~.sandbox.RewardSandbox` with an empty environment in an empty directory. It reads frames
(4-byte big-endian length, then msgpack) on the descriptor that was its stdin and writes replies on the one
that was its stdout; both are moved aside first and fds 0 and 1 point at /dev/null, so whatever a scorer
prints goes nowhere. The first frame names the task; the worker builds it, scores a few of the task's own
solutions (imports a scorer makes lazily happen now, not under the limits), then confines itself and replies
``{"ok": true, ...}``. Each later frame is ``{"p": prompt, "c": completion, "r": reference}``, answered with
``{"v": reward}`` or ``{"e": "what failed"}``, and ``"blocked"``: how many things the sandbox refused while it
scored.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import sys

_HEADER = struct.Struct(">I")
MAX_REQUEST = 64 << 20  # the task's data set travels in the first frame


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd: int):
    import msgpack

    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    (n,) = _HEADER.unpack(head)
    if n > MAX_REQUEST:
        raise ValueError(f"request of {n} bytes")
    body = _read_exact(fd, n)
    return None if body is None else msgpack.unpackb(body, raw=False)


def write_frame(fd: int, obj) -> None:
    import msgpack

    body = msgpack.packb(obj, use_bin_type=True)
    data = _HEADER.pack(len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def _warm_up(task, n: int = 4) -> None:
    rng = random.Random(0)
    for _ in range(n):
        try:
            ex = task.sample(rng)
            task.reward(ex.prompt, ex.solution, ex.reference)
            task.reward(ex.prompt, "not the answer", ex.reference)
        except Exception:  # a task whose own solution fails its scorer is the scorer's problem, not ours
            pass


def main() -> None:
    from .confine import deny_processes, guard_eval, install_audit_hook, isolate_process, limit_memory

    isolation = isolate_process()
    fd_in, fd_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    init = read_frame(fd_in)
    if init is None:
        return
    try:
        from .registry import get_task

        task = get_task(
            init["name"], allow_rewards=tuple(init["allow_rewards"]), data=init["data"], **init["params"]
        )
        _warm_up(task)
    except Exception as e:
        write_frame(fd_out, {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
        return
    if deny_processes():
        isolation.append("no processes (seccomp)")
    cap = limit_memory(int(init["memory_mb"]) << 20)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    refused = [0]

    def count(_event: str) -> None:
        refused[0] += 1

    guard_eval()
    install_audit_hook([os.getcwd()], on_refusal=count)
    write_frame(fd_out, {"ok": True, "isolation": isolation, "memory_cap": cap})
    while True:
        req = read_frame(fd_in)
        if req is None:
            return
        before = refused[0]
        try:
            reply = {"v": float(task.reward(req["p"], req["c"], req["r"]))}
        except BaseException as e:  # noqa: BLE001 - whatever an answer raises (SystemExit too) scores 0
            reply = {"e": f"{type(e).__name__}: {e}"[:300]}
        reply["blocked"] = refused[0] - before
        write_frame(fd_out, reply)


if __name__ == "__main__":
    main()
