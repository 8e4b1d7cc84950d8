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
ones skip the tail. Tiles that hold a row's target are always kept.

The bound is made relative to each row's own gradient with a per-row ``scale`` ≤ 1, the row's
gradient mass: for cross-entropy the gradient row r·(P − e_y) has L1 mass 2r·(1 − P_y), so a
row may lose ε·min(1, 2(1 − P_y)) of its softmax mass. A confident row (P_y → 1), whose whole
gradient is the tiny tail it would otherwise drop, then keeps its tiles; every row's gradient
keeps a relative error ≤ ε.

That is the "block" rule (``live_tiles``). The "pooled" rule (``pooled_live_tiles``,
``FUSEDLOSS_FILTER_RULE=pooled``) bounds the relative L2 error of the call's logit gradient G
instead, from per-row tile log-masses L_rt = log Σ_{j∈t} exp(X_rj) (the forward's ``PER_ROW``
statistics). With w_r the row's gradient weight (its coefficient on P) and m_rt = exp(L_rt −
lse_r) its mass in tile t, a row that loses the tiles S changes its gradient by at most
w_r Σ_{t∈S} m_rt in L2 (‖·‖₂ ≤ ‖·‖₁), and by Minkowski's inequality over the block's rows

    ‖ΔG_b‖_F ≤ Σ_{t∈S} q_bt,        q_bt = sqrt(Σ_{r∈b} w_r² m_rt²).

Per row block the tiles of smallest q_bt are skipped while Σ q_bt ≤ ε · sqrt(Σ_{r∈b} f_r²),
where f_r ≤ ‖G_r‖₂ is a floor of the row's gradient norm (the magnitude of its target entry,
w_r (1 − P_y) for cross-entropy). Summed over blocks, ‖ΔG‖_F ≤ ε‖G‖_F on any input: a flat
softmax affords nothing, a confident row adds little budget but vetoes nothing. The column
direction (column softmax Q) is the same rule on per-column masses per row block.
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

# Relative L2 error of the call's logit gradient the pooled rule allows, by input dtype. bf16:
# 2⁻¹⁰. On an H200, 2⁻⁸ gave dE errors of 0.73× PyTorch's own bf16 error on a trained LM but
# 1.4–1.8× on the benchmark's peaked regime (exact: 0.8–0.9×), the skipped part adding ~1.5×
# there; a quarter of that keeps the total within 1.0× (docs/design.md). fp16 carries 3 more
# significant bits (unit roundoff 2⁻¹¹ against bf16's 2⁻⁸), so PyTorch's error there, and the
# budget with it, is 2⁻³ times smaller. fp32: exact.
AUTO_POOLED_FILTER_EPS = {
    torch.bfloat16: 2.0**-10,
    torch.float16: 2.0**-13,
    torch.float32: None,
}


def resolve_filter_eps(filter_eps: float | str | None, dtype: torch.dtype,
                       rule: str | None = None) -> float | None:
    """Maps the user's ``filter_eps`` ("auto", None or a float ≥ 0) to a bound or None: under
    the "block" rule a softmax mass per row, under "pooled" a relative L2 error of the logit
    gradient (``rule`` None: ``FUSEDLOSS_FILTER_RULE``)."""
    if filter_eps is None:
        return None
    if isinstance(filter_eps, str):
        if filter_eps != "auto":
            raise ValueError(f"filter_eps must be 'auto', None or a float >= 0, got {filter_eps!r}")
        rule = rule or config.filter_rule()
        return (AUTO_POOLED_FILTER_EPS if rule == "pooled" else AUTO_FILTER_EPS).get(dtype)
    try:
        eps = float(filter_eps)
    except (TypeError, ValueError):
        eps = float("nan")
    if not eps >= 0.0:
        raise ValueError(f"filter_eps must be 'auto', None or a float >= 0, got {filter_eps!r}")
    return eps if eps > 0.0 else None


