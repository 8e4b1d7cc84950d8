"""Benchmark suites. Each module defines a :class:`Suite` and is registered in ``SUITES``.

Adding a suite: write ``benchmarks/suites/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> exit code``, wrap them in a ``Suite``, and add it to ``SUITES`` below.
"""

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

    suites = (lm_head.SUITE, contrastive.SUITE, ring.SUITE, vocab_parallel.SUITE, train.SUITE,
              grad_cache.SUITE, companions.SUITE, sizes.SUITE, post_training.SUITE,
              retrieval.SUITE)
    return {suite.name: suite for suite in suites}


SUITES: dict[str, Suite] = _registry()
DEFAULT_SUITE = "lm-head"
