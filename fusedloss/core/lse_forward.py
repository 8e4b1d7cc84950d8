"""Forward of the linear-log-sum-exp core: row (and column) statistics of X without storing it.

X = softcap(s · A Bᵀ + bias), optionally with the entries X_ii masked out (``DIAG_MASK``: the
self-pairs of SimCLR, where A and B are the same rows).

Grid: (row groups, column splits). Program (g, c) owns the rectangle "row blocks of group g ×
column tiles of split c" and visits it row block by row block, tile by tile:

- per row it keeps an online (max, sum) over its tiles and writes one partial per split;
- with ``COL_STATS`` it also folds each tile into a per-column (max, sum) partial of its group
  (a read-modify-write of BLOCK_N pairs that only this program touches): both directions of a
  symmetric contrastive loss come from one pass over the tiles;
- it records, per (row block, column tile), the largest log-mass log Σ_{j∈tile} exp(X_rj) over
  the block's rows (and with ``COL_STATS`` the largest log Σ_{r∈block} exp(X_rj) over the tile's
  columns): the backward turns these into safe skipping decisions (``filtering.py``).

``_combine_partials_kernel`` then merges the partials (a log-sum-exp over a few dozen
entries per row or column) in one launch for rows and columns together.
Each row's target logit comes from ``_target_logit_kernel``, one small tile per row block
that reproduces the forward's value for it bit for bit (a confident row's loss, LSE − target,
is then exactly 0 where it rounds to 0).

``ENTROPY`` adds per row Σ_j exp(X_ij − max)·(X_ij − max) (the split's max), kept online as
the sum is: with it, a row's entropy is log Σ − (this / Σ), a sum of two terms ≥ 0 without
cancellation.

``SQUARES`` adds per row Σ_j exp(2·(X_ij − max)) (the split's max): with it, log Σ_j P_ij² is
log(this) − 2·log Σ.

``SIGMOID`` switches the statistic to the pairwise sigmoid loss of SigLIP: per row the sum
Σ_j softplus(−z_ij X_ij) with z = +1 at the row's target and −1 elsewhere.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .logits import dot_tile, dot_tile_tma, exp, log, log1p_exp_neg, logits_from_dot


@triton.jit
def _lse_forward_kernel(
    a_ptr, b_ptr,
    a_desc, b_desc,      # TMA descriptors of A in compact row order and of B, or None (USE_TMA)
    bias_ptr, scale_ptr,
    row_index_ptr,       # (N,) int64: compact row p reads A[row_index[p]]
    n_valid_ptr,         # () int64: rows p >= n_valid are skipped (ignored tokens)
    col_order_ptr,       # (V,) int64: tile position j holds column col_order[j] (vocabulary sorting)
    target_ptr,          # (N,) int64: original column id of each compact row's target, or -1
                         # (read with HAS_TARGET: the sigmoid loss, whose targets flip sign;
                         # the other losses take target logits from _target_logit_kernel)
    col_weight_ptr,      # (V,) fp32 column weights of the weighted row sum
    max_out_ptr,         # (splits, N) fp32 partial row max
    sum_out_ptr,         # (splits, N) fp32 partial Σ exp(X - max)   (SIGMOID: Σ softplus(−zX))
    target_out_ptr,      # (splits, N) fp32 partial target logit
    wsum_out_ptr,        # (splits, N) fp32 partial Σ_j w_j X_ij
    ent_out_ptr,         # (splits, N) fp32 partial Σ_j exp(X_ij − max)·(X_ij − max) (ENTROPY)
    sq_out_ptr,          # (splits, N) fp32 partial Σ_j exp(2·(X_ij − max)) (SQUARES)
    tile_stat_ptr,       # (row blocks, column tiles) fp32 max_r log Σ_{j∈tile} exp(X_rj)
    col_max_ptr,         # (row groups, V) fp32 partial column max, by tile position
    col_sum_ptr,         # (row groups, V) fp32 partial column Σ exp(X - max)
    col_tile_stat_ptr,   # (row blocks, column tiles) fp32 max_j log Σ_{r∈block} exp(X_rj)
    N, V, D, stride_a, stride_b, blocks_per_group, tiles_per_split, n_col_tiles,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_WSUM: tl.constexpr,
    HAS_COL_WEIGHT: tl.constexpr, RECORD_TILES: tl.constexpr,
    COL_STATS: tl.constexpr, DIAG_MASK: tl.constexpr, SIGMOID: tl.constexpr,
    ENTROPY: tl.constexpr, SQUARES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, ROUND: tl.constexpr, PRECISE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_g = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    block_begin = pid_g * blocks_per_group
    block_end = tl.minimum(block_begin + blocks_per_group, tl.cdiv(n_valid, BLOCK_M))
    tile_begin = pid_s * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, n_col_tiles)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)

    for rb in range(block_begin, block_end):
        offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_rows = offs_m < n_valid
        rows = tl.load(row_index_ptr + offs_m, mask=m_rows, other=0).to(tl.int64)
        if HAS_TARGET:
            target = tl.load(target_ptr + offs_m, mask=m_rows, other=-1)

        row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        row_sum = tl.zeros((BLOCK_M,), tl.float32)
        target_logit = tl.zeros((BLOCK_M,), tl.float32)
        weighted_sum = tl.zeros((BLOCK_M,), tl.float32)
        centered_sum = tl.zeros((BLOCK_M,), tl.float32)
        square_sum = tl.zeros((BLOCK_M,), tl.float32)

        for t in range(tile_begin, tile_end):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            m_cols = offs_n < V
            if HAS_ORDER:
                cols = tl.load(col_order_ptr + offs_n, mask=m_cols, other=0).to(tl.int64)
            else:
                cols = offs_n.to(tl.int64)
            if USE_TMA:
                raw = dot_tile_tma(a_desc, b_desc, rb * BLOCK_M, t * BLOCK_N, D,
                                   BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
            else:
                raw = dot_tile(a_ptr, b_ptr, rows, cols, m_rows, m_cols, stride_a, stride_b, D,
                               BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
            x = logits_from_dot(raw, bias_ptr, cols, m_cols, scale, HAS_BIAS, HAS_SCALE, SOFTCAP,
                                ROUND, PRECISE)
            x = tl.where(m_cols[None, :], x, float("-inf"))
            # Tile-wide id comparisons in 32 bits (ids < 2³¹, checked by the host): a 64-bit
            # one holds two registers per entry and made the tile spill.
            if DIAG_MASK:
                x = tl.where(rows.to(tl.int32)[:, None] == cols.to(tl.int32)[None, :],
                             float("-inf"), x)
            y = x  # SIGMOID: −z·X, z = +1 at the target
            if HAS_TARGET:
                # Test once whether the tile holds any of the block's targets (most don't).
                if _may_hold(target, t, BLOCK_N, HAS_ORDER):
                    hit = _is_target(target, cols, t, BLOCK_N, HAS_ORDER) & m_cols[None, :]
                    target_logit += tl.sum(tl.where(hit, x, 0.0), axis=1)
                    if SIGMOID:
                        y = tl.where(hit, -x, x)

            if SIGMOID:
                # softplus(y): max(y, 0) + log1p(exp(−|y|)), exact in the tails.
                softplus = tl.maximum(y, 0.0) + log1p_exp_neg(tl.abs(y), PRECISE)
                row_sum += tl.sum(tl.where(m_cols[None, :], softplus, 0.0), axis=1)
            else:
                new_max = tl.maximum(row_max, tl.max(x, axis=1))
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                e = exp(x - safe_max[:, None], PRECISE)
                tile_sum = tl.sum(e, axis=1)
                if ENTROPY:
                    # Σ e·(X − max) moves to the new max as the sum does, plus (old − new)·Σ
                    # (entries with e = 0, masked ones included, add nothing).
                    shift = tl.where(row_max > float("-inf"), row_max - safe_max, 0.0)
                    tile_centered = tl.sum(tl.where(e > 0, e * (x - safe_max[:, None]), 0.0),
                                           axis=1)
                    centered_sum = ((centered_sum + shift * row_sum) * exp(shift, PRECISE)
                                    + tile_centered)
                if SQUARES:
                    rescale = exp(row_max - safe_max, PRECISE)
                    square_sum = square_sum * rescale * rescale + tl.sum(e * e, axis=1)
                row_sum = row_sum * exp(row_max - safe_max, PRECISE) + tile_sum
                row_max = new_max
                if RECORD_TILES:
                    tile_mass = tl.where(m_rows, new_max + tl.log(tile_sum), float("-inf"))
                    tl.store(tile_stat_ptr + (rb * n_col_tiles + t).to(tl.int64),
                             tl.max(tile_mass, axis=0))
                if COL_STATS:
                    _fold_columns(x, m_rows, m_cols, offs_n, pid_g, rb, t, V, n_col_tiles,
                                  col_max_ptr, col_sum_ptr, col_tile_stat_ptr, RECORD_TILES,
                                  BLOCK_N, PRECISE)
            if HAS_WSUM:
                xw = tl.where(m_cols[None, :], x, 0.0)
                if HAS_COL_WEIGHT:
                    w = tl.load(col_weight_ptr + cols, mask=m_cols, other=0.0)
                    xw = xw * w[None, :]
                weighted_sum += tl.sum(xw, axis=1)

        out = pid_s.to(tl.int64) * N + offs_m
        if not SIGMOID:
            tl.store(max_out_ptr + out, row_max, mask=m_rows)
        tl.store(sum_out_ptr + out, row_sum, mask=m_rows)
        if HAS_TARGET:
            tl.store(target_out_ptr + out, target_logit, mask=m_rows)
        if HAS_WSUM:
            tl.store(wsum_out_ptr + out, weighted_sum, mask=m_rows)
        if ENTROPY:
            tl.store(ent_out_ptr + out, centered_sum, mask=m_rows)
        if SQUARES:
            tl.store(sq_out_ptr + out, square_sum, mask=m_rows)


@triton.jit
def _may_hold(target, t, BLOCK_N: tl.constexpr, HAS_ORDER: tl.constexpr):
    """Whether column tile t may hold some row's target (targets are column ids; with a
    column order, tile positions differ from ids and every tile may)."""
    if HAS_ORDER:
        return True
    else:
        lo = t * BLOCK_N
        inside = (target >= lo) & (target < lo + BLOCK_N)
        return tl.max(inside.to(tl.int32), axis=0) > 0


@triton.jit
def _is_target(target, cols, t, BLOCK_N: tl.constexpr, HAS_ORDER: tl.constexpr):
    """(rows, tile columns) mask of each row's target in column tile t.

    In 32 bits (ids < 2³¹, checked by the host): a 64-bit comparison holds two registers per
    entry. Without a column order, positions are ids: compare offsets within the tile.
    """
    if HAS_ORDER:
        return cols.to(tl.int32)[None, :] == target.to(tl.int32)[:, None]
    else:
        local = (target - t * BLOCK_N).to(tl.int32)
        return tl.arange(0, BLOCK_N)[None, :] == local[:, None]


@triton.jit
def _fold_columns(x, m_rows, m_cols, offs_n, pid_g, rb, t, V, n_col_tiles,
                  col_max_ptr, col_sum_ptr, col_tile_stat_ptr, RECORD_TILES: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISE: tl.constexpr):
    """Adds one tile's column (max, Σ exp) to the group's running column partials."""
    xc = tl.where(m_rows[:, None], x, float("-inf"))
    tile_max = tl.max(xc, axis=0)
    safe_tile = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    tile_sum = tl.sum(exp(xc - safe_tile[None, :], PRECISE), axis=0)
    if RECORD_TILES:
        mass = tl.where(m_cols, tile_max + tl.log(tile_sum), float("-inf"))
        tl.store(col_tile_stat_ptr + (rb * n_col_tiles + t).to(tl.int64), tl.max(mass, axis=0))
    ptrs = pid_g.to(tl.int64) * V + offs_n
    old_max = tl.load(col_max_ptr + ptrs, mask=m_cols, other=float("-inf"))
    old_sum = tl.load(col_sum_ptr + ptrs, mask=m_cols, other=0.0)
    new_max = tl.maximum(old_max, tile_max)
    safe_new = tl.where(new_max == float("-inf"), 0.0, new_max)
    new_sum = (old_sum * exp(old_max - safe_new, PRECISE)
               + tile_sum * exp(tile_max - safe_new, PRECISE))
    tl.store(col_max_ptr + ptrs, new_max, mask=m_cols)
    tl.store(col_sum_ptr + ptrs, new_sum, mask=m_cols)
    # The next row block of this program reads these partials back: make the stores visible
    # to every thread of the block whatever layout the compiler picks.
    tl.debug_barrier()


@triton.jit
def _target_logit_kernel(
    a_ptr, b_ptr, bias_ptr, scale_ptr,
    row_index_ptr,       # (N,) int64: compact row p reads A[row_index[p]]
    n_valid_ptr,         # () int64: rows p >= n_valid are skipped
    target_ptr,          # (N,) int64: original column id of each compact row's target, or -1
    out_ptr,             # (N,) fp32: X[p, target[p]], 0 where the target is -1
    N, D, stride_a, stride_b,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, ROUND: tl.constexpr, PRECISE: tl.constexpr,
):
    """Each row's target logit, bit for bit the value the forward's tile holds for it.

    One program per row block: a tile whose column c is the target column of the block's row c
    (BLOCK_M / BLOCK_N tiles when BLOCK_N < BLOCK_M), formed by the same helpers, block sizes
    and K order as the forward's tiles, so each entry is the same sum in the same order; the
    diagonal is kept. This costs N · BLOCK_M · D multiply-adds, where testing every forward
    tile for targets costs work on all N · V entries (docs/design.md, "Target logits").
    """
    rb = tl.program_id(0)
    n_valid = tl.load(n_valid_ptr)
    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_rows = offs_m < n_valid
    rows = tl.load(row_index_ptr + offs_m, mask=m_rows, other=0).to(tl.int64)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    target_logit = tl.zeros((BLOCK_M,), tl.float32)
    for c0 in tl.static_range(0, BLOCK_M, BLOCK_N):
        local = c0 + tl.arange(0, BLOCK_N)  # the block's row that tile column c belongs to
        offs_c = rb * BLOCK_M + local
        m_cols = (local < BLOCK_M) & (offs_c < n_valid)
        target = tl.load(target_ptr + offs_c, mask=m_cols, other=-1)
        m_cols = m_cols & (target >= 0)
        cols = tl.where(m_cols, target, 0).to(tl.int64)
        raw = dot_tile(a_ptr, b_ptr, rows, cols, m_rows, m_cols, stride_a, stride_b, D,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
        x = logits_from_dot(raw, bias_ptr, cols, m_cols, scale, HAS_BIAS, HAS_SCALE, SOFTCAP,
                            ROUND, PRECISE)
        own = (tl.arange(0, BLOCK_M)[:, None] == local[None, :]) & m_cols[None, :]
        target_logit += tl.sum(tl.where(own, x, 0.0), axis=1)
    tl.store(out_ptr + offs_m, target_logit, mask=offs_m < N)


@triton.jit
def _combine_partials_kernel(
    row_max_ptr, row_sum_ptr,  # (row parts, N) fp32 partial (max, Σ exp(X − max)) per row
    n_row_parts, N,
    n_valid_ptr,               # () int64: rows p >= n_valid get max 0, sum 1 (lse 0)
    row_out_ptr,               # (4, N) fp32 out: max, sum, log sum, lse per row
    col_max_ptr, col_sum_ptr,  # (column parts, V) fp32 partials per column, by tile position
    n_col_parts, V,
    col_order_ptr,             # (V,) int64: position j holds column col_order[j] (HAS_ORDER)
    col_out_ptr,               # (4, V) fp32 out, by column id
    n_row_programs,
    COLUMNS: tl.constexpr, HAS_ORDER: tl.constexpr, BLOCK: tl.constexpr,
    PARTS: tl.constexpr, PRECISE: tl.constexpr,
):
    """lse = max + log Σ_k sum_k · exp(max_k − max) over the partials of each row (programs
    below ``n_row_programs``) and each column (the others): one launch where the host would
    issue two dozen small operations. The max is 0 where no partial is finite (sum then 0)."""
    pid = tl.program_id(0)
    if pid < n_row_programs:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        valid = offs < tl.load(n_valid_ptr)
        _combine(row_max_ptr, row_sum_ptr, n_row_parts, N, offs, valid, offs, row_out_ptr,
                 BLOCK, PARTS, PRECISE)
    elif COLUMNS:
        offs = (pid - n_row_programs) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        dest = offs
        if HAS_ORDER:
            dest = tl.load(col_order_ptr + offs, mask=inside, other=0)
        _combine(col_max_ptr, col_sum_ptr, n_col_parts, V, offs, inside, dest, col_out_ptr,
                 BLOCK, PARTS, PRECISE)


@triton.jit
def _merge_pair_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """(max, Σ exp(· − max)) of two partials of the same n rows, each packed (2, n) as
    [max; sum] (``out`` may be either input). A partial with sum 0 (no entries; the forward
    reports max 0 there) counts as max −inf; NaN stays NaN."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    s1 = tl.load(x_ptr + n + offs, mask=inside, other=0.0)
    s2 = tl.load(y_ptr + n + offs, mask=inside, other=0.0)
    m1 = tl.where(s1 > 0, tl.load(x_ptr + offs, mask=inside, other=0.0), float("-inf"))
    m2 = tl.where(s2 > 0, tl.load(y_ptr + offs, mask=inside, other=0.0), float("-inf"))
    top = tl.maximum(m1, m2, propagate_nan=tl.PropagateNan.ALL)
    safe = tl.where(top - top == 0.0, top, 0.0)  # ±inf and NaN → 0
    total = s1 * exp(m1 - safe, PRECISE) + s2 * exp(m2 - safe, PRECISE)
    tl.store(out_ptr + offs, top, mask=inside)
    tl.store(out_ptr + n + offs, total, mask=inside)


