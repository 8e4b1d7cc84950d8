"""Hopper (sm90) forward of the core: the softmax contrastive losses' statistics.

The same statistics as ``lse_forward._lse_forward_kernel``: with ``COL_STATS`` (CLIP) row and
column (max, Σ exp) partials and per-tile log-masses for both filtering rules; without, the
rows' alone (InfoNCE; NT-Xent with ``DIAG_MASK``, A's rows B's in order), their per-tile records
at 64-row blocks (``engine._merge_row_blocks`` merges them into the forward's tiles). Written
in Gluon, Triton's lower-level dialect, to control what the Triton kernel cannot: which warps
do what, and where the column reductions happen. docs/design.md ("The Hopper forward") has the
measurements.

Partitions (``gl.warp_specialize``):

- a loader warp issues every TMA copy: per pair of row blocks, each consumer's 64-row A block
  (resident in shared memory, once the consumer has multiplied its previous one), then the
  B chunks (BLOCK_N × BLOCK_K) of every tile of the split into a ring of STAGES slots (above
  D = MAX_D, where two resident A blocks do not fit, each slot also takes the two consumers'
  A chunks that meet its B chunk: ``STREAM_A``);
- two consumer warpgroups, each with row blocks of its own, multiply the same B chunks
  (``warpgroup_mma``; a slot is free once both have read it) and fold the tiles into the
  statistics: while one forms a tile's softmax sums, the other's products run.

Columns: a column's Σ_r exp(X_rj − m) over the tile's rows is summed per warp (its 16 rows,
shuffles within the warp) and the four warps' sums are combined in one layout exchange, where
a reduction over the whole tile (the Triton kernel's ``tl.max(x, axis=0)``) costs three
exchanges through shared memory per tile. Where every entry of the tile lies within
_REF_RANGE of its largest row max, the sums reuse the row softmax's exponentials with that max
as the columns' shared reference (no exponential per entry); other tiles take each column's
own max, as the Triton kernel (``_fold_columns``, which the per-column path mirrors).

The raw tile, its scaling (one rounded product, as ``logits.mul_rn``) and masks equal the
Triton kernels' bit for bit, so the target logits and the backward's recomputed tiles agree
with these statistics exactly.

Gluon kernels run on the GPU only (not under Triton's interpreter): the Triton kernel serves
every other device, dtype and option, and the GPU tests (``tests/test_sm90_forward.py``)
compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# A TMA copy into shared memory: ``async_load`` in newer Tritons, which removed the older name.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_M = 64   # rows of a tile: one warpgroup, 16 rows per warp
BLOCK_N = 128  # columns of a tile: the backward's column tile (its statistics address it)
BLOCK_K = 64   # width of one operand chunk (128 bytes of bf16: one TMA swizzle row)
MAX_D = 512    # two consumers' A blocks (2 · 64 · D · 2 bytes) stay in shared memory
MAX_STREAMED_D = 1024  # wider A blocks come through the ring beside the B chunks (STREAM_A)
WARPS = 4      # per consumer warpgroup; the loader's warp comes on top
# Registers: 12 warps (the loader's rounded up to a warpgroup) share 64K per SM: 168 each on
# launch, then the loader gives its up (24) and the consumers take 232 each.
MAX_REGS = 168
CONSUMER_REGS = 232
# Column sums share one reference per tile (the largest row max) where every entry lies within
# this many nats of it: exp(X − ref) ≥ e⁻⁸⁰ stays a normal fp32 number (e⁻⁸⁷ is the least).
_REF_RANGE = gl.constexpr(80.0)
_SMEM_BUDGET = 208 * 1024  # of Hopper's 227 KiB per block; the rest for layout exchanges


@gluon.jit
def _mul_rn(x, y):
    """x · y rounded once, never fused into a later add (``logits.mul_rn``)."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _exp_ftz(x):
    """e^x as ``gl.exp`` forms it (ex2 of x · log2 e), with results below 2⁻¹²⁶ flushed to 0:
    ex2.approx.ftz is one instruction where the denormal-keeping ex2 behind ``gl.exp`` takes
    four. For the entries of a softmax, exp(X − max) < e⁻⁸⁷ weighs nothing beside the max's 1."""
    return gl.exp2(x * 1.4426950408889634)


