"""SwitchBack's primitives as Triton kernels: quantizers, row-wise dequantization, and the
quantized matmul with its dequantization and bias fused in the epilogue.

The host functions have the signatures of ``reference.py``. The quantizers give the same int8 /
fp8 values and absmax scales bit for bit: they compute x · Q / absmax in float64 and round it
exactly, as the reference does (they are memory-bound, where float64 arithmetic is affordable).
The row-wise dequantization is bit for bit the reference's too. The matmul sums int8 products
in an int32 accumulator (exact for K <= 133144, checked) or fp8 e4m3 products in float32, then
scales in float32:

    c = float32(acc) · ((absmax_a · 1/Q) · (absmax_b · 1/Q)) (+ float32(bias))

a few float32 roundings (relative 2⁻²⁴ each) before the conversion to the output dtype, where
the reference scales in float64; docs/companions.md states the bound the tests hold it to.

fp8 runs through the same kernel as int8 (``tl.dot`` on float8e4nv operands) rather than
``torch._scaled_mm``: one code path and epilogue for both formats (bias, any of the three output
dtypes), no alignment rules on K and N, and it runs under Triton's interpreter, so the CPU tests
cover it. It needs fp8 tensor cores: compute capability 8.9 (Ada) or later.

Tensors must be on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported), which runs int8 and fp8 ``tl.dot`` alike; its float32 ->
bfloat16 conversion truncates, so there the kernels round bfloat16 outputs by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..core import config
from . import reference
from .reference import QUANT_FORMATS, check_float, check_quant_dtype, q_max

#: the largest inner dimension whose int8 sums fit the int32 accumulator: K · 127² < 2³¹
INT8_MAX_K = (2**31 - 1) // (127 * 127)
_FP8_CAPABILITY = (8, 9)


# --------------------------------------------------------------------------------------------
# Devices and tile shapes
# --------------------------------------------------------------------------------------------


def check_device(name: str, t: Tensor | torch.device, quant_dtype: str = "int8") -> None:
    """Raise unless the kernels can run on t's device: CUDA (fp8: capability >= 8.9), or the
    CPU under Triton's interpreter."""
    device = t if isinstance(t, torch.device) else t.device
    if device.type == "cuda":
        if quant_dtype == "fp8" and config.capability(device) < _FP8_CAPABILITY:
            major, minor = config.capability(device)
            raise RuntimeError(
                f"quant_dtype='fp8' with backend='triton' needs fp8 tensor cores (compute "
                f"capability 8.9 or later: Ada, Hopper); {name} is on {device}, capability "
                f"{major}.{minor}. Use quant_dtype='int8', or backend='torch' (the emulation)."
            )
        return
    if device.type == "cpu" and config.interpreting():
        return
    raise RuntimeError(
        f"backend='triton' needs CUDA tensors, but {name} is on {device}; on the CPU the kernels "
        "run only through Triton's interpreter (set TRITON_INTERPRET=1 before importing "
        "triton). Use backend='torch' or 'auto' for CPU tensors."
    )


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


_MATMUL_INTERPRETER = MatmulConfig(16, 16, 16, 2, num_warps=1, num_stages=1)


def matmul_config(device: torch.device, n: int) -> MatmulConfig:
    """Tile of the quantized matmul; frozen per architecture (no autotuning).

    Both formats move one byte per operand element, so one config serves int8 and fp8. On
    Hopper, 128-byte K steps feed wgmma; a 128 × 256 tile on two warpgroups keeps three stages
    of A and B (144 KiB) in shared memory; narrow outputs take 128 × 128 tiles and a fourth
    stage. Programs walk the tiles in groups of 8 row-blocks so that B's column-blocks are
    reused from L2."""
    if device.type != "cuda":
        return _MATMUL_INTERPRETER
    major, _ = config.capability(device)
    if major >= 9:
        if n <= 128:
            return MatmulConfig(128, 128, 128, 8, num_warps=8, num_stages=4)
        return MatmulConfig(128, 256, 128, 8, num_warps=8, num_stages=3)
    return MatmulConfig(128, 128, 64, 8, num_warps=8, num_stages=3)


