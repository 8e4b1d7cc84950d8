"""Hopper (sm90) SigLIP chunk: G = s·dX of a chunk of rows against every column, with the
chunk's sums of the loss and of the scale's and the bias's gradient terms, formed from the
logits while they are in registers: the Gluon counterpart of ``chunked_contrastive``'s cuBLAS
fp32 logits and ``_siglip_rows_kernel``, without the fp32 logits' round trip through memory
(written by cuBLAS, read back by the row pass: twice the bytes of G).

Per tile of the chunk's rows × columns, the same arithmetic as ``_siglip_rows_kernel``:
X = s·Z + β, z = +1 where the (global) row id equals the column id and −1 elsewhere,
softplus(−z·X) (log1p by a series, no branch), dX = −coef·z·σ(−z·X), G = s·dX in the input
dtype, and the rows' Σ softplus, Σ dX·Z, Σ dX, summed over the tile and kept per row block
and column split (no atomics: the same sums in the same order every call). Tiles without a
diagonal entry or an edge, nearly all, take a shorter form without labels or masks
(``_siglip_tile``).

The schedule is the Hopper recompute's (``lse_backward_sm90``): a loader warp issues every TMA
copy, each consumer's 64-row A block resident in shared memory (above D = 512, its chunks
through the ring beside the B chunks) and the B chunks through a ring of stages; two consumer
warpgroups with row blocks of their own multiply the same B chunks.
Each consumer forms a tile's G and sums after issuing the next tile's first ``AHEAD`` chunk
products, while they run (FlashAttention-3's overlap within a warpgroup): two fp32
accumulators, which fit in registers without spills at 64-column tiles (64 × 64 × 4 bytes a
warpgroup each), where 128 columns spill hundreds of values. Each consumer writes a tile's G
into a shared-memory tile of its own and one TMA copy takes it to a buffer whose rows and
columns are padded to whole tiles (zeros there); the copy runs while the consumer goes on.

Gluon kernels run on the GPU only: ``chunked_contrastive`` keeps the cuBLAS and Triton path for
every other case, and the GPU tests (``tests/test_sm90_siglip.py``) compare the two.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import config
from .lse_backward_sm90 import schedule
from .lse_forward_sm90 import (
    BLOCK_K,
    BLOCK_M,
    CONSUMER_REGS,
    MAX_REGS,
    WARPS,
    _a_block_done,
    _a_block_ready,
    _a_chunk,
    _exp_ftz,
    _loader,
    _program_ranges,
    _ring,
    _ring_done,
    descriptor,
    stages,
    streams_a,
    supports,
)

__all__ = ["BLOCK_M", "BLOCK_N", "Chunks", "supports"]

_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

BLOCK_N = 64  # columns of a tile: two fp32 accumulators a consumer, without spills
AHEAD = 3     # chunk products in flight while a consumer forms the previous tile's G
G_TILE_ELEMENTS = 2 * BLOCK_M * BLOCK_N  # the consumers' shared-memory G tiles


@gluon.jit
def _rcp(x):
    """1 / x by the hardware's reciprocal (rcp.approx.ftz.f32, within an ulp of fp32)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _log1p_unit(u):
    """log(1 + u) for u in [0, 1], to about an ulp of fp32 and without a branch: 2·atanh(t),
    t = u / (2 + u) ≤ 1/3, by its series to t¹³ (the rest below 2·10⁻⁸ of the value). gl.log
    would call libdevice's logf, a branch per element, and the hardware's lg2.approx loses the
    relative accuracy of log(1 + u) for small u that Goldberg's form keeps in the Triton row
    kernel (a SigLIP loss is mostly such terms: through lg2.approx(1 + u) it came out 3.6·10⁻⁴
    high at b = 65,536)."""
    t = u * _rcp(2.0 + u)
    t2 = t * t
    p = 1.0 / 13.0
    p = p * t2 + 1.0 / 11.0
    p = p * t2 + 1.0 / 9.0
    p = p * t2 + 1.0 / 7.0
    p = p * t2 + 1.0 / 5.0
    p = p * t2 + 1.0 / 3.0
    p = p * t2 + 1.0
    return 2.0 * t * p


@gluon.jit
def _grow(p, q):
    """(1 + p)(1 + q) − 1: the row's product of (1 + u) less one, kept in its own scale (no
    rounding of 1 + u for small u)."""
    return p + q + p * q


@gluon.jit
def _log1p(q):
    """log(1 + q) for q ≥ 0: ``_log1p_unit`` up to 1; above, 1 + q = 2^e · f with f in [1, 2)
    gives e · ln 2 + log1p(f − 1) (1 + q rounded costs 6·10⁻⁸ of a value ≥ ln 2)."""
    big = q >= 1.0
    bits = (1.0 + q).to(gl.int32, bitcast=True)
    f = ((bits & 0x7FFFFF) | 0x3F800000).to(gl.float32, bitcast=True)
    e = ((bits >> 23) - 127).to(gl.float32)
    return gl.where(big, e * 0.6931471805599453, 0.0) + _log1p_unit(gl.where(big, f - 1.0, q))


