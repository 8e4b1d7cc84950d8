"""The Hopper forward with column statistics on transposed tiles (``lse_forward_sm90.TRANSPOSED``,
off until measured against the plain tiles of ``lse_forward_sm90``).

Each consumer warpgroup multiplies its half of a B chunk (64 of the tile's 128 columns of X)
by one resident 128-row block of A that both consumers share: its accumulator is a 64 × 128
tile of Xᵀ, one X column per accumulator row. Where the plain tile spreads a column over the
four warps (its sum needs shuffles over 16 rows and an exchange through shared memory in every
tile), here a thread holds 32 entries of two columns:

- columns: (max, Σ exp) over the block's 128 rows from a thread's own entries and two shuffle
  levels within a quad, complete in the tile, then merged into the column partials (one
  exponential per entry);
- rows: each thread keeps an online (max, Σ exp) per row over the columns it holds (its two
  accumulator rows, tile after tile) in registers, and the 32 such partials of a row (8 lanes
  × 4 warps) are merged once per row block; each consumer writes its own row partials (the
  row partials have two parts per column split). One and a half exponentials per entry more.
- per-tile records: the column records exact (the max over the tile's columns of each 64-row
  half's log-mass), the row records a bound (the half's largest entry + log 128, at most
  log 128 above the exact one: filtering skips no tile it would not skip with the exact
  records, and maybe fewer).

Same logits as the plain kernel (one rounded scale product, then the bias), so the row maxima
and target logits agree with the Triton kernel bit for bit.
"""

from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .lse_forward_sm90 import _mul_rn, _tile_products, _tma_load

_LOG_BLOCK_N = gl.constexpr(math.log(128.0))


@gluon.jit
def _loader(a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, ready, empty,
            block_begin, block_end, tile_begin, tile_end,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, K_TILES: gl.constexpr,
            STAGES: gl.constexpr):
    """One warp: per pair of 64-row blocks their 128 rows of A (once both consumers have
    multiplied the previous pair's), then the B chunks of every tile into the ring."""
    c = 0
    for pair in range(gl.cdiv(gl.maximum(block_end - block_begin, 0), 2)):
        rb = block_begin + 2 * pair
        mbarrier.wait(a_empty.index(0), (pair & 1) ^ 1)
        mbarrier.expect(a_ready.index(0), K_TILES * a_desc.block_type.nbytes)
        for k in gl.static_range(K_TILES):
            _tma_load(a_desc, [rb * 64, k * BLOCK_K], a_ready.index(0), a_smem.index(k))
        for t in range(tile_begin, tile_end):
            for k in gl.static_range(K_TILES):
                slot = c % STAGES
                mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), b_desc.block_type.nbytes)
                _tma_load(b_desc, [t * BLOCK_N, k * BLOCK_K], ready.index(slot),
                          b_smem.index(slot))
                c += 1


