"""Safe gradient filtering: which logit tiles the backward may skip.

A rule like "skip a tile when each of its probabilities is below ε" drops the whole gradient
mass when the softmax is flat (an untrained model: every p ≈ 1/V). Instead we bound the total
probability mass skipped per row:

    the forward records, per (row block, column tile), M_bt = max_{r∈b} log Σ_{j∈t} exp(X_rj);
    for every row r of block b, the mass of tile t is
        exp(M_bt − lse_r) ≤ exp(M_bt − min_{r∈b} lse_r);
    per row block, tiles are sorted by that bound and the smallest are skipped while the sum of
    their bounds stays ≤ ε.

So every row loses at most ε of its softmax mass (its gradient changes by at most ε · max_j |B_j|
in dA and its share of dB likewise), whatever the input: flat logits keep every tile, peaked
ones skip the tail. Tiles that hold a row's target are always kept. (The Hopper kernels flush
exponentials below 2⁻¹²⁶ to zero, in M_bt as in the gradient tiles: each such entry's
probability is below 2⁻¹²⁶, so the bound holds to V · 2⁻¹²⁶ more, 10⁻³² at V = 10⁶.)

The bound is made relative to each row's own gradient with a per-row ``scale`` ≤ 1, the row's
gradient mass: for cross-entropy the gradient row r·(P − e_y) has L1 mass 2r·(1 − P_y), so a
row may lose ε·min(1, 2(1 − P_y)) of its softmax mass. A confident row (P_y → 1), whose whole
gradient is the tiny tail it would otherwise drop, then keeps its tiles; every row's gradient
keeps a relative error ≤ ε.

That is the rule (``live_tiles``). A second rule, bounding the relative L2 error of the call's
whole logit gradient from per-row tile statistics, was measured against it and deleted
(docs/design.md, "Safe gradient filtering").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import config
from .logits import exp

# Probability mass a row may lose, by input dtype: a fraction of one ulp of the dtype, so the
# dropped mass stays below the rounding the gradient gets anyway when it is stored.
AUTO_FILTER_EPS = {
    torch.bfloat16: 2.0**-12,
    torch.float16: 2.0**-15,
    torch.float32: None,
}

def resolve_filter_eps(filter_eps: float | str | None, dtype: torch.dtype) -> float | None:
    """Maps the user's ``filter_eps`` ("auto", None or a float ≥ 0) to a bound on each row's
    lost softmax mass, or None."""
    if filter_eps is None:
        return None
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise ValueError(f"filter_eps must be 'auto', None or a float >= 0, got {filter_eps!r}")
        return AUTO_FILTER_EPS.get(dtype)
    try:
        eps = float(filter_eps)
    except (TypeError, ValueError):
        eps = float("nan")
    if not eps >= 0.0:
        raise ValueError(f"filter_eps must be 'auto', None or a float >= 0, got {filter_eps!r}")
    return eps if eps > 0.0 else None


def resolve_lm_head_filter_eps(filter_eps: float | str | None, dtype: torch.dtype
                               ) -> float | None:
    """The LM heads' ``filter_eps``: as :func:`resolve_filter_eps`, except that "auto" computes
    every tile (None). On LM-head inputs no rule skips enough at the accuracy bar to pay for its
    bookkeeping (the forward's per-tile statistics, the mask's launches; docs/design.md, "The LM
    heads' default"). An explicit ε still filters."""
    if isinstance(filter_eps, str) and filter_eps == "auto":
        return None
    return resolve_filter_eps(filter_eps, dtype)


def gradient_mass(loss: torch.Tensor) -> torch.Tensor:
    """min(1, 2(1 − P_y)) from a row's loss lse − X_y = −log P_y: the ``scale`` of a CE row."""
    return torch.clamp(-2.0 * torch.expm1(-loss), max=1.0)


def live_tiles(
    tile_log_mass: torch.Tensor,  # (row blocks, column tiles) fp32, from the forward
    lse: torch.Tensor,  # (row blocks * block_m,) fp32, compact row order, padded
    n_valid: torch.Tensor | int,  # () int64 on the device, or a host int
    block_m: int,
    eps: float | None,
    scale: torch.Tensor | None = None,  # (n,) n ≤ row blocks * block_m: per-row factor on eps
) -> torch.Tensor:
    """Boolean (row blocks, column tiles) mask of the tiles the backward must compute."""
    n_blocks, _ = tile_log_mass.shape
    row_ok = torch.arange(n_blocks * block_m, device=lse.device) < n_valid
    block_has_rows = row_ok.view(n_blocks, block_m).any(dim=1)
    if eps is None:
        return block_has_rows[:, None].expand_as(tile_log_mass).clone()
    # Python scalars, not torch.tensor(…, device=…): a host-to-device copy would wait for the GPU.
    inf = float("inf")
    min_lse = torch.where(row_ok, lse[: n_blocks * block_m], inf).view(n_blocks, block_m)
    min_lse = min_lse.amin(dim=1, keepdim=True)
    bound = torch.exp(tile_log_mass - min_lse)  # ≥ each row's mass in the tile
    budget = torch.full((n_blocks, 1), float(eps), device=lse.device)
    if scale is not None:  # the block's budget is its most demanding row's
        padded = torch.ones(n_blocks * block_m, device=lse.device)
        padded[: scale.numel()] = scale.float()
        padded = torch.where(row_ok, padded, inf).view(n_blocks, block_m)
        budget = eps * torch.nan_to_num(padded, nan=0.0).amin(dim=1, keepdim=True)
    sorted_bound, order = torch.sort(bound, dim=1)
    skip_sorted = torch.cumsum(sorted_bound, dim=1) <= budget  # NaN compares False: kept
    skip = torch.empty_like(skip_sorted).scatter_(1, order, skip_sorted)
    return ~skip & block_has_rows[:, None]


def mark_targets_live(
    live: torch.Tensor,  # (row blocks, column tiles) bool, modified in place
    target_pos: torch.Tensor,  # (N,) int64 target's position in the column order, or -1
    block_m: int,
    block_n: int,
) -> None:
    """Keeps every tile that holds some row's target (its one-hot term is never negligible).

    The PyTorch form of what ``backward_tiles`` does in its launch; the tests hold the two to
    each other."""
    n_tiles = live.shape[1]
    row_block = torch.arange(target_pos.numel(), device=target_pos.device) // block_m
    has = target_pos >= 0
    flat = row_block * n_tiles + torch.where(has, target_pos // block_n, 0)
    # amax instead of an indexed |=: repeated indices must not overwrite a True with a False.
    marks = torch.zeros(live.numel(), dtype=torch.uint8, device=live.device)
    marks.scatter_reduce_(0, flat, has.to(torch.uint8), reduce="amax")
    live |= marks.view_as(live).bool()


def backward_tiles(
    coarse: torch.Tensor | None,  # (coarse blocks, coarse tiles) bool, or None: every tile
    factors: tuple[int, int],  # (rows, columns) of a coarse tile over those of a backward tile
    n_blocks: int,
    n_tiles: int,
    block_m: int,
    block_n: int,
    n_valid: torch.Tensor,  # () int64 on the device
    target_pos: torch.Tensor | None = None,  # (N,) int64 target's position in column order, or -1
) -> torch.Tensor:
    """The (n_blocks, n_tiles) bool mask of the backward's (block_m × block_n) tiles, in one
    launch: tile (i, j) is live when its row block holds valid rows and the coarse tile that
    covers it is live (the forward's tiles are whole multiples of the backward's), or when it
    holds some row's target (``mark_targets_live``, whose one-hot term is never negligible).
    """
    out = torch.empty((n_blocks, n_tiles), dtype=torch.bool, device=n_valid.device)
    _backward_tiles_kernel[(n_blocks,)](
        coarse.view(torch.uint8) if coarse is not None else out,
        coarse.stride(0) if coarse is not None else 0,
        out.view(torch.uint8), n_tiles, n_valid,
        target_pos if target_pos is not None else n_valid,
        HAS_COARSE=coarse is not None, HAS_TARGETS=target_pos is not None,
        ROW_FACTOR=factors[0], COL_FACTOR=factors[1], BLOCK_M=block_m, BLOCK_N=block_n,
        CHUNK=min(4096, max(16, triton.next_power_of_2(n_tiles))), num_warps=4,
    )
    return out


@triton.jit
def _backward_tiles_kernel(
    coarse_ptr, stride_coarse,  # (coarse blocks, coarse tiles) uint8
    out_ptr,                    # (blocks, n_tiles) uint8
    n_tiles, n_valid_ptr,
    target_ptr,                 # (N,) int64 target positions, or -1
    HAS_COARSE: tl.constexpr, HAS_TARGETS: tl.constexpr,
    ROW_FACTOR: tl.constexpr, COL_FACTOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    n_valid = tl.load(n_valid_ptr)
    has_rows = i * BLOCK_M < n_valid
    row = out_ptr + i.to(tl.int64) * n_tiles
    for j0 in range(0, n_tiles, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        inside = j < n_tiles
        live = inside & has_rows
        if HAS_COARSE:
            c = tl.load(coarse_ptr + (i // ROW_FACTOR).to(tl.int64) * stride_coarse
                        + j // COL_FACTOR, mask=inside, other=0)
            live = live & (c != 0)
        tl.store(row + j, live.to(tl.uint8), mask=inside)
    if HAS_TARGETS:
        # After the row is written: the barrier orders these stores after the ones above.
        tl.debug_barrier()
        offs = i * BLOCK_M + tl.arange(0, BLOCK_M)
        pos = tl.load(target_ptr + offs, mask=offs < n_valid, other=-1)
        tl.store(row + tl.where(pos >= 0, pos, 0) // BLOCK_N, tl.full((BLOCK_M,), 1, tl.uint8),
                 mask=pos >= 0)


# Largest tile count one program of ``live_tiles_into`` sorts (larger: the PyTorch rule).
MAX_SORTED_TILES = 16384


def live_tiles_into(
    out: torch.Tensor,  # (blocks, tiles) bool, written (or OR-ed into with ``accumulate``)
    tile_log_mass: torch.Tensor,  # (blocks, tiles) fp32, any strides
    lse: torch.Tensor,  # (blocks * block,) fp32
    n_valid: torch.Tensor | int,  # () int64 on the device, or a host int
    block: int,
    eps: float,
    scale: torch.Tensor | None = None,
    *,
    accumulate: bool = False,
    tile_rows: int = 0,  # with ``accumulate``: tile t counts only if t * tile_rows < tile_limit
    tile_limit: torch.Tensor | None = None,
) -> None:
    """``live_tiles`` in one Triton launch (one program per block), where the PyTorch version
    issues ~25 small operations: on a short call the host's time to issue them, not the GPU,
    was the limit. Same bound, same guarantee; where bounds tie at the threshold this keeps
    every tied tile (PyTorch's sort may skip some of them), so it never skips more.
    ``out`` may be a transposed view (the column direction); ``accumulate`` ORs into it."""
    n_blocks, n_tiles = tile_log_mass.shape
    block_t = max(2, triton.next_power_of_2(n_tiles))
    if block_t > MAX_SORTED_TILES:  # one program's sort would not fit its registers
        live = live_tiles(tile_log_mass, lse, n_valid, block, eps, scale)
        if not accumulate:
            out.copy_(live)
            return
        if tile_rows > 0:
            counted = torch.arange(n_tiles, device=out.device) * tile_rows < tile_limit
            live &= counted[None, :]
        out |= live
        return
    flat = out.view(torch.uint8)
    from_ptr = isinstance(n_valid, torch.Tensor)
    _live_tiles_kernel[(n_blocks,)](
        tile_log_mass, tile_log_mass.stride(0), tile_log_mass.stride(1),
        lse, n_valid if from_ptr else lse, 0 if from_ptr else int(n_valid),
        scale if scale is not None else lse, scale.numel() if scale is not None else 0,
        flat, flat.stride(0), flat.stride(1),
        tile_limit if tile_limit is not None else lse, n_tiles, float(eps),
        BLOCK=block, BLOCK_T=block_t, N_VALID_PTR=from_ptr, HAS_SCALE=scale is not None,
        ACCUMULATE=accumulate, TILE_ROWS=tile_rows,
        PRECISE=not config.interpreting(), num_warps=8 if block_t >= 2048 else 4,
    )


@triton.jit
def _live_tiles_kernel(
    stat_ptr, stride_sb, stride_st,  # (blocks, tiles) fp32 log-mass statistics
    lse_ptr,                         # (blocks * BLOCK,) fp32
    n_valid_ptr, n_valid_int,        # valid rows: a () int64 on the device or a host int
    scale_ptr, n_scale,              # (n_scale,) per-row factor on eps; 1 beyond n_scale
    live_ptr, stride_lb, stride_lt,  # (blocks, tiles) uint8 out
    tile_limit_ptr,                  # () int64: tiles t with t * TILE_ROWS >= it stay as they are
    n_tiles, eps,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, N_VALID_PTR: tl.constexpr,
    HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, TILE_ROWS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    b = tl.program_id(0)
    if N_VALID_PTR:
        n_valid = tl.load(n_valid_ptr)
    else:
        n_valid = n_valid_int
    offs_r = b * BLOCK + tl.arange(0, BLOCK)
    valid = offs_r < n_valid
    lse = tl.load(lse_ptr + offs_r, mask=valid, other=float("inf"))
    has_rows = tl.max(valid.to(tl.int32), axis=0) > 0
    # A NaN LSE (a NaN input row) licenses no skip in its block.
    nan_row = tl.max((valid & (lse != lse)).to(tl.int32), axis=0) > 0
    min_lse = tl.min(tl.where(valid, lse, float("inf")), axis=0)
    budget = eps
    if HAS_SCALE:
        s = tl.load(scale_ptr + offs_r, mask=valid & (offs_r < n_scale), other=1.0)
        s = tl.where(s != s, 0.0, s)
        budget = eps * tl.min(tl.where(valid, s, float("inf")), axis=0)

    offs_t = tl.arange(0, BLOCK_T)
    in_range = offs_t < n_tiles
    stat = tl.load(stat_ptr + b * stride_sb + offs_t.to(tl.int64) * stride_st, mask=in_range,
                   other=float("inf"))
    bound = exp(stat - min_lse, PRECISE)  # ≥ every valid row's mass in the tile
    # (Tiles outside the range loaded +inf: they sort last.)
    live = ~(bound < _skip_threshold(bound, budget)) | nan_row
    m_out = in_range
    if TILE_ROWS > 0:
        m_out = m_out & (offs_t * TILE_ROWS < tl.load(tile_limit_ptr))
    _store_live(live & has_rows, live_ptr + b * stride_lb + offs_t.to(tl.int64) * stride_lt,
                m_out, ACCUMULATE)


@triton.jit
def _skip_threshold(bound, budget):
    """The rule skips a block's smallest bounds while their running sum stays within the
    budget: every tile below the threshold returned here, the first sorted bound whose running
    sum exceeds the budget (NaN sorts as +inf: kept)."""
    ordered = tl.sort(tl.where(bound == bound, bound, float("inf")))
    running = tl.cumsum(ordered, 0)
    return tl.min(tl.where(running > budget, ordered, float("inf")), axis=0)


@triton.jit
def _store_live(live, ptrs, mask, ACCUMULATE: tl.constexpr):
    """Stores a block's live mask (uint8), or'ed into the one there with ``ACCUMULATE``."""
    if ACCUMULATE:
        live = live | (tl.load(ptrs, mask=mask, other=0) != 0)
    tl.store(ptrs, live.to(tl.uint8), mask=mask)
