"""The ``rewards`` target: hostile answers, through the reward sandbox
(:mod:`heterorl.peer.tasks.sandbox`), at every built-in reward and task scorer.

**Scorers** (:func:`scorer_specs`, read off the tree at run time, so a reward or task added later is fuzzed
without a change here): each built-in reward of ``REWARDS`` on a task that suits it (``arithmetic_exact`` on
bare arithmetic, ``arithmetic_answer`` on question-style arithmetic, ``countdown``, ``gsm8k`` on a tiny
in-memory GSM8K-style data set, ``math_verify`` on a tiny LaTeX data set, any other on the GSM8K data set),
the reasoning-gym datasets in :data:`RG_DATASETS` where the ``reasoning_gym`` task exists (two scorers that
``eval()`` the answer, one that parses it with sympy), any other task kind with its defaults, and
``heterorl.testing.hostile_rewards:evaluates`` / ``:sympy_parses``, stand-ins for a scorer that evaluates
its input. One :class:`~heterorl.peer.tasks.sandbox.RewardSandbox` per scorer for the whole run, started
side by side, :data:`LIMIT_S` (1 s) an answer so that a bomb costs little, closed at the end.

**Inputs** (seeded; :data:`FAMILY_SHARES`): the task's own solutions, bare or wrapped as an answer extractor
wants them (``<answer>..</answer>``, ``\\boxed{}``, ``####``), and wrong answers; mutations of solutions,
prompts and references; code (``__import__('os').system('touch CANARY')``, ``open(CANARY, 'w')``, dunder
escapes, fullwidth names, sympy's ``sympify``/``preview``/``lambdify``, a scorer patched to pass every
later answer), a connection to a listener this target opens on 127.0.0.1; CPU and memory bombs
(``9**9**9**9``, ``sum(range(10**12))``), LaTeX bombs (``\\frac`` nested deep, ``\\underbrace``,
``10^{10^{10^{10}}}``, ``\\boxed{`` x 10 000); sizes (10 MB, exactly at and one past the sandbox's text cap,
10 000 nested brackets); invalid UTF-8 (bytes decoded with surrogateescape, lone surrogates). Each run
starts with :data:`PRELUDE`, a few fixed inputs, so even a short run sends a bomb, a refused process and a
connection. Hypothesis draws its share from random text and the cheap payloads.

**Oracle**, per input: nothing got out (no file in this run's fresh temp directory, where every payload
aims, no connection accepted by the listener, no process whose parent is a reward worker; checked after each
input) -- else ``escaped``; ``task.reward`` returned (an exception is a crash); the reward is a float in
[0, 1] -- else ``wrong_result``; the call returned within ``LIMIT_S + SLACK_S`` -- else a hang; an honest
answer (a solution or wrong answer this target wrote itself, never hostile text) scores in the sandbox what
the task's reward function scores in this process -- else ``wrong_result``, and the scorer gets a fresh
sandbox (up to :data:`MAX_REBUILDS` times: an earlier answer may have subverted its worker). An honest
answer that runs past the limit scores 0 and is counted apart (``honest_to``), not judged.

**Time.** The harness's own hang limit is for decoders that take microseconds: this target sets
``hang_s = inf`` (its oracle judges each call against the sandbox's limit plus a slack) and ``abort_s``
long enough for a worker's start plus an answer; SIGALRM interrupting a reward call past that counts as a
hang and the scorer's sandbox is rebuilt (a worker interrupted mid-answer would answer the next one). After
an input that cost its worker (a timeout, a crash, a refusal) the next call starts a fresh one: this target
makes that call itself, at once, with the task's own solution, times it as a restart (``restart_s``, apart
from the inputs' times) and checks it scores as in this process, so every judged call ran on a live worker
(one that still needed a start is allowed :data:`START_S` on top).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .base import _call, _Hang, _Outcome, _Target
from .report import _short

if TYPE_CHECKING:
    from heterorl.peer.tasks.base import Task
    from heterorl.peer.tasks.sandbox import RewardSandbox, TaskSpec

    from .harness import _Harness

# Short answers so a bomb costs a second, not the production default of 2 s; a small memory headroom since
# a dozen workers live at once.
LIMIT_S = 1.0
MEMORY_MB = 256
START_S = 120.0  # a worker's start (a reasoning-gym import on a loaded machine takes seconds)
SLACK_S = 1.5  # a loaded machine: a reward call may return this long after its limit
MAX_REBUILDS = 3  # fresh sandboxes per scorer after a wrong result (one costs seconds for reasoning-gym)
EXAMPLES = 6  # the task's own examples drawn per scorer, for honest answers and mutations
_HOSTILE = "heterorl.testing.hostile_rewards"
RG_SIZE = 64
# reasoning-gym datasets fuzzed where the ``reasoning_gym`` task exists, and what their scorers do with an
# answer (sympy: ``parse_expr``, which evaluates Python; eval: ``eval()``; text: string and float compares).
# Not the other parse_expr ones: polynomial_multiplication and intermediate_integration draw entries that
# follow PYTHONHASHSEED (the task refuses the first), puzzle24 takes 150 ms an entry (a worker's start: 20 s).
RG_DATASETS = {
    "basic_arithmetic": "text",
    "string_insertion": "eval",
    "spiral_matrix": "eval",
    "simple_integration": "sympy",
    "complex_arithmetic": "text",
}
_STATS = ("answers", "timeouts", "crashes", "errors", "oversize", "blocked", "restarts")

# Share of the seeded inputs per family (the prelude and hypothesis aside). Bombs, and the sizes and code that
# cost a worker, are what take time (a timeout: the limit plus a restart): a few percent of the inputs.
FAMILY_SHARES = {
    "honest": 0.30,
    "wrong": 0.05,
    "mutated": 0.25,
    "code": 0.18,
    "unicode": 0.09,
    "size": 0.05,
    "bomb": 0.05,
    "socket": 0.03,
}
COSTLY_BOMB_SCALE = 0.5  # scorers whose worker takes seconds to start (reasoning-gym) get half the bombs

_GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
        "clips altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
    {
        "question": "A shop sells 1,250 pens a week. How many in 4 weeks?",
        "answer": "1,250 * 4 = 5,000\n#### 5,000",
    },
    {"question": "What is -3.5 plus 1?", "answer": "-3.5 + 1 = -2.5\n#### -2.5"},
]
_MATH = [
    {"question": "Simplify $\\frac{2}{4}$.", "answer": "$\\frac{2}{4} = \\boxed{\\frac{1}{2}}$"},
    {"question": "Solve $x^2 = 4$ for $x > 0$.", "answer": "$x = \\boxed{2}$"},
    {"question": "Write $\\sqrt{8}$ in simplest form.", "answer": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$"},
    {"question": "Compute $3^4$.", "answer": "$3^4 = \\boxed{81}$"},
    {"question": "Which $x$ satisfy $1 \\le x < 3$?", "answer": "$x \\in \\boxed{[1, 3)}$"},
]


def _jsonl(records: list[dict]) -> bytes:
    return b"\n".join(json.dumps(r).encode() for r in records) + b"\n"


@dataclasses.dataclass(frozen=True)
class ScorerSpec:
    """One scorer to fuzz: a name, the task the sandbox's worker builds, what its scorer does with an answer
    (``text``, ``eval``, ``sympy``, ``latex``), whether a worker is slow to start, whether it may be left out
    (a task of another engineer's that cannot be built with these parameters: reported, not fatal)."""

    name: str
    spec: TaskSpec
    kind: str = "text"
    wrapper: str = "{}"  # how an answer reaches the scorer past the task's extraction (reasoning-gym: tags)
    costly: bool = False
    optional: bool = False
    alternatives: tuple[TaskSpec, ...] = ()  # tried in turn when ``spec`` cannot be built (optional only)
    skip: str | None = None  # why it cannot run here (a reward whose package is not installed)


def scorer_specs() -> list[ScorerSpec]:
    """Every built-in reward and task scorer in the tree now, and the two eval-ing stand-ins."""
    from heterorl.peer.tasks.registry import task_names
    from heterorl.peer.tasks.rewards import REWARDS
    from heterorl.peer.tasks.sandbox import TaskSpec

    gsm8k, math_data = _jsonl(_GSM8K), _jsonl(_MATH)
    known = {
        "arithmetic_exact": ScorerSpec(
            "arithmetic_exact", TaskSpec("arithmetic", {"digits": 3, "ops": "+-*"})
        ),
        "arithmetic_answer": ScorerSpec(
            "arithmetic_answer", TaskSpec("arithmetic", {"digits": 3, "ops": "+-*", "style": "question"})
        ),
        "countdown": ScorerSpec(
            "countdown", TaskSpec("countdown", {"n_numbers": 4, "max_number": 25, "division": True})
        ),
        "gsm8k": ScorerSpec("gsm8k", TaskSpec("jsonl", {}, data=gsm8k)),
        "math_verify": ScorerSpec(
            "math_verify", TaskSpec("jsonl", {"reward": "math_verify"}, data=math_data), kind="latex"
        ),
    }
    out = [known[r] for r in known if r in REWARDS]
    if "math_verify" in REWARDS:
        try:
            from heterorl.peer.tasks.math_reward import missing
        except ImportError:
            pass
        else:
            out = [dataclasses.replace(s, skip=missing()) if s.name == "math_verify" else s for s in out]
    out += [
        ScorerSpec(f"reward:{r}", TaskSpec("jsonl", {"reward": r}, data=gsm8k))
        for r in REWARDS
        if r not in known
    ]
    tasks = task_names()
    if "reasoning_gym" in tasks:
        for ds, kind in RG_DATASETS.items():
            out.append(
                ScorerSpec(
                    f"rg:{ds}",
                    TaskSpec("reasoning_gym", {"dataset": ds, "size": RG_SIZE}),
                    kind=kind,
                    wrapper="<answer>{}</answer>",
                    costly=True,
                    optional=True,
                    alternatives=(TaskSpec("reasoning_gym", {"dataset": ds}),),
                )
            )
        # the untagged path: a reply's last number, read by a regex over its end (extract = "last_number")
        out.append(
            ScorerSpec(
                "rg:chain_sum/last_number",
                TaskSpec(
                    "reasoning_gym", {"dataset": "chain_sum", "size": RG_SIZE, "extract": "last_number"}
                ),
                kind="text",
                costly=True,
                optional=True,
            )
        )
    for t in tasks:
        if t not in ("arithmetic", "countdown", "jsonl", "reasoning_gym"):
            out.append(ScorerSpec(f"task:{t}", TaskSpec(t, {}), optional=True))
    for fn, kind in (("evaluates", "eval"), ("sympy_parses", "sympy")):
        reward = f"{_HOSTILE}:{fn}"
        out.append(
            ScorerSpec(
                f"hostile:{fn}", TaskSpec("arithmetic", {"digits": 2, "reward": reward}, (reward,)), kind
            )
        )
    return out


# ----------------------------------------------------------------------------------------------- payloads
# {CANARY}: a path in this run's temp directory (nothing may appear there); {PORT}: the listener's port.

WRAPPERS = (
    "{}",
    " {} \n",
    "<answer>{}</answer>",
    "<think>Let me see.</think>\n<answer>{}</answer>",
    "\\boxed{{}}",
    "The answer is $\\boxed{{}}$.",
    "#### {}",
    "Answer: {}",
)
_WRONG = ("not the answer", "", "0", "-1", "42", "I don't know", "x", "[]", "None")


def _wrap(wrapper: str, text: str) -> str:
    """``text`` where the wrapper's ``{}`` is (``{{}}``: inside braces, as ``\\boxed{..}`` wants it)."""
    if "{{}}" in wrapper:
        head, tail = wrapper.split("{{}}", 1)
        return head + "{" + text + "}" + tail
    head, tail = wrapper.split("{}", 1)
    return head + text + tail


def _fork_exec(argv: list[str]) -> str:
    """Python that starts ``argv`` with no ``subprocess`` audit event (``_posixsubprocess.fork_exec``)."""
    args = repr([a.encode() for a in argv])
    return (
        f"(lambda P, r: P.fork_exec({args}, [{argv[0].encode()!r}], True, (r[1],), None, None, "
        "-1, -1, -1, -1, -1, -1, r[0], r[1], True, False, -1, None, None, None, -1, None, False))"
        "(__import__('_posixsubprocess'), __import__('os').pipe())"
    )


def _lambdify(code: str) -> str:
    """sympy's ``lambdify`` compiles a string with ``exec``: the code in it is not an ``eval``'s."""
    return f"lambdify([], {code!r}, 'math')()"


_CONNECT = "__import__('socket').create_connection(('127.0.0.1', {PORT}), 1).sendall(b'escaped')"
_PY_CONNECT = "import socket; socket.create_connection(('127.0.0.1', {PORT}), 1).sendall(b'escaped')"
# a subverted scorer that passes every later answer (sympy_parses's own code); the next entry of CODE does it
# to sympy's parse_expr, which the parse_expr-based datasets call
_PERSIST = _lambdify(
    f"setattr(__import__('{_HOSTILE}', fromlist=['x']).sympy_parses, '__code__', "
    "(lambda p, c, r: 1.0).__code__)"
)
CODE = (
    "__import__('os').system('touch {CANARY}')",
    "__import__('subprocess').run(['touch', '{CANARY}'])",
    "open('{CANARY}', 'w').write('escaped')",
    "open('CANARY', 'w')",
    "open('/etc/passwd').read()",
    "().__class__.__base__.__subclasses__()",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'catch_warnings'][0]()._module"
    ".__builtins__['__import__']('os').system('touch {CANARY}')",
    "(lambda: 0).__globals__['__builtins__']['open']('{CANARY}', 'w')",
    "getattr(getattr(1, '__class__'), '__base__')",
    "[].__class__.__mro__[1].__subclasses__()",
    "'{0.__class__.__mro__}'.format(1)",
    "vars()",
    "globals()",
    "breakpoint()",
    "help()",
    "license()",
    "exit(3)",
    "exec(\"open('{CANARY}', 'w')\")",
    "eval(\"__import__('os').system('touch {CANARY}')\")",
    "compile('1', 'x', 'eval')",
    "type('X', (), {})",
    "memoryview(b'x')",
    "\uff4f\uff50\uff45\uff4e('{CANARY}', 'w')",  # fullwidth "open": the parser folds it (NFKC)
    "__\uff49\uff4d\uff50\uff4f\uff52\uff54__('os').system('touch {CANARY}')",
    # sympy's namespace (sympy_parses, parse_expr-based datasets, math_verify)
    "sympify(\"__import__('os').system('touch {CANARY}')\")",
    "S(\"open('{CANARY}', 'w')\")",
    "preview(x)",
    "preview(x, viewer='file', filename='{CANARY}')",
    "init_printing()",
    "var('os sys')",
    _lambdify("open('{CANARY}', 'w').write('escaped')"),
    _lambdify("__import__('os').system('touch {CANARY}')"),
    _lambdify(_fork_exec(["/usr/bin/touch", "{CANARY}"])),
    _lambdify(_fork_exec(["/bin/sh", "-c", "touch {CANARY}"])),
    _PERSIST,
    _lambdify("setattr(__import__('sympy'), 'parse_expr', lambda *a, **k: 0)"),
    "\\text{__import__('os').system('touch {CANARY}')}",
    "$\\boxed{__import__('os').system('touch {CANARY}')}$",
)
SOCKET = (
    _CONNECT,
    "socket.create_connection(('127.0.0.1', {PORT}))",
    _lambdify(_CONNECT),
    _lambdify(_fork_exec(["/usr/bin/python3", "-c", _PY_CONNECT])),
)


