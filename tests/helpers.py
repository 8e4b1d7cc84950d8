"""Shared test helpers: relative errors, the "no worse than PyTorch" accuracy check, and
what the benchmark runner's tests share.

Import from test modules as ``from helpers import ...`` (pytest puts ``tests/`` on sys.path).

The accuracy rule of the library: against a float64 reference, our result in
a given dtype must be no worse than PyTorch's own result in that dtype, up to a factor 1.5,
plus a small floor for results that PyTorch happens to get (nearly) exact.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import note
from hypothesis.control import currently_in_test_context
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parents[1]
_TRUE_STRINGS = ("1", "true", "on", "yes")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def triton_interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to run kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_STRINGS


def can_run_triton() -> bool:
    """Whether Triton kernels can run here: a CUDA device, or the CPU interpreter."""
    return torch.cuda.is_available() or triton_interpreter_enabled()


# Where the tests put their tensors, and the mark of tests that run Triton kernels.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
requires_triton = pytest.mark.skipif(
    not can_run_triton(),
    reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1 (set before triton is "
    "imported; `make pytest` exports it on CPU machines)",
)


def _gluon_gpu() -> bool:
    from fusedloss.core import config

    return torch.cuda.is_available() and config.gluon_enabled(torch.device("cuda"))


# The Hopper Gluon kernels' tests: Gluon does not run under Triton's interpreter.
requires_sm90 = pytest.mark.skipif(not _gluon_gpu(), reason="needs an sm90 GPU and Triton's Gluon")


def rel_err(x: Tensor, ref: Tensor) -> float:
    """Relative L2 error ``‖x − ref‖ / ‖ref‖``, computed in float64.

    0 when both are zero; inf when only ``ref`` is zero; NaN when ``x`` is not finite.
    """
    x64 = x.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    if x64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: {tuple(x64.shape)} vs reference {tuple(ref64.shape)}")
    diff = torch.linalg.vector_norm(x64 - ref64).item()
    scale = torch.linalg.vector_norm(ref64).item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def default_floor(x: Tensor) -> float:
    """Default error floor of ``assert_close_to_ref``: ``4 * eps(x.dtype) / sqrt(x.numel())``.

    That is the relative L2 error of one element off by 4 ulps in a tensor of equal-magnitude
    entries: 4 ulps for a scalar, vanishing for a large gradient. It only forgives a PyTorch
    result that happens to be (nearly) exact. A flat ``4 * eps`` would be 3.1e-2 in bfloat16,
    looser than the bad gradients (errors 2e-2 and 3.5e-3, ten times PyTorch's) that the rule
    exists to catch.
    """
    return 4.0 * torch.finfo(x.dtype).eps / max(x.numel(), 1) ** 0.5


def assert_close_to_ref(
    ours: Tensor,
    torch_same_dtype: Tensor,
    ref: Tensor,
    *,
    factor: float = 1.5,
    floor: float | None = None,
    name: str = "result",
) -> None:
    """Assert ``rel_err(ours, ref) <= factor * rel_err(torch_same_dtype, ref) + floor``.

    ``ours`` and ``torch_same_dtype`` are the same quantity computed by our kernel and by plain
    PyTorch in the same (low) precision; ``ref`` is the float64 reference. ``floor`` defaults
    to ``default_floor(ours)``; pass one explicitly where that is too strict or too loose.
    A reference whose norm is below the dtype's smallest normal number is held to an absolute
    error of that number instead.
    """
    tiny = torch.finfo(ours.dtype).tiny
    if torch.linalg.vector_norm(ref.detach().double().cpu()).item() < tiny:
        # A result below the dtype's smallest normal number (a SigLIP loss of 3e-42 for one
        # pair that matches at scale 100): the GPU kernels flush subnormal values to zero
        # (Triton builds libdevice's exp and log1p with FTZ), so only an absolute bound holds.
        diff = torch.linalg.vector_norm((ours.detach().double() - ref.detach().double()).cpu())
        assert diff.item() <= tiny, f"{name}: error {diff.item():.3e} on a subnormal result"
        return
    if floor is None:
        floor = default_floor(ours)
    ours_err = rel_err(ours, ref)
    torch_err = rel_err(torch_same_dtype, ref)
    bound = factor * torch_err + floor
    assert ours_err <= bound, (
        f"{name}: relative error {ours_err:.3e} exceeds bound {bound:.3e} = "
        f"{factor} x torch's {torch_err:.3e} (same dtype {torch_same_dtype.dtype}) "
        f"+ floor {floor:.3e}"
    )


# ----------------------------------------------------------------------------- benchmark tests


def launches_of(monkeypatch, module: ModuleType, name: str) -> list:
    """The grids of every launch of the Triton kernel ``module.name`` from now on (a spy set in
    its place: every launch through the JIT passes its ``__getitem__``)."""
    kernel, grids = getattr(module, name), []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

        def __getattr__(self, attribute):
            return getattr(kernel, attribute)

    monkeypatch.setattr(module, name, Spy())
    return grids


def import_benchmarks(*names: str) -> list[ModuleType]:
    """The modules ``benchmarks.<name>`` for ``names``.

    benchmarks/ is not part of the installed package: it becomes importable once the
    repository root is on sys.path, as ``python benchmarks/run.py`` arranges for itself.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return [importlib.import_module(f"benchmarks.{name}") for name in names]


def read_results(directory: Path, pattern: str) -> tuple[dict[str, Any], str]:
    """The JSON data and the markdown of the one results pair ``<pattern>.json`` / ``.md``
    that a benchmark run wrote to ``directory``."""
    (json_path,) = directory.glob(f"{pattern}.json")
    (md_path,) = directory.glob(f"{pattern}.md")
    return json.loads(json_path.read_text(encoding="utf-8")), md_path.read_text(encoding="utf-8")


def note_case(text: str) -> None:
    """Records text in hypothesis's report of a failing example; a no-op outside one."""
    if currently_in_test_context():
        note(text)


def run_on_cpu_without_interpreter(script: str) -> str:
    """Runs ``script`` (dedented) in a fresh Python with TRITON_INTERPRET unset and no GPU
    visible, and returns its stdout (the variable must be unset before triton is imported)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU machine must not rescue the CPU tensors
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


@contextlib.contextmanager
def counting_training_path(function: str, rows: int | None = None) -> Iterator[list]:
    """Counts the calls of ``fusedloss.core.chunked_logits.<function>`` within the block (a
    list that grows by one per call), the LM head's training path running in chunks of
    ``rows`` rows, its gradient formed in the forward (None: the policies',
    ``config.lm_head_chunk_rows`` and ``config.lm_head_deferred``: a few rows call
    ``loss_and_grads`` twice, the forward for the loss and the backward for the gradients)."""
    from fusedloss.core import chunked_logits, config

    calls = []
    original = getattr(chunked_logits, function)
    policies = config.lm_head_chunk_rows, config.lm_head_deferred

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(chunked_logits, function, counted)
    if rows is not None:
        config.lm_head_chunk_rows = lambda n, v, element_size: rows
        config.lm_head_deferred = lambda n, v, element_size: False
    try:
        yield calls
    finally:
        setattr(chunked_logits, function, original)
        config.lm_head_chunk_rows, config.lm_head_deferred = policies
