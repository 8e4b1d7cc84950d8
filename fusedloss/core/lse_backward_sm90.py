"""Hopper (sm90) gradient recompute of the core: dX tiles of the softmax losses into the slab
scratch, the Gluon counterpart of ``lse_backward._grad_logits_kernel`` on a dense slab.

Each dX tile is the Triton kernel's, formed from the same saved statistics and coefficients:

    dX_ij = r_i · P_ij + c_j · Q_ij − t_i · [j = y_i]          (× s in the scratch, SCALE_DX)

with P's exponentials exp(X − max_i) and Q's from them where the tile allows
(``lse_backward._softmax_terms``: every column max within _FACTOR_RANGE of the rows' largest
max), else a second exponential per entry. Dead tiles (``live`` 0) read as zeros, as the
dense path needs.

The schedule is the Hopper forward's (``lse_forward_sm90``): a loader warp issues every TMA
copy, each consumer's 64-row A block resident in shared memory and the B chunks of the slab's
tiles through a ring of stages; two consumer warpgroups, each with row blocks of its own,
multiply the same B chunks, so that one's epilogue (the gradient tile and its store) runs
while the other's products do. 64 × 128 tiles fed this way read half the bytes of B per
product that the Triton kernel's one-tile programs read (docs/design.md, "The Hopper
backward").

Nothing in a tile's epilogue waits for the other warps of its warpgroup but the column
coefficients' layout exchange: the two sides of the factored form's range check, which the
Triton kernel reduces inside every tile, are reduced once per row block (the rows' largest
max, as the block's target range) and once per call on the host (the columns' smallest max
per tile, ``Recompute``), and d(scale)'s partial sums stay per row in registers until the row
block ends (one total per row block and split, where the Triton kernel writes one per tile).

Gluon kernels run on the GPU only: the Triton kernel serves every other case and the
interpreter, and the GPU tests (``tests/test_sm90_backward.py``) compare the two.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import config
from .lse_forward_sm90 import (
    BLOCK_K,
    BLOCK_M,
    BLOCK_N,
    CONSUMER_REGS,
    MAX_REGS,
    WARPS,
    _a_block_done,
    _a_block_ready,
    _exp_ftz,
    _loader,
    _mul_rn,
    _program_ranges,
    _ring,
    _ring_done,
    _tile_products,
    descriptor,
    stages,
    streams_a,
)

# Q's factored form: every column max of the tile within this many nats of the rows' largest
# max (``lse_backward._FACTOR_RANGE``, the same bound).
_FACTOR_RANGE = gl.constexpr(60.0)
# Shared memory kept back for the dX tile's layout exchange (64 × 128 × 2 bytes).
_EXCHANGE_BYTES = BLOCK_M * BLOCK_N * 2


@gluon.jit
def _logits(raw, scale, bias, offs_m, offs_n, on_diagonal, HAS_SCALE: gl.constexpr,
            HAS_BIAS: gl.constexpr, DIAG_MASK: gl.constexpr):
    """X = scale · raw (one rounded product, as ``logits.mul_rn``) + bias; -inf where the row
    id equals the column id (DIAG_MASK: A and B the same rows, in order; only a tile
    ``on_diagonal`` holds such entries)."""
    x = raw
    if HAS_SCALE:
        x = _mul_rn(x, scale)
    if HAS_BIAS:
        x = x + gl.expand_dims(bias, 0)
    if DIAG_MASK:
        if on_diagonal:
            x = gl.where(gl.expand_dims(offs_m, 1) == gl.expand_dims(offs_n, 0),
                         float("-inf"), x)
    return x


@gluon.jit
def _grad_tile(raw, t, live, rb, offs_m, m_rows, row_max, coef_lse, a_row, ref,
               target, coef_target, t_lo, t_hi, cmax_v, ccoef_v, low,
               bias_ptr, scale, n_valid, V, width, slab_tile_start, scratch_ptr,
               col_l: gl.constexpr,
               HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr, SCALE_DX: gl.constexpr,
               HAS_TARGET: gl.constexpr, COL_LSE: gl.constexpr, GRAD_SCALE: gl.constexpr,
               DIAG_MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """dX of one raw tile into the scratch, the arithmetic of ``_grad_logits_kernel`` in the
    same order; returns each row's Σ_j dX_ij·raw_ij over the tile (GRAD_SCALE, else 0)."""
    offs_n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    m_cols = offs_n < V
    # Nearly every tile lies inside the matrix, is live and (DIAG_MASK) off the diagonal:
    # there the per-entry masks are left out (the same values; fewer instructions per entry).
    row_lo = rb * BLOCK_M
    col_lo = t * BLOCK_N
    on_diagonal = (row_lo < col_lo + BLOCK_N) & (col_lo < row_lo + BLOCK_M)
    inside = (row_lo + BLOCK_M <= n_valid) & (col_lo + BLOCK_N <= V) & (live != 0)
    bias = gl.zeros([BLOCK_N], gl.float32, col_l)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n, mask=m_cols, other=0.0).to(gl.float32)
    # X and P's exponentials are formed inside each branch: across a branch only the raw tile
    # is live (X, P and raw together would not fit in the registers).
    if COL_LSE:
        if ref - low <= _FACTOR_RANGE:
            # r_i·P + c_j·Q = e_ij · (r_i + a_i·b_j): one exponential per entry
            b = gl.convert_layout(ccoef_v * gl.exp(ref - cmax_v), col_l)
            x = _logits(raw, scale, bias, offs_m, offs_n, on_diagonal, HAS_SCALE, HAS_BIAS,
                        DIAG_MASK)
            e = _exp_ftz(x - gl.expand_dims(row_max, 1))
            dx = e * (gl.expand_dims(coef_lse, 1)
                      + gl.expand_dims(a_row, 1) * gl.expand_dims(b, 0))
        else:
            cmax = gl.convert_layout(cmax_v, col_l)
            ccoef = gl.convert_layout(ccoef_v, col_l)
            x = _logits(raw, scale, bias, offs_m, offs_n, on_diagonal, HAS_SCALE, HAS_BIAS,
                        DIAG_MASK)
            e = _exp_ftz(x - gl.expand_dims(row_max, 1))
            dx = (gl.expand_dims(coef_lse, 1) * e
                  + gl.expand_dims(ccoef, 0) * _exp_ftz(x - gl.expand_dims(cmax, 0)))
    else:
        x = _logits(raw, scale, bias, offs_m, offs_n, on_diagonal, HAS_SCALE, HAS_BIAS,
                    DIAG_MASK)
        dx = gl.expand_dims(coef_lse, 1) * _exp_ftz(x - gl.expand_dims(row_max, 1))
    if HAS_TARGET:
        lo = t * BLOCK_N
        if (t_hi >= lo) & (t_lo < lo + BLOCK_N):  # some row's target may lie in this tile
            local = (target - lo).to(gl.int32)
            hit = (gl.expand_dims(gl.arange(0, BLOCK_N, layout=col_l), 0)
                   == gl.expand_dims(local, 1))
            dx = dx - gl.where(hit, gl.expand_dims(coef_target, 1), 0.0)
    if not inside:
        keep = gl.expand_dims(m_rows, 1) & gl.expand_dims(m_cols, 0) & (live != 0)
        dx = gl.where(keep, dx, 0.0)
    scale_part = gl.zeros_like(row_max)
    if GRAD_SCALE:
        scale_part = gl.sum(dx * raw, axis=1)
    if SCALE_DX:
        dx = dx * scale
    dx = dx.to(scratch_ptr.dtype.element_ty)
    base = scratch_ptr + (rb * BLOCK_M).to(gl.int64) * width + (t - slab_tile_start) * BLOCK_N
    # Through shared memory into rows of 16-byte pieces, each warp storing whole rows (the
    # products' layout, two columns a thread, stored 5% slower: docs/design.md).
    store_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                             warps_per_cta=[4, 1], order=[1, 0])
    dx = gl.convert_layout(dx, store_l)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_l))
    cc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_l))
    gl.store(base + gl.expand_dims(r * width, 1) + gl.expand_dims(cc, 0), dx)
    return scale_part


