"""Triton helpers shared by the kernels: how one logit tile is formed from A and B.

A tile of logits is X = s · A_rows · B_colsᵀ (+ bias_cols), then optionally soft-capped
X ← c · tanh(X / c). Every kernel that needs logits builds them with these helpers, so the
forward and the backward see bit-identical values.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp(x, PRECISE: tl.constexpr):
    """e^x. ``PRECISE``: libdevice's expf (≤ 2 ulp, as PyTorch's exp). Otherwise the hardware
    approximation ex2.approx(x · log2 e), whose error grows with |x| (≈ 2 + 1.2·|x| ulp): far
    below bf16/fp16 rounding, but 10–30 ulp of fp32 at the |x| of a sigmoid loss's logits.
    Under the interpreter (numpy's exact exp) ``PRECISE`` must be off: it has no libdevice."""
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log(x, PRECISE: tl.constexpr):
    """log x. ``PRECISE``: libdevice's logf (≤ 1 ulp); otherwise the hardware lg2.approx."""
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def div(x, y, PRECISE: tl.constexpr):
    """x / y, correctly rounded when ``PRECISE`` (Triton's fp32 division is approximate)."""
    if PRECISE:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def tanh(x, PRECISE: tl.constexpr):
    # 1 - 2 / (exp(2x) + 1): exact at ±inf, no dependence on a libdevice tanh.
    return 1.0 - div(2.0, exp(2.0 * x, PRECISE) + 1.0, PRECISE)


@triton.jit
def tanh_approx(x, HARDWARE: tl.constexpr):
    """tanh x from the GPU's special-function unit (``tanh.approx.f32``: one operation, relative
    error ≤ 2^-10.99, far below a bf16/fp16 logit's rounding) where ``HARDWARE``; else the
    formula of ``tanh`` (the interpreter has no inline PTX)."""
    if HARDWARE:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tanh(x, False)


@triton.jit
def log1p_exp_neg(y, PRECISE: tl.constexpr):
    """log(1 + e^(−y)) for y >= 0, accurate in the tail (the softplus of −y)."""
    u = exp(-y, PRECISE)
    if PRECISE:
        return libdevice.log1p(u)
    else:
        # Goldberg's log1p: log(1 + u) to a few ulps for tiny u.
        w = 1.0 + u
        return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def sigmoid(y, PRECISE: tl.constexpr):
    # 1 / (1 + exp(-y)) without overflow on either side.
    e = exp(-tl.abs(y), PRECISE)
    return tl.where(y >= 0, div(1.0, 1.0 + e, PRECISE), div(e, 1.0 + e, PRECISE))


@triton.jit
def accumulate(acc, a, b, PRECISION: tl.constexpr, PRECISE: tl.constexpr):
    """acc + a · b. An fp32 ("ieee") tl.dot is one FMA chain per output over every step of a
    loop that feeds it acc: its rounding error grows with the loop's whole length, well above
    cuBLAS's and PyTorch's (docs/design.md, "fp32 inputs").
    ``PRECISE`` sums each step's product on its own and adds it once: two short chains.
    It needs a GPU (inline PTX), like ``mul_rn``; the interpreter's numpy dot is exact anyway."""
    if PRECISE:
        # An inline add: the compiler folds a plain acc + dot(a, b) back into dot(a, b, acc).
        step = tl.dot(a, b, input_precision=PRECISION)
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, step],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def dot_tile(
    a_ptr, b_ptr,                # A (·, D) and B (·, D), row-major, innermost stride 1
    rows, cols,                  # int64 row indices into A (BLOCK_M,), into B (BLOCK_N,)
    row_mask, col_mask,
    stride_a, stride_b, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,      # upcast operands before tl.dot (CPU interpreter: bf16 dot is wrong)
    PRECISION: tl.constexpr,     # tl.dot input_precision: "ieee" keeps fp32 inputs exact, not tf32
    PRECISE: tl.constexpr = False,   # short FMA chains (see accumulate)
):
    """Raw dot products A[rows] · B[cols]ᵀ over the full width D, fp32 accumulation."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + cols[:, None] * stride_b + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        k_mask = offs_k < D - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = accumulate(acc, a, tl.trans(b), PRECISION, PRECISE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def dot_tile_tma(
    a_desc, b_desc,              # TMA descriptors of A (·, D) and B (·, D), blocks (BLOCK_·, BLOCK_K)
    row0, col0, D,               # first row of the A block, first row of the B block
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PRECISE: tl.constexpr,
):
    """``dot_tile`` for blocks of consecutive rows, fed by the bulk copy engine (rows past
    either matrix's end read as zeros)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row0 = tl.cast(row0, tl.int32)  # TMA coordinates are 32-bit (rows < 2³¹ always hold)
    col0 = tl.cast(col0, tl.int32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        a = a_desc.load([row0, k * BLOCK_K])
        b = b_desc.load([col0, k * BLOCK_K])
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = accumulate(acc, a, tl.trans(b), PRECISION, PRECISE)
    return acc


@triton.jit
def mul_rn(x, y, ROUND: tl.constexpr):
    """x · y rounded to fp32 as written: the compiler may not fuse it into a later add (FMA).

    X = s · raw must be the same rounded number in the forward (which takes max_j X_ij) and in
    the backward (which forms X − max): fma(s, raw, −max) would keep the product's rounding
    error, ≈ ulp(X), in P = exp(X − max − log Σ), and that error is the whole gradient of a
    confident row (1 − P_ii). ``ROUND`` is off under the interpreter (no inline PTX; numpy
    rounds every product anyway).
    """
    if ROUND:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return x * y


@triton.jit
def logits_from_dot(
    raw, bias_ptr, cols, col_mask, scale,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    ROUND: tl.constexpr, PRECISE: tl.constexpr,
):
    """X = softcap(scale · raw + bias); returns the fp32 tile (masked columns untouched)."""
    x = raw
    if HAS_SCALE:
        x = mul_rn(x, tl.zeros_like(x) + scale, ROUND)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = x + bias[None, :]
    if SOFTCAP > 0:
        t = tanh(div(x, SOFTCAP, PRECISE), PRECISE)
        x = mul_rn(t, tl.zeros_like(t) + SOFTCAP, ROUND)
    return x