def _nest(open_: str, close: str, inner: str, depth: int) -> str:
    return open_ * depth + inner + close * depth


def _frac(depth: int) -> str:
    s = "1"
    for _ in range(depth):
        s = "\\frac{" + s + "}{2}"
    return s


PY_BOMBS = (
    "9**9**9**9",
    "sum(range(10**12))",
    "10**10**10",
    "max(range(10**12))",
    "any(iter(int, 1))",
    "list(iter(int, 1))",
    "'a' * 10**10",
    "[0] * 10**10",
    "2**2**2**2**2**2",
    "factorial(10**8)",
    "expand((x + 1)**(10**6))",
    "Integer(9)**9**9**9",
    "test()",
    _lambdify("sum(range(10**12))"),
)
TEX_BOMBS = (
    "$" + _frac(2000) + "$",
    "$" + _frac(300) + "$",
    "$10^{10^{10^{10}}}$",
    "$9^{9^{9^{9}}}$",
    "$\\underbrace{" + "x+" * 2000 + "x}_{10^{10}\\text{ times}}$",
    _nest("\\underbrace{", "}_{n}", "1", 500),
    "$\\sum_{n=1}^{10^{12}} n$",
    "$(10^{10})!$",
    "$\\binom{10^{100}}{10^{50}}$",
    "$" + _nest("\\sqrt{", "}", "2", 2000) + "$",
    "$" + _nest("\\left(", "\\right)", "x", 3000) + "$",
    "$" + _nest("x^{", "}", "x", 1000) + "$",
    "\\boxed{" * 10_000,
    "$\\begin{pmatrix}" + "\\\\".join(["&".join(["1"] * 150)] * 150) + "\\end{pmatrix}^{1000}$",
)
BOMBS = PY_BOMBS + TEX_BOMBS


