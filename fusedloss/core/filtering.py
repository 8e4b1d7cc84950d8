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
"""

from __future__ import annotations

import torch

# Probability mass a row may lose, by input dtype: a fraction of one ulp of the dtype, so the
# dropped mass stays below the rounding the gradient gets anyway when it is stored.
AUTO_FILTER_EPS = {
    torch.bfloat16: 2.0**-12,
    torch.float16: 2.0**-15,
    torch.float32: None,
}


def resolve_filter_eps(filter_eps: float | str | None, dtype: torch.dtype) -> float | None:
    """Maps the user's ``filter_eps`` ("auto", None or a float ≥ 0) to a mass bound or None."""
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
    """Keeps every tile that holds some row's target (its one-hot term is never negligible)."""
    n_tiles = live.shape[1]
    row_block = torch.arange(target_pos.numel(), device=target_pos.device) // block_m
    has = target_pos >= 0
    flat = row_block * n_tiles + torch.where(has, target_pos // block_n, 0)
    # amax instead of an indexed |=: repeated indices must not overwrite a True with a False.
    marks = torch.zeros(live.numel(), dtype=torch.uint8, device=live.device)
    marks.scatter_reduce_(0, flat, has.to(torch.uint8), reduce="amax")
    live |= marks.view_as(live).bool()
