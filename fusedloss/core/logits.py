"""Triton helpers shared by the kernels: how one logit tile is formed from A and B.

A tile of logits is X = s · A_rows · B_colsᵀ (+ bias_cols), then optionally soft-capped
X ← c · tanh(X / c). Every kernel that needs logits builds them with these helpers, so the
forward and the backward see bit-identical values.
"""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact at ±inf, no dependence on a libdevice tanh.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def log1p(u):
    # log(1 + u) for finite u >= 0, accurate to a few ulps for tiny u (Goldberg's trick).
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def sigmoid(y):
    # 1 / (1 + exp(-y)) without overflow on either side.
    e = tl.exp(-tl.abs(y))
    return tl.where(y >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def dot_tile(
    a_ptr, b_ptr,                # A (·, D) and B (·, D), row-major, innermost stride 1
    rows, cols,                  # int64 row indices into A (BLOCK_M,), into B (BLOCK_N,)
    row_mask, col_mask,
    stride_a, stride_b, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,      # upcast operands before tl.dot (CPU interpreter: bf16 dot is wrong)
    PRECISION: tl.constexpr,     # tl.dot input_precision: "ieee" keeps fp32 inputs exact, not tf32
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
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
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
    ROUND: tl.constexpr,
):
    """X = softcap(scale · raw + bias); returns the fp32 tile (masked columns untouched)."""
    x = raw
    if HAS_SCALE:
        x = mul_rn(x, tl.zeros_like(x) + scale, ROUND)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = x + bias[None, :]
    if SOFTCAP > 0:
        t = tanh(x / SOFTCAP)
        x = mul_rn(t, tl.zeros_like(t) + SOFTCAP, ROUND)
    return x
