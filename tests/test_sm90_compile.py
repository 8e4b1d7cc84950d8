"""The Hopper Gluon kernels compile for sm90 on any machine, without a GPU.

Gluon kernels do not run under Triton's interpreter, so the GPU tests
(``tests/test_sm90_forward.py``, ``tests/test_sm90_backward.py``,
``tests/test_sm90_siglip.py``) are the only ones that run them. Here the kernels are compiled
ahead of time for an sm90 target with the Triton at hand
(its ``GluonASTSource`` and the ptxas its wheel ships): a Triton that renamed or removed a
Gluon function, a layout the compiler rejects, or a shared-memory plan over Hopper's 227 KiB
fails on a CPU machine too. Skipped where this Triton cannot compile Gluon offline.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # an older Triton: nothing to compile offline with
    GluonASTSource = TensorDescriptor = None

pytestmark = [
    pytest.mark.slow,  # ~20 s of compiling
    # A Triton whose descriptors cannot name their type in a signature (3.6's) would type them
    # as integers here; on such a GPU machine the sm90 tests compile and run the kernels.
    pytest.mark.skipif(GluonASTSource is None or not hasattr(TensorDescriptor, "__mangle__"),
                       reason="this Triton cannot compile Gluon kernels offline"),
]

HOPPER_SHARED_BYTES = 227 * 1024


def _type(value) -> str:
    """The kernel signature's type of one argument value."""
    if isinstance(value, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                      torch.int64: "i64", torch.uint8: "u8"}[value.dtype]
    if hasattr(value, "__mangle__"):  # a TMA descriptor
        return value.__mangle__()
    return "fp32" if isinstance(value, float) else "i32"


def _compile(kernel, args, constants, **options):
    """Compiles ``kernel`` for sm90: ``args`` its runtime arguments in order, ``constants``
    its constexpr ones by name."""
    names = kernel.arg_names
    runtime = iter(args)
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params, strict=True)):
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        else:
            signature[name] = _type(next(runtime))
    import triton
    from triton.backends.compiler import GPUTarget

    source = GluonASTSource(kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128), options=options)


def _operands(d, dtype=torch.bfloat16, n=4096):
    from fusedloss.core import lse_forward_sm90 as fwd

    a, b = torch.empty(n, d, dtype=dtype), torch.empty(n, d, dtype=dtype)
    return fwd.descriptor(a, fwd.BLOCK_M), fwd.descriptor(b, fwd.BLOCK_N), a


def _constants(d, stages, **flags):
    from fusedloss.core import lse_forward_sm90 as fwd

    return dict(flags, BLOCK_M=fwd.BLOCK_M, BLOCK_N=fwd.BLOCK_N, BLOCK_K=fwd.BLOCK_K,
                K_TILES=d // fwd.BLOCK_K, STAGES=stages, CONSUMER_REGS=fwd.CONSUMER_REGS)


def compile_forward(d: int, col_stats: bool = True, diag_mask: bool = False) -> None:
    from fusedloss.core import lse_forward_sm90 as fwd

    a_desc, b_desc, _ = _operands(d)
    f32, i64 = torch.empty(1), torch.empty(1, dtype=torch.int64)
    kernel = _compile(
        fwd._forward_sm90_kernel,
        [a_desc, b_desc, f32, f32, i64, *[f32] * 6, 4096, 4096, 8, 4, 32],
        _constants(d, fwd.stages(d, 2), HAS_BIAS=True, HAS_SCALE=True, RECORD_TILES=True,
                   COL_STATS=col_stats, DIAG_MASK=diag_mask, STREAM_A=fwd.streams_a(d)),
        num_warps=fwd.WARPS, maxnreg=fwd.MAX_REGS)
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, kernel.metadata.shared


def compile_recompute(diag_mask: bool, d: int) -> None:
    from fusedloss.core import lse_backward_sm90 as bwd
    from fusedloss.core import lse_forward_sm90 as fwd

    a_desc, b_desc, a = _operands(d, torch.float16)
    f32, i64 = torch.empty(1), torch.empty(1, dtype=torch.int64)
    u8 = torch.empty(1, dtype=torch.uint8)
    stages = fwd.stages(d, 2, bwd._EXCHANGE_BYTES)
    kernel = _compile(
        bwd._clip_grad_sm90_kernel,
        [a_desc, b_desc, f32, f32, i64, f32, f32, i64, *[f32] * 4, u8, a, f32,
         4096, 4096, 64, 0, 32, 32, 8, 32],
        _constants(d, stages, HAS_BIAS=True, HAS_SCALE=True, SCALE_DX=False, HAS_TARGET=True,
                   COL_LSE=True, GRAD_SCALE=True, DIAG_MASK=diag_mask,
                   STREAM_A=fwd.streams_a(d)),
        num_warps=fwd.WARPS, maxnreg=fwd.MAX_REGS)
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, kernel.metadata.shared


def compile_siglip(d: int) -> None:
    from fusedloss.core import lse_forward_sm90 as fwd
    from fusedloss.core import siglip_sm90

    a = torch.empty(4096, d, dtype=torch.bfloat16)
    b_desc = fwd.descriptor(torch.empty(4096, d, dtype=torch.bfloat16), siglip_sm90.BLOCK_N)
    f32 = torch.empty(1)
    stages = fwd.stages(d, 2, reserve=2 * siglip_sm90.G_TILE_ELEMENTS, block_n=siglip_sm90.BLOCK_N)
    kernel = _compile(
        siglip_sm90._siglip_sm90_kernel,
        [fwd.descriptor(a, fwd.BLOCK_M), b_desc, f32, f32,
         fwd.descriptor(torch.empty(4032, 4096, dtype=torch.bfloat16), siglip_sm90.BLOCK_M),
         f32, 4000, 4090, 0, 0.5, 63, 64, 132, 8316, 8, 32],
        dict(_constants(d, stages, AHEAD=siglip_sm90.AHEAD, STREAM_A=fwd.streams_a(d)),
             BLOCK_N=siglip_sm90.BLOCK_N),
        num_warps=fwd.WARPS, maxnreg=fwd.MAX_REGS)
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, kernel.metadata.shared


def _in_a_compiler_process(call: str) -> None:
    """Runs ``call`` (a function of this module) in a fresh Python without Triton's
    interpreter, which would wrap the kernels for the CPU instead of compiling them."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           f"import test_sm90_compile as t; t.{call}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


# The widest D with A resident in shared memory, and the widest with A streamed (STREAM_A);
# with column statistics (CLIP), and rows only (InfoNCE) or with the diagonal masked (NT-Xent).
@pytest.mark.parametrize(("d", "col_stats", "diag_mask"),
                         [(512, True, False), (1024, True, False), (512, False, False),
                          (1024, False, True)])
def test_forward_compiles_for_sm90(d, col_stats, diag_mask):
    _in_a_compiler_process(f"compile_forward({d}, {col_stats}, {diag_mask})")


@pytest.mark.parametrize(("diag_mask", "d"), [(False, 512), (True, 512), (False, 1024)])
def test_recompute_compiles_for_sm90(diag_mask, d):
    _in_a_compiler_process(f"compile_recompute({diag_mask}, {d})")


@pytest.mark.parametrize("d", [512, 1024])
def test_siglip_compiles_for_sm90(d):
    _in_a_compiler_process(f"compile_siglip({d})")