def _sizes() -> tuple[tuple[str, Any], ...]:
    """(name, builder) for the size family: built when drawn, so a 10 MB string lives one input."""
    from heterorl.peer.tasks.sandbox import MAX_TEXT_CHARS

    return (
        ("10MB", lambda: "A" * 10_000_000),
        ("at_cap", lambda: "9" * MAX_TEXT_CHARS),
        ("past_cap", lambda: "9" * (MAX_TEXT_CHARS + 1)),
        ("brackets", lambda: "[" * 10_000 + "]" * 10_000),
        ("parens", lambda: "(" * 10_000 + "1" + ")" * 10_000),
        ("braces", lambda: "{" * 10_000 + "}" * 10_000),
        ("open_parens", lambda: "(" * 100_000),
        ("boxed", lambda: "\\boxed{" * 10_000),
        ("answer_tags", lambda: "<answer>" * 10_000 + "1" + "</answer>" * 10_000),
        ("plus_chain", lambda: "1+" * 200_000 + "1"),
        ("minus_run", lambda: "-" * 500_000 + "1"),
        ("hashes", lambda: "#### " + "9" * 100_000),
        ("newlines", lambda: "\n" * 1_000_000),
        ("numbers", lambda: " ".join(["12345"] * 150_000)),
    )


_INSERTS = (
    "**", "^", "\\frac", "</answer>", "<answer>", "\\boxed{", "####", "e", "j", "i", "x", "-", ".", ",", "(",
    ")", "[", "]", "{", "}", "$", " ", "\n", "\u2212", "\uff11", "\u00b2", "\u200b", "\x00", "\ufeff", "nan",
    "inf", "1e308", "/0", "%",
)  # fmt: skip
_NUMBER = re.compile(r"\d+")


