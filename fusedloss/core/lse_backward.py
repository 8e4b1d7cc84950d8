"""Backward of the linear-log-sum-exp core: block-sparse recompute, then block-sparse matmuls.

The loss layer hands the core per-row coefficients so that the gradient of the loss with
respect to the logits is

    dX_ij = r_i · P_ij + c_j · Q_ij − t_i · [j = y_i] − u_i · w_j + e_i · P_ij · (X_ij − max_i)
    P = exp(X − lse_i) (row softmax),  Q = exp(X − lse^col_j) (column softmax, optional),
    the last term an entropy's (optional)

(times 1 − tanh² under softcap), or for the pairwise sigmoid loss (SigLIP)

    dX_ij = −r_i · z_ij · σ(−z_ij X_ij)        z = +1 at j = y_i, −1 elsewhere. Only live tiles (``filtering.py``) are computed. The work is
split in column slabs so the scratch stays bounded; per slab:

1. ``_grad_logits_kernel``: one program per live tile recomputes X over the full width D and
   writes dX (input dtype; s·dX when the logits have a scale and no bias, so that the matmuls
   below need no scaling) into a slab scratch, plus the tile's share of d(scale).
2. ``_grad_b_kernel``: one program per (column tile, D chunk) reduces dXᵀ · A over the tile's
   live row blocks, in fp32 on chip, and writes dB once (dbias too).
3. ``_grad_a_kernel``: one program per (row block, D chunk) reduces dX · B over the block's
   live column tiles and adds it to an fp32 accumulator that it owns.

Slabs where most tiles are live take a dense path instead: steps 2 and 3 become two cuBLAS
matmuls on the scratch (the host code in ``engine.py``), which are faster than any sparse
kernel when there is nothing to skip.

Every output element has exactly one writer: no atomics, deterministic results.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .logits import accumulate, div, dot_tile, dot_tile_tma, exp, logits_from_dot, sigmoid
from .lse_forward import _is_target, _may_hold


# The slab's first tile changes from launch to launch of one compiled kernel (core/launch.py):
# never specialized on.
@triton.jit(do_not_specialize=["slab_tile_start", "slab_tiles", "group_rows"])
def _grad_logits_kernel(
    a_ptr, b_ptr,
    a_desc, b_desc,      # TMA descriptors of A in compact row order and of B, or None (USE_TMA)
    bias_ptr, scale_ptr,
    row_index_ptr, n_valid_ptr, col_order_ptr, target_ptr, col_weight_ptr,
    row_max_ptr,         # (N,) fp32 row max, compact row order
    coef_lse_ptr,        # (N,) fp32 r_i / Σ_j exp(X_ij − max_i): r_i · P_ij = this · exp(X − max)
    coef_target_ptr, coef_uniform_ptr,   # (N,) fp32 t_i, u_i, compact row order
    coef_logit_ptr,      # (N,) fp32 e_i / Σ_j exp(X_ij − max_i) (HAS_LOGIT_TERM)
    col_max_ptr,         # (V,) fp32 column max
    coef_col_ptr,        # (V,) fp32 c_j / Σ_i exp(X_ij − max_j), by column id
    live_ptr,            # (row blocks, column tiles) int8: 1 = compute this tile
    scratch_ptr,         # (row blocks · BLOCK_M, scratch_width) dX, input dtype, row-major
    dscale_ptr,          # (row blocks, column tiles) fp32 partial Σ dX_pre · raw
    V, D, stride_a, stride_b, slab_tile_start, slab_tiles, group_rows, scratch_width,
    n_col_tiles,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    SCALE_DX: tl.constexpr,  # store s · dX (the gradient matmuls then need no scaling)
    SOFTCAP: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_UNIFORM: tl.constexpr,
    HAS_COL_WEIGHT: tl.constexpr, HAS_LOGIT_TERM: tl.constexpr, GRAD_SCALE: tl.constexpr,
    ZERO_DEAD: tl.constexpr,
    COL_LSE: tl.constexpr, DIAG_MASK: tl.constexpr, SIGMOID: tl.constexpr,
    FACTOR_COLUMNS: tl.constexpr,  # Q from P's exponentials where a tile allows (_softmax_terms)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, ROUND: tl.constexpr, PRECISE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_m, pid_t = _grouped_tile(tl.program_id(0), tl.num_programs(0) // slab_tiles, slab_tiles,
                                 group_rows)
    tile_id = pid_m.to(tl.int64) * n_col_tiles + slab_tile_start + pid_t
    width = scratch_width  # every slab's rows have the stride of the widest one
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.load(live_ptr + tile_id) == 0:
        if ZERO_DEAD:  # the dense path multiplies every tile: a skipped one must read as 0
            tl.store(_scratch_tile(scratch_ptr, offs_m, pid_t, width, BLOCK_N),
                     tl.zeros((BLOCK_M, BLOCK_N), scratch_ptr.dtype.element_ty))
        return
    n_valid = tl.load(n_valid_ptr)
    m_rows = offs_m < n_valid
    rows = tl.load(row_index_ptr + offs_m, mask=m_rows, other=0).to(tl.int64)
    offs_n = (slab_tile_start + pid_t) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_cols = offs_n < V
    if HAS_ORDER:
        cols = tl.load(col_order_ptr + offs_n, mask=m_cols, other=0).to(tl.int64)
    else:
        cols = offs_n.to(tl.int64)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)

    if USE_TMA:
        raw = dot_tile_tma(a_desc, b_desc, pid_m * BLOCK_M, (slab_tile_start + pid_t) * BLOCK_N, D,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
    else:
        raw = dot_tile(a_ptr, b_ptr, rows, cols, m_rows, m_cols, stride_a, stride_b, D,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
    x = logits_from_dot(raw, bias_ptr, cols, m_cols, scale, HAS_BIAS, HAS_SCALE, SOFTCAP, ROUND,
                        PRECISE)

    # Tile-wide id comparisons in 32 bits (ids < 2³¹): 64-bit ones take two registers per entry.
    if DIAG_MASK:
        x = tl.where(rows.to(tl.int32)[:, None] == cols.to(tl.int32)[None, :], float("-inf"), x)
    coef_lse = tl.load(coef_lse_ptr + offs_m, mask=m_rows, other=0.0)
    if SIGMOID:
        target = tl.load(target_ptr + offs_m, mask=m_rows, other=-1)
        hit = _is_target(target, cols, slab_tile_start + pid_t, BLOCK_N, HAS_ORDER)
        # d softplus(−zX)/dX = −z·σ(−zX)
        dx = tl.where(hit, -sigmoid(-x, PRECISE), sigmoid(x, PRECISE)) * coef_lse[:, None]
    else:
        # P = exp(X − max) / Σ: the division is folded into the coefficient (see RowStats).
        row_max = tl.load(row_max_ptr + offs_m, mask=m_rows, other=0.0)
        e = exp(x - row_max[:, None], PRECISE)
        if COL_LSE:
            col_max = tl.load(col_max_ptr + cols, mask=m_cols, other=0.0)
            coef_col = tl.load(coef_col_ptr + cols, mask=m_cols, other=0.0)
            dx = _softmax_terms(x, e, coef_lse, row_max, m_rows, coef_col, col_max, m_cols,
                                FACTOR_COLUMNS, PRECISE)
        else:
            dx = coef_lse[:, None] * e
        if HAS_LOGIT_TERM:
            coef_logit = tl.load(coef_logit_ptr + offs_m, mask=m_rows, other=0.0)
            centered = tl.where(e > 0, e * (x - row_max[:, None]), 0.0)
            dx += coef_logit[:, None] * centered
        if HAS_TARGET:
            target = tl.load(target_ptr + offs_m, mask=m_rows, other=-1)
            # Most tiles hold no target of this block: test that once, not per element (here,
            # unlike in the forward, the branch measured no slower than the masked update).
            if _may_hold(target, slab_tile_start + pid_t, BLOCK_N, HAS_ORDER):
                coef_target = tl.load(coef_target_ptr + offs_m, mask=m_rows, other=0.0)
                hit = _is_target(target, cols, slab_tile_start + pid_t, BLOCK_N, HAS_ORDER)
                dx -= tl.where(hit, coef_target[:, None], 0.0)
    if HAS_UNIFORM:
        coef_uniform = tl.load(coef_uniform_ptr + offs_m, mask=m_rows, other=0.0)
        if HAS_COL_WEIGHT:
            w = tl.load(col_weight_ptr + cols, mask=m_cols, other=0.0)
            dx -= coef_uniform[:, None] * w[None, :]
        else:
            dx -= coef_uniform[:, None]
    if SOFTCAP > 0:
        capped = div(x, SOFTCAP, PRECISE)
        dx = dx * (1.0 - capped * capped)
    dx = tl.where(m_rows[:, None] & m_cols[None, :], dx, 0.0)
    if GRAD_SCALE:
        tl.store(dscale_ptr + tile_id, tl.sum(tl.sum(dx * raw, axis=1), axis=0))
    if SCALE_DX:
        dx = dx * scale

    tl.store(_scratch_tile(scratch_ptr, offs_m, pid_t, width, BLOCK_N),
             dx.to(scratch_ptr.dtype.element_ty))


@triton.jit
def _grouped_tile(pid, n_rows, n_tiles, group_rows):
    """(row block, tile) of program ``pid`` of a (n_rows × n_tiles) grid, launched in groups
    of ``group_rows`` row blocks: within a group, consecutive programs take consecutive row
    blocks of one tile (running programs share the tile's B rows), and a group sweeps every
    tile before the next group starts (its A rows stay in L2 across the tiles).

    Row blocks first over the whole grid re-read every row of A from memory at each tile
    once A outgrows L2; tiles first lose the B rows' sharing where A fits. Groups keep both
    (docs/design.md, "Backward", item 1, has the timings of the three orders).
    """
    per_group = group_rows * n_tiles
    group = pid // per_group
    first = group * group_rows
    rows_here = tl.minimum(group_rows, n_rows - first)
    local = pid - group * per_group
    return first + local % rows_here, local // rows_here


# Q's factored form needs every column max within this many nats of the tile's largest row
# max: exp(ref − max_j) ≤ e⁶⁰ ≈ 1e26 leaves 1e12 of fp32's range to the coefficient c_j (loss
# scaling included), and an entry that counts in its column, X_ij ≈ max_j, keeps
# exp(X_ij − ref) ≥ e⁻⁶⁰, far from fp32's underflow (e⁻⁸⁷).
_FACTOR_RANGE = tl.constexpr(60.0)


@triton.jit
def _softmax_terms(x, e, coef_lse, row_max, m_rows, coef_col, col_max, m_cols,
                   FACTOR_COLUMNS: tl.constexpr, PRECISE: tl.constexpr):
    """r_i · P_ij + c_j · Q_ij of a tile, given e = exp(X − max_i) (P's exponentials).

    Q needs exp(X_ij − max_j), a second exponential per entry. With ``FACTOR_COLUMNS`` (bf16
    and fp16 inputs, whose dX is stored in that dtype) it comes from e instead, where the
    tile's maxima lie within _FACTOR_RANGE of each other:

        exp(X_ij − max_j) = e_ij · exp(max_i − ref) · exp(ref − max_j),   ref = max over rows

    so r_i·P + c_j·Q = e_ij · (coef_lse_i + a_i · b_j) with a and b per row and per column:
    one exponential per entry instead of two (a few fp32 ulp from the direct form; the
    precise form stays for fp32 inputs and for wide tiles).
    """
    if FACTOR_COLUMNS:
        ref = tl.max(tl.where(m_rows, row_max, float("-inf")), axis=0)
        low = tl.min(tl.where(m_cols, col_max, float("inf")), axis=0)
        if ref - low <= _FACTOR_RANGE:
            a = exp(row_max - ref, PRECISE)
            b = coef_col * exp(ref - col_max, PRECISE)
            dx = e * (coef_lse[:, None] + a[:, None] * b[None, :])
        else:
            dx = coef_lse[:, None] * e + coef_col[None, :] * exp(x - col_max[None, :], PRECISE)
    else:
        dx = coef_lse[:, None] * e + coef_col[None, :] * exp(x - col_max[None, :], PRECISE)
    return dx


@triton.jit
def _scratch_tile(scratch_ptr, offs_m, pid_t, width, BLOCK_N: tl.constexpr):
    """Pointers of tile (row block, pid_t) in the row-major slab scratch (formed where they are
    used: a tile of 64-bit pointers held across the kernel costs two registers per entry)."""
    return (scratch_ptr + offs_m.to(tl.int64)[:, None] * width
            + (pid_t * BLOCK_N + tl.arange(0, BLOCK_N))[None, :])


@triton.jit
def _grad_b_kernel(
    a_ptr, scratch_ptr, scale_ptr,
    row_index_ptr, n_valid_ptr, col_order_ptr,
    col_list_ptr,        # (slab tiles, row blocks) int32: live row blocks of each tile, first
    col_count_ptr,       # (slab tiles,) int32
    grad_b_ptr,          # (V, D) written once per element (input dtype), or accumulated (fp32)
    grad_bias_ptr,       # (V,) fp32
    rank1_col_ptr,       # (V,) fp32 w_j of the rank-1 term  −w_j · v  (label smoothing)
    rank1_vec_ptr,       # (D,) fp32 v = s · Σ_i u_i A_i
    rank1_bias_ptr,      # () fp32 Σ_i u_i, the rank-1 term's share of dbias
    V, D, stride_a, stride_gb, n_row_blocks, scratch_width, slab_tile_start,
    HAS_SCALE: tl.constexpr, HAS_ORDER: tl.constexpr, GRAD_B: tl.constexpr,
    GRAD_BIAS: tl.constexpr, HAS_RANK1: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PRECISE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    offs_n = (slab_tile_start + pid_t) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_cols = offs_n < V
    if HAS_ORDER:
        cols = tl.load(col_order_ptr + offs_n, mask=m_cols, other=0).to(tl.int64)
    else:
        cols = offs_n.to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = offs_d < D
    width = scratch_width
    offs_tile = (tl.arange(0, BLOCK_M)[:, None] * width
                 + pid_t * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])

    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    bias_acc = tl.zeros((BLOCK_N,), tl.float32)
    count = tl.load(col_count_ptr + pid_t)
    for q in range(0, count):
        i = tl.load(col_list_ptr + pid_t.to(tl.int64) * n_row_blocks + q).to(tl.int64)
        offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
        m_rows = offs_m < n_valid
        rows = tl.load(row_index_ptr + offs_m, mask=m_rows, other=0).to(tl.int64)
        dx = tl.load(scratch_ptr + i * BLOCK_M * width + offs_tile)
        if GRAD_B:
            a = tl.load(a_ptr + rows[:, None] * stride_a + offs_d[None, :],
                        mask=m_rows[:, None] & m_d[None, :], other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                dx = dx.to(tl.float32)
            acc = accumulate(acc, tl.trans(dx), a, PRECISION, PRECISE)
        if GRAD_BIAS:
            bias_acc += tl.sum(dx.to(tl.float32), axis=0)

    if HAS_RANK1:
        w = tl.load(rank1_col_ptr + cols, mask=m_cols, other=0.0)
    if GRAD_B:
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr).to(tl.float32)
        if HAS_RANK1:
            v = tl.load(rank1_vec_ptr + offs_d, mask=m_d, other=0.0)
            acc -= w[:, None] * v[None, :]
        out_ptrs = grad_b_ptr + cols[:, None] * stride_gb + offs_d[None, :]
        out_mask = m_cols[:, None] & m_d[None, :]
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(grad_b_ptr.dtype.element_ty), mask=out_mask)
    if GRAD_BIAS:
        if pid_d == 0:
            if HAS_RANK1:
                bias_acc -= w * tl.load(rank1_bias_ptr)
            bias_ptrs = grad_bias_ptr + cols
            if ACCUMULATE:
                bias_acc += tl.load(bias_ptrs, mask=m_cols, other=0.0)
            tl.store(bias_ptrs, bias_acc, mask=m_cols)


@triton.jit
def _grad_a_kernel(
    b_ptr, scratch_ptr,
    n_valid_ptr, col_order_ptr,
    row_list_ptr,        # (row blocks, slab tiles) int32: live tiles of each row block, first
    row_count_ptr,       # (row blocks,) int32
    acc_ptr,             # (row blocks · BLOCK_M, D) fp32 Σ_slabs dX · B, compact row order
    V, D, stride_b, n_slab_tiles, scratch_width, slab_tile_start,
    HAS_ORDER: tl.constexpr, FIRST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PRECISE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    if pid_m * BLOCK_M >= n_valid:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = offs_m < n_valid
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = offs_d < D
    width = scratch_width
    row_base = scratch_ptr + offs_m.to(tl.int64)[:, None] * width + tl.arange(0, BLOCK_N)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    count = tl.load(row_count_ptr + pid_m)
    for q in range(0, count):
        t = tl.load(row_list_ptr + pid_m.to(tl.int64) * n_slab_tiles + q).to(tl.int64)
        offs_n = (slab_tile_start + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_cols = offs_n < V
        if HAS_ORDER:
            cols = tl.load(col_order_ptr + offs_n, mask=m_cols, other=0).to(tl.int64)
        else:
            cols = offs_n.to(tl.int64)
        dx = tl.load(row_base + t * BLOCK_N)
        b = tl.load(b_ptr + cols[:, None] * stride_b + offs_d[None, :],
                    mask=m_cols[:, None] & m_d[None, :], other=0.0)
        if DOT_FP32:
            dx = dx.to(tl.float32)
            b = b.to(tl.float32)
        acc = accumulate(acc, dx, b, PRECISION, PRECISE)

    acc_ptrs = acc_ptr + offs_m.to(tl.int64)[:, None] * D + offs_d[None, :]
    mask = m_rows[:, None] & m_d[None, :]
    if not FIRST:
        acc += tl.load(acc_ptrs, mask=mask, other=0.0)
    tl.store(acc_ptrs, acc, mask=mask)


# The slab's first column and width change from launch to launch (core/launch.py).
@triton.jit(do_not_specialize=["K", "c0", "first"])
def _accumulate_split_kernel(
    dx_ptr, b_ptr, dx_desc, b_desc,   # the slab's dX (rows, K) and B's rows c0.. (K, D), or TMA
    hi_ptr, lo_ptr,      # (rows, D) bf16: the running Σ dX · B as hi + lo, row-major
    n_rows, D, K, c0, V, stride_dx, stride_b, stride_acc,
    first,               # 1: hi and lo hold nothing yet (a runtime flag: one compiled kernel)
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """hi + lo += dX · B_slab, one (BLOCK_M × BLOCK_D) output tile per program.

    A bf16 pair (hi = the sum rounded, lo = the rest rounded) carries ~16 significant bits, far
    below the one bf16 rounding the result gets, in half the bytes of an fp32 accumulator; the
    product itself is accumulated in fp32 over the slab's K.
    """
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_rows = offs_m < n_rows
    m_d = offs_d < D
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if USE_TMA:
            x = dx_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([c0 + k * BLOCK_K, pid_d * BLOCK_D])
        else:
            ks = k * BLOCK_K + offs_k
            x = tl.load(dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dx + ks[None, :],
                        mask=m_rows[:, None] & (ks < K)[None, :], other=0.0)
            rows_b = (c0 + ks).to(tl.int64)
            b = tl.load(b_ptr + rows_b[:, None] * stride_b + offs_d[None, :],
                        mask=((ks < K) & (rows_b < V))[:, None] & m_d[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(x, b, acc, input_precision=PRECISION)
    ptrs = offs_m.to(tl.int64)[:, None] * stride_acc + offs_d[None, :]
    mask = m_rows[:, None] & m_d[None, :]
    if first == 0:
        # hi + lo is exact in fp32 (lo is below hi's last bit); one rounding adds the product.
        acc += (tl.load(hi_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
                + tl.load(lo_ptr + ptrs, mask=mask, other=0.0).to(tl.float32))
    hi = _bf16_rn(acc)
    lo = _bf16_rn(acc - hi.to(tl.float32))
    tl.store(hi_ptr + ptrs, hi, mask=mask)
    tl.store(lo_ptr + ptrs, lo, mask=mask)


@triton.jit
def _bf16_rn(x):
    """fp32 → bf16 rounded to nearest even, on the bits: the same on a GPU and under the
    interpreter, whose conversion truncates. Inf and NaN stay what they are."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    # A NaN whose payload fills the mantissa would carry into the sign bit above.
    return tl.where(x == x, rounded, x.to(tl.bfloat16))