def _elementwise_blocks(device: torch.device) -> tuple[int, int, int]:
    """(block_r, block_c, num_warps) of the elementwise and tile-reduction kernels."""
    return (16, 16, 1) if device.type != "cuda" else (64, 64, 4)


def _row_blocks(device: torch.device, contiguous_rows: bool, c: int) -> tuple[int, int, int]:
    """(block_r, block_c, num_warps) of the row-reduction quantizer: a few rows with long
    contiguous chunks, or, for the columns of a row-major matrix, 32 adjacent columns read
    together (64 bytes per row of the tile)."""
    if device.type != "cuda":
        return 8, 16, 1
    if contiguous_rows:
        return 8, min(max(triton.next_power_of_2(c), 16), 512), 4
    return 32, 64, 4


def _bf16_by_hand(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and config.interpreting()


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(v):
    """Round float64 v (|v| < 2³¹) to the nearest integer, ties to even, exactly (as int32)."""
    t = v.to(tl.int32)  # toward zero
    frac = v - t.to(tl.float64)  # exact
    away = tl.abs(frac)
    up = (away > 0.5) | ((away == 0.5) & ((t & 1) != 0))
    return t + tl.where(up, tl.where(frac > 0, 1, -1), 0)


@triton.jit
def _power_of_two(e):
    """2^e as float64 for int32 e in the normal range, built from its bits."""
    return ((e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _to_output(x, dtype: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """float32 x converted to the output dtype, to nearest even. ``BF16_BY_HAND``: bfloat16
    rounded from the bits, for Triton's interpreter, whose float32 -> bfloat16 truncates."""
    if BF16_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x == x, bits, 0x7FC0).to(tl.uint16)  # keep NaN a NaN
        return bits.to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _quantize(x, absmax, FP8: tl.constexpr):
    """q of a block of x with its float32 absmax (broadcast; NaN or 0 -> q = 0), exactly as
    ``reference._quantize``: v = x·Q/absmax in float64, rounded once to int8 or e4m3."""
    a64 = absmax.to(tl.float64)
    usable = a64 > 0  # False for NaN
    denom = tl.where(usable, a64, 1.0)
    if FP8:
        v = tl.where(usable, x.to(tl.float32).to(tl.float64) * 448.0 / denom, 0.0)
        # e4m3 keeps 3 fraction bits: the step of v's binade is 2^(e - 3), at least 2⁻⁹.
        e = ((v.to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32) - 1023
        step = tl.maximum(e, -6) - 3
        r = tl.abs(_round_half_even(v * _power_of_two(-step)).to(tl.float64))
        r = tl.where(v.to(tl.int64, bitcast=True) < 0, -r, r) * _power_of_two(step)  # -0 too
        q = r.to(tl.float32).to(tl.float8e4nv)  # representable: exact
    else:
        v = tl.where(usable, x.to(tl.float32).to(tl.float64) * 127.0 / denom, 0.0)
        q = tl.minimum(tl.maximum(_round_half_even(v), -127), 127).to(tl.int8)
    return q


@triton.jit
def _quantize_rows_kernel(
    p_x, p_q, p_absmax,  # x (R, C) any strides; q (R, C) its own strides; absmax (R,) fp32
    R, C, stride_xr, stride_xc, stride_qr, stride_qc,
    FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Row-wise quantization: one absmax per row of x (a column of x's transpose when the
    strides say so), in two passes over the row: absmax, then q."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < R
    o_r64 = o_r.to(tl.int64)
    o_c = tl.arange(0, BLOCK_C)
    b_max = tl.zeros((BLOCK_R,), tl.float32)
    b_bad = tl.zeros((BLOCK_R,), tl.int32)
    for c0 in range(0, C, BLOCK_C):
        m = m_r[:, None] & (c0 + o_c < C)[None, :]
        p = p_x + o_r64[:, None] * stride_xr + (c0 + o_c)[None, :] * stride_xc
        b_abs = tl.abs(tl.load(p, mask=m, other=0.0).to(tl.float32))
        finite = b_abs < float("inf")  # False for NaN
        b_max = tl.maximum(b_max, tl.max(tl.where(finite, b_abs, 0.0), axis=1))
        b_bad = tl.maximum(b_bad, tl.max(tl.where(finite, 0, 1), axis=1))
    b_state = tl.where(b_bad > 0, float("nan"), b_max)
    tl.store(p_absmax + o_r, b_state, mask=m_r)
    for c0 in range(0, C, BLOCK_C):
        m = m_r[:, None] & (c0 + o_c < C)[None, :]
        p = p_x + o_r64[:, None] * stride_xr + (c0 + o_c)[None, :] * stride_xc
        b_q = _quantize(tl.load(p, mask=m, other=0.0), b_state[:, None], FP8)
        tl.store(p_q + o_r64[:, None] * stride_qr + (c0 + o_c)[None, :] * stride_qc, b_q, mask=m)


@triton.jit
def _absmax_tiles_kernel(
    p_x, p_partial,  # x (R, C) row-major; partial (tiles,) fp32: NaN for a tile with NaN/Inf
    R, C, stride_xr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per-tile absmax, the first pass of tensor-wise quantization."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    o_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    p = p_x + o_r.to(tl.int64)[:, None] * stride_xr + o_c[None, :]
    b_abs = tl.abs(tl.load(p, mask=m, other=0.0).to(tl.float32))
    finite = b_abs < float("inf")
    b_max = tl.max(tl.max(tl.where(finite, b_abs, 0.0), axis=1), axis=0)
    bad = tl.max(tl.max(tl.where(finite, 0, 1), axis=1), axis=0)
    tl.store(p_partial + pid_r * tl.num_programs(1) + pid_c, tl.where(bad > 0, float("nan"), b_max))


@triton.jit
def _quantize_tensor_kernel(
    p_x, p_q, p_absmax,  # x (R, C) row-major; q (R, C) at strides (q's transpose: (C, R)); 0-d
    R, C, stride_xr, stride_qr, stride_qc,
    FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Tensor-wise quantization with one absmax, the transpose fused into the store."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    o_r64 = o_r.to(tl.int64)
    b_x = tl.load(p_x + o_r64[:, None] * stride_xr + o_c[None, :], mask=m, other=0.0)
    b_q = _quantize(b_x, tl.load(p_absmax), FP8)
    tl.store(p_q + o_r64[:, None] * stride_qr + o_c.to(tl.int64)[None, :] * stride_qc, b_q, mask=m)


@triton.jit
def _dequantize_rows_kernel(
    p_q, p_absmax, p_out,  # q (R, C) row-major int8 / e4m3; absmax (R,) fp32; out (R, C)
    R, C, Q: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out = q · absmax / Q in float64, converted through float32 as PyTorch converts."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    o = o_r.to(tl.int64)[:, None] * C + o_c[None, :]
    b_q = tl.load(p_q + o, mask=m, other=0.0).to(tl.float32).to(tl.float64)
    b_scale = tl.load(p_absmax + o_r, mask=o_r < R, other=0.0).to(tl.float64) / Q
    b_out = (b_q * b_scale[:, None]).to(tl.float32)
    tl.store(p_out + o, _to_output(b_out, p_out.dtype.element_ty, BF16_BY_HAND), mask=m)


@triton.jit
def _matmul_dequantize_kernel(
    p_a, p_b,  # a (M, K), b (N, K): int8 or float8e4nv, row-major
    p_absmax_a, p_absmax_b, p_bias,  # (M,) fp32; (N,) or () fp32; (N,) any float, or None
    p_c,  # (M, N) row-major, the output dtype
    M, N, K,
    B_ROWWISE: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, INV_Q: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C = (a bᵀ) · absmax_a / Q · absmax_b / Q (+ bias): the tensor-core dot in int32 (int8) or
    float32 (fp8), the dequantization and bias in the epilogue."""
    # Grouped order: GROUP_M row-blocks share each column-block of b while it is in L2.
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    # Rows past the edge read row 0 (never stored): only the K tail needs a load mask.
    p_a_k = p_a + (o_m % M).to(tl.int64)[:, None] * K + o_k[None, :]  # (BLOCK_M, BLOCK_K)
    p_b_k = p_b + (o_n % N).to(tl.int64)[None, :] * K + o_k[:, None]  # (BLOCK_K, BLOCK_N)
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        m_k = o_k < K - k0
        b_a = tl.load(p_a_k, mask=m_k[None, :], other=0.0)
        b_b = tl.load(p_b_k, mask=m_k[:, None], other=0.0)
        if FP8:
            # Hopper's fp8 wgmma adds into a narrower accumulator than float32; this moves
            # each BLOCK_K chunk's partial sum into the float32 one.
            acc = tl.dot(b_a, b_b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(b_a, b_b, acc)
        p_a_k += BLOCK_K
        p_b_k += BLOCK_K

    m_m, m_n = o_m < M, o_n < N
    scale_a = tl.load(p_absmax_a + o_m, mask=m_m, other=0.0) * INV_Q
    if B_ROWWISE:
        scale_b = tl.load(p_absmax_b + o_n, mask=m_n, other=0.0) * INV_Q
    else:
        scale_b = tl.zeros((BLOCK_N,), tl.float32) + tl.load(p_absmax_b) * INV_Q
    # One product of the scales first: acc · scale_a alone can overflow where C does not.
    c = acc.to(tl.float32) * (scale_a[:, None] * scale_b[None, :])
    if HAS_BIAS:
        c += tl.load(p_bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    p = p_c + o_m.to(tl.int64)[:, None] * N + o_n[None, :]
    tl.store(p, _to_output(c, p_c.dtype.element_ty, BF16_BY_HAND), mask=m_m[:, None] & m_n[None, :])


# --------------------------------------------------------------------------------------------
# Host functions (the signatures of reference.py)
# --------------------------------------------------------------------------------------------


def quantize_rowwise(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Row-wise: x (M, K) -> (q (M, K) int8 or float8_e4m3fn, absmax (M,) float32)."""
    check_float("x", x, (2,))
    check_quant_dtype(quant_dtype)
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one column, got shape {tuple(x.shape)}")
    check_device("x", x, quant_dtype)
    return _quantize_rows(x, quant_dtype)


def _quantize_rows(x: Tensor, quant_dtype: str) -> tuple[Tensor, Tensor]:
    """Rows of the 2-D (possibly transposed) view x, into a contiguous q."""
    r, c = x.shape
    q = torch.empty((r, c), dtype=QUANT_FORMATS[quant_dtype][0], device=x.device)
    absmax = torch.empty(r, dtype=torch.float32, device=x.device)
    if r:
        block_r, block_c, warps = _row_blocks(x.device, x.stride(1) == 1, c)
        _quantize_rows_kernel[(triton.cdiv(r, block_r),)](
            x, q, absmax, r, c, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
            FP8=quant_dtype == "fp8", BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        )
    return q, absmax


def quantize_columnwise_transpose(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Column-wise of x (M, N), transposed: (q (N, M), absmax (N,)), one scale per column."""
    check_float("x", x, (2,))
    check_quant_dtype(quant_dtype)
    if x.shape[0] == 0:
        raise ValueError(f"x must have at least one row, got shape {tuple(x.shape)}")
    check_device("x", x, quant_dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    return _quantize_rows(x.t(), quant_dtype)


def _tensorwise(x: Tensor, quant_dtype: str, transpose: bool) -> tuple[Tensor, Tensor]:
    check_quant_dtype(quant_dtype)
    if x.numel() == 0:
        raise ValueError("x must not be empty for tensor-wise quantization")
    check_device("x", x, quant_dtype)
    x2 = x.reshape(-1, x.shape[-1] if x.dim() else 1).contiguous()
    r, c = x2.shape
    block_r, block_c, warps = _elementwise_blocks(x.device)
    grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c))
    partial = torch.empty(grid, dtype=torch.float32, device=x.device)
    _absmax_tiles_kernel[grid](x2, partial, r, c, x2.stride(0), BLOCK_R=block_r,
                               BLOCK_C=block_c, num_warps=warps)
    absmax = partial.amax()  # NaN propagates: a tile with NaN/Inf makes the state NaN
    storage = QUANT_FORMATS[quant_dtype][0]
    q = torch.empty((c, r) if transpose else (r, c), dtype=storage, device=x.device)
    stride_qr, stride_qc = (1, r) if transpose else (c, 1)
    _quantize_tensor_kernel[grid](
        x2, q, absmax, r, c, x2.stride(0), stride_qr, stride_qc,
        FP8=quant_dtype == "fp8", BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
    )
    return (q if transpose else q.reshape(x.shape)), absmax


def quantize_tensorwise(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Tensor-wise: x (any shape, non-empty) -> (q, absmax float32 0-d)."""
    check_float("x", x)
    return _tensorwise(x, quant_dtype, transpose=False)


def quantize_tensorwise_transpose(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Tensor-wise of x (M, N), stored transposed: (q (N, M) contiguous, absmax 0-d)."""
    check_float("x", x, (2,))
    return _tensorwise(x, quant_dtype, transpose=True)


def dequantize_rowwise(q: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    """q (M, K) int8 or float8_e4m3fn · absmax (M,) / Q, converted to ``dtype``."""
    check_device("q", q)
    scale = q_max(q.dtype)
    q = q.contiguous()
    r, c = q.shape
    out = torch.empty((r, c), dtype=dtype, device=q.device)
    if q.numel():
        block_r, block_c, warps = _elementwise_blocks(q.device)
        grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c))
        _dequantize_rows_kernel[grid](q, absmax.contiguous(), out, r, c, Q=scale,
                                      BF16_BY_HAND=_bf16_by_hand(dtype), BLOCK_R=block_r,
                                      BLOCK_C=block_c, num_warps=warps)
    return out


def matmul_dequantize(
    a: Tensor,  # (M, K) int8 or float8_e4m3fn
    b: Tensor,  # (N, K), a's dtype
    absmax_a: Tensor,  # (M,) float32
    absmax_b: Tensor,  # () or (N,) float32
    bias: Tensor | None,  # (N,)
    out_dtype: torch.dtype,
) -> Tensor:
    """C = (a @ bᵀ) · absmax_a[:, None] · absmax_b / Q² (+ bias) in out_dtype, one kernel."""
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a quantized dtype, got {a.dtype} and {b.dtype}")
    scale = q_max(a.dtype)
    fp8 = a.dtype == torch.float8_e4m3fn
    check_device("a", a, "fp8" if fp8 else "int8")
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"a (M, K) and b (N, K) must share K, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if not fp8 and k > INT8_MAX_K:
        raise ValueError(f"int8 matmul over K = {k} could overflow its int32 accumulator "
                         f"(K <= {INT8_MAX_K}); use backend='torch' or quant_dtype='fp8'")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = matmul_config(a.device, n)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_dequantize_kernel[grid](
        a.contiguous(), b.contiguous(), absmax_a.contiguous(), absmax_b.contiguous(),
        bias.contiguous() if bias is not None else None, c, m, n, k,
        B_ROWWISE=absmax_b.dim() == 1, HAS_BIAS=bias is not None, FP8=fp8, INV_Q=1.0 / scale,
        BF16_BY_HAND=_bf16_by_hand(out_dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


__all__ = [name for name in reference.__all__ if name != "int8_matmul_dequantize"]
