"""What a reward worker does to itself so that code an answer smuggles into a scorer can reach nothing.

A task library's scorer is someone else's code run on text a hostile sampler chose: reasoning-gym's
``string_insertion`` scorer ``eval()``s the answer, sympy's ``parse_expr`` evaluates its input. The worker
(:mod:`.sandbox_worker`) is a process of its own, started with an empty environment in an empty directory, and
layers these on itself, each a guard where another may not hold:

- :func:`isolate_process` (first, while the process has one thread): a network namespace of its own where the
kernel allows one (nothing to connect to), ``PR_SET_NO_NEW_PRIVS``, death with its parent, no core files. -
:func:`limit_memory`: an address-space limit a fixed headroom above what the built task holds. -
:func:`guard_eval`: ``eval`` of text or code that names anything private (``_``-prefixed: ``__import__``,
``__class__``, ``__subclasses__``) or a builtin that reaches outside (``open``, ``exec``, ``getattr`` ...) is
refused before it runs. A scorer's own arithmetic (``"(5 - 3) * 6"``, sympy's ``Integer (2 )*Symbol ('x' )``)
passes. - :func:`install_audit_hook`: processes, sockets, signals, ``ctypes``, writes and reads outside the
libraries' own directories raise PermissionError (:pep:`578` audit hooks cannot be removed once added).

The time limit is the parent's: it kills a worker whose answer runs past it (:mod:`.sandbox`).
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import ctypes.util
import os
import resource
import signal
import sys
import types
from collections.abc import Iterable

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

# builtins that reach outside an expression's own values, or out of the sandbox's rules
DENIED_NAMES = frozenset(
    {
        "open", "exec", "eval", "compile", "getattr", "setattr", "delattr", "globals", "locals", "vars",
        "input", "breakpoint", "help", "exit", "quit", "memoryview", "type", "object", "super", "dir",
        "print", "classmethod", "staticmethod", "property", "copyright", "credits", "license",
    }
)  # fmt: skip
# audit events refused outright (prefix match) once the worker serves answers
DENIED_EVENTS = (
    "socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "os.kill", "os.killpg", "os.remove", "os.unlink", "os.rmdir", "os.rename", "os.replace",
    "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.symlink", "os.link", "os.putenv",
    "os.unsetenv", "os.chdir", "os.chroot", "os.setxattr", "os.removexattr", "shutil.", "ctypes.", "pty.",
    "resource.setrlimit", "resource.prlimit", "signal.pthread_kill", "sys.addaudithook", "urllib.",
    "http.", "ftplib.", "smtplib.", "telnetlib.", "webbrowser.", "sqlite3.", "mmap.",
)  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class Refused(PermissionError):
    """Something the sandbox does not allow an answer's scoring to do."""


def isolate_process() -> list[str]:
    """Kernel-level isolation this process can give itself; returns what applied (for the log)."""
    applied = []
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
        applied.append("dies with its parent")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        applied.append("no new privileges")
    for flags, what in ((CLONE_NEWNET, "own network namespace"), (CLONE_NEWUSER | CLONE_NEWNET, "own user "
                        "and network namespace")):  # fmt: skip
        if libc.unshare(flags) == 0:
            applied.append(what)
            break
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return applied


# seccomp: per architecture (uname -m), the AUDIT_ARCH_* value the kernel reports and the syscall numbers of
# execve, execveat, fork and vfork (none on aarch64), clone, clone3.
_SYSCALLS = {
    "x86_64": (
        0xC000003E,
        {"execve": 59, "execveat": 322, "fork": 57, "vfork": 58, "clone": 56, "clone3": 435},
    ),
    "aarch64": (0xC00000B7, {"execve": 221, "execveat": 281, "clone": 220, "clone3": 435}),
}
_CLONE_THREAD = 0x00010000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def deny_processes() -> bool:
    """A seccomp filter on this process (it needs ``PR_SET_NO_NEW_PRIVS``, set by :func:`isolate_process`):
    ``execve``/``execveat`` fail with EPERM, so no program can be started whatever Python route reaches them
    (``_posixsubprocess.fork_exec`` raises no audit event); ``fork``, ``vfork`` and a ``clone`` that is not a
    thread fail too; ``clone3`` answers ENOSYS (its flags are out of a filter's reach; libc falls back to
    ``clone`` for threads); syscalls of another ABI (x32, i386) fail. False where it was not installed."""
    import platform

    arch = _SYSCALLS.get(platform.machine())
    if arch is None:
        return False
    audit_arch, nr = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    denied = [nr[k] for k in ("execve", "execveat", "fork", "vfork") if k in nr]
    # (code, jump-if-true label, jump-if-false label, k); labels resolved below
    prog = [
        (ld, None, None, 4),
        (jeq, "next", "deny", audit_arch),
        (ld, None, None, 0),
        (jge, "deny", "next", 0x40000000),
    ]
    prog += [(jeq, "deny", "next", n) for n in denied]
    prog += [(jeq, "enosys", "next", nr["clone3"]), (jeq, "next", "allow", nr["clone"]), (ld, None, None, 16)]
    prog += [(jset, "allow", "deny", _CLONE_THREAD)]
    labels = {"allow": len(prog), "deny": len(prog) + 1, "enosys": len(prog) + 2}
    prog += [(ret, None, None, allow), (ret, None, None, eperm), (ret, None, None, enosys)]

    class SockFilter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint32),
        ]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    def off(i: int, label: str | None) -> int:
        return 0 if label in (None, "next") else labels[label] - i - 1

    filters = (SockFilter * len(prog))(
        *(SockFilter(c, off(i, t), off(i, f), k) for i, (c, t, f, k) in enumerate(prog))
    )
    fprog = SockFprog(len(prog), filters)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