@gluon.jit
def _consumer(W: gl.constexpr, a_smem, b_smem, a_ready, a_empty, ready, empty, turn,
              bias_ptr, scale_ptr, max_out_ptr, sum_out_ptr, tile_stat_ptr,
              col_max_ptr, col_sum_ptr, col_tile_stat_ptr,
              n_valid, N, V, pid_g, pid_s, block_begin, block_end, tile_begin, tile_end,
              n_col_tiles,
              HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr, RECORD_TILES: gl.constexpr,
              BLOCK_N: gl.constexpr, K_TILES: gl.constexpr, STAGES: gl.constexpr,
              LAG: gl.constexpr):
    """One warpgroup: columns [64·W, 64·W + 64) of every tile of the split against each pair
    of row blocks of the group. Its column partials are row 2·g + W of the (2 · groups, V)
    arrays (the other consumer's columns stay at their initial values there), its row
    partials row 2·s + W of the (2 · splits, N) arrays."""
    HALF: gl.constexpr = BLOCK_N // 2   # columns of X per consumer: accumulator rows
    ROWS: gl.constexpr = 128            # rows of X per pair: accumulator columns
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, ROWS, 16])
    j_l: gl.constexpr = gl.SliceLayout(1, mma)
    i_l: gl.constexpr = gl.SliceLayout(0, mma)
    scale = 1.0
    if HAS_SCALE:
        scale = gl.load(scale_ptr).to(gl.float32)
    col_part = (pid_g * 2 + W).to(gl.int64) * V
    row_end = gl.minimum(n_valid, block_end * 64)  # rows past the group's own are another's

    c = 0
    for pair in range(gl.cdiv(gl.maximum(block_end - block_begin, 0), 2)):
        rb = block_begin + 2 * pair
        mbarrier.wait(a_ready.index(0), pair & 1)
        offs_i = rb * 64 + gl.arange(0, ROWS, layout=i_l)
        m_i = offs_i < row_end
        # Accumulator row j = 16·warp + 8·h + lane group: per (warp, lane group) the online
        # (max, Σ exp) of each row over the columns this thread holds.
        run_max = gl.max(gl.reshape(gl.full([HALF, ROWS], float("-inf"), gl.float32, mma),
                                    [4, 2, 8, ROWS]), axis=1)
        run_sum = gl.zeros_like(run_max)

        for t in range(tile_begin, tile_end):
            offs_j = t * BLOCK_N + W * HALF + gl.arange(0, HALF, layout=j_l)
            m_j = offs_j < V
            # the columns' partials and bias, read before the products
            old_max = gl.load(col_max_ptr + col_part + offs_j, mask=m_j, other=float("-inf"))
            old_sum = gl.load(col_sum_ptr + col_part + offs_j, mask=m_j, other=0.0)
            bias = gl.zeros([HALF], gl.float32, j_l)
            if HAS_BIAS:
                bias = gl.load(bias_ptr + offs_j, mask=m_j, other=0.0).to(gl.float32)
            raw, c = _tile_products(W, a_smem, b_smem, ready, empty, turn, c, mma,
                                    HALF, ROWS, K_TILES, STAGES, LAG, True)
            mbarrier.arrive(a_empty.index(0), count=1, pred=t == tile_end - 1)
            x = raw
            if HAS_SCALE:
                x = _mul_rn(x, scale)
            if HAS_BIAS:
                x = x + gl.expand_dims(bias, 1)
            x = gl.where(gl.expand_dims(m_j, 1) & gl.expand_dims(m_i, 0), x, float("-inf"))

            # Columns: complete over the pair's rows within the tile.
            c_max = gl.max(x, axis=1)
            c_safe = gl.where(c_max == float("-inf"), 0.0, c_max)
            p = gl.exp(x - gl.expand_dims(c_safe, 1))
            c_sum = gl.sum(p, axis=1)
            top = gl.maximum(old_max, c_max)
            safe_top = gl.where(top == float("-inf"), 0.0, top)
            total = old_sum * gl.exp(old_max - safe_top) + c_sum * gl.exp(c_max - safe_top)
            gl.store(col_max_ptr + col_part + offs_j, top, mask=m_j)
            gl.store(col_sum_ptr + col_part + offs_j, total, mask=m_j)

            # Rows: each thread's online partials over its two accumulator rows.
            x4 = gl.reshape(x, [4, 2, 8, ROWS])
            new_max = gl.maximum(run_max, gl.max(x4, axis=1))
            safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = (run_sum * gl.exp(run_max - safe_max)
                       + gl.sum(gl.exp(x4 - gl.expand_dims(safe_max, 1)), axis=1))
            run_max = new_max

            if RECORD_TILES:
                # per 64-row half h: columns' log-masses (exact) and the rows' bound
                half_sums = gl.sum(gl.reshape(p, [HALF, 2, 64]), axis=2)  # (column, half)
                c_ref = gl.convert_layout(c_safe, gl.SliceLayout(1, half_sums.type.layout))
                # (a column past V has no entries: log 0 = -inf)
                col_record = gl.max(gl.expand_dims(c_ref, 1) + gl.log(half_sums), axis=0)
                row_record = gl.max(gl.max(gl.reshape(x, [HALF, 2, 64]), axis=2), axis=0)
                halves = gl.arange(0, 2, layout=col_record.type.layout)
                at = (rb + halves).to(gl.int64) * n_col_tiles + t
                in_rows = (rb + halves) * 64 < row_end
                gl.atomic_max(col_tile_stat_ptr + at, col_record, mask=in_rows)
                gl.atomic_max(tile_stat_ptr + at, row_record + _LOG_BLOCK_N, mask=in_rows)

        # The row partials: the 32 per-thread partials of each row merged once per pair.
        row_max = gl.max(gl.max(run_max, axis=0), axis=0)
        safe_row = gl.where(row_max == float("-inf"), 0.0, row_max)
        shift = gl.expand_dims(gl.expand_dims(safe_row, 0), 0)
        row_sum = gl.sum(gl.sum(run_sum * gl.exp(run_max - shift), axis=0), axis=0)
        rows = gl.arange(0, ROWS, layout=row_max.type.layout) + rb * 64
        out = (pid_s * 2 + W).to(gl.int64) * N + rows
        gl.store(max_out_ptr + out, row_max, mask=rows < row_end)
        gl.store(sum_out_ptr + out, row_sum, mask=rows < row_end)


