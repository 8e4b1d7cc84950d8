"""core/lse_backward.py ``_accumulate_split_kernel``: dA summed over slabs as a bf16 pair.

hi + lo += dX · B over a sequence of slabs must leave hi equal to the exact sum rounded once
to bf16 (what an fp32 accumulator rounded at the end gives, up to fp32's own rounding), and
hi + lo within ~2⁻¹⁵ of the sum, whatever the slabs' magnitudes and signs (cancellation).
"""

from __future__ import annotations

import torch
import triton
from helpers import DEVICE, requires_triton
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedloss.core import config
from fusedloss.core.lse_backward import _accumulate_split_kernel


def _accumulate(slabs, b, cfg):
    """Runs the kernel over ``slabs`` (list of (dX, first column)); returns (hi, lo)."""
    n, d = slabs[0][0].shape[0], b.shape[1]
    hi = torch.empty(n, d, dtype=torch.bfloat16, device=DEVICE)
    lo = torch.empty_like(hi)
    for k, (dx, c0) in enumerate(slabs):
        _accumulate_split_kernel[(triton.cdiv(n, cfg.block_m), triton.cdiv(d, cfg.block_d))](
            dx, b, None, None, hi, lo, n, d, dx.shape[1], c0, b.shape[0], dx.stride(0),
            b.stride(0), hi.stride(0), int(k == 0), BLOCK_M=cfg.block_m, BLOCK_D=cfg.block_d,
            BLOCK_K=cfg.block_k, DOT_FP32=config.interpreting(), PRECISION="ieee",
            USE_TMA=False, num_warps=cfg.num_warps)
    return hi, lo


@requires_triton
@settings(max_examples=20)  # each example is a few interpreter launches
@given(n=st.sampled_from([1, 7, 20]), d=st.sampled_from([1, 16, 20]),
       width=st.sampled_from([16, 32]), n_slabs=st.integers(1, 5),
       magnitudes=st.lists(st.sampled_from([1e-6, 1e-2, 1.0, 1e3]), min_size=5, max_size=5),
       seed=st.integers(0, 2**16))
def test_hi_is_the_sum_rounded_once(n, d, width, n_slabs, magnitudes, seed):
    gen = torch.Generator().manual_seed(seed)
    v = width * n_slabs - 5  # the last slab runs past B's end: those rows read as zero
    b = torch.randn(v, d, generator=gen).bfloat16()
    exact = torch.zeros(n, d, dtype=torch.float64)
    slabs = []
    for k in range(n_slabs):
        dx = (torch.randn(n, width, generator=gen) * magnitudes[k]).bfloat16()
        c0 = k * width
        rows = b[c0:c0 + width].double()
        exact += dx[:, : rows.shape[0]].double() @ rows
        slabs.append((dx.to(DEVICE), c0))
    cfg = config.split_accumulate_config(torch.device(DEVICE), d)
    hi, lo = (t.cpu() for t in _accumulate(slabs, b.to(DEVICE), cfg))
    scale = exact.abs().max().item() or 1.0
    # fp32 products and sums of bf16 inputs, rounded into the pair at each slab: ~2⁻¹⁷ of the
    # running sum per slab, far below bf16's 2⁻⁹.
    assert (hi.double() + lo.double() - exact).abs().max().item() <= 2.0**-14 * scale
    # hi is exact's rounding but where exact lies within the pair's own error of a midpoint
    # between two bf16 values (half an ulp from its rounding).
    pair_err = (hi.double() + lo.double() - exact).abs()
    rounded = exact.to(torch.bfloat16).double()
    half_ulp = torch.ldexp(torch.ones_like(rounded), torch.frexp(rounded).exponent - 9)
    near_midpoint = ((exact - rounded).abs() - half_ulp).abs() <= pair_err + 2.0**-24 * scale
    assert not ((hi.double() != rounded) & ~near_midpoint).any()


@requires_triton
def test_infinity_and_nan_pass_through():
    b = torch.ones(16, 4, dtype=torch.bfloat16, device=DEVICE)
    dx = torch.zeros(2, 16, dtype=torch.bfloat16, device=DEVICE)
    dx[0, 0], dx[1, 0] = float("inf"), float("nan")
    cfg = config.split_accumulate_config(torch.device(DEVICE), 4)
    hi, _ = _accumulate([(dx, 0)], b, cfg)
    assert torch.isinf(hi[0]).all() and torch.isnan(hi[1]).all()