def address_space() -> int:
    """This process's virtual memory size in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def limit_memory(headroom_bytes: int) -> int:
    """Cap the address space at what the process holds now plus ``headroom_bytes``; returns the cap (0: not
    set). An answer that allocates past it gets a MemoryError (its scorer fails: it scores 0)."""
    now = address_space()
    if now <= 0:
        return 0
    cap = now + headroom_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def _denied_name(name: str) -> bool:
    return name.startswith("_") or name in DENIED_NAMES


def _code_names(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    yield from code.co_varnames
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def check_expression(source: object) -> None:
    """Refused if ``source`` (text or a code object about to be ``eval``-ed) names anything private or a
    denied builtin; SyntaxError/RecursionError/MemoryError from parsing propagate (the caller's scorer sees an
    error either way)."""
    if isinstance(source, types.CodeType):
        bad = sorted({n for n in _code_names(source) if _denied_name(n)})
    else:
        text = source.decode("utf-8", "replace") if isinstance(source, bytes | bytearray) else str(source)
        tree = ast.parse(text.strip(), mode="eval")
        bad = sorted(
            {
                n
                for node in ast.walk(tree)
                for n in (
                    (node.id,)
                    if isinstance(node, ast.Name)
                    else (node.attr,)
                    if isinstance(node, ast.Attribute)
                    else (node.arg,)
                    if isinstance(node, ast.keyword) and node.arg
                    else ()
                )
                if _denied_name(n)
            }
        )
    if bad:
        raise Refused(f"eval of an expression naming {', '.join(bad[:5])} refused")


def guard_eval() -> None:
    """Replace ``builtins.eval`` with one that checks its expression first (:func:`check_expression`)."""
    real_eval = builtins.eval

    def guarded_eval(source, globals=None, locals=None, /):  # noqa: A002 - eval's own parameter names
        check_expression(source)
        return real_eval(source, globals, locals)

    builtins.eval = guarded_eval


def _roots(extra: Iterable[str]) -> tuple[str, ...]:
    """Directories reads are allowed under: Python's own, and those of every module loaded so far (imports
    that happen later, from the same libraries, read there)."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *extra}
    for mod in list(sys.modules.values()):
        for d in getattr(mod, "__path__", None) or ():
            dirs.add(d)
        f = getattr(mod, "__file__", None)
        if f:
            dirs.add(os.path.dirname(f))
    out = {os.path.realpath(d) for d in dirs if isinstance(d, str) and d}
    return tuple(sorted(d.rstrip("/") + "/" for d in out if d != "/"))


def install_audit_hook(extra_roots: Iterable[str] = (), on_refusal=None) -> None:
    """Refuse :data:`DENIED_EVENTS`, opens for writing, and reads outside the allowed roots (``extra_roots``:
    the worker's own empty directory). ``on_refusal(event)`` is called before each refusal is raised."""
    roots = _roots(extra_roots)
    realpath, startswith = os.path.realpath, str.startswith

    def refuse(event: str) -> None:
        if on_refusal is not None:
            on_refusal(event)
        raise Refused(f"{event} refused in the reward sandbox")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            if isinstance(mode, str) and any(c in mode for c in "wax+"):
                refuse("open for writing")
            if isinstance(flags, int) and flags & _WRITE_FLAGS:
                refuse("open for writing")
            if isinstance(path, os.PathLike):
                path = os.fspath(path)
            if isinstance(path, int):
                return  # an open descriptor (the worker's own pipes: they are not reopened)
            if isinstance(path, bytes):
                path = path.decode("utf-8", "surrogateescape")
            if not isinstance(path, str) or not startswith(realpath(path), roots):
                refuse("open outside the libraries")
        elif event == "exec":
            # code compiled from text at run time (eval, exec, compile, sympy's lambdify ...): the eval
            # guard's rule, whatever route runs it (a code object from a file is a library's: an import)
            code = args[0] if args else None
            dynamic = isinstance(code, types.CodeType) and not os.path.isabs(code.co_filename)
            if dynamic and any(_denied_name(n) for n in _code_names(code)):
                refuse("exec of code naming private or denied names")
        elif startswith(event, DENIED_EVENTS):
            refuse(event)

    sys.addaudithook(hook)
