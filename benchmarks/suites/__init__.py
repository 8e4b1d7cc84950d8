"""Benchmark suites: each module defines ``SUITE``, a :class:`Suite` (``add_arguments(parser)``,
``run(args) -> exit code``), registered in ``SUITES`` below."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    name: str  # command-line name, e.g. "lm-head"
    help: str  # one line for ``run.py --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


MODULES = ("lm_head", "contrastive", "ring", "vocab_parallel", "train", "grad_cache", "companions",
           "sizes", "post_training", "retrieval")
SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (importlib.import_module(f"benchmarks.suites.{m}").SUITE for m in MODULES)}
DEFAULT_SUITE = "lm-head"
