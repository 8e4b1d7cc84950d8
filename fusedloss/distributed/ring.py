"""The ring: a contrastive loss over the ranks of a group, one block of columns at a time.

Rank r holds its rows A_r (images, queries, or the two views for NT-Xent) and its column block
B_r (texts, keys, or A_r itself). The loss is that of the global batch: rows and columns are
the concatenation over the ranks in rank order. No rank ever gathers the other ranks' features:
the column blocks travel around the ring instead (rank r sends to r + 1 and receives from
r − 1), so that at step k rank r holds block s = (r − k) mod W, and after W steps every block
has met every rank's rows.

Forward, at each step: post the transfer of the block held now to the next rank (and of the
next block from the previous one), then run the engine's forward on (A_r, B_s) while the
transfer is in flight. Row statistics (max, Σ exp) stay home and are merged step by step; for
CLIP the visiting block's column statistics travel with it, merged at each rank, and arrive
home complete after the last step. Backward: the same tour, with the block, its complete column
statistics and column coefficients travelling ahead of the compute, and its gradient
accumulator (fp32) travelling behind it, home after the last step. Gradients accumulate in fp32
over the W blocks and are rounded once.

Memory per rank beyond inputs and gradients: the block in flight besides the one held (c·b_max
elements), the travelling dB accumulator in fp32 (and the one arriving: 2·4·b_max·c bytes) and
the dA accumulator (4·b_r·c bytes) in the backward, O(b_r + b_max) statistics, the per-step
tile statistics the backward's filtering reads (⌈b_r/128⌉·⌈b_s/128⌉ floats per step), and the
engine's own working memory for one (b_r × b_s) block. (The tile statistics grow with the
global batch: past ``TILE_STATS_BUDGET`` the ring does not filter.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core import engine
from ..core.engine import GradCoefficients, Logits, Rows, RowStats
from ..core.filtering import gradient_mass
from ..ops._common import scratch_bytes
from ._group import Layout, Shift

_F32 = torch.float32
# Filtering over the ring keeps each step's per-tile statistics until the backward: about
# ⌈n/128⌉·⌈B/128⌉ floats (×2 for CLIP), which grows with the global batch B. Beyond this many
# bytes the ring computes every tile instead (exact, and no such memory).
TILE_STATS_BUDGET = 64 * 2**20


@dataclass
class Saved:
    """What the ring's forward leaves for its backward (this rank's rows and own columns)."""

    row_max: Tensor  # (n,) fp32, over every column of the global batch
    row_sum: Tensor  # (n,)
    col_max: Tensor | None = None  # (m,) CLIP: this rank's columns, over every row
    col_sum: Tensor | None = None
    row_mass: Tensor | None = None  # (n,) gradient mass of each row, with filtering
    col_mass: Tensor | None = None  # (m,) CLIP, with filtering
    tiles: list = field(default_factory=list)  # per step: (row tiles, column tiles) or None
    block: tuple[int, int] = (0, 0)  # the forward's (block_m, block_n)


def forward(layout: Layout, kind: str, a: Tensor, b: Tensor, scale: Tensor,
            bias: Tensor | None, labels: Tensor | None, filter_eps: float | None,
            backend: str, record: bool) -> tuple[Tensor, Saved]:
    """Per-row losses (n,) fp32 of this rank's rows against the global columns (the table in
    ``fusedloss/ops/contrastive.py``), and what the backward needs (``record``: keep the
    per-step tile statistics that filtering reads)."""
    n, d = a.shape
    dev = a.device
    clip, siglip = kind == "clip", kind == "siglip"
    filtering = (record and filter_eps is not None and not siglip and backend == "triton"
                 and _tile_stats_bytes(layout, kind, a) <= TILE_STATS_BUDGET)
    run_max = torch.full((n,), float("-inf"), dtype=_F32, device=dev)
    run_sum = torch.zeros(n, dtype=_F32, device=dev)
    sig_sum = torch.zeros(n, dtype=_F32, device=dev) if siglip else None
    target_logit = torch.zeros(n, dtype=_F32, device=dev)
    saved = Saved(row_max=run_max, row_sum=run_sum)
    held = b
    # CLIP: the (max, Σ exp) of the held block's columns over the rows it has met so far
    # arrive from the previous rank while this rank computes its part (``behind``, posted at
    # the end of the previous step), and go on to the next rank; home after the last step.
    behind, cols = None, None
    for step in range(layout.world):
        s = layout.block_at(step)
        last = step == layout.world - 1
        ahead = None
        if not last:
            incoming = b.new_empty((layout.cols[layout.block_at(step + 1)], d))
            ahead = Shift(layout, [held], [incoming])
        m_s = held.shape[0]
        tiles, part_cols = None, None
        if n and m_s:
            rows = _rows(kind, layout, step, s, n, m_s, labels, dev)
            stats = engine.row_stats(
                a, held, _logits(kind, held, scale, bias, step), rows,
                col_stats=clip, sigmoid=siglip, record_tiles=filtering, backend=backend)
            if siglip:
                sig_sum += stats.sigmoid_sum
            else:
                run_max, run_sum = _merge(run_max, run_sum, stats.max, stats.sum)
                if clip:
                    part_cols = (stats.col_max, stats.col_sum)
                if kind == "info_nce":
                    in_block = _in_block(labels, layout.col_offset(s), m_s)
                    target_logit = torch.where(in_block, stats.target_logit, target_logit)
                elif step == 0:
                    target_logit = stats.target_logit
            saved.block = (stats.block_m, stats.block_n)
            if filtering:
                tiles = (stats.tile_log_mass, stats.col_tile_log_mass)
        saved.tiles.append(tiles)
        if clip:
            if step == 0:
                cols = _empty_cols(m_s, dev)
            elif behind is not None:
                behind.wait()  # the held block's statistics from the previous ranks
            if part_cols is not None:
                cols = torch.stack(_merge(cols[0], cols[1], *part_cols))
            if layout.world > 1:  # on to the next rank (home, after the last step)
                arriving = torch.empty((2, layout.cols[layout.block_at(step + 1)]),
                                       dtype=_F32, device=dev)
                behind = Shift(layout, [cols], [arriving], tag=2)
                cols = arriving
        if ahead is not None:
            ahead.wait()
            held = incoming
    if behind is not None:
        behind.wait()

    if siglip:
        return sig_sum, saved
    saved.row_max, saved.row_sum = run_max, run_sum
    row_margin = (run_max - target_logit) + torch.log(run_sum)
    loss = row_margin
    if clip:
        saved.col_max, saved.col_sum = cols[0], cols[1]
        col_margin = (cols[0] - target_logit) + torch.log(cols[1])
        loss = 0.5 * (row_margin + col_margin)
        if filtering:
            saved.col_mass = gradient_mass(col_margin)
    if filtering:
        saved.row_mass = gradient_mass(row_margin)
    return loss, saved


def backward(layout: Layout, kind: str, a: Tensor, b: Tensor, scale: Tensor,
             bias: Tensor | None, labels: Tensor | None, saved: Saved, grad_loss: Tensor,
             filter_eps: float | None, backend: str,
             needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """(dA, dB, d scale, d bias) of Σ_ranks Σ_rows grad_loss · loss for this rank's inputs,
    in their dtypes (d scale, d bias fp32; this rank's tiles' share: the shares sum over the
    ranks to the gradient). For NT-Xent dB is added into dA and returned as None."""
    need_a, need_b, need_scale, need_bias = needs
    n, d = a.shape
    dev = a.device
    clip, siglip = kind == "clip", kind == "siglip"
    g = grad_loss.float().contiguous()
    row_log_sum = torch.log(saved.row_sum)
    grad_a = torch.zeros((n, d), dtype=_F32, device=dev) if need_a else None
    # The held block's dB accumulator (fp32), over the ranks it has visited; it starts at home,
    # arrives from the previous rank while this rank computes its part (``behind``, posted at
    # the end of the previous step), and goes on to the next rank; home after the last step.
    behind, grad_b = None, None
    grad_scale = torch.zeros((), dtype=_F32, device=dev)
    grad_bias = torch.zeros((), dtype=_F32, device=dev)
    # What travels ahead with a CLIP block: (col max, col sum, col coefficient, col mass).
    held_cols = None
    if clip:
        mass = saved.col_mass if saved.col_mass is not None else torch.ones_like(saved.col_max)
        held_cols = torch.stack((saved.col_max, saved.col_sum, 0.5 * g, mass))
    held = b
    for step in range(layout.world):
        s = layout.block_at(step)
        last = step == layout.world - 1
        ahead = None
        if not last:
            m_next = layout.cols[layout.block_at(step + 1)]
            incoming = b.new_empty((m_next, d))
            incoming_cols = torch.empty((4, m_next) if clip else (0,), dtype=_F32, device=dev)
            ahead = Shift(layout, [held, held_cols if clip else incoming_cols],
                          [incoming, incoming_cols])
        m_s = held.shape[0]
        part_b = None
        if n and m_s:
            rows = _rows(kind, layout, step, s, n, m_s, labels, dev)
            tiles = saved.tiles[step] or (None, None)
            stats = RowStats(lse=saved.row_max + row_log_sum, max=saved.row_max,
                             log_sum=row_log_sum, sum=saved.row_sum, target_logit=None,
                             weighted_sum=None, tile_log_mass=tiles[0],
                             col_tile_log_mass=tiles[1], block_m=saved.block[0],
                             block_n=saved.block[1])
            col_mass = None
            if clip:
                stats.set_columns(held_cols[0], held_cols[1])
                col_mass = held_cols[3] if saved.col_mass is not None else None
            coef = _coefficients(kind, g, rows, held_cols, labels, layout.col_offset(s), m_s,
                                 step)
            grads = engine.grads(
                a, held, _logits(kind, held, scale, bias, step), rows, stats, coef,
                filter_eps=filter_eps, need_a=need_a, need_b=need_b,
                need_bias=bias is not None and need_bias, need_scale=need_scale,
                sigmoid=siglip, filter_scale=(saved.row_mass, col_mass),
                scratch_bytes=scratch_bytes(a, False), sparse=False, grad_dtype=_F32,
                backend=backend)
            if need_a:
                grad_a += grads.a
            part_b = grads.b
            if need_scale:
                grad_scale += grads.scale
            if grads.bias is not None:
                grad_bias += grads.bias.sum()
        if need_b:
            if step == 0:
                grad_b = part_b if part_b is not None else torch.zeros((m_s, d), dtype=_F32,
                                                                       device=dev)
            else:
                behind.wait()  # the held block's accumulator from the previous ranks
                if part_b is not None:
                    grad_b += part_b
            if layout.world > 1:  # on to the next rank (home, after the last step)
                arriving = torch.empty((layout.cols[layout.block_at(step + 1)], d),
                                       dtype=_F32, device=dev)
                behind = Shift(layout, [grad_b], [arriving], tag=2)
                grad_b = arriving
        if ahead is not None:
            ahead.wait()
            held, held_cols = incoming, incoming_cols if clip else None
    if behind is not None:
        behind.wait()

    if kind == "nt_xent":  # A and B are the same rows: both sides of the product
        if need_a or need_b:
            total = (grad_a if need_a else 0) + (grad_b if need_b else 0)
            return total.to(a.dtype), None, _opt(grad_scale, need_scale), None
    return (grad_a.to(a.dtype) if need_a else None, grad_b.to(b.dtype) if need_b else None,
            _opt(grad_scale, need_scale), _opt(grad_bias, need_bias and bias is not None))


# ---------------------------------------------------------------------------------------------
# per step: which rows have a target in the held block, and how the logits are formed


def _rows(kind: str, layout: Layout, step: int, s: int, n: int, m_s: int,
          labels: Tensor | None, dev: torch.device) -> Rows:
    """All n rows, in order; their targets within the held block (column ids of the block)."""
    target = None
    if kind == "info_nce":
        # Each query's positive key lies in one block; elsewhere a stand-in id whose
        # target logit and coefficient are masked out.
        offset = layout.col_offset(s)
        target = torch.where(_in_block(labels, offset, m_s), labels - offset, 0)
    elif step == 0:  # the diagonal pairs live in the home block
        ids = torch.arange(n, device=dev)
        target = (ids + n // 2) % n if kind == "nt_xent" else ids
    elif kind == "siglip":  # sigmoid mode needs targets: none of these columns is one
        target = torch.full((n,), -1, dtype=torch.int64, device=dev)
    return Rows(index=torch.arange(n, device=dev),
                n_valid=torch.full((), n, dtype=torch.int64, device=dev),
                target=target, identity=True, all_valid=True)


def _logits(kind: str, held: Tensor, scale: Tensor, bias: Tensor | None, step: int) -> Logits:
    column_bias = bias.expand(held.shape[0]).contiguous() if bias is not None else None
    # NT-Xent leaves out each row's similarity with itself: in the home block only.
    return Logits(bias=column_bias, scale=scale, diag_mask=kind == "nt_xent" and step == 0)


def _coefficients(kind: str, g: Tensor, rows: Rows, held_cols: Tensor | None,
                  labels: Tensor | None, offset: int, m_s: int, step: int) -> GradCoefficients:
    """dX = r·P + c·Q − t·onehot(target) for this block (the table in ops/contrastive.py)."""
    if kind == "siglip":
        return GradCoefficients(lse=g)
    if kind == "clip":
        return GradCoefficients(lse=0.5 * g, col=held_cols[2],
                                target=g if rows.target is not None else None)
    if kind == "info_nce":
        return GradCoefficients(lse=g, target=torch.where(_in_block(labels, offset, m_s), g, 0.0))
    return GradCoefficients(lse=g, target=g if rows.target is not None else None)


def _in_block(labels: Tensor, offset: int, m: int) -> Tensor:
    return (labels >= offset) & (labels < offset + m)


# ---------------------------------------------------------------------------------------------
# statistics


def _tile_stats_bytes(layout: Layout, kind: str, a: Tensor) -> int:
    """Bytes of the per-tile statistics that filtering would keep over the W steps."""
    n, d = a.shape
    clip = kind == "clip"
    elements = 0
    for m in layout.cols:
        rows, cols = engine.tile_stats_shapes(n, m, a.device, a.dtype, d, col_stats=clip)
        elements += rows[0] * rows[1] + (cols[0] * cols[1] if clip else 0)
    return 4 * elements


def _empty_cols(m: int, dev: torch.device) -> Tensor:
    return torch.stack((torch.full((m,), float("-inf"), dtype=_F32, device=dev),
                        torch.zeros(m, dtype=_F32, device=dev)))


def _merge(max1: Tensor, sum1: Tensor, max2: Tensor, sum2: Tensor) -> tuple[Tensor, Tensor]:
    """(max, Σ exp(· − max)) of two partial pairs of the same rows (or columns).

    A partial without entries (sum 0; the engine reports max 0 there) counts as max −inf, so it
    cannot swamp a row whose entries are all far below 0. NaN stays NaN.
    """
    max1 = torch.where(sum1 > 0, max1, float("-inf"))
    max2 = torch.where(sum2 > 0, max2, float("-inf"))
    top = torch.maximum(max1, max2)
    safe = torch.where(torch.isfinite(top), top, 0.0)
    return top, sum1 * torch.exp(max1 - safe) + sum2 * torch.exp(max2 - safe)


def _opt(t: Tensor, needed: bool) -> Tensor | None:
    return t if needed else None