@gluon.jit
def _clip_forward_sm90_t_kernel(
    a_desc, b_desc,      # TMA descriptors of A in compact row order (128 × BLOCK_K) and B
    bias_ptr, scale_ptr,
    n_valid_ptr,         # () int64: rows p >= n_valid are skipped
    max_out_ptr,         # (2 · splits, N) fp32 partial row max, one part per consumer
    sum_out_ptr,         # (2 · splits, N) fp32 partial Σ exp(X − max)
    tile_stat_ptr,       # (row blocks, column tiles) -inf: a bound of the row records
    col_max_ptr,         # (2 · row groups, V) fp32 partial column max
    col_sum_ptr,         # (2 · row groups, V) fp32 partial column Σ exp(X − max)
    col_tile_stat_ptr,   # (row blocks, column tiles) -inf: the column records
    N, V, blocks_per_group, tiles_per_split, n_col_tiles,
    HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
    RECORD_TILES: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """Program (g, s): pairs of row blocks of group g × column tiles of split s (the plain
    kernel's grid; ``blocks_per_group`` even), a loader warp and two consumer warpgroups that
    share each pair's rows of A and split each B chunk's rows."""
    pid_g = gl.program_id(0)
    pid_s = gl.program_id(1)
    n_valid = gl.load(n_valid_ptr).to(gl.int32)
    block_begin = pid_g * blocks_per_group
    block_end = gl.minimum(block_begin + blocks_per_group, gl.cdiv(n_valid, BLOCK_M))
    tile_begin = pid_s * tiles_per_split
    tile_end = gl.minimum(tile_begin + tiles_per_split, n_col_tiles)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [K_TILES, 2 * BLOCK_M, BLOCK_K],
                                       a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(a_ready.index(0), count=1)
    mbarrier.init(a_empty.index(0), count=2)  # both consumers multiply the pair's rows
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # each consumer reads its half of every chunk

    gl.warp_specialize([
        (_consumer, (0, a_smem, b_smem, a_ready, a_empty, ready, empty, turn,
                     bias_ptr, scale_ptr, max_out_ptr, sum_out_ptr, tile_stat_ptr,
                     col_max_ptr, col_sum_ptr, col_tile_stat_ptr,
                     n_valid, N, V, pid_g, pid_s, block_begin, block_end, tile_begin, tile_end,
                     n_col_tiles, HAS_BIAS, HAS_SCALE, RECORD_TILES,
                     BLOCK_N, K_TILES, STAGES, LAG)),
        (_consumer, (1, a_smem, b_smem, a_ready, a_empty, ready, empty, turn,
                     bias_ptr, scale_ptr, max_out_ptr, sum_out_ptr, tile_stat_ptr,
                     col_max_ptr, col_sum_ptr, col_tile_stat_ptr,
                     n_valid, N, V, pid_g, pid_s, block_begin, block_end, tile_begin, tile_end,
                     n_col_tiles, HAS_BIAS, HAS_SCALE, RECORD_TILES,
                     BLOCK_N, K_TILES, STAGES, LAG)),
        (_loader, (a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, ready, empty,
                   block_begin, block_end, tile_begin, tile_end,
                   BLOCK_N, BLOCK_K, K_TILES, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])

    mbarrier.invalidate(a_ready.index(0))
    mbarrier.invalidate(a_empty.index(0))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
