"""Benchmark suites: each module defines a :class:`Suite` (``add_arguments(parser)``,
``run(args) -> exit code``), registered in ``SUITES`` below."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    name: str  # command-line name, e.g. "lm-head"
    help: str  # one line for ``run.py --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _registry() -> dict[str, Suite]:
    from benchmarks.suites import (
        companions,
        contrastive,
        grad_cache,
        lm_head,
        post_training,
        retrieval,
        ring,
        sizes,
        train,
        vocab_parallel,
    )

    suites = (lm_head, contrastive, ring, vocab_parallel, train, grad_cache, companions, sizes,
              post_training, retrieval)
    return {module.SUITE.name: module.SUITE for module in suites}


SUITES: dict[str, Suite] = _registry()
DEFAULT_SUITE = "lm-head"