@gluon.jit
def _consumer(W: gl.constexpr, a_smem, b_smem, a_ready, a_empty, ready, empty,
              bias_ptr, scale_ptr, row_max_ptr, coef_lse_ptr, target_ptr, coef_target_ptr,
              col_max_ptr, coef_col_ptr, tile_low_ptr, live_ptr,
              scratch_ptr, dscale_ptr,
              n_valid, V, width, slab_tile_start, n_col_tiles,
              block_begin, block_end, tile_begin, tile_end,
              HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr, SCALE_DX: gl.constexpr,
              HAS_TARGET: gl.constexpr, COL_LSE: gl.constexpr, GRAD_SCALE: gl.constexpr,
              DIAG_MASK: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_TILES: gl.constexpr,
              STAGES: gl.constexpr, STREAM_A: gl.constexpr):
    """One warpgroup: row blocks block_begin + W, + 2 + W, ... against the tiles
    [tile_begin, tile_end) of the slab."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    # A tile's column statistics, one column per thread: read before the products.
    vec_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[BLOCK_N // 128],
                                           threads_per_warp=[32], warps_per_cta=[4], order=[0])
    scale = 1.0
    if HAS_SCALE:
        scale = gl.load(scale_ptr).to(gl.float32)

    c = 0
    for pair in range(gl.cdiv(gl.maximum(block_end - block_begin, 0), 2)):
        rb = block_begin + 2 * pair + W
        active = rb < block_end  # the last pair of an odd count has one block
        live_rb = gl.minimum(rb, block_end - 1).to(gl.int64)  # a valid index either way
        _a_block_ready(W, a_ready, pair, active, STREAM_A)
        offs_m = rb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
        m_rows = offs_m < n_valid
        row_max = gl.load(row_max_ptr + offs_m, mask=m_rows, other=0.0)
        coef_lse = gl.load(coef_lse_ptr + offs_m, mask=m_rows, other=0.0)
        ref = 0.0
        a_row = coef_lse
        if COL_LSE:
            # the rows' largest max: the rows' side of the factored form's range check
            ref = gl.max(gl.where(m_rows, row_max, float("-inf")), axis=0)
            a_row = gl.exp(row_max - ref)
        target = offs_m
        coef_target = coef_lse
        t_lo = 0
        t_hi = 0
        if HAS_TARGET:
            target = gl.load(target_ptr + offs_m, mask=m_rows, other=-1)
            coef_target = gl.load(coef_target_ptr + offs_m, mask=m_rows, other=0.0)
            t_lo = gl.min(target, axis=0)
            t_hi = gl.max(target, axis=0)
        # each row's Σ dX·raw over the split's tiles: one total per row block and split
        scale_rows = gl.zeros_like(row_max)

        for t in range(tile_begin, tile_end):
            live = gl.load(live_ptr + (live_rb * n_col_tiles + t)).to(gl.int32)
            cmax_v = gl.zeros([BLOCK_N], gl.float32, vec_l)
            ccoef_v = cmax_v
            low = 0.0
            if COL_LSE:
                cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=vec_l)
                cmax_v = gl.load(col_max_ptr + cols, mask=cols < V, other=0.0)
                ccoef_v = gl.load(coef_col_ptr + cols, mask=cols < V, other=0.0)
                low = gl.load(tile_low_ptr + t)
            raw, c = _tile_products(W, a_smem, b_smem, ready, empty, c, mma,
                                    BLOCK_M, BLOCK_N, K_TILES, STAGES, STREAM_A)
            _a_block_done(W, a_empty, t == tile_end - 1, STREAM_A)
            if active:
                scale_rows += _grad_tile(
                    raw, t, live, rb, offs_m, m_rows, row_max, coef_lse, a_row, ref,
                    target, coef_target, t_lo, t_hi, cmax_v, ccoef_v, low,
                    bias_ptr, scale, n_valid, V, width, slab_tile_start, scratch_ptr, col_l,
                    HAS_BIAS, HAS_SCALE, SCALE_DX, HAS_TARGET, COL_LSE, GRAD_SCALE,
                    DIAG_MASK, BLOCK_M, BLOCK_N)
        if GRAD_SCALE:
            if active:
                # into the (row block, first tile of the split) entry; the rest of the block's
                # entries stay 0 (only their sum is read)
                gl.store(dscale_ptr + (rb.to(gl.int64) * n_col_tiles + tile_begin),
                         gl.sum(scale_rows, axis=0))


# As the forward's, the sizes are not specialized on, but the scratch's row stride (``width``),
# whose alignment lets the stores be 16 bytes wide.
@gluon.jit(do_not_specialize=["V", "row_blocks", "slab_tile_start", "slab_tiles", "n_col_tiles",
                              "blocks_per_group", "tiles_per_split"])
def _clip_grad_sm90_kernel(
    a_desc, b_desc,        # TMA descriptors of A in compact row order (BLOCK_M × BLOCK_K) and B
    bias_ptr, scale_ptr,
    n_valid_ptr,           # () int64: rows p >= n_valid read as zeros
    row_max_ptr,           # (N,) fp32 row max, compact row order
    coef_lse_ptr,          # (N,) fp32 r_i / Σ_j exp(X_ij − max_i)
    target_ptr,            # (N,) int64 target column ids (HAS_TARGET)
    coef_target_ptr,       # (N,) fp32 t_i (HAS_TARGET)
    col_max_ptr,           # (V,) fp32 column max (COL_LSE)
    coef_col_ptr,          # (V,) fp32 c_j / Σ_i exp(X_ij − max_j) (COL_LSE)
    tile_low_ptr,          # (column tiles,) fp32 smallest valid column max per tile (COL_LSE)
    live_ptr,              # (row blocks, column tiles) uint8: 0 = a dead tile, zeros
    scratch_ptr,           # (row blocks · BLOCK_M, width) the slab's dX, input dtype
    dscale_ptr,            # (row blocks, column tiles) fp32 zeros: Σ dX · raw (GRAD_SCALE),
                           # one total per row block and split, at the split's first tile
    V, width, row_blocks, slab_tile_start, slab_tiles, n_col_tiles,
    blocks_per_group, tiles_per_split,
    HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr, SCALE_DX: gl.constexpr,
    HAS_TARGET: gl.constexpr, COL_LSE: gl.constexpr, GRAD_SCALE: gl.constexpr,
    DIAG_MASK: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    STREAM_A: gl.constexpr,
):
    """Program (g, s): row blocks of group g × the slab's tiles of split s; a loader warp and
    two consumer warpgroups that share the B chunks (as ``_forward_sm90_kernel``)."""
    n_valid = gl.load(n_valid_ptr).to(gl.int32)  # TMA coordinates are 32-bit; N < 2³¹
    block_begin, block_end, tile_begin, tile_end = _program_ranges(
        row_blocks, blocks_per_group, slab_tile_start, slab_tiles, tiles_per_split)

    a_smem, b_smem, a_ready, a_empty, ready, empty = _ring(
        a_desc, b_desc, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, STAGES, STREAM_A)

    gl.warp_specialize([
        (_consumer, (0, a_smem, b_smem, a_ready, a_empty, ready, empty,
                     bias_ptr, scale_ptr, row_max_ptr, coef_lse_ptr, target_ptr,
                     coef_target_ptr, col_max_ptr, coef_col_ptr, tile_low_ptr,
                     live_ptr, scratch_ptr, dscale_ptr,
                     n_valid, V, width, slab_tile_start, n_col_tiles,
                     block_begin, block_end, tile_begin, tile_end,
                     HAS_BIAS, HAS_SCALE, SCALE_DX, HAS_TARGET, COL_LSE, GRAD_SCALE, DIAG_MASK,
                     BLOCK_M, BLOCK_N, K_TILES, STAGES, STREAM_A)),
        (_consumer, (1, a_smem, b_smem, a_ready, a_empty, ready, empty,
                     bias_ptr, scale_ptr, row_max_ptr, coef_lse_ptr, target_ptr,
                     coef_target_ptr, col_max_ptr, coef_col_ptr, tile_low_ptr,
                     live_ptr, scratch_ptr, dscale_ptr,
                     n_valid, V, width, slab_tile_start, n_col_tiles,
                     block_begin, block_end, tile_begin, tile_end,
                     HAS_BIAS, HAS_SCALE, SCALE_DX, HAS_TARGET, COL_LSE, GRAD_SCALE, DIAG_MASK,
                     BLOCK_M, BLOCK_N, K_TILES, STAGES, STREAM_A)),
        (_loader, (a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, ready, empty,
                   block_begin, block_end, tile_begin, tile_end,
                   BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, STAGES, STREAM_A)),
    ], [4, 1], [CONSUMER_REGS, 24])

    _ring_done(a_ready, a_empty, ready, empty, STAGES)


@functools.lru_cache(maxsize=256)
def schedule(row_blocks: int, tiles: int, slots: int) -> tuple[int, int, int, int]:
    """(row groups, blocks per group, splits, tiles per split) for a slab of ``tiles`` column
    tiles over ``row_blocks`` row blocks on ``slots`` SMs (one program each): the shortest
    longest program, counting a pair of row blocks' A load and setup as one tile more, over
    whole waves; the fewest programs among equals."""
    pairs = (row_blocks + 1) // 2
    best = None
    for per_pairs in sorted({-(-pairs // g) for g in range(1, pairs + 1)}):
        groups = -(-pairs // per_pairs)
        for per_tiles in sorted({-(-tiles // s) for s in range(1, tiles + 1)}):
            splits = -(-tiles // per_tiles)
            waves = -(-(groups * splits) // slots)
            key = (waves * per_pairs * (per_tiles + 1), groups * splits)
            if best is None or key < best[0]:
                best = (key, (groups, 2 * per_pairs, splits, per_tiles))
    return best[1]


class Recompute:
    """The kernel bound to one backward call's operands, statistics and outputs; called once
    per slab (``engine._grads_triton``'s dense slabs).

    ``a_rows``: A in compact row order, TMA-ready (as b); ``logits``: scale, bias and the
    diagonal mask (with every row in order: compact positions are row ids);
    ``rows``: ``engine.Rows``; ``stats``: ``engine.RowStats`` (row max, column max with column
    coefficients); ``coef``: ``engine.GradCoefficients`` (lse, target, col); ``live``: (row
    blocks, column tiles) bool; ``out``: (scratch, dscale or None).
    """

    def __init__(self, a_rows, b, logits, rows, stats, coef, live, out):
        scratch, dscale = out
        v, d = b.shape
        n_rb, n_ct = live.shape
        col_lse = coef.col is not None
        has_target = rows.target is not None and coef.target is not None
        dummy = stats.max
        tile_low = dummy
        if col_lse:
            # the columns' side of the factored form's range check (the Triton kernel reduces
            # it in every tile), padded columns at +inf
            col_max = stats.col_max
            if v < n_ct * BLOCK_N:
                col_max = torch.nn.functional.pad(col_max, (0, n_ct * BLOCK_N - v),
                                                  value=float("inf"))
            tile_low = col_max.view(n_ct, BLOCK_N).amin(1)
        self._slots = config.sm_count(b.device)
        self._v, self._n_ct = v, n_ct
        self._args = (
            descriptor(a_rows, BLOCK_M), descriptor(b, BLOCK_N),
            logits.bias if logits.bias is not None else dummy,
            logits.scale if logits.scale is not None else dummy, rows.n_valid,
            stats.max, coef.lse,
            rows.target if has_target else rows.index,
            coef.target if has_target else dummy,
            stats.col_max if col_lse else dummy, coef.col if col_lse else dummy,
            tile_low, live.view(torch.uint8), scratch, dscale if dscale is not None else dummy,
        )
        self._width = scratch.shape[1]
        n_stages = stages(d, a_rows.element_size(), _EXCHANGE_BYTES)
        self._flags = dict(
            HAS_BIAS=logits.bias is not None, HAS_SCALE=logits.scale is not None,
            SCALE_DX=logits.scale is not None and logits.bias is None, HAS_TARGET=has_target,
            COL_LSE=col_lse, GRAD_SCALE=dscale is not None, DIAG_MASK=logits.diag_mask,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, K_TILES=d // BLOCK_K,
            STAGES=n_stages, STREAM_A=streams_a(d),
            CONSUMER_REGS=CONSUMER_REGS, num_warps=WARPS, maxnreg=MAX_REGS,
        )

    def __call__(self, tile_start: int, tiles: int, row_blocks: int) -> None:
        """dX of tiles [tile_start, tile_start + tiles) over the first ``row_blocks`` row blocks
        into the scratch's columns from 0."""
        groups, per_group, splits, per_split = schedule(row_blocks, tiles, self._slots)
        _clip_grad_sm90_kernel[(groups, splits)](
            *self._args, self._v, self._width, row_blocks, tile_start, tiles, self._n_ct,
            per_group, per_split, **self._flags)
