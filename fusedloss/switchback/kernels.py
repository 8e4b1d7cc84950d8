"""SwitchBack's primitives as Triton kernels: quantizers, row-wise dequantization, and the
quantized matmul with its dequantization and bias fused in the epilogue.

The host functions have the signatures of ``reference.py``. The quantizers give the same int8 /
fp8 values and absmax scales bit for bit, on every backend by construction: they build each
int8 value or e4m3 bit pattern with integer and float64 operations whose results IEEE 754 fixes
(no rounded float32 arithmetic, no hardware float8 conversion, no unary minus; see
``_quantize``). The row-wise dequantization is bit for bit the reference's too. The matmul
sums int8 products in an int32 accumulator (exact for K <= 133144, checked) or fp8 e4m3
products in the tensor cores' accumulator, then scales in float32:

    c = float32(acc) · ((absmax_a · 1/Q) · (absmax_b · 1/Q)) (+ float32(bias))

a few float32 roundings (relative 2⁻²⁴ each) before the conversion to the output dtype, where
the reference scales in float64; docs/companions.md states the bound the tests hold it to.

Operand layouts. The matmul computes C = A Bᵀ with A (M, K) and B (N, K) both row-major, the
inner dimension K contiguous in both, as Hopper's 8-bit wgmma requires of both operands (B's
tiles are read (BLOCK_N, BLOCK_K) and transposed in the dot). The layer's three products:

    forward      Y  = Xq · Wqᵀ     A = Xq (tokens, in),  B = Wq (out, in)      no copy
    input grad   dX = dYq · Wq     A = dYq (tokens, out), B = Wqᵀ (in, out)    W's transpose is
                                   written by its quantizer (W is row-major (out, in), so no
                                   K-major read of it exists for K = out; d² bytes, small)
    weight grad  dW = dYᵀ · X      16-bit, cuBLAS through PyTorch (transposed operands read in
                                   place), nothing quantized

Time budget. Even with every kernel at the hardware's peak rate the quantizers' memory traffic
keeps a layer's speed-up over nn.Linear below the 1.5× of the 8-bit matmuls alone
(docs/companions.md, SwitchBack, "What bounds it": each step's budget, to read measured times).

fp8 runs through the same kernel as int8 (``tl.dot`` on float8e4nv operands) rather than
``torch._scaled_mm``: one code path and epilogue for both formats (bias, any of the three output
dtypes), no alignment rules on K and N, and it runs under Triton's interpreter, so the CPU tests
cover it. It needs fp8 tensor cores: compute capability 8.9 (Ada) or later.

Tensors must be on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported), which runs int8 and fp8 ``tl.dot`` alike; its float32 ->
bfloat16 conversion truncates, so there the kernels round bfloat16 outputs by hand.
"""

from __future__ import annotations

import functools
import warnings
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
FP8_CAPABILITY = (8, 9)


# --------------------------------------------------------------------------------------------
# Devices and tile shapes
# --------------------------------------------------------------------------------------------


def runs_natively(device: torch.device, quant_dtype: str = "int8") -> bool:
    """Whether the kernels run on ``device``'s own hardware: a CUDA GPU (fp8: capability 8.9+,
    fp8 tensor cores)."""
    return device.type == "cuda" and (quant_dtype != "fp8"
                                      or config.capability(device) >= FP8_CAPABILITY)


def check_device(name: str, t: Tensor | torch.device, quant_dtype: str = "int8") -> None:
    """Raise unless the kernels can run on t's device: CUDA (fp8: capability >= 8.9), or the
    CPU under Triton's interpreter."""
    device = t if isinstance(t, torch.device) else t.device
    if device.type == "cuda":
        if quant_dtype == "fp8" and config.capability(device) < FP8_CAPABILITY:
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