@triton.jit
def _margins_kernel(rows_ptr, cols_ptr, target_ptr, row_margin_ptr, col_margin_ptr,
                    row_mass_ptr, col_mass_ptr, n, LOG_SUM: tl.constexpr, COLS: tl.constexpr,
                    MASS: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    """lse − x per row (and per column, COLS) from packed statistics ((·, n) fp32: [max; sum]
    or, LOG_SUM, [max; sum; log sum; lse]), and with MASS their gradient masses
    min(1, −2·expm1(−margin)) (``filtering.gradient_mass``), each (n,). One program per BLOCK
    entries of both sides."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(target_ptr + offs, mask=inside, other=0.0)
    for side in tl.static_range(2 if COLS else 1):
        stats_ptr = rows_ptr if side == 0 else cols_ptr
        top = tl.load(stats_ptr + offs, mask=inside, other=0.0)
        if LOG_SUM:
            log_sum = tl.load(stats_ptr + 2 * n + offs, mask=inside, other=0.0)
        else:
            log_sum = log(tl.load(stats_ptr + n + offs, mask=inside, other=1.0), PRECISE)
        margin = (top - x) + log_sum
        tl.store((row_margin_ptr if side == 0 else col_margin_ptr) + offs, margin, mask=inside)
        if MASS:
            mass = tl.minimum(-2.0 * _expm1(-margin, PRECISE), 1.0,
                              propagate_nan=tl.PropagateNan.ALL)
            tl.store((row_mass_ptr if side == 0 else col_mass_ptr) + offs, mass, mask=inside)


@triton.jit
def _expm1(x, PRECISE: tl.constexpr):
    """e^x − 1, accurate near 0 (libdevice's where PRECISE; otherwise a series there)."""
    if PRECISE:
        return libdevice.expm1(x)
    else:
        return tl.where(tl.abs(x) < 1e-3, x + x * x * (0.5 + x / 6.0), tl.exp(x) - 1.0)


@triton.jit
def _max_propagating_nan(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _combine(max_ptr, sum_ptr, n_parts, n, offs, valid, dest, out_ptr, BLOCK: tl.constexpr,
             PARTS: tl.constexpr, PRECISE: tl.constexpr):
    # PARTS partials per load: a loop over one partial at a time waits on each load's latency
    # (two passes over ~130 column partials took ~80 µs at V = 16384).
    inside = offs < n
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    for k0 in range(0, n_parts, PARTS):
        k = k0 + tl.arange(0, PARTS)
        at = (k[:, None] < n_parts) & valid[None, :]
        part = tl.load(max_ptr + k[:, None] * n + offs[None, :], mask=at, other=float("-inf"))
        top = tl.maximum(top, tl.reduce(part, 0, _max_propagating_nan),
                         propagate_nan=tl.PropagateNan.ALL)
    top = tl.where(top - top == 0.0, top, 0.0)  # ±inf and NaN → 0, as the kernels' safe max
    total = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, n_parts, PARTS):
        k = k0 + tl.arange(0, PARTS)
        at = (k[:, None] < n_parts) & valid[None, :]
        part = tl.load(max_ptr + k[:, None] * n + offs[None, :], mask=at, other=float("-inf"))
        sums = tl.load(sum_ptr + k[:, None] * n + offs[None, :], mask=at, other=0.0)
        total += tl.sum(sums * exp(part - top[None, :], PRECISE), axis=0)
    top = tl.where(valid, top, 0.0)
    total = tl.where(valid, total, 1.0)
    log_sum = log(total, PRECISE)
    dest = dest.to(tl.int64)
    tl.store(out_ptr + dest, top, mask=inside)
    tl.store(out_ptr + n + dest, total, mask=inside)
    tl.store(out_ptr + 2 * n + dest, log_sum, mask=inside)
    tl.store(out_ptr + 3 * n + dest, top + log_sum, mask=inside)
