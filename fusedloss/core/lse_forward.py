"""Forward of the linear-log-sum-exp core: row statistics of X = softcap(s · A Bᵀ + bias).

Grid: (row blocks, column splits). Program (i, c) walks the column tiles of split c for the
BLOCK_M rows of row block i, keeping an online (max, sum) per row, and writes one partial
per split; the host combines the partials (a log-sum-exp over at most a few dozen splits).
No logit ever leaves the chip. Besides the LSE it records, per (row block, column tile), the
largest log-mass log Σ_{j∈tile} exp(X_rj) over the block's rows: the backward turns these into
safe skipping decisions before it recomputes anything (see ``filtering.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .logits import dot_tile, logits_from_dot


@triton.jit
def _lse_forward_kernel(
    a_ptr, b_ptr, bias_ptr, scale_ptr,
    row_index_ptr,       # (N,) int64: compact row p reads A[row_index[p]]
    n_valid_ptr,         # () int64: rows p >= n_valid are skipped (ignored tokens)
    col_order_ptr,       # (V,) int64: tile position j holds column col_order[j] (vocabulary sorting)
    target_ptr,          # (N,) int64: original column id of each compact row's target, or -1
    col_weight_ptr,      # (V,) fp32 column weights of the weighted row sum
    max_out_ptr,         # (splits, N) fp32 partial row max
    sum_out_ptr,         # (splits, N) fp32 partial Σ exp(X - max)
    target_out_ptr,      # (splits, N) fp32 partial target logit
    wsum_out_ptr,        # (splits, N) fp32 partial Σ_j w_j X_ij
    tile_stat_ptr,       # (row blocks, column tiles) fp32 max_r log Σ_{j∈tile} exp(X_rj)
    N, V, D, stride_a, stride_b, tiles_per_split, n_col_tiles,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_TARGET: tl.constexpr, HAS_WSUM: tl.constexpr,
    HAS_COL_WEIGHT: tl.constexpr, RECORD_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_valid = tl.load(n_valid_ptr)
    row_start = pid_m * BLOCK_M
    if row_start >= n_valid:
        return
    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_rows = offs_m < n_valid
    rows = tl.load(row_index_ptr + offs_m, mask=m_rows, other=0).to(tl.int64)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    if HAS_TARGET:
        target = tl.load(target_ptr + offs_m, mask=m_rows, other=-1)

    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    target_logit = tl.zeros((BLOCK_M,), tl.float32)
    weighted_sum = tl.zeros((BLOCK_M,), tl.float32)

    tile_begin = pid_s * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, n_col_tiles)
    for t in range(tile_begin, tile_end):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        m_cols = offs_n < V
        if HAS_ORDER:
            cols = tl.load(col_order_ptr + offs_n, mask=m_cols, other=0).to(tl.int64)
        else:
            cols = offs_n.to(tl.int64)
        raw = dot_tile(a_ptr, b_ptr, rows, cols, m_rows, m_cols, stride_a, stride_b, D,
                       BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, PRECISION)
        x = logits_from_dot(raw, bias_ptr, cols, m_cols, scale, HAS_BIAS, HAS_SCALE, SOFTCAP)
        x = tl.where(m_cols[None, :], x, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(x, axis=1))
        p = tl.exp(x - new_max[:, None])
        tile_sum = tl.sum(p, axis=1)
        row_sum = row_sum * tl.exp(row_max - new_max) + tile_sum
        row_max = new_max
        if RECORD_TILES:
            tile_mass = tl.where(m_rows, new_max + tl.log(tile_sum), float("-inf"))
            tl.store(tile_stat_ptr + pid_m.to(tl.int64) * n_col_tiles + t, tl.max(tile_mass, axis=0))
        if HAS_TARGET:
            hit = cols[None, :] == target[:, None]
            target_logit += tl.sum(tl.where(hit & m_cols[None, :], x, 0.0), axis=1)
        if HAS_WSUM:
            xw = tl.where(m_cols[None, :], x, 0.0)
            if HAS_COL_WEIGHT:
                w = tl.load(col_weight_ptr + cols, mask=m_cols, other=0.0)
                xw = xw * w[None, :]
            weighted_sum += tl.sum(xw, axis=1)

    out = pid_s.to(tl.int64) * N + offs_m
    tl.store(max_out_ptr + out, row_max, mask=m_rows)
    tl.store(sum_out_ptr + out, row_sum, mask=m_rows)
    if HAS_TARGET:
        tl.store(target_out_ptr + out, target_logit, mask=m_rows)
    if HAS_WSUM:
        tl.store(wsum_out_ptr + out, weighted_sum, mask=m_rows)