def _cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host (``triton.cdiv`` is a constexpr function: microseconds a call)."""
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (≥ 1), on the host."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# K steps of 32 under the interpreter: K padded to 16 still leaves a tail to mask
_MATMUL_INTERPRETER = MatmulConfig(16, 16, 32, 2, num_warps=1, num_stages=1)
#: persistent programs under the interpreter: a few, so that the tile loop runs several times
_INTERPRETER_PROGRAMS = 3


@functools.lru_cache(maxsize=256)
def matmul_config(device: torch.device, m: int, n: int) -> MatmulConfig:
    """Tile of the quantized matmul; frozen per architecture (no autotuning).

    Both formats move one byte per operand element, so one config serves int8 and fp8. On
    Hopper, 128-byte K steps feed wgmma; a 128 × 256 (or 256 × 128) tile on two warpgroups
    keeps three stages of A and B (48 KiB each) and half the output tile in shared memory. The
    tile's long side goes where it divides the problem: N = 1664 = 13 · 128 would leave its
    last 256-wide column of tiles half empty, so it takes 256 × 128 tiles. Narrow outputs take
    128 × 128 tiles and a fourth stage. Tiles are visited in groups of 8 row-blocks, so that
    the operand rows in flight stay in L2."""
    if device.type != "cuda":
        return _MATMUL_INTERPRETER
    major, _ = config.capability(device)
    if major >= 9:
        if n <= 128:
            return MatmulConfig(128, 128, 128, 8, num_warps=8, num_stages=4)
        if n % 256 and n % 128 == 0 and m > 128:
            return MatmulConfig(256, 128, 128, 8, num_warps=8, num_stages=3)
        return MatmulConfig(128, 256, 128, 8, num_warps=8, num_stages=3)
    return MatmulConfig(128, 128, 64, 8, num_warps=8, num_stages=3)


def _matmul_stride(device: torch.device) -> int:
    """The persistent grid's size on a large problem: one program per SM (the tiles' shared
    memory allows one), each walking the tiles in steps of this many. A fixed number per
    device (the kernel takes it as a constant); smaller problems launch one program per tile."""
    return _INTERPRETER_PROGRAMS if device.type != "cuda" else config.sm_count(device)


def _tma_ready(t: Tensor) -> bool:
    """Whether the bulk tensor copy engine (TMA) can read or write t's tiles: a Hopper or later
    GPU (or the interpreter), row-major, 16-byte aligned base and row stride."""
    if not (config.interpreting() or (t.is_cuda and config.capability(t.device)[0] >= 9)):
        return False
    size = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * size) % 16 == 0)


@dataclass(frozen=True)
class RowPlan:
    """How the row-wise quantizer covers a block of rows: ``pieces`` > 0: (block_r, block_c)
    tiles side by side, read once and held in registers; 0: two sweeps of such tiles."""

    block_r: int
    block_c: int
    pieces: int
    num_warps: int


@functools.lru_cache(maxsize=256)
def _row_plan(device: torch.device, c: int, contiguous_rows: bool) -> RowPlan:
    """Tiles of 8 elements per thread (16-byte loads of 16-bit x), as many side by side as a
    row needs, at most 8, all of one width so that they share one register layout: the power
    of two from 256 to 2048 that covers the row with the fewest lanes (1664: seven of 256,
    128 lanes to spare; 1280: five of 256; 6656: seven of 1024). Longer rows (or, under the
    interpreter, more than four tiles of 16) take two sweeps, as do the columns of a row-major
    matrix (W column-wise), 32 adjacent columns (64 bytes of each row) at a time."""
    if device.type != "cuda":
        if not contiguous_rows:
            return RowPlan(32, 16, 0, 1)
        return RowPlan(8, 16, _cdiv(c, 16), 1) if c <= 64 else RowPlan(8, 64, 0, 1)
    if not contiguous_rows:
        return RowPlan(32, 64, 0, 4)
    if c <= 256:
        block_c = max(16, _next_power_of_2(c))
        return RowPlan(max(1, 1024 // block_c), block_c, 1, 4)
    fits = [(_cdiv(c, w) * w, -w) for w in (256, 512, 1024, 2048) if _cdiv(c, w) <= 8]
    if not fits:
        return RowPlan(1, 2048, 0, 8)
    block_c = -min(fits)[1]
    warps = 4 if block_c <= 1024 else 8
    return RowPlan(max(1, 256 * warps // block_c), block_c, _cdiv(c, block_c), warps)


def _tile_blocks(device: torch.device) -> tuple[int, int, int]:
    """(block_r, block_c, num_warps) of the elementwise and tile-reduction kernels."""
    return (16, 16, 1) if device.type != "cuda" else (64, 64, 4)


def _bf16_by_hand(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and config.interpreting()


# --------------------------------------------------------------------------------------------
# Kernels: quantization
# --------------------------------------------------------------------------------------------


@triton.jit
def _quantize(x, absmax, FP8: tl.constexpr):
    """The int8 values, or the e4m3 bit patterns as int8, of a block of x with its float32
    absmax (broadcast against x; 0 or NaN: all 0), exactly ``reference._quantize``.

    v = x · Q / absmax is taken as x · fl(Q / absmax) in float64 (x and absmax widened
    exactly): within 2⁻⁵² of itself, relatively (the quotient's rounding and the product's,
    which the compiler may instead fuse into the next addition). u is v in units of the target
    grid's step (int8: 1; e4m3: 2^(e − 3) in |v|'s binade 2^e, 2⁻⁹ below 2⁻⁶), so |u| <= 127
    and u is within 2⁻⁴⁵ of its exact value. When the exact v lies on a rounding boundary (a
    tie), u is that close to a half-integer; when it does not, u is more than 2⁻³⁵ from every
    half-integer (x and absmax have 24-bit significands and Q < 2⁹, so x · Q − boundary ·
    absmax, not 0, is a multiple of a power of two that bounds it from below). Rounding u to a
    multiple of 2⁻⁴⁰ ((u + 1.5·2¹²) − 1.5·2¹²) therefore makes every tie exact and moves no
    other value across a boundary; adding 1.5·2⁵² then rounds half to even (IEEE addition)
    and leaves the integer in the low bits, two's complement for int8's signed u. e4m3 rounds
    |u| and takes the sign bit from x (-0, and negative values that round to 0, give -0 as
    the emulation does); its code is (binade + 6) · 8 + n, n reaching 16 carrying into the
    next binade.

    Only integer operations, exact widenings and correctly rounded float64 arithmetic (never
    flushed to zero on NVIDIA GPUs) take part, so the result depends neither on the
    hardware's float32 -> float8 conversion nor on float32 division or denormal modes, nor on
    how the compiler lowers ``-x`` (Triton 3.6 emits 0 − x, which turns -0 into +0)."""
    usable = absmax > 0  # False for NaN
    x32 = x.to(tl.float32)
    if FP8:
        v = tl.abs(x32).to(tl.float64) * (448.0 / tl.where(usable, absmax, 1.0).to(tl.float64))
        # |v|'s binade 2^e as its biased exponent e + 1023, at least e4m3's smallest normal 2⁻⁶
        biased = tl.maximum((v.to(tl.int64, bitcast=True) >> 52).to(tl.int32), 1017)
        u = v * ((2049 - biased).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # · 2^(3 − e)
    else:
        u = x32.to(tl.float64) * (127.0 / tl.where(usable, absmax, 1.0).to(tl.float64))
    u = (u + 6144.0) - 6144.0
    n = (u + 6755399441055744.0).to(tl.int64, bitcast=True).to(tl.int32)
    if FP8:
        n = ((biased - 1017) << 3) + n + ((x32.to(tl.int32, bitcast=True) >> 24) & 0x80)
    return tl.where(usable, n, 0).to(tl.int8)


@triton.jit
def _absmax_bits(b):
    """|b| as float32 bits (int32): non-negative floats order as their bits, and every finite
    value lies below ±Inf's (0x7F800000) and NaN's bits, so an integer max finds the absmax
    and whether the block holds NaN or ±Inf in one reduction."""
    return b.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _absmax_state(bits):
    """The absmax kept for a block from its largest |x| bits: NaN where the block holds NaN or
    ±Inf."""
    return tl.where(bits < 0x7F800000, bits.to(tl.float32, bitcast=True), float("nan"))


@triton.jit
def _quantize_rows_kernel(
    p_x, p_q, p_absmax,  # x (R, C) any strides; q (R, C) int8 (fp8: its bits), own strides; (R,)
    R, C, stride_xr, stride_xc, stride_qr, stride_qc,
    FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PIECES: tl.constexpr,
):
    """Row-wise quantization: one absmax per row of x (a column of x's transpose when the
    strides say so). PIECES > 0: the BLOCK_R rows are read once, as PIECES tiles of
    (BLOCK_R, BLOCK_C) side by side (C <= PIECES · BLOCK_C) held in registers; PIECES = 0: two
    sweeps of such tiles over the rows, the second one reading them again."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.arange(0, BLOCK_C)
    m_r = o_r < R
    p_x_rows = p_x + o_r.to(tl.int64)[:, None] * stride_xr
    p_q_rows = p_q + o_r.to(tl.int64)[:, None] * stride_qr
    # The largest |x| of each row as float32 bits (see _absmax_bits), elementwise over the
    # tiles first, across threads once at the end.
    b_bits = tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
    if PIECES > 0:
        b_tiles = ()
        for i in tl.static_range(PIECES):
            m = m_r[:, None] & (i * BLOCK_C + o_c < C)[None, :]
            b = tl.load(p_x_rows + (i * BLOCK_C + o_c)[None, :] * stride_xc, mask=m, other=0.0)
            b_bits = tl.maximum(b_bits, _absmax_bits(b))
            b_tiles = b_tiles + (b,)
        b_state = _absmax_state(tl.max(b_bits, axis=1))
        tl.store(p_absmax + o_r, b_state, mask=m_r)
        for i in tl.static_range(PIECES):
            m = m_r[:, None] & (i * BLOCK_C + o_c < C)[None, :]
            tl.store(p_q_rows + (i * BLOCK_C + o_c)[None, :] * stride_qc,
                     _quantize(b_tiles[i], b_state[:, None], FP8), mask=m)
    else:
        for c0 in range(0, C, BLOCK_C):
            m = m_r[:, None] & (c0 + o_c < C)[None, :]
            b = tl.load(p_x_rows + (c0 + o_c)[None, :] * stride_xc, mask=m, other=0.0)
            b_bits = tl.maximum(b_bits, _absmax_bits(b))
        b_state = _absmax_state(tl.max(b_bits, axis=1))
        tl.store(p_absmax + o_r, b_state, mask=m_r)
        for c0 in range(0, C, BLOCK_C):
            m = m_r[:, None] & (c0 + o_c < C)[None, :]
            b = tl.load(p_x_rows + (c0 + o_c)[None, :] * stride_xc, mask=m, other=0.0)
            tl.store(p_q_rows + (c0 + o_c)[None, :] * stride_qc,
                     _quantize(b, b_state[:, None], FP8), mask=m)


