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


# ------------------------------------------------------------------------- launch (any kernel)

@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_launch_equals_the_jit_for_every_specialization(dtype):
    """Launches of one kernel whose arguments differ in what Triton specializes on (an
    address off 16 bytes, a length of 1, a multiple of 16 or neither, the dtype, a
    compile-time block) each give what the kernel computes: none reuses a kernel compiled
    for other assumptions."""
    from fusedloss.core.launch import launch

    torch.manual_seed(0)
    base_x = torch.randn(300, device=DEVICE).to(dtype)
    base_y = torch.randn(300, device=DEVICE).to(dtype)
    for offset, n, block, alpha in [(0, 256, 64, 2.0), (1, 256, 64, 2.0), (0, 1, 64, -1.0),
                                    (0, 77, 64, 0.5), (3, 77, 32, 0.5), (0, 256, 64, 3.0),
                                    (1, 1, 32, 1.5), (0, 200, 128, 2.0)]:
        x, y = base_x[offset:offset + n], base_y[offset:offset + n]
        for _ in range(2):  # the second launch of a specialization goes through its launcher
            out = torch.full((n,), float("nan"), device=DEVICE, dtype=dtype)
            launch(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, alpha, n, BLOCK=block,
                   num_warps=1)
            # (to one rounding of the output: the kernel may fuse a multiply-add)
            expected = alpha * x.float() + y.float()
            tol = 2**-9 if dtype == torch.float16 else 2**-20
            torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)


@requires_cuda
def test_launch_goes_through_the_jit_once_per_specialization(monkeypatch):
    """The first launch of each specialization compiles through the JIT; every later one goes
    to the compiled kernel's launcher, and gives the same result."""
    from fusedloss.core import launch as launch_module

    jit_runs = []
    run = _axpy_kernel.run
    monkeypatch.setattr(_axpy_kernel, "run", lambda *a, **k: (jit_runs.append(1), run(*a, **k))[1])
    monkeypatch.setattr(launch_module, "_LAUNCHERS", {})
    x, y = torch.randn(300, device="cuda"), torch.randn(300, device="cuda")
    cases = [(0, 256, 64), (1, 256, 64), (0, 1, 64), (0, 77, 64), (3, 77, 32), (1, 1, 32)]
    for repeat in range(3):
        for offset, n, block in cases:
            out = torch.empty(n, device="cuda")
            launch_module.launch(_axpy_kernel, (triton.cdiv(n, block),), x[offset:],
                                 y[offset:], out, float(repeat), n, BLOCK=block, num_warps=1)
            torch.testing.assert_close(out, repeat * x[offset:offset + n] + y[offset:offset + n])
    assert len(jit_runs) == len(cases) == len(launch_module._LAUNCHERS)


def test_argument_keys_hold_what_triton_specializes_on():
    """The key of a runtime argument separates every property Triton specializes on (on the
    CPU: no kernel is launched)."""
    from fusedloss.core.launch import _argument_key

    def key(value):
        return _argument_key(value)[0]

    t = torch.zeros(64)
    assert key(t) != key(t[1:])  # 16-byte alignment
    assert key(t) != key(t.to(torch.bfloat16))  # dtype
    assert _argument_key(t)[1] == t.data_ptr()
    assert len({key(1), key(2), key(16), key(32), key(2**31), key(2**63)}) == 5
    assert key(16) == key(32) and key(3) == key(5)
    assert key(True) != key(1) and key(True) != key(False)
    assert key(1.0) == key(2.5) and key(1.0) != key(1)
    assert key(None) == ("none",)