@gluon.jit
def _shuffle_xor(x, MASK: gl.constexpr):
    """Each lane's element from the lane ``lane ^ MASK`` (the same register)."""
    return gl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {MASK}, 31, -1;", "=r,r",
                                     [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _halve(x, lane, BIT: gl.constexpr, C: gl.constexpr):
    """(x, lane) [4, 8, C] → [4, 8, C/2]: lane rows differing in bit BIT of l (lanes 4·2^BIT
    apart) swap halves of their columns and add: the lane row with the bit set keeps the
    upper half."""
    x0, x1 = gl.split(gl.permute(gl.reshape(x, [4, 8, 2, C // 2]), [0, 1, 3, 2]))
    lane, _ = gl.split(gl.permute(gl.reshape(lane, [4, 8, 2, C // 2]), [0, 1, 3, 2]))
    upper = ((lane >> BIT) & 1) == 1
    keep = gl.where(upper, x1, x0)
    send = gl.where(upper, x0, x1)
    return keep + _shuffle_xor(send, 4 << BIT), lane


@gluon.jit
def _max_min_max(a0, b0, c0, a1, b1, c1):
    return gl.maximum(a0, a1), gl.minimum(b0, b1), gl.maximum(c0, c1)


@gluon.jit
def _program_ranges(row_blocks, blocks_per_group, tile_start, n_tiles, tiles_per_split):
    """Program (g, s)'s row blocks [block_begin, block_end) of group g and tiles
    [tile_begin, tile_end) of split s, the splits counted from ``tile_start`` over ``n_tiles``
    tiles: the grid every Hopper kernel here shares."""
    block_begin = gl.program_id(0) * blocks_per_group
    block_end = gl.minimum(block_begin + blocks_per_group, row_blocks)
    tile_begin = tile_start + gl.program_id(1) * tiles_per_split
    tile_end = gl.minimum(tile_begin + tiles_per_split, tile_start + n_tiles)
    return block_begin, block_end, tile_begin, tile_end


@gluon.jit
def _ring(a_desc, b_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          K_TILES: gl.constexpr, STAGES: gl.constexpr, STREAM_A: gl.constexpr = False):
    """The shared memory of the plan every Hopper kernel here follows (a loader warp, two
    consumer warpgroups): each consumer's A block (K_TILES chunks; with STREAM_A, each slot's
    two A chunks instead), the ring of STAGES B chunks, and their barriers, initialized:
    (a_smem, b_smem, a_ready, a_empty, ready, empty)."""
    if STREAM_A:
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
    else:
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * K_TILES, BLOCK_M, BLOCK_K],
                                           a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers read every chunk
    return a_smem, b_smem, a_ready, a_empty, ready, empty


@gluon.jit
def _ring_done(a_ready, a_empty, ready, empty, STAGES: gl.constexpr):
    """Invalidates ``_ring``'s barriers once every partition is done."""
    for i in gl.static_range(2):
        mbarrier.invalidate(a_ready.index(i))
        mbarrier.invalidate(a_empty.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _loader(a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, ready, empty,
            block_begin, block_end, tile_begin, tile_end,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            K_TILES: gl.constexpr, STAGES: gl.constexpr, STREAM_A: gl.constexpr = False):
    """One warp that issues every TMA copy: per pair of row blocks, each consumer's A block
    (once the consumer has multiplied its previous one), then the B chunks of every tile
    into the ring (once both consumers have multiplied the chunk a slot held). With
    STREAM_A, no resident A blocks: each slot also takes the two consumers' A chunks of its
    B chunk (A read once per tile, from L2)."""
    c = 0
    for pair in range(gl.cdiv(gl.maximum(block_end - block_begin, 0), 2)):
        if not STREAM_A:
            for w in gl.static_range(2):
                rb = block_begin + 2 * pair + w
                active = rb < block_end
                # Barriers start with phase 1 complete: the first wait passes.
                mbarrier.wait(a_empty.index(w), (pair & 1) ^ 1, pred=active)
                mbarrier.expect(a_ready.index(w), K_TILES * a_desc.block_type.nbytes,
                                pred=active)
                for k in gl.static_range(K_TILES):
                    _tma_load(a_desc, [rb * BLOCK_M, k * BLOCK_K], a_ready.index(w),
                              a_smem.index(w * K_TILES + k), pred=active)
        # The last pair of an odd count has one block: its second consumer reads the first's.
        rb1 = gl.minimum(block_begin + 2 * pair + 1, block_end - 1)
        for t in range(tile_begin, tile_end):
            for k in gl.static_range(K_TILES):
                slot = c % STAGES
                mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
                if STREAM_A:
                    mbarrier.expect(ready.index(slot), b_desc.block_type.nbytes
                                    + 2 * a_desc.block_type.nbytes)
                    _tma_load(a_desc, [(block_begin + 2 * pair) * BLOCK_M, k * BLOCK_K],
                              ready.index(slot), a_smem.index(2 * slot))
                    _tma_load(a_desc, [rb1 * BLOCK_M, k * BLOCK_K],
                              ready.index(slot), a_smem.index(2 * slot + 1))
                else:
                    mbarrier.expect(ready.index(slot), b_desc.block_type.nbytes)
                _tma_load(b_desc, [t * BLOCK_N, k * BLOCK_K], ready.index(slot),
                          b_smem.index(slot))
                c += 1


@gluon.jit
def _a_chunk(a_smem, W: gl.constexpr, slot, k: gl.constexpr, K_TILES: gl.constexpr,
             STREAM_A: gl.constexpr):
    """Consumer W's A chunk k: of its resident block, or with STREAM_A the one in ``slot``."""
    if STREAM_A:
        return a_smem.index(2 * slot + W)
    else:
        return a_smem.index(W * K_TILES + k)


@gluon.jit
def _a_block_ready(W: gl.constexpr, a_ready, pair, active, STREAM_A: gl.constexpr):
    """Waits for consumer W's resident A block of this pair (nothing to wait for with
    STREAM_A: each chunk comes with its slot)."""
    if not STREAM_A:
        mbarrier.wait(a_ready.index(W), pair & 1, pred=active)


@gluon.jit
def _a_block_done(W: gl.constexpr, a_empty, last, STREAM_A: gl.constexpr):
    """After the block's ``last`` tile's products: the loader may bring consumer W's next A
    block in (without STREAM_A)."""
    if not STREAM_A:
        mbarrier.arrive(a_empty.index(W), count=1, pred=last)


@gluon.jit
def _tile_products(W: gl.constexpr, a_smem, b_smem, ready, empty, c, mma: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_TILES: gl.constexpr,
                   STAGES: gl.constexpr, STREAM_A: gl.constexpr = False):
    """(raw tile, chunk count): consumer W's A block (resident, or with STREAM_A its chunks in
    the slots) times the ring's next K_TILES B chunks (c of them consumed so far), asynchronous
    products, each chunk's slot released once its product is done. The two consumers run
    freely: taking turns at the tensor cores (FA3's ping-pong) measured no faster
    (docs/design.md, "The Hopper forward")."""
    raw = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    for k in gl.static_range(K_TILES):
        slot = c % STAGES
        mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
        raw = warpgroup_mma(_a_chunk(a_smem, W, slot, k, K_TILES, STREAM_A),
                            b_smem.index(slot).permute((1, 0)), raw, use_acc=k > 0,
                            is_async=True)
        # The previous chunk's product is done: its slot may be refilled.
        raw = warpgroup_mma_wait(num_outstanding=1, deps=(raw,))
        if k > 0:
            mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
        c += 1
    raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
    mbarrier.arrive(empty.index((c - 1) % STAGES), count=1)
    return raw, c


@gluon.jit
def _consumer(W: gl.constexpr, a_smem, b_smem, a_ready, a_empty, ready, empty,
              bias_ptr, scale_ptr, max_out_ptr, sum_out_ptr, tile_stat_ptr,
              col_max_ptr, col_sum_ptr, col_tile_stat_ptr,
              n_valid, N, V, pid_g, pid_s, block_begin, block_end, tile_begin, tile_end,
              n_col_tiles,
              HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
              RECORD_TILES: gl.constexpr, COL_STATS: gl.constexpr, DIAG_MASK: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_TILES: gl.constexpr,
              STAGES: gl.constexpr, STREAM_A: gl.constexpr):
    """One warpgroup: row blocks block_begin + W, + 2 + W, ... against every tile of the
    split. Its column partials (COL_STATS) are row 2·g + W of the (2 · groups, V) arrays."""
    WARP_ROWS: gl.constexpr = BLOCK_M // 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    # The four warps' column partials, each thread holding one column's four: combined there.
    parts_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, BLOCK_N // 128],
                                             threads_per_warp=[1, 32], warps_per_cta=[1, 4],
                                             order=[0, 1])
    pcol_l: gl.constexpr = gl.SliceLayout(0, parts_l)
    scale = 1.0
    if HAS_SCALE:
        scale = gl.load(scale_ptr).to(gl.float32)
    col_part = (pid_g * 2 + W).to(gl.int64) * V

    c = 0
    for pair in range(gl.cdiv(gl.maximum(block_end - block_begin, 0), 2)):
        rb = block_begin + 2 * pair + W
        active = rb < block_end  # the last pair of an odd count has one block
        _a_block_ready(W, a_ready, pair, active, STREAM_A)
        offs_m = rb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
        m_rows = offs_m < n_valid
        row_max = gl.full([BLOCK_M], float("-inf"), gl.float32, row_l)
        row_sum = gl.zeros([BLOCK_M], gl.float32, row_l)

        for t in range(tile_begin, tile_end):
            # The tile's column partials, read before its products: their latency (a round
            # trip to L2 per tile) hides behind the tensor cores' work.
            old_max = gl.full([BLOCK_N], float("-inf"), gl.float32, pcol_l)
            old_sum = gl.zeros([BLOCK_N], gl.float32, pcol_l)
            if COL_STATS:
                cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=pcol_l)
                old_max = gl.load(col_max_ptr + col_part + cols, mask=cols < V,
                                  other=float("-inf"))
                old_sum = gl.load(col_sum_ptr + col_part + cols, mask=cols < V, other=0.0)
            raw, c = _tile_products(W, a_smem, b_smem, ready, empty, c, mma,
                                    BLOCK_M, BLOCK_N, K_TILES, STAGES, STREAM_A)
            # The block's last product is done: the loader may bring the next block in while
            # this tile's statistics are formed.
            _a_block_done(W, a_empty, t == tile_end - 1, STREAM_A)
            if active:
                row_max, row_sum = _tile_statistics(
                    raw, row_max, row_sum, offs_m, m_rows, rb, t, bias_ptr, scale, V,
                    n_col_tiles, tile_stat_ptr, col_max_ptr + col_part, col_sum_ptr + col_part,
                    old_max, old_sum, col_tile_stat_ptr, mma, col_l, parts_l, pcol_l,
                    HAS_BIAS, HAS_SCALE, RECORD_TILES, COL_STATS, DIAG_MASK, BLOCK_N, WARP_ROWS)

        if active:
            out = pid_s.to(gl.int64) * N + offs_m
            gl.store(max_out_ptr + out, row_max, mask=m_rows)
            gl.store(sum_out_ptr + out, row_sum, mask=m_rows)


@gluon.jit
def _tile_statistics(raw, row_max, row_sum, offs_m, m_rows, rb, t, bias_ptr, scale, V,
                     n_col_tiles, tile_stat_ptr, col_max_ptr, col_sum_ptr, old_max, old_sum,
                     col_tile_stat_ptr,
                     mma: gl.constexpr, col_l: gl.constexpr, parts_l: gl.constexpr,
                     pcol_l: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
                     RECORD_TILES: gl.constexpr, COL_STATS: gl.constexpr,
                     DIAG_MASK: gl.constexpr, BLOCK_N: gl.constexpr, WARP_ROWS: gl.constexpr):
    """Folds one raw tile into the rows' online (max, Σ exp), the column partials (COL_STATS:
    ``col_*_ptr`` at the consumer's row, whose values before this tile are ``old_max``,
    ``old_sum``) and the per-tile records; returns the rows' (max, sum). DIAG_MASK: X = -inf
    where the row id equals the column id (A and B the same rows, in order)."""
    offs_n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    m_cols = offs_n < V
    x = raw
    if HAS_SCALE:
        x = _mul_rn(x, scale)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + offs_n, mask=m_cols, other=0.0).to(gl.float32)
        x = x + gl.expand_dims(bias, 0)
    if t * BLOCK_N + BLOCK_N > V:  # the last column tile: the columns past V out
        x = gl.where(gl.expand_dims(m_cols, 0), x, float("-inf"))
    if DIAG_MASK:
        row_lo = rb * (4 * WARP_ROWS)
        if (row_lo < t * BLOCK_N + BLOCK_N) & (t * BLOCK_N < row_lo + 4 * WARP_ROWS):
            x = gl.where(gl.expand_dims(offs_m, 1) == gl.expand_dims(offs_n, 0),
                         float("-inf"), x)

    # Rows: the online (max, Σ exp) of the Triton kernel.
    new_max = gl.maximum(row_max, gl.max(x, axis=1))
    safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
    p = _exp_ftz(x - gl.expand_dims(safe_max, 1))
    tile_sum = gl.sum(p, axis=1)
    row_sum = row_sum * gl.exp(row_max - safe_max) + tile_sum
    mass = new_max + gl.log(tile_sum)  # each row's log Σ over the tile (records only)
    if not COL_STATS:
        if RECORD_TILES:
            top_mass = gl.max(gl.where(m_rows, mass, float("-inf")), axis=0)
            gl.store(tile_stat_ptr + (rb * n_col_tiles + t).to(gl.int64), top_mass)
    else:
        # Three scalars of the tile in one exchange across the warps: the largest row max (the
        # columns' shared reference below), the smallest entry, the largest row log-mass.
        ref, low, top_mass = gl.reduce(
            (gl.where(m_rows, safe_max, float("-inf")),
             gl.where(m_rows, gl.min(x, axis=1), float("inf")),
             gl.where(m_rows, mass, float("-inf"))), 0, _max_min_max)
        if RECORD_TILES:
            gl.store(tile_stat_ptr + (rb * n_col_tiles + t).to(gl.int64), top_mass)

        # Columns: Σ_r exp(X_rj − m) for one reference m per tile, each warp over its own rows
        # (no exchange between warps), then the four partials added.
        if low >= ref - _REF_RANGE:
            # Every entry lies within _REF_RANGE of the largest row max: exp(X − ref) is a normal
            # float, formed from the rows' own exponentials, exp(X − max_r) · exp(max_r − ref),
            # without an exponential per entry.
            r = gl.where(m_rows, gl.exp(safe_max - ref), 0.0)
            e = p * gl.expand_dims(r, 1)
            # Each warp's sums over its 16 rows, scattered over its lanes: rows l and l + 8 of a
            # thread added, then three halvings between lane rows (28 shuffles where an all-reduce
            # takes 96), each thread left with 4 columns' sums.
            lane = gl.expand_dims(offs_m % 8, 1) + gl.zeros_like(x).to(gl.int32)
            e = gl.sum(gl.reshape(e, [4, 2, 8, BLOCK_N]), axis=1)
            lane = gl.max(gl.reshape(lane, [4, 2, 8, BLOCK_N]), axis=1)
            e, lane = _halve(e, lane, 0, BLOCK_N)
            e, lane = _halve(e, lane, 1, BLOCK_N // 2)
            e, lane = _halve(e, lane, 2, BLOCK_N // 4)
            # e[w, l, c]: warp w's sum of column 64·l₀ + 32·l₁ + 16·l₂ + c (l's bits l₂l₁l₀)
            e = gl.permute(gl.reshape(e, [4, 2, 2, 2, BLOCK_N // 8]), [0, 3, 2, 1, 4])
            e = gl.reshape(e, [4, BLOCK_N])
            tile_csum = gl.sum(gl.convert_layout(e, parts_l), axis=0)
            tile_max = gl.zeros_like(tile_csum) + ref
        else:
            # A wide tile (or the matrix's edge, where masked entries are -inf): each column
            # against its own max, as the Triton kernel.
            xc = gl.where(gl.expand_dims(m_rows, 1), x, float("-inf"))
            x3 = gl.reshape(xc, [4, WARP_ROWS, BLOCK_N])
            w_max = gl.max(x3, axis=1)
            w_safe = gl.where(w_max == float("-inf"), 0.0, w_max)
            w_sum = gl.sum(_exp_ftz(x3 - gl.expand_dims(w_safe, 1)), axis=1)
            w_max = gl.convert_layout(w_max, parts_l)
            w_sum = gl.convert_layout(w_sum, parts_l)
            tile_max = gl.max(w_max, axis=0)
            safe_tile = gl.where(tile_max == float("-inf"), 0.0, tile_max)
            tile_csum = gl.sum(w_sum * gl.exp(w_max - gl.expand_dims(safe_tile, 0)), axis=0)

        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=pcol_l)
        inside = cols < V
        if RECORD_TILES:
            cmass = gl.where(inside, tile_max + gl.log(tile_csum), float("-inf"))
            gl.store(col_tile_stat_ptr + (rb * n_col_tiles + t).to(gl.int64), gl.max(cmass, axis=0))
        # Each thread reads back (old_max, old_sum) only the columns it wrote (one layout): no
        # barrier needed.
        top = gl.maximum(old_max, tile_max)
        safe_top = gl.where(top == float("-inf"), 0.0, top)
        total = old_sum * gl.exp(old_max - safe_top) + tile_csum * gl.exp(tile_max - safe_top)
        gl.store(col_max_ptr + cols, top, mask=inside)
        gl.store(col_sum_ptr + cols, total, mask=inside)
    return new_max, row_sum


# The sizes are not specialized on (a compile per batch size otherwise): no access vectorizes
# on them.
@gluon.jit(do_not_specialize=["N", "V", "blocks_per_group", "tiles_per_split", "n_col_tiles"])
def _forward_sm90_kernel(
    a_desc, b_desc,      # TMA descriptors of A in compact row order (BLOCK_M × BLOCK_K) and B
    bias_ptr, scale_ptr,
    n_valid_ptr,         # () int64: rows p >= n_valid are skipped
    max_out_ptr,         # (splits, N) fp32 partial row max
    sum_out_ptr,         # (splits, N) fp32 partial Σ exp(X − max)
    tile_stat_ptr,       # as _lse_forward_kernel's, RECORD_TILES
    col_max_ptr,         # (2 · row groups, V) fp32 partial column max (COL_STATS)
    col_sum_ptr,         # (2 · row groups, V) fp32 partial column Σ exp(X − max) (COL_STATS)
    col_tile_stat_ptr,   # as _lse_forward_kernel's, RECORD_TILES and COL_STATS
    N, V, blocks_per_group, tiles_per_split, n_col_tiles,
    HAS_BIAS: gl.constexpr, HAS_SCALE: gl.constexpr,
    RECORD_TILES: gl.constexpr, COL_STATS: gl.constexpr, DIAG_MASK: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    STREAM_A: gl.constexpr,
):
    """Program (g, c) visits row blocks of group g × column tiles of split c, as the Triton
    kernel's grid (engine._forward_grid), with three partitions: a loader warp and two
    consumer warpgroups, each with row blocks of its own, that share the B chunks."""
    pid_g = gl.program_id(0)
    pid_s = gl.program_id(1)
    n_valid = gl.load(n_valid_ptr).to(gl.int32)  # TMA coordinates are 32-bit; N < 2³¹
    block_begin, block_end, tile_begin, tile_end = _program_ranges(
        gl.cdiv(n_valid, BLOCK_M), blocks_per_group, 0, n_col_tiles, tiles_per_split)

    a_smem, b_smem, a_ready, a_empty, ready, empty = _ring(
        a_desc, b_desc, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, STAGES, STREAM_A)

    gl.warp_specialize([
        (_consumer, (0, a_smem, b_smem, a_ready, a_empty, ready, empty,
                     bias_ptr, scale_ptr, max_out_ptr, sum_out_ptr, tile_stat_ptr,
                     col_max_ptr, col_sum_ptr, col_tile_stat_ptr,
                     n_valid, N, V, pid_g, pid_s, block_begin, block_end, tile_begin, tile_end,
                     n_col_tiles, HAS_BIAS, HAS_SCALE, RECORD_TILES, COL_STATS, DIAG_MASK,
                     BLOCK_M, BLOCK_N, K_TILES, STAGES, STREAM_A)),
        (_consumer, (1, a_smem, b_smem, a_ready, a_empty, ready, empty,
                     bias_ptr, scale_ptr, max_out_ptr, sum_out_ptr, tile_stat_ptr,
                     col_max_ptr, col_sum_ptr, col_tile_stat_ptr,
                     n_valid, N, V, pid_g, pid_s, block_begin, block_end, tile_begin, tile_end,
                     n_col_tiles, HAS_BIAS, HAS_SCALE, RECORD_TILES, COL_STATS, DIAG_MASK,
                     BLOCK_M, BLOCK_N, K_TILES, STAGES, STREAM_A)),
        (_loader, (a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, ready, empty,
                   block_begin, block_end, tile_begin, tile_end,
                   BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, STAGES, STREAM_A)),
    ], [4, 1], [CONSUMER_REGS, 24])

    _ring_done(a_ready, a_empty, ready, empty, STAGES)


def streams_a(d: int) -> bool:
    """Whether A comes through the ring (STREAM_A): its two resident blocks would not fit."""
    return d > MAX_D


def stages(d: int, element_size: int, reserve: int = 0, block_n: int = BLOCK_N) -> int:
    """Ring slots that fit beside the two consumers' resident A blocks (and ``reserve``
    bytes kept for a kernel's own use); a slot holds a B chunk of ``block_n`` rows, and with
    STREAM_A (``streams_a``) the two A chunks that meet it."""
    slot = block_n * BLOCK_K * element_size
    if streams_a(d):
        slot += 2 * BLOCK_M * BLOCK_K * element_size
    else:
        reserve += 2 * BLOCK_M * d * element_size
    return max(2, min(2 * (d // BLOCK_K), (_SMEM_BUDGET - reserve) // slot))


def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """The TMA descriptor of a row-major bf16/fp16 operand read in (rows × BLOCK_K) blocks."""
    gl_dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl_dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, BLOCK_K], layout)


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernels take these operands (dtype and width; the caller checks the GPU):
    D a multiple of 64 up to MAX_STREAMED_D, two 64-row blocks of A resident in shared memory
    up to MAX_D and streamed beside the B chunks above (``streams_a``)."""
    d = b.shape[1]
    return (a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype
            and d % BLOCK_K == 0 and BLOCK_K <= d <= MAX_STREAMED_D)


@dataclass(frozen=True)
class Partials:
    """What the kernel writes: the row partials (splits, N) fp32, the per-tile records
    (⌈N / 64⌉, ⌈V / 128⌉) from -inf, and, for column statistics, the column partials
    (2 · row groups, V) fp32 (from -inf and 0), one row per consumer warpgroup, with their
    per-tile records (as ``_lse_forward_kernel``'s outputs otherwise); None without."""

    row_max: torch.Tensor
    row_sum: torch.Tensor
    tiles: torch.Tensor
    col_max: torch.Tensor | None = None
    col_sum: torch.Tensor | None = None
    col_tiles: torch.Tensor | None = None


@dataclass(frozen=True)
class Schedule:
    """The grid (row groups × column splits) and what each program covers."""

    groups: int
    splits: int
    blocks_per_group: int
    tiles_per_split: int
    n_col_tiles: int


def launch(a_rows, b, logits, n_valid, out: Partials, schedule: Schedule,
           record_tiles: bool) -> None:
    """Runs the kernel; ``a_rows``: A in compact row order, TMA-ready (engine._tma_ready), as
    b; ``logits``: the engine's ``Logits`` (scale and bias; the diagonal mask with A and B the
    same rows in order; no softcap or order). Column statistics where ``out`` has them."""
    d = b.shape[1]
    bias, scale = logits.bias, logits.scale
    n_stages = stages(d, a_rows.element_size())
    dummy = out.row_sum
    col_stats = out.col_max is not None
    cols = (out.col_max, out.col_sum, out.col_tiles) if col_stats else (dummy,) * 3
    _forward_sm90_kernel[(schedule.groups, schedule.splits)](
        descriptor(a_rows, BLOCK_M), descriptor(b, BLOCK_N),
        bias if bias is not None else dummy, scale if scale is not None else dummy, n_valid,
        out.row_max, out.row_sum, out.tiles, *cols,
        a_rows.shape[0], b.shape[0], schedule.blocks_per_group, schedule.tiles_per_split,
        schedule.n_col_tiles,
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        RECORD_TILES=record_tiles, COL_STATS=col_stats, DIAG_MASK=logits.diag_mask,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, K_TILES=d // BLOCK_K,
        STAGES=n_stages, CONSUMER_REGS=CONSUMER_REGS, STREAM_A=streams_a(d),
        num_warps=WARPS, maxnreg=MAX_REGS,
    )