@triton.jit
def _absmax_tiles_kernel(
    p_x, p_partial,  # x (R, C) row-major; partial (tiles,) int32: the tile's largest |x| bits
    R, C, stride_xr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per-tile absmax (as bits, see _absmax_bits), the first pass of tensor-wise
    quantization."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    o_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    b = tl.load(p_x + o_r.to(tl.int64)[:, None] * stride_xr + o_c[None, :], mask=m, other=0.0)
    b_bits = tl.max(tl.max(_absmax_bits(b), axis=1), axis=0)
    tl.store(p_partial + pid_r * tl.num_programs(1) + pid_c, b_bits)


@triton.jit
def _quantize_tensor_kernel(
    p_x, p_partial, p_q, p_absmax,  # x (R, C) row-major; partial (P,) int32 tile maxima (bits);
                                    # q (R, C), or (C, R) with TRANSPOSE, int8; absmax () fp32
    R, C, stride_xr, P,
    FP8: tl.constexpr, TRANSPOSE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Tensor-wise quantization, the second pass: every program reduces the tile maxima to the
    tensor's absmax (a few KB from L2; no kernel in between), the first one stores it, and each
    quantizes its tile, storing q as is or transposed (the transpose through registers, so that
    both the load and the store are contiguous)."""
    o_p = tl.arange(0, BLOCK_P)
    b_bits = tl.zeros((BLOCK_P,), tl.int32)
    for p0 in range(0, P, BLOCK_P):
        b_bits = tl.maximum(b_bits, tl.load(p_partial + p0 + o_p, mask=p0 + o_p < P, other=0))
    absmax = _absmax_state(tl.max(b_bits, axis=0))
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    tl.store(p_absmax, absmax, mask=(pid_r == 0) & (pid_c == 0))
    o_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    o_r64, o_c64 = o_r.to(tl.int64), o_c.to(tl.int64)
    b_x = tl.load(p_x + o_r64[:, None] * stride_xr + o_c[None, :], mask=m, other=0.0)
    b_q = _quantize(b_x, absmax, FP8)
    if TRANSPOSE:
        tl.store(p_q + o_c64[:, None] * R + o_r64[None, :], tl.trans(b_q), mask=tl.trans(m))
    else:
        tl.store(p_q + o_r64[:, None] * C + o_c64[None, :], b_q, mask=m)


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
def _dequantize_rows_kernel(
    p_q, p_absmax, p_out,  # q (R, C) row-major int8 / e4m3; absmax (R,) fp32; out (R, C)
    R, C, Q: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out = q · (absmax / Q) in float64, converted through float32 as PyTorch converts."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < R)[:, None] & (o_c < C)[None, :]
    o = o_r.to(tl.int64)[:, None] * C + o_c[None, :]
    b_q = tl.load(p_q + o, mask=m, other=0.0).to(tl.float32).to(tl.float64)
    b_scale = tl.load(p_absmax + o_r, mask=o_r < R, other=0.0).to(tl.float64) / Q
    b_out = (b_q * b_scale[:, None]).to(tl.float32)
    tl.store(p_out + o, _to_output(b_out, p_out.dtype.element_ty, BF16_BY_HAND), mask=m)


# --------------------------------------------------------------------------------------------
# Kernels: the quantized matmul
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_position(tile, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a tile: GROUP_M row-blocks take each column block in turn,
    so that the operand rows of the tiles in flight stay in L2."""
    per_group = GROUP_M * blocks_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _dequantize_tile(
    acc, o_m, o_n,  # acc (BLOCK_M, WIDTH) int32 / fp32; its rows and columns
    p_absmax_a, p_absmax_b, p_bias, M, N,
    B_ROWWISE: tl.constexpr, HAS_BIAS: tl.constexpr, INV_Q: tl.constexpr,
    dtype: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """acc · absmax_a / Q · absmax_b / Q (+ bias) in float32, converted to the output dtype."""
    m_n = o_n < N
    scale_a = tl.load(p_absmax_a + o_m, mask=o_m < M, other=0.0) * INV_Q
    if B_ROWWISE:
        scale_b = tl.load(p_absmax_b + o_n, mask=m_n, other=0.0) * INV_Q
    else:
        scale_b = tl.zeros(o_n.shape, tl.float32) + tl.load(p_absmax_b) * INV_Q
    # One product of the scales first: acc · scale_a alone can overflow where C does not.
    c = acc.to(tl.float32) * (scale_a[:, None] * scale_b[None, :])
    if HAS_BIAS:
        c += tl.load(p_bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    return _to_output(c, dtype, BF16_BY_HAND)


@triton.jit
def _matmul_dequantize_kernel(
    p_a, p_b,  # a (M, K), b (N, K): int8 or float8e4nv, row-major, K a multiple of 16
    a_desc, b_desc,  # their TMA descriptors, blocks (BLOCK_M, BLOCK_K), (BLOCK_N, BLOCK_K), or None
    p_absmax_a, p_absmax_b, p_bias,  # (M,) fp32; (N,) or () fp32; (N,) any float, or None
    p_c, c_desc,  # (M, N) row-major, the output dtype; descriptor (BLOCK_M, BLOCK_N // 2) or None
    M, N, K,
    B_ROWWISE: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, INV_Q: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, TMA_LOADS: tl.constexpr, TMA_STORE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """C = (a bᵀ) · absmax_a / Q · absmax_b / Q (+ bias), persistent: program p computes tiles
    p, p + NUM_PROGRAMS, ... (the grid has at most NUM_PROGRAMS programs). The tensor-core dot
    sums in int32 (int8) or float32 (fp8: Hopper adds the products of each wgmma in its
    narrower fp8 accumulator, which Triton leaves as it is by default), both operands K-major:
    b's (BLOCK_N, BLOCK_K) tiles are transposed in the dot. TMA_LOADS: tiles through the bulk
    copy engine (rows and K past the ends read as zeros); otherwise pointer loads, rows past M
    or N reading rows inside (never stored), unmasked unless K has a tail (EVEN_K). TMA_STORE:
    C through it as well (clipped at the edges), otherwise masked stores."""
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    o_k = tl.arange(0, BLOCK_K)
    # The epilogue counts tiles on its own (as Triton's persistent matmul tutorial does), so
    # that the flattened loop may overlap one tile's epilogue with the next tile's loads.
    tile_c = pid - NUM_PROGRAMS
    for tile in tl.range(pid, blocks_m * blocks_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, blocks_m, blocks_n, GROUP_M)
        if FP8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
        if not TMA_LOADS:
            o_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
            o_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
            p_a_k = p_a + o_am.to(tl.int64)[:, None] * K + o_k[None, :]  # (BLOCK_M, BLOCK_K)
            p_b_k = p_b + o_bn.to(tl.int64)[:, None] * K + o_k[None, :]  # (BLOCK_N, BLOCK_K)
        for ks in range(k_steps):
            if TMA_LOADS:
                b_a = a_desc.load([pid_m * BLOCK_M, ks * BLOCK_K])
                b_b = b_desc.load([pid_n * BLOCK_N, ks * BLOCK_K])
            elif EVEN_K:
                b_a = tl.load(p_a_k + ks * BLOCK_K)
                b_b = tl.load(p_b_k + ks * BLOCK_K)
            else:
                m_k = (o_k < K - ks * BLOCK_K)[None, :]
                b_a = tl.load(p_a_k + ks * BLOCK_K, mask=m_k, other=0.0)
                b_b = tl.load(p_b_k + ks * BLOCK_K, mask=m_k, other=0.0)
            # out_dtype must name the accumulator's type (Triton 3.6 asserts it; its default,
            # float32, does not fit the int32 sums of int8 operands).
            if FP8:
                acc = tl.dot(b_a, tl.trans(b_b), acc, out_dtype=tl.float32)
            else:
                acc = tl.dot(b_a, tl.trans(b_b), acc, out_dtype=tl.int32)

        tile_c += NUM_PROGRAMS
        pid_m, pid_n = _tile_position(tile_c, blocks_m, blocks_n, GROUP_M)
        # The epilogue in two half-width pieces: half the shared memory for the outgoing tile
        # (its layout conversion or its TMA store), which leaves room for the three operand
        # stages with any output dtype.
        acc_0, acc_1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)),
                                           (0, 2, 1)))
        m0, n0 = pid_m * BLOCK_M, pid_n * BLOCK_N
        o_m = m0 + tl.arange(0, BLOCK_M)
        o_n = n0 + tl.arange(0, BLOCK_N // 2)
        c_0 = _dequantize_tile(acc_0, o_m, o_n, p_absmax_a, p_absmax_b, p_bias, M, N,
                               B_ROWWISE, HAS_BIAS, INV_Q, p_c.dtype.element_ty, BF16_BY_HAND)
        c_1 = _dequantize_tile(acc_1, o_m, o_n + BLOCK_N // 2, p_absmax_a, p_absmax_b, p_bias,
                               M, N, B_ROWWISE, HAS_BIAS, INV_Q, p_c.dtype.element_ty,
                               BF16_BY_HAND)
        if TMA_STORE:
            c_desc.store([m0, n0], c_0)
            c_desc.store([m0, n0 + BLOCK_N // 2], c_1)
        else:
            p = p_c + o_m.to(tl.int64)[:, None] * N + o_n[None, :]
            m_m = (o_m < M)[:, None]
            tl.store(p, c_0, mask=m_m & (o_n < N)[None, :])
            tl.store(p + BLOCK_N // 2, c_1, mask=m_m & (o_n + BLOCK_N // 2 < N)[None, :])


# --------------------------------------------------------------------------------------------
# Host functions (the signatures of reference.py)
# --------------------------------------------------------------------------------------------


def _bits(q: Tensor) -> Tensor:
    """q's storage as int8, what the quantizer kernels write (e4m3 codes for fp8)."""
    return q.view(torch.int8)


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
        plan = _row_plan(x.device, c, x.stride(1) == 1)
        _quantize_rows_kernel[(_cdiv(r, plan.block_r),)](
            x, _bits(q), absmax, r, c, x.stride(0), x.stride(1), q.stride(0), q.stride(1),
            FP8=quant_dtype == "fp8", BLOCK_R=plan.block_r, BLOCK_C=plan.block_c,
            PIECES=plan.pieces, num_warps=plan.num_warps,
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
    block_r, block_c, warps = _tile_blocks(x.device)
    grid = (_cdiv(r, block_r), _cdiv(c, block_c))
    partial = torch.empty(grid, dtype=torch.int32, device=x.device)
    _absmax_tiles_kernel[grid](x2, partial, r, c, x2.stride(0), BLOCK_R=block_r,
                               BLOCK_C=block_c, num_warps=warps)
    absmax = torch.empty((), dtype=torch.float32, device=x.device)
    q = torch.empty((c, r) if transpose else (r, c), dtype=QUANT_FORMATS[quant_dtype][0],
                    device=x.device)
    _quantize_tensor_kernel[grid](
        x2, partial, _bits(q), absmax, r, c, x2.stride(0), partial.numel(),
        FP8=quant_dtype == "fp8", TRANSPOSE=transpose, BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_P=min(1024, _next_power_of_2(partial.numel())), num_warps=warps,
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
        block_r, block_c, warps = _tile_blocks(q.device)
        grid = (_cdiv(r, block_r), _cdiv(c, block_c))
        _dequantize_rows_kernel[grid](q, absmax.contiguous(), out, r, c, Q=scale,
                                      BF16_BY_HAND=_bf16_by_hand(dtype), BLOCK_R=block_r,
                                      BLOCK_C=block_c, num_warps=warps)
    return out


#: configurations whose TMA variant failed to build here; they use pointer loads from then on
_TMA_FAILED: set[tuple] = set()


def _pad_inner(t: Tensor, k: int) -> Tensor:
    """t (rows, K) widened with zero columns to (rows, k): zeros add nothing to the sums."""
    out = t.new_zeros((t.shape[0], k))
    out[:, : t.shape[1]] = t
    return out


def matmul_dequantize(
    a: Tensor,  # (M, K) int8 or float8_e4m3fn
    b: Tensor,  # (N, K), a's dtype
    absmax_a: Tensor,  # (M,) float32
    absmax_b: Tensor,  # () or (N,) float32
    bias: Tensor | None,  # (N,)
    out_dtype: torch.dtype,
    *,
    tma: bool | None = None,
) -> Tensor:
    """C = (a @ bᵀ) · absmax_a[:, None] · absmax_b / Q² (+ bias) in out_dtype, one kernel.

    K is padded with zeros to a multiple of 16 (16-byte rows: vector and TMA loads) where it is
    not one. ``tma``: None (default) reads the tiles through TMA descriptors where the device
    allows it (Hopper or later, or the interpreter) and ``FUSEDLOSS_TMA`` is not 0, and writes
    C through one where its rows are 16-byte aligned, falling back to pointer loads with a
    warning if that variant fails to build; True requires it (ValueError where the device has
    no TMA); False uses pointer loads and stores. The result is the same either way, bit for
    bit."""
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
    a, b = a.contiguous(), b.contiguous()
    if k % 16:
        a, b = _pad_inner(a, k + (-k) % 16), _pad_inner(b, k + (-k) % 16)
    cfg = matmul_config(a.device, m, n)
    key = (a.device.type, a.dtype, out_dtype, cfg, absmax_b.dim(), bias is not None)
    tma_loads = _tma_ready(a) and _tma_ready(b)
    if tma and not tma_loads:
        raise ValueError(f"tma=True needs TMA: a Hopper or later GPU (or Triton's interpreter), "
                         f"got {a.device}")
    if tma is None:
        tma_loads = tma_loads and config.tma_enabled() and key not in _TMA_FAILED
    elif not tma:
        tma_loads = False
    args = (a, b, absmax_a.contiguous(), absmax_b.contiguous(),
            bias.contiguous() if bias is not None else None, c, cfg, fp8, scale)
    if tma_loads and tma is None:
        try:
            _launch_matmul(*args, tma=True)
            return c
        except (triton.CompilationError, triton.OutOfResources, RuntimeError) as err:
            _TMA_FAILED.add(key)
            warnings.warn(f"SwitchBack's TMA matmul failed to build ({type(err).__name__}: "
                          f"{str(err)[:300]}); using pointer loads for {key}", RuntimeWarning,
                          stacklevel=2)
            tma_loads = False
    _launch_matmul(*args, tma=tma_loads)
    return c


def _launch_matmul(a, b, absmax_a, absmax_b, bias, c, cfg: MatmulConfig, fp8: bool, scale: float,
                   *, tma: bool) -> None:
    (m, k), n = a.shape, b.shape[0]
    a_desc = b_desc = c_desc = None
    tma_store = tma and _tma_ready(c)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor(a, [m, k], [k, 1], [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor(b, [n, k], [k, 1], [cfg.block_n, cfg.block_k])
        if tma_store:
            c_desc = TensorDescriptor(c, [m, n], [n, 1], [cfg.block_m, cfg.block_n // 2])
    stride = _matmul_stride(a.device)
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    _matmul_dequantize_kernel[(min(tiles, stride),)](
        a, b, a_desc, b_desc, absmax_a, absmax_b, bias, c, c_desc, m, n, k,
        B_ROWWISE=absmax_b.dim() == 1, HAS_BIAS=bias is not None, FP8=fp8, INV_Q=1.0 / scale,
        BF16_BY_HAND=_bf16_by_hand(c.dtype), TMA_LOADS=tma, TMA_STORE=tma_store,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_PROGRAMS=stride, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


__all__ = [name for name in reference.__all__ if name != "int8_matmul_dequantize"]
