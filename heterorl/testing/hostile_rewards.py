"""Reward functions that behave as a scorer subverted by its input would: the sandbox's tests and the reward
fuzz target run them in a reward worker (``module:function`` rewards, allowed by name) and check that nothing
they try gets out. Each takes ``(prompt, completion, reference)``; the completion carries the path or payload.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time


def evaluates(prompt: str, completion: str, reference: str) -> float:
    """What reasoning-gym's ``string_insertion`` scorer does: ``eval`` the answer."""
    return 1.0 if str(eval(completion)) == reference else 0.0  # noqa: S307 - the point of the test


def sympy_parses(prompt: str, completion: str, reference: str) -> float:
    """What sympy-based scorers do: ``parse_expr`` the answer (which evaluates Python)."""
    from sympy.parsing.sympy_parser import parse_expr

    return 1.0 if str(parse_expr(completion)) == reference else 0.0


def writes_file(prompt: str, completion: str, reference: str) -> float:
    with open(completion, "w") as f:
        f.write("escaped")
    return 1.0


def reads_file(prompt: str, completion: str, reference: str) -> float:
    with open(completion, "rb") as f:
        return 1.0 if f.read() else 0.0


def runs_command(prompt: str, completion: str, reference: str) -> float:
    os.system(f"touch {completion}")  # noqa: S605
    subprocess.run(["touch", completion], check=False)
    return 1.0


def connects(prompt: str, completion: str, reference: str) -> float:
    host, port = completion.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=1.0) as s:
        s.sendall(b"escaped")
    return 1.0


def sees_environment(prompt: str, completion: str, reference: str) -> float:
    """1.0 when the variable ``completion`` names is in the worker's environment (it must not be)."""
    return 1.0 if completion in os.environ else 0.0


def sleeps(prompt: str, completion: str, reference: str) -> float:
    time.sleep(float(completion))
    return 1.0


def exits(prompt: str, completion: str, reference: str) -> float:
    if completion == "exit":
        os._exit(3)
    return 0.0


def allocates(prompt: str, completion: str, reference: str) -> float:
    block = bytearray(int(completion))
    return 1.0 if block else 0.0


def echoes(prompt: str, completion: str, reference: str) -> float:
    """A well-behaved scorer: 1.0 when the completion is the reference."""
    return 1.0 if completion.strip() == reference else 0.0
