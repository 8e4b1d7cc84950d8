"""core/launch.py: repeated launches give what launches through the JIT give."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, requires_cuda, requires_triton

from fusedloss.core.launch import RepeatedLaunch


@triton.jit(do_not_specialize=["start"])
def _ramp_kernel(out_ptr, start, n, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    offs = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, OFFSET + offs.to(tl.float32), mask=offs < n)


@requires_triton
def test_changing_arguments_reach_the_kernel():
    n, block = 100, 16
    out = torch.full((n,), -1.0, device=DEVICE)
    launch = RepeatedLaunch(_ramp_kernel, dict(num_warps=1), out_ptr=out, start=0, n=n,
                            OFFSET=0.0, BLOCK=block)
    expected = torch.full((n,), -1.0)
    # Starts that are and are not multiples of 16 (1 included), and two compile-time offsets.
    for i, start in enumerate([0, 1, 17, 32, 50, 77, 96]):
        offset = 1000.0 * (i % 2)
        launch((1,), start=start, OFFSET=offset)
        stop = min(start + block, n)
        expected[start:stop] = offset + torch.arange(start, stop, dtype=torch.float32)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    if launch.direct:
        assert len(launch.compiled) == 2  # one compiled kernel per OFFSET


@requires_cuda
def test_a_specialized_scalar_may_not_change():
    out = torch.zeros(64, device="cuda")
    launch = RepeatedLaunch(_ramp_kernel, dict(num_warps=1), out_ptr=out, start=0, n=64,
                            OFFSET=0.0, BLOCK=16)
    with pytest.raises(ValueError, match="n is specialized on"):
        launch((1,), n=32)


@requires_cuda
def test_every_parameter_must_be_given():
    with pytest.raises(TypeError, match="missing"):
        RepeatedLaunch(_ramp_kernel, {}, out_ptr=torch.zeros(4, device="cuda"), start=0, n=4)


@requires_cuda
def test_launch_hooks_see_repeated_launches():
    """With a launch hook registered (a profiler's), every launch goes through Triton's own
    launch path, so the hook sees each one."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    out = torch.zeros(64, device="cuda")
    launch = RepeatedLaunch(_ramp_kernel, dict(num_warps=1), out_ptr=out, start=0, n=64,
                            OFFSET=0.0, BLOCK=16)
    launch((1,), start=0)  # compiles, through the JIT
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        for start in (16, 32, 48):
            launch((1,), start=start)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 3
    torch.testing.assert_close(out.cpu(), torch.arange(64, dtype=torch.float32), rtol=0, atol=0)
