"""The command line: ``heterorl bench fuzz`` / ``python -m heterorl.bench.fuzz``. Parses the flags, runs
:func:`~heterorl.bench.fuzz.runner.run_fuzz` (or the atheris mode), prints the table, writes the JSON report.
Exit status: 0 pass, 1 a failure found, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from .config import ALL_TARGETS, DEFAULT_TARGETS
from .libfuzzer import atheris_main
from .runner import run_fuzz


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs in all (default 100000)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed: a run is deterministic for it")
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated subset of: {','.join(ALL_TARGETS)} (default: all but rewards)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the full report as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--hypothesis-share",
        type=float,
        default=0.2,
        help="share of each target's inputs drawn from hypothesis strategies (default 0.2)",
    )
    parser.add_argument(
        "--atheris",
        metavar="TARGET",
        help="instead: coverage-guided atheris/libFuzzer run of one target "
        "(needs `pip install atheris`; exits the process when done)",
    )
    parser.add_argument(
        "--libfuzzer",
        metavar="FLAGS",
        default="",
        help="with --atheris: extra libFuzzer flags in one string, e.g. '-max_len=4096 -jobs=2'",
    )


def run_from_args(args: argparse.Namespace) -> int:
    if getattr(args, "atheris", None):
        runs = [f"-runs={args.inputs}", f"-seed={args.seed + 1}"]
        return atheris_main([args.atheris, *runs, *shlex.split(args.libfuzzer)])
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in ALL_TARGETS]
    if unknown or not targets or args.inputs < 0 or not 0 <= args.hypothesis_share <= 1:
        print(
            f"error: --targets takes a comma-separated subset of {','.join(ALL_TARGETS)} "
            f"(got {args.targets!r}); --inputs >= 0; 0 <= --hypothesis-share <= 1",
            file=sys.stderr,
        )
        return 2
    report = run_fuzz(
        args.inputs, args.seed, targets, progress=not args.no_progress, hypothesis_share=args.hypothesis_share
    )
    print(report.format_table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
        print(f"report written to {args.json}")
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    package_doc = sys.modules[__package__].__doc__ or ""  # the fuzzer's own docstring, not this module's
    parser = argparse.ArgumentParser(prog="heterorl bench fuzz", description=package_doc.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