def _mutate(rng: random.Random, s: str, other: str) -> str:
    """One to three edits of ``s``: flips, inserts, deletions, repeats, a number moved, a splice, a wrap."""
    for _ in range(rng.randint(1, 3)):
        n = len(s)
        op = rng.randrange(9)
        i = rng.randint(0, n)
        j = rng.randint(i, min(n, i + 1 + rng.randrange(8)))
        if op == 0 and n:
            s = s[:i] + chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)])) + s[i + 1 :]
        elif op == 1:
            s = s[:i] + rng.choice(_INSERTS) + s[i:]
        elif op == 2:
            s = s[:i] + s[j:]
        elif op == 3:
            s = s[:j] + s[i:j] * rng.randint(1, 4) + s[j:]
        elif op == 4:
            s = _NUMBER.sub(lambda m: str(int(m.group()) + rng.choice([-1, 1, 10, -100])), s, count=1)
        elif op == 5:
            s = s[:i] + other[: rng.randint(0, len(other))] + s[i:]
        elif op == 6:
            s = s.swapcase() if rng.random() < 0.5 else s[::-1]
        elif op == 7:
            s = s[:i]
        else:
            s = _wrap(rng.choice(WRAPPERS), s)
    return s


def _unicode(rng: random.Random, solution: str) -> str:
    r = rng.randrange(6)
    if r == 0:
        return rng.randbytes(rng.randint(1, 64)).decode("utf-8", "surrogateescape")
    if r == 1:
        i = rng.randint(0, len(solution))
        return solution[:i] + rng.choice(["\ud800", "\udfff", "\udc80", "\ud83d"]) + solution[i:]
    if r == 2:
        digits = rng.choice(["\uff10", "\u0660", "\u0966", "\U0001d7ce"])  # fullwidth, Arabic-Indic, ...
        return "".join(chr(ord(digits) + int(c)) if c.isdigit() else c for c in solution)
    if r == 3:
        return rng.choice(["\u202e", "\u200d", "\u0301", "\x00", "\ufeff", "\uffff", "\U0001f600"]).join(
            solution
        )
    if r == 4:
        raw = solution.encode() + rng.choice(
            [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"]
        )
        return raw.decode("utf-8", "surrogateescape")
    return rng.randbytes(rng.randint(1, 16)).decode("latin-1")


@dataclasses.dataclass(frozen=True)
class RewardCase:
    """One answer for one scorer. ``trusted``: text this target wrote from the task's own solutions (an
    honest or a wrong answer, never hostile), which the task's reward function may score in this process."""

    scorer: str
    family: str
    prompt: str
    completion: str
    reference: str
    trusted: bool = False


# Fixed first inputs of every run (scorers absent from the tree are passed over): a bomb, a refused process,
# code for the guards, a connection, the sandbox's size cap, a patched scorer then a wrong answer to it.
PRELUDE = (
    ("hostile:evaluates", "bomb", "9**9**9**9"),
    ("hostile:sympy_parses", "code", "preview(x)"),
    ("hostile:evaluates", "code", CODE[0]),
    ("hostile:evaluates", "socket", _CONNECT),
    ("hostile:sympy_parses", "code", _lambdify(_fork_exec(["/usr/bin/touch", "{CANARY}"]))),
    ("hostile:sympy_parses", "socket", SOCKET[3]),
    ("gsm8k", "size", "\\boxed{" * 10_000),
    ("arithmetic_exact", "size", "A" * 10_000_000),
    ("hostile:sympy_parses", "code", _PERSIST),
    ("hostile:sympy_parses", "wrong", "not the answer"),
)


@dataclasses.dataclass
class _Scorer:
    spec: ScorerSpec
    task: Task
    box: RewardSandbox
    examples: list
    start_s: float
    counts: dict = dataclasses.field(default_factory=dict)
    expected: dict = dataclasses.field(default_factory=dict)  # (prompt, completion, reference) -> reward

    def __post_init__(self) -> None:
        keys = ("inputs", "honest", "scored", "timeouts", "crashes", "errors", "blocked", "oversize")
        more = ("restarts", "rebuilds", "honest_to", "max_s", "restart_s", "start_s")
        self.counts = {k: 0 for k in (*keys, *more)}
        self.counts["start_s"] = self.start_s


def _build(s: ScorerSpec, seed: int) -> _Scorer:
    """The task here (prompts, references, the in-process reward for honest answers) and its sandbox."""
    from heterorl.peer.tasks.registry import get_task
    from heterorl.peer.tasks.sandbox import RewardSandbox, SandboxLimits

    last: Exception | None = None
    for spec in (s.spec, *s.alternatives):
        try:
            task = get_task(spec.name, allow_rewards=spec.allow_rewards, data=spec.data, **dict(spec.params))
        except ValueError as e:
            last = e
            continue
        rng = random.Random(f"heterorl-fuzz-rewards:{seed}:{s.name}")
        examples = list({ex.prompt: ex for ex in (task.sample(rng) for _ in range(EXAMPLES))}.values())
        t0 = time.monotonic()
        box = RewardSandbox(spec, SandboxLimits(time_s=LIMIT_S, memory_mb=MEMORY_MB, start_s=START_S))
        task.scorer = box
        return _Scorer(dataclasses.replace(s, spec=spec), task, box, examples, time.monotonic() - t0)
    raise ValueError(f"{s.name}: cannot build {s.spec.name!r} with {dict(s.spec.params)}: {last}")


class RewardTarget(_Target):
    """Hostile answers at every reward scorer through its sandbox (see the module docstring)."""

    name = "rewards"
    hang_s = math.inf  # judged per call by the oracle: the sandbox's limit plus SLACK_S
    abort_s = START_S + LIMIT_S + 30.0  # a restart and an answer: past that the parent itself is stuck

    def __init__(self, h: _Harness):
        super().__init__(h)
        # each timeout and refusal is logged, and math-verify warns that its own timeouts are off: quiet
        self._logs = {n: logging.getLogger(n) for n in ("heterorl.rewards", "math_verify")}
        self._log_levels = {n: log.level for n, log in self._logs.items()}
        for log in self._logs.values():
            log.setLevel(logging.ERROR)
        self.dir = tempfile.mkdtemp(prefix="heterorl-fuzz-rewards-")
        self.canary = os.path.join(self.dir, "CANARY")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self._baseline = set(_children(os.getpid()))  # processes that are not reward workers
        self._reported: set[int] = set()
        self.skipped: dict[str, str] = {}
        self.scorers: dict[str, _Scorer] = {}
        self._previous = "-"
        self._pool: ThreadPoolExecutor | None = None
        try:
            self._build_all(h.seed)
        except BaseException:
            self.close()
            raise
        self.names = list(self.scorers)
        self._prelude = [
            RewardCase(n, fam, ex.prompt, text, ex.reference, trusted=fam == "wrong")
            for n, fam, text in PRELUDE
            if n in self.scorers
            for ex in self.scorers[n].examples[:1]
        ]
        self._sizes = _sizes()

    def _build_all(self, seed: int) -> None:
        # The workers' starts wait on imports: overlap them. The pool's threads live until close(): a worker
        # dies with the thread that started it (PR_SET_PDEATHSIG follows the thread, not the process).
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward-fuzz-start")
        specs = scorer_specs()
        self.skipped.update({s.name: s.skip for s in specs if s.skip})
        futures = [(s, self._pool.submit(_build, s, seed)) for s in specs if not s.skip]
        errors = []
        for s, fut in futures:
            try:
                self.scorers[s.name] = fut.result()
            except Exception as e:
                if s.optional:
                    self.skipped[s.name] = f"{type(e).__name__}: {e}"[:300]
                else:
                    errors.append(f"{s.name}: {type(e).__name__}: {e}")
        if errors:
            raise RuntimeError("reward fuzz target: cannot build " + "; ".join(errors))

    # -------------------------------------------------------------------------------------- inputs
    def generate(self, rng: random.Random) -> RewardCase:
        if self._prelude:
            return self._prelude.pop(0)
        sc = self.scorers[rng.choice(self.names)]
        ex = rng.choice(sc.examples)
        fam = _pick(rng, COSTLY_BOMB_SCALE if sc.spec.costly else 1.0)
        prompt, reference, trusted = ex.prompt, ex.reference, False
        if fam == "honest":
            text, trusted = _wrap(rng.choice(WRAPPERS), ex.solution), True
        elif fam == "wrong":
            text, trusted = _wrap(rng.choice(WRAPPERS), rng.choice(_WRONG)), True
        elif fam == "mutated":
            other = rng.choice(sc.examples)
            r = rng.random()
            text = _mutate(rng, rng.choice([ex.solution, ex.reference, ex.prompt]), other.solution)
            if r < 0.15:
                prompt, text = _mutate(rng, ex.prompt, other.prompt), ex.solution
            elif r < 0.25:
                reference = _mutate(rng, ex.reference, other.reference)
            elif r < 0.3:
                prompt = other.prompt
        elif fam == "code":
            text = _wrap(self._wrapper(rng, sc), rng.choice(CODE))
        elif fam == "socket":
            text = _wrap(self._wrapper(rng, sc), rng.choice(SOCKET))
        elif fam == "bomb":  # mostly those that this scorer's parser reaches
            tex = rng.random() < {"latex": 0.8, "text": 0.5}.get(sc.spec.kind, 0.2)
            text = _wrap(self._wrapper(rng, sc), rng.choice(TEX_BOMBS if tex else PY_BOMBS))
        elif fam == "size":
            name, build = rng.choice(self._sizes)
            text = build()
            if rng.random() < 0.1:  # a prompt that size, the task's own answer
                prompt, text = text, ex.solution
        else:
            text = _unicode(rng, ex.solution)
        return RewardCase(sc.spec.name, fam, prompt, text, reference, trusted)

    @staticmethod
    def _wrapper(rng: random.Random, sc: _Scorer) -> str:
        return sc.spec.wrapper if rng.random() < 0.6 else rng.choice(WRAPPERS)

    def strategy(self) -> Any:
        from hypothesis import strategies as st

        cheap = st.sampled_from(CODE + SOCKET)
        text = st.one_of(
            st.text(max_size=200),
            st.binary(max_size=200).map(lambda b: b.decode("utf-8", "surrogateescape")),
            cheap,
            st.from_regex(r"-?\d{1,12}(\.\d{1,6})?", fullmatch=True),
        )

        def build(args: tuple) -> RewardCase:
            name, i, wrapper, body = args
            ex = self.scorers[name].examples[i % len(self.scorers[name].examples)]
            return RewardCase(name, "hypothesis", ex.prompt, _wrap(wrapper, body), ex.reference)

        return st.tuples(
            st.sampled_from(self.names), st.integers(0, EXAMPLES), st.sampled_from(WRAPPERS), text
        ).map(build)

    def describe(self, case: RewardCase) -> tuple[bytes, dict]:
        side = hashlib.sha256(f"{case.prompt}\0{case.reference}".encode("utf-8", "surrogatepass")).hexdigest()
        blob = case.completion.encode("utf-8", "surrogatepass")
        return blob, {"scorer": case.scorer, "family": case.family, "prompt_reference": side[:16]}

    # ------------------------------------------------------------------------------------- running
    def _fill(self, text: str) -> str:
        return text.replace("{CANARY}", self.canary).replace("{PORT}", str(self.port))

    def execute(self, case: RewardCase) -> _Outcome:
        sc = self.scorers[case.scorer]
        prompt, completion, reference = (
            self._fill(t) for t in (case.prompt, case.completion, case.reference)
        )
        expected = self._expected(sc, prompt, completion, reference) if case.trusted else None
        before = sc.box.stats()
        try:
            _, value, dt = _call(sc.task.reward, prompt, completion, reference, allowed=())
        except _Hang:  # interrupted mid-answer, this worker would answer the next request with this reply
            self._rebuild(sc)
            raise
        after = sc.box.stats()
        d = {k: after[k] - before[k] for k in _STATS}
        c = sc.counts
        c["inputs"] += 1
        c["honest"] += case.trusted
        c["scored"] += value > 0
        for k in ("timeouts", "crashes", "errors", "blocked", "oversize", "restarts"):
            c[k] += d[k]
        c["max_s"] = max(c["max_s"], dt)
        name = sc.spec.name
        violation = self._escaped(f"{name} {case.family} {_short(completion, 80)}")
        limit = LIMIT_S + SLACK_S + (START_S if d["restarts"] else 0.0)
        if violation is None and not (isinstance(value, float) and 0.0 <= value <= 1.0):
            violation = ("wrong_result", f"{name}: reward outside [0, 1]", repr(value))
        if violation is None and dt > limit:
            violation = ("hangs", f"{name}: past the sandbox's limit", f"{dt:.2f} s > {limit:.2f} s")
        if expected is not None:
            if d["timeouts"]:
                c["honest_to"] += 1
            elif violation is None and abs(value - expected) > 1e-9:
                violation = (
                    "wrong_result",
                    f"{name}: an honest answer scored otherwise in the sandbox",
                    f"{value!r} in the sandbox, {expected!r} in process",
                )
        if violation is not None and violation[0] == "wrong_result" and c["rebuilds"] < MAX_REBUILDS:
            # the worker may be subverted (a patched scorer passes every later answer): go on with a fresh
            # one, so that later inputs test the sandbox rather than what an earlier answer made of it
            self._rebuild(sc)
        elif d["timeouts"] or d["crashes"] or d["blocked"]:
            violation = violation or self._restart(sc)
        return _Outcome(value > 0, dt, violation)

    def _expected(self, sc: _Scorer, prompt: str, completion: str, reference: str) -> float:
        """The task's reward function on our own honest text, in this process (cached)."""
        key = (prompt, completion, reference)
        if key not in sc.expected:
            with _alarm_kept():  # math_verify times itself with signal.alarm: the harness's abort stays armed
                try:
                    v = float(sc.task.reward_fn(prompt, completion, reference))
                except Exception:  # the sandbox scores a scorer's exception 0
                    v = 0.0
            sc.expected[key] = v if math.isfinite(v) and 0.0 <= v <= 1.0 else 0.0
        return sc.expected[key]

    def _restart(self, sc: _Scorer) -> tuple[str, str, str] | None:
        """The worker is gone: start the next one now, timed apart, on the task's own solution."""
        ex = sc.examples[0]
        expected = self._expected(sc, ex.prompt, ex.solution, ex.reference)
        before = sc.box.stats()
        t0 = time.monotonic()
        try:
            value = sc.task.reward(ex.prompt, ex.solution, ex.reference)
        except _Hang:
            self._rebuild(sc)
            raise
        except Exception as e:
            return ("wrong_result", f"{sc.spec.name}: a restarted worker raised", f"{type(e).__name__}: {e}")
        dt = time.monotonic() - t0
        after = sc.box.stats()
        sc.counts["restarts"] += after["restarts"] - before["restarts"]
        sc.counts["restart_s"] = max(sc.counts["restart_s"], dt)
        if after["timeouts"] > before["timeouts"]:
            sc.counts["honest_to"] += 1
            return None
        if after["crashes"] > before["crashes"]:
            return ("wrong_result", f"{sc.spec.name}: the worker did not restart", str(after))
        if abs(value - expected) > 1e-9:
            return (
                "wrong_result",
                f"{sc.spec.name}: a restarted worker scored the task's solution otherwise",
                f"{value!r} in the sandbox, {expected!r} in process",
            )
        return None

    def _rebuild(self, sc: _Scorer) -> None:
        """A new sandbox for ``sc`` (the old one's workers killed), its start timed as a restart."""
        from heterorl.peer.tasks.sandbox import RewardSandbox

        sc.box.close()
        t0 = time.monotonic()
        sc.box = RewardSandbox(sc.box.spec, sc.box.limits)
        sc.task.scorer = sc.box
        sc.counts["rebuilds"] += 1
        sc.counts["restart_s"] = max(sc.counts["restart_s"], time.monotonic() - t0)

    def _escaped(self, last: str) -> tuple[str, str, str] | None:
        """A file in the canary directory, a connection to the listener, a process a worker started (a
        zombie until its worker reaps it or dies: seen even when it has exited). ``last``: this input."""
        found = []
        names = os.listdir(self.dir)
        if names:
            found.append(f"file(s) {sorted(names)} appeared in the canary directory")
            for n in names:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.dir, n))
        with contextlib.suppress(BlockingIOError):
            while True:
                conn, addr = self.listener.accept()
                conn.settimeout(0.2)
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                conn.close()
                found.append(f"a connection from {addr} ({data!r})")
        workers = set(_children(os.getpid())) - self._baseline
        procs = [(p, comm) for p, comm in _children(*workers).items() if p not in self._reported]
        if procs:
            self._reported.update(p for p, _ in procs)
            found.append(f"process(es) started by a reward worker: {procs}")
        previous, self._previous = self._previous, last
        if not found:
            return None
        what = found[0].split(" ")[0]
        return ("escaped", what, "; ".join(found) + f" (after this input, or the one before: {previous})")

    # ------------------------------------------------------------------------------------- report
    def details(self) -> dict:
        time.sleep(0.5)  # a process an answer started late gets its chance to show
        late = self._escaped("(after the last input)")
        scorers = {
            name: {k: round(v, 3) if isinstance(v, float) else v for k, v in sc.counts.items()}
            for name, sc in self.scorers.items()
        }
        keys = ("inputs", "timeouts", "crashes", "errors", "blocked", "oversize", "restarts", "rebuilds")
        totals = {k: sum(r[k] for r in scorers.values()) for k in keys}
        totals["max_s"] = max((r["max_s"] for r in scorers.values()), default=0.0)
        totals["restart_s"] = max((r["restart_s"] for r in scorers.values()), default=0.0)
        return {
            "scorers": scorers,
            "totals": totals,
            "limits": {"time_s": LIMIT_S, "slack_s": SLACK_S, "memory_mb": MEMORY_MB, "start_s": START_S},
            "skipped": self.skipped,
            "escaped_after_last_input": [late[2]] if late else [],
        }

    def close(self) -> None:
        for sc in self.scorers.values():
            sc.box.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        for n, log in self._logs.items():
            log.setLevel(self._log_levels[n])


def _pick(rng: random.Random, bomb_scale: float) -> str:
    shares = dict(FAMILY_SHARES)
    shares["bomb"] *= bomb_scale
    r = rng.random() * sum(shares.values())
    for fam, w in shares.items():
        r -= w
        if r < 0:
            return fam
    return "honest"


def _children(*parents: int) -> dict[int, str]:
    """{pid: command} of the processes whose parent is one of ``parents`` (from /proc; empty elsewhere)."""
    if not parents:
        return {}
    want, out = set(parents), {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        close = stat.rfind(b")")
        fields = stat[close + 2 :].split()
        if len(fields) > 1 and int(fields[1]) in want:
            out[int(e)] = stat[stat.find(b"(") + 1 : close].decode(errors="replace")
    return out


@contextlib.contextmanager
def _alarm_kept():
    """Restore SIGALRM's handler and the real-time timer after code that uses them itself."""
    handler = signal.getsignal(signal.SIGALRM)
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    t0 = time.monotonic()
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, TypeError):  # not the main thread / no handler to restore
            signal.signal(signal.SIGALRM, handler)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, left - (time.monotonic() - t0)))