def resolve_lm_head_filter_eps(filter_eps: float | str | None, dtype: torch.dtype,
                               rule: str | None = None) -> float | None:
    """The LM heads' ``filter_eps``: as :func:`resolve_filter_eps`, except that "auto" computes
    every tile (None). On LM-head inputs no rule skips enough at the accuracy bar to pay for its
    bookkeeping (the forward's per-tile statistics, the mask's launches; docs/design.md, "The LM
    heads' default"). An explicit ε still filters, under either rule."""
    if isinstance(filter_eps, str) and filter_eps == "auto":
        return None
    return resolve_filter_eps(filter_eps, dtype, rule)


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
    """Both rules skip a block's smallest bounds while their running sum stays within the
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


# ---------------------------------------------------------------------------------------------
# the pooled rule


def pooled_live_tiles(
    unit_log_mass: torch.Tensor,  # (blocks * block, tiles) fp32: log-mass of each unit per tile
    lse: torch.Tensor,  # (blocks * block,) fp32 per unit
    n_valid: torch.Tensor | int,  # () int64 on the device, or a host int: units that count
    block: int,
    eps: float | None,
    weight: torch.Tensor | None = None,  # (n,) each unit's gradient weight w; 1 beyond n
    floor: torch.Tensor | None = None,  # (n,) floor of each unit's gradient norm; None: |w|
    tiles_valid: torch.Tensor | None = None,  # (tiles,) bool; False: statistics not written
) -> torch.Tensor:
    """Boolean (blocks, tiles) mask of the tiles the backward must compute, by the pooled rule
    (module doc): per block, the tiles of smallest q_t = sqrt(Σ_r w_r² exp(2(L_rt − lse_r)))
    are skipped while Σ q_t ≤ eps · sqrt(Σ_r floor_r²). A unit is a row (or, for the column
    direction, a column); a NaN among a valid unit's lse, w or floor keeps its whole block.

    The PyTorch form of ``pooled_live_tiles_into``; the tests hold the two to each other."""
    n_units, n_tiles = unit_log_mass.shape
    n_blocks = n_units // block
    dev = lse.device
    valid = torch.arange(n_blocks * block, device=dev) < n_valid
    block_has_rows = valid.view(n_blocks, block).any(dim=1)
    if eps is None:
        return block_has_rows[:, None].expand(n_blocks, n_tiles).clone()
    w = _pad_units(weight, n_blocks * block, dev).abs()
    f = w if floor is None else _pad_units(floor, n_blocks * block, dev).abs()
    bad = valid & (lse[: n_blocks * block].isnan() | w.isnan() | f.isnan())
    block_bad = bad.view(n_blocks, block).any(dim=1)
    # Divided by the block's largest weight: the rule is homogeneous in (w, floor), and the
    # squares of tiny weights (a mean over many rows) must not underflow.
    top = torch.where(valid & ~w.isnan(), w, 0.0).view(n_blocks, block).amax(dim=1)
    top = torch.where((top > 0) & top.isfinite(), top, 1.0).repeat_interleave(block)
    w, f = w / top, f / top
    stat = unit_log_mass[: n_blocks * block]
    if tiles_valid is not None:
        stat = torch.where(tiles_valid[None, :], stat, float("-inf"))
    mass = torch.exp(stat - lse[: n_blocks * block, None]) * w[:, None]
    mass = torch.where(valid[:, None], mass, 0.0)
    q = mass.square().view(n_blocks, block, n_tiles).sum(dim=1).sqrt()
    budget = eps * torch.where(valid, f.square(), 0.0).view(n_blocks, block).sum(dim=1).sqrt()
    key = torch.where(q.isnan(), float("inf"), q)
    sorted_q, order = torch.sort(key, dim=1)
    skip_sorted = torch.cumsum(sorted_q, dim=1) <= budget[:, None]
    skip = torch.empty_like(skip_sorted).scatter_(1, order, skip_sorted)
    return (~skip | block_bad[:, None]) & block_has_rows[:, None]


def _pad_units(values: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """(n,) fp32: ``values`` then ones (None: all ones)."""
    out = torch.ones(n, device=device)
    if values is not None:
        m = min(n, values.numel())
        out[:m] = values[:m].float()
    return out


def pooled_live_tiles_into(
    out: torch.Tensor,  # (blocks, tiles) bool, written (or OR-ed into with ``accumulate``)
    unit_log_mass: torch.Tensor,  # (blocks * block, tiles) fp32, any strides
    lse: torch.Tensor,  # (blocks * block,) fp32
    n_valid: torch.Tensor | int,  # () int64 on the device, or a host int
    block: int,
    eps: float,
    weight: torch.Tensor | None = None,  # (n,) fp32 gradient weight per unit; 1 beyond n
    floor: torch.Tensor | None = None,  # (n,) fp32 gradient-norm floor per unit; None: |weight|
    *,
    accumulate: bool = False,
    # (rows per tile, () int64 limit): tile t counts only if t · rows < limit (else not written)
    tile_limit: tuple[int, torch.Tensor] | None = None,
) -> None:
    """``pooled_live_tiles`` in one Triton launch, one program per block: it accumulates q over
    the block's units in chunks, sorts the tiles by q with ``tl.sort`` and keeps every tile from
    the first whose running sum exceeds the budget. Where q ties at the threshold it keeps every
    tied tile, so it never skips more than the PyTorch rule. ``out`` may be a transposed view
    (the column direction); ``accumulate`` ORs into it. Tiles past ``tile_limit`` are neither
    read nor written (the column direction's row blocks without valid rows, whose statistics
    the forward never wrote)."""
    tile_rows, tile_limit = tile_limit if tile_limit is not None else (0, None)
    n_units, n_tiles = unit_log_mass.shape
    n_blocks = n_units // block
    block_t = max(2, triton.next_power_of_2(n_tiles))
    if block_t > MAX_SORTED_TILES:  # one program's sort would not fit its registers
        counted = None
        if tile_rows > 0:
            counted = torch.arange(n_tiles, device=out.device) * tile_rows < tile_limit
        live = pooled_live_tiles(unit_log_mass, lse, n_valid, block, eps, weight, floor, counted)
        if not accumulate:
            out.copy_(live)
            return
        if counted is not None:
            live &= counted[None, :]
        out |= live
        return
    flat = out.view(torch.uint8)
    from_ptr = isinstance(n_valid, torch.Tensor)
    # Units per step: a (units × BLOCK_T) chunk of statistics in registers, ~8K values.
    units = min(triton.next_power_of_2(block), max(1, 8192 // block_t))
    _pooled_live_tiles_kernel[(n_blocks,)](
        unit_log_mass, unit_log_mass.stride(0), unit_log_mass.stride(1),
        lse, n_valid if from_ptr else lse, 0 if from_ptr else int(n_valid),
        weight if weight is not None else lse, weight.numel() if weight is not None else 0,
        floor if floor is not None else lse, floor.numel() if floor is not None else 0,
        flat, flat.stride(0), flat.stride(1),
        tile_limit if tile_limit is not None else lse, n_tiles, float(eps),
        BLOCK=block, BLOCK_T=block_t, UNITS=units, N_VALID_PTR=from_ptr,
        HAS_WEIGHT=weight is not None, HAS_FLOOR=floor is not None, ACCUMULATE=accumulate,
        TILE_ROWS=tile_rows, PRECISE=not config.interpreting(),
        num_warps=8 if block_t >= 2048 else 4,
    )


@triton.jit
def _pooled_live_tiles_kernel(
    stat_ptr, stride_su, stride_st,  # (blocks * BLOCK, tiles) fp32 log-mass per unit and tile
    lse_ptr,                         # (blocks * BLOCK,) fp32 per unit
    n_valid_ptr, n_valid_int,        # valid units: a () int64 on the device or a host int
    weight_ptr, n_weight,            # (n_weight,) gradient weight per unit; 1 beyond
    floor_ptr, n_floor,              # (n_floor,) gradient-norm floor per unit; 1 beyond
    live_ptr, stride_lb, stride_lt,  # (blocks, tiles) uint8 out
    tile_limit_ptr,                  # () int64: tiles t with t * TILE_ROWS >= it stay as they are
    n_tiles, eps,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, UNITS: tl.constexpr,
    N_VALID_PTR: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_FLOOR: tl.constexpr,
    ACCUMULATE: tl.constexpr, TILE_ROWS: tl.constexpr, PRECISE: tl.constexpr,
):
    b = tl.program_id(0)
    if N_VALID_PTR:
        n_valid = tl.load(n_valid_ptr)
    else:
        n_valid = n_valid_int
    offs_t = tl.arange(0, BLOCK_T)
    in_range = offs_t < n_tiles
    counted = in_range
    if TILE_ROWS > 0:
        counted = counted & (offs_t * TILE_ROWS < tl.load(tile_limit_ptr))
    # The block's largest weight: weights and floors are divided by it (the rule is homogeneous
    # in both), so that the squares of tiny weights do not underflow.
    top = 1.0
    if HAS_WEIGHT:
        offs_b = b * BLOCK + tl.arange(0, BLOCK)
        ok = (offs_b < n_valid) & (offs_b < n_weight)
        w_all = tl.abs(tl.load(weight_ptr + offs_b, mask=ok, other=1.0))
        w_all = tl.where((offs_b < n_valid) & (w_all == w_all), w_all, 0.0)
        top = tl.max(w_all, axis=0)
        top = tl.where((top > 0.0) & (top < float("inf")), top, 1.0)

    q2 = tl.zeros((BLOCK_T,), tl.float32)  # Σ_r (w_r m_rt)², per tile
    floor2 = tl.zeros((UNITS,), tl.float32)  # Σ_r f_r², per chunk position
    bad = tl.zeros((UNITS,), tl.int32)  # a NaN lse, weight or floor among the valid units
    any_valid = tl.zeros((UNITS,), tl.int32)
    for u0 in range(0, BLOCK, UNITS):
        offs_u = b * BLOCK + u0 + tl.arange(0, UNITS)
        valid = (offs_u < n_valid) & (u0 + tl.arange(0, UNITS) < BLOCK)
        lse = tl.load(lse_ptr + offs_u, mask=valid, other=0.0)
        w = tl.full((UNITS,), 1.0, tl.float32)
        if HAS_WEIGHT:
            w = tl.abs(tl.load(weight_ptr + offs_u, mask=valid & (offs_u < n_weight), other=1.0))
        f = w
        if HAS_FLOOR:
            f = tl.abs(tl.load(floor_ptr + offs_u, mask=valid & (offs_u < n_floor), other=1.0))
        w = w / top
        f = f / top
        bad = bad | (valid & ((lse != lse) | (w != w) | (f != f))).to(tl.int32)
        any_valid = any_valid | valid.to(tl.int32)
        floor2 += tl.where(valid, f * f, 0.0)
        stat = tl.load(stat_ptr + offs_u.to(tl.int64)[:, None] * stride_su
                       + offs_t.to(tl.int64)[None, :] * stride_st,
                       mask=valid[:, None] & counted[None, :], other=float("-inf"))
        mass = exp(stat - lse[:, None], PRECISE) * w[:, None]  # w_r · m_rt (0 where not read)
        q2 += tl.sum(mass * mass, axis=0)
    has_rows = tl.max(any_valid, axis=0) > 0
    nan_block = tl.max(bad, axis=0) > 0
    budget = eps * tl.sqrt(tl.sum(floor2, axis=0))
    q = tl.sqrt(q2)
    # Tiles outside the range sort last.
    threshold = _skip_threshold(tl.where(in_range, q, float("inf")), budget)
    live = ~(q < threshold) | nan_block
    _store_live(live & has_rows, live_ptr + b * stride_lb + offs_t.to(tl.int64) * stride_lt,
                counted, ACCUMULATE)
