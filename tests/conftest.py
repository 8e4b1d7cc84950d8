"""Test-suite configuration: hypothesis profiles and shared fixtures.

Hypothesis profiles, chosen by the environment variable ``FUSEDLOSS_HYPOTHESIS_PROFILE``:

- ``ci``  (default without CUDA): few examples, derandomized so a CI run is reproducible.
  Kernels run on Triton's CPU interpreter there, which is slow.
- ``gpu`` (default with CUDA): four times as many examples, random ones, so that successive
  runs cover different cases; the whole suite stays within about 15 minutes of one GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import can_run_triton
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "gpu",
    max_examples=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

HYPOTHESIS_PROFILE = os.environ.get(
    "FUSEDLOSS_HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "ci"
)
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"fusedloss: hypothesis profile {HYPOTHESIS_PROFILE!r}, "
        f"cuda={torch.cuda.is_available()}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}, "
        f"triton kernels runnable={can_run_triton()}"
    ]


@pytest.fixture
def device() -> str:
    """The device tests put tensors on: "cuda" when available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_available() -> bool:
    """Whether Triton kernels can run: a CUDA device, or ``TRITON_INTERPRET=1``."""
    return can_run_triton()


@pytest.fixture
def tune(monkeypatch):
    """``tune(**fields)``: the library's tuning (``fusedloss.core.config.Tuning``) with these
    fields for the rest of the test."""
    import dataclasses

    from fusedloss.core import config

    def apply(**changes):
        monkeypatch.setattr(config, "_TUNING", dataclasses.replace(config.tuning(), **changes))

    return apply


@pytest.fixture
def requires_triton() -> None:
    """Skip the requesting test when Triton kernels cannot run here."""
    if not can_run_triton():
        pytest.skip("Triton kernels need a CUDA device or TRITON_INTERPRET=1")


def _worker_groups(backend: str):
    """A ``get(world)`` that starts (once) and returns ``workers.Workers`` of that size."""
    from workers import Workers

    made: dict = {}

    def get(world: int):
        if world not in made or not made[world].alive:
            made[world] = Workers(world, backend=backend)
        return made[world]

    yield get
    for w in made.values():
        w.close()


@pytest.fixture(scope="session")
def workers():
    """``workers(world)``: processes in a gloo process group of that size, started once per
    test session (``workers.Workers``)."""
    yield from _worker_groups("gloo")


@pytest.fixture(scope="session")
def nccl_workers():
    """``nccl_workers(world)``: processes in an NCCL process group, one GPU each."""
    yield from _worker_groups("nccl")
