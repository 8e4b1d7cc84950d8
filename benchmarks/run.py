#!/usr/bin/env python
"""Benchmark runner: ``python benchmarks/run.py [SUITE] [options]`` (SUITE defaults to lm-head)
from the repository root (``make bench`` does); ``benchmarks/README.md`` has the rest."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

# ``python benchmarks/run.py`` puts benchmarks/ on sys.path, not the repository root.
REPO_ROOT = str(Path(__file__).resolve().parents[1])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.suites import DEFAULT_SUITE, SUITES  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description=f"fusedloss benchmarks (suite defaults to {DEFAULT_SUITE}).",
    )
    subparsers = parser.add_subparsers(dest="suite", metavar="SUITE")
    for suite in SUITES.values():
        suite.add_arguments(subparsers.add_parser(suite.name, help=suite.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, DEFAULT_SUITE)
    args = build_parser().parse_args(args_list)
    return SUITES[args.suite].run(args)


if __name__ == "__main__":
    sys.exit(main())