@gluon.jit
def _siglip_tile(raw, t, rb, offs_m, m_rows, row0, scale, beta, coef, R, M, g_smem, g_desc,
                 col_l: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """G of one raw tile into the chunk's buffer (``_store_tile``); returns the rows'
    (Σ softplus(−z·X), Σ dX·Z, Σ dX) over the tile.

    Most tiles hold neither a diagonal entry nor a row or column past the edge: there z = −1
    everywhere and nothing is masked, so softplus(−z·X) = softplus(X), dX = coef·σ(X), and the
    per-element labels and masks of the general case (a third of its instructions) are left out:
    at b = 65,536 the chunk kernel took 15.3 ms instead of 26.8."""
    offs_n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    r_lo = row0 + rb * BLOCK_M  # the column of the tile's first row's positive
    c_lo = t * BLOCK_N
    plain = ((rb * BLOCK_M + BLOCK_M <= R) & (c_lo + BLOCK_N <= M)
             & ((r_lo + BLOCK_M <= c_lo) | (c_lo + BLOCK_N <= r_lo)))
    if plain:
        x = scale * raw + beta
        # softplus(X) = max(X, 0) + log1p(e^(−|X|)); σ(X) from the same exponential
        u = _exp_ftz(-gl.abs(x))
        r = _rcp(1.0 + u)
        sig = gl.where(x >= 0.0, r, u * r)
        # Σ_j log1p(u_j) = log1p(Π_j (1 + u_j) − 1): two instructions an entry and one log1p
        # a row, where a log1p an entry took a dozen (Π ≤ 2^BLOCK_N = 2^64: no overflow)
        loss_part = gl.sum(gl.maximum(x, 0.0), axis=1) + _log1p(gl.reduce(u, 1, _grow))
        scale_part = gl.sum(sig * raw, axis=1) * coef
        bias_part = gl.sum(sig, axis=1) * coef
        g = ((scale * coef) * sig).to(g_smem.dtype)
    else:
        m_cols = offs_n < M
        sign = gl.where(gl.expand_dims(offs_m + row0, 1) == gl.expand_dims(offs_n, 0), 1.0, -1.0)
        y = sign * (scale * raw + beta)  # z·X
        # softplus(−y) = max(−y, 0) + log1p(e^(−|y|)); σ(−y) from the same exponential
        u = gl.exp(-gl.abs(y))
        lost = gl.maximum(-y, 0.0) + _log1p_unit(u)
        r = _rcp(1.0 + u)
        sig = gl.where(y <= 0.0, r, u * r)
        dx = -coef * sign * sig
        keep = gl.expand_dims(m_rows, 1) & gl.expand_dims(m_cols, 0)
        lost = gl.where(keep, lost, 0.0)
        dx = gl.where(keep, dx, 0.0)
        loss_part = gl.sum(lost, axis=1)
        scale_part = gl.sum(dx * raw, axis=1)
        bias_part = gl.sum(dx, axis=1)
        g = (scale * dx).to(g_smem.dtype)
    _store_tile(g, g_smem, g_desc, rb * BLOCK_M, c_lo)
    return loss_part, scale_part, bias_part


@gluon.jit
def _store_tile(g, g_smem, g_desc, row, col):
    """G's tile into the buffer at (row, col) through the consumer's shared-memory tile and one
    TMA copy, which runs on while the consumer goes on (stored straight from the products'
    register layout, 4 bytes a thread, the G store took a third of the kernel's time)."""
    tma.store_wait(0)  # the previous tile's copy has read the shared-memory tile
    g_smem.store(g)
    fence_async_shared()
    _tma_store(g_desc, [row, col], g_smem)


@gluon.jit
def _consumer(W: gl.constexpr, a_smem, b_smem, a_ready, a_empty, ready, empty, g_smem,
              scale_ptr, bias_ptr, g_desc, sums_ptr,
              R, M, row0, coef, split, sums_row, sums_stride,
              block_begin, block_end, tile_begin, tile_end,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_TILES: gl.constexpr,
              STAGES: gl.constexpr, AHEAD: gl.constexpr, STREAM_A: gl.constexpr):
    """One warpgroup: row blocks block_begin + W, + 2 + W, ... against the tiles
    [tile_begin, tile_end) (split ``split``); each row block's three sums over the split go to
    its entry for the split. A tile's G and sums are formed once the next tile's first AHEAD chunk
    products are issued; a chunk's slot is released once its product is done (at most AHEAD
    slots held, fewer than the ring's, so that the other consumer and the loader go on)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    g_tile = g_smem.index(W)
    scale = gl.load(scale_ptr).to(gl.float32)
    beta = gl.load(bias_ptr).to(gl.float32)

    c = 0
    for pair in range(gl.cdiv(gl.maximum(block_end - block_begin, 0), 2)):
        rb = block_begin + 2 * pair + W
        active = rb < block_end  # the last pair of an odd count has one block
        _a_block_ready(W, a_ready, pair, active, STREAM_A)
        offs_m = rb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
        m_rows = offs_m < R
        loss_rows = gl.zeros([BLOCK_M], gl.float32, row_l)
        scale_rows = gl.zeros([BLOCK_M], gl.float32, row_l)
        bias_rows = gl.zeros([BLOCK_M], gl.float32, row_l)
        prev = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        for t in range(tile_begin, tile_end):
            raw = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
            for k in gl.static_range(K_TILES):
                slot = c % STAGES
                mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
                raw = warpgroup_mma(_a_chunk(a_smem, W, slot, k, K_TILES, STREAM_A),
                                    b_smem.index(slot).permute((1, 0)), raw, use_acc=k > 0,
                                    is_async=True)
                if k == AHEAD - 1:  # the previous tile, while these products run
                    if active and t > tile_begin:
                        lp, sp, bp = _siglip_tile(prev, t - 1, rb, offs_m, m_rows, row0, scale,
                                                  beta, coef, R, M, g_tile, g_desc, col_l,
                                                  BLOCK_M, BLOCK_N)
                        loss_rows += lp
                        scale_rows += sp
                        bias_rows += bp
                if k >= AHEAD - 1:
                    raw = warpgroup_mma_wait(num_outstanding=AHEAD - 1, deps=(raw,))
                    mbarrier.arrive(empty.index((c - (AHEAD - 1)) % STAGES), count=1)
                c += 1
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            for j in gl.static_range(AHEAD - 1):
                mbarrier.arrive(empty.index((c - (AHEAD - 1) + j) % STAGES), count=1)
            # The block's last product is done: the loader may bring the next block in.
            _a_block_done(W, a_empty, t == tile_end - 1, STREAM_A)
            prev = raw
        if active and tile_end > tile_begin:
            lp, sp, bp = _siglip_tile(prev, tile_end - 1, rb, offs_m, m_rows, row0, scale, beta,
                                      coef, R, M, g_tile, g_desc, col_l, BLOCK_M, BLOCK_N)
            loss_rows += lp
            scale_rows += sp
            bias_rows += bp
        if active:
            entry = sums_ptr + (rb.to(gl.int64) * sums_row + split)
            gl.store(entry, gl.sum(loss_rows, axis=0))
            gl.store(entry + sums_stride, gl.sum(scale_rows, axis=0))
            gl.store(entry + 2 * sums_stride, gl.sum(bias_rows, axis=0))
    tma.store_wait(0)


# The sizes are not specialized on (a compile per batch size otherwise).
@gluon.jit(do_not_specialize=["R", "M", "row0", "coef", "row_blocks", "n_col_tiles",
                              "sums_row", "sums_stride", "blocks_per_group", "tiles_per_split"])
def _siglip_sm90_kernel(
    a_desc, b_desc,   # TMA descriptors of the chunk's rows of A (BLOCK_M × BLOCK_K) and of B
    scale_ptr,        # () fp32 s
    bias_ptr,         # () fp32 β
    g_desc,           # TMA descriptor of G out (row blocks · BLOCK_M, ≥ tiles · BLOCK_N), input
                      # dtype, in BLOCK_M × BLOCK_N tiles
    sums_ptr,         # (3, row blocks, ≥ splits) fp32 zeros: Σ softplus, Σ dX·Z, Σ dX,
                      # one total per row block and split
    R, M,
    row0,             # the column of the chunk's first row's positive (its global row id; M or
                      # more: no positives)
    coef, row_blocks, n_col_tiles, sums_row, sums_stride,
    blocks_per_group, tiles_per_split,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    K_TILES: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    AHEAD: gl.constexpr, STREAM_A: gl.constexpr,
):
    """Program (g, s): row blocks of group g × the tiles of split s; a loader warp and two
    consumer warpgroups that share the B chunks (as ``_clip_grad_sm90_kernel``), each storing
    G through a shared-memory tile of its own."""
    pid_s = gl.program_id(1)
    block_begin, block_end, tile_begin, tile_end = _program_ranges(
        row_blocks, blocks_per_group, 0, n_col_tiles, tiles_per_split)

    a_smem, b_smem, a_ready, a_empty, ready, empty = _ring(
        a_desc, b_desc, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, STAGES, STREAM_A)
    g_smem = gl.allocate_shared_memory(g_desc.dtype, [2, BLOCK_M, BLOCK_N], g_desc.layout)

    gl.warp_specialize([
        (_consumer, (0, a_smem, b_smem, a_ready, a_empty, ready, empty, g_smem,
                     scale_ptr, bias_ptr, g_desc, sums_ptr,
                     R, M, row0, coef, pid_s, sums_row, sums_stride,
                     block_begin, block_end, tile_begin, tile_end,
                     BLOCK_M, BLOCK_N, K_TILES, STAGES, AHEAD, STREAM_A)),
        (_consumer, (1, a_smem, b_smem, a_ready, a_empty, ready, empty, g_smem,
                     scale_ptr, bias_ptr, g_desc, sums_ptr,
                     R, M, row0, coef, pid_s, sums_row, sums_stride,
                     block_begin, block_end, tile_begin, tile_end,
                     BLOCK_M, BLOCK_N, K_TILES, STAGES, AHEAD, STREAM_A)),
        (_loader, (a_desc, b_desc, a_smem, b_smem, a_ready, a_empty, ready, empty,
                   block_begin, block_end, tile_begin, tile_end,
                   BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, STAGES, STREAM_A)),
    ], [4, 1], [CONSUMER_REGS, 24])

    _ring_done(a_ready, a_empty, ready, empty, STAGES)


class Chunks:
    """The kernel bound to one call's B (or a chunk of its columns), scale, bias and G buffer;
    called once per chunk of rows of A (``chunked_contrastive.siglip_loss_and_grads``), for the
    rows of A in order.

    ``g``: (chunk rows rounded up to BLOCK_M, tiles · BLOCK_N) in the input dtype, its padding
    left as the kernel writes it (zeros); ``n``, ``chunk``: the rows of A and of a chunk (a
    multiple of BLOCK_M unless it is all of them); ``shift``: row i's positive is column
    i + shift of ``b``, none where that is outside [0, M) (M or more: none at all; −c0 for the
    chunk of columns from c0 on). The sums of the loss and of the scale's and the bias's
    gradient terms are kept per row block and column split, 12·(n / 64)·splits bytes
    (splits ≤ one per SM), and added up in the same order every call (``totals``).
    """

    def __init__(self, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, coef: float,
                 g: torch.Tensor, n: int, chunk: int, shift: int = 0):
        m, d = b.shape
        self._b_desc = descriptor(b, BLOCK_N)
        self._scale, self._bias, self._coef = scale, bias, coef
        self._g_desc = descriptor(g, BLOCK_M)  # BLOCK_M × BLOCK_K tiles: BLOCK_K = BLOCK_N
        self._shift = shift
        self._m, self._n_ct = m, -(-m // BLOCK_N)
        self._slots = config.sm_count(b.device)
        sizes = {min(chunk, n), n % chunk or chunk}  # a full chunk and the last one
        splits = max(self._schedule(r)[2] for r in sizes)
        self._sums = torch.zeros((3, -(-n // BLOCK_M), splits), dtype=torch.float32,
                                 device=b.device)
        n_stages = stages(d, b.element_size(), reserve=G_TILE_ELEMENTS * b.element_size(),
                          block_n=BLOCK_N)
        self._flags = dict(
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, K_TILES=d // BLOCK_K,
            STAGES=n_stages, CONSUMER_REGS=CONSUMER_REGS, STREAM_A=streams_a(d),
            AHEAD=min(AHEAD, d // BLOCK_K, n_stages),  # slots held < the ring's
            num_warps=WARPS, maxnreg=MAX_REGS,
        )

    def _schedule(self, rows: int) -> tuple[int, int, int, int]:
        return schedule(-(-rows // BLOCK_M), self._n_ct, self._slots)

    def __call__(self, a_chunk: torch.Tensor, row0: int) -> None:
        """G and the sums of rows row0 … row0 + len(a_chunk) (row0 a multiple of BLOCK_M)."""
        r = a_chunk.shape[0]
        groups, per_group, splits, per_split = self._schedule(r)
        sums = self._sums[:, row0 // BLOCK_M:]
        _siglip_sm90_kernel[(groups, splits)](
            descriptor(a_chunk, BLOCK_M), self._b_desc, self._scale, self._bias,
            self._g_desc, sums, r, self._m, row0 + self._shift, float(self._coef),
            -(-r // BLOCK_M), self._n_ct, sums.stride(1), sums.stride(0), per_group, per_split,
            **self._flags)

    def totals(self) -> torch.Tensor:
        """(3,) fp32: Σ softplus(−z·X), Σ dX·Z, Σ dX over every row so far."""
        return self._sums.sum(dim=(1, 2))
