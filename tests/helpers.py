"""Shared test helpers: relative errors and the "no worse than PyTorch" accuracy check.

Import from test modules as ``from helpers import ...`` (pytest puts ``tests/`` on sys.path).

The accuracy rule of the library: against a float64 reference, our result in
a given dtype must be no worse than PyTorch's own result in that dtype, up to a factor 1.5,
plus a small floor for results that PyTorch happens to get (nearly) exact.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

_TRUE_STRINGS = ("1", "true", "on", "yes")


def triton_interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to run kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_STRINGS


def can_run_triton() -> bool:
    """Whether Triton kernels can run here: a CUDA device, or the CPU interpreter."""
    return torch.cuda.is_available() or triton_interpreter_enabled()


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
    """
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
