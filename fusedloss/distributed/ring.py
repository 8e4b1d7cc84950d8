"""The ring: a contrastive loss over the ranks of a group, one block of columns at a time.

Rank r holds its rows A_r (images, queries, or the two views for NT-Xent) and its column block
B_r (texts, keys, or A_r itself). The loss is that of the global batch: rows and columns are
the concatenation over the ranks in rank order. No rank ever gathers the other ranks' features:
the column blocks travel around the ring instead (rank r sends to r + 1 and receives from
r − 1), so that at step k rank r holds block s = (r − k) mod W, and after W steps every block
has met every rank's rows.

Forward, at each step: run the engine's forward on (A_r, B_s) while the next block is in
flight (posted at the previous step boundary). Row statistics (max, Σ exp) stay home, each
step's merged into those of the steps before (one launch); for CLIP the visiting block's column
statistics travel with it, merged at each rank, and arrive home complete after the last step.
Backward: the tour the other way round (rank r sends to r − 1), starting from the block each
rank held last in the forward (r + 1's, kept for it) and ending with its own: at step k rank r
holds block (r + 1 + k) mod W. The block, its complete column statistics and column
coefficients travel ahead of the compute (for CLIP the first block's come from its home in one
small transfer before the first step), and its gradient accumulator (fp32) travels behind it,
complete where the tour ends, at home: nothing is sent after the last step's compute.
Gradients accumulate in fp32 over the W blocks and are rounded once.

SigLIP on the Triton backend (``siglip``) needs neither statistics nor a second tour: the
forward's tour forms each block's gradients (three products a block), dA at home and the held
block's dB accumulator travelling one step behind the block, as CLIP's column statistics do.

Whatever crosses one step boundary travels as one transfer (``_Parcel``): the next block and
the held block's statistics or accumulator, as sections of one buffer, which each rank forwards
as it arrived once its own part is added in place — one NCCL send and one receive per step;
each posting costs the host about 0.1 ms, and at 16384 rows per rank the host's time per step
is close to the GPU's.

Memory per rank beyond inputs and gradients: the block in flight besides the one held (c·b_max
elements; from the forward to the backward, the block held last: c·b_(r+1)), the travelling dB
accumulator in fp32 (and the one arriving: 2·4·b_max·c bytes) and the dA accumulator
(4·b_r·c bytes) in the backward, the row statistics so far and the step's (16·b_r bytes),
O(b_max) column statistics, the per-step tile statistics the backward's filtering
reads (⌈b_r/128⌉·⌈b_s/128⌉ floats per step), and the engine's own working memory for one
(b_r × b_s) block. (The tile statistics grow with the global batch: past
``TILE_STATS_BUDGET`` the ring does not filter.) Where every block's products fit
``Tuning.replay_work`` (16384 rows a rank at c ≤ 1024), a rank's whole tour, forward and
backward, replays its launches as CUDA graphs (``core/replay.py``), its transfers posted and
awaited on the host between them: the graphs keep that working memory (the parcels and
accumulators above, one block's engine memory), the call's inputs and its outputs between
calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core import chunked_contrastive, engine, replay
from ..core.engine import GradCoefficients, Rows, RowStats
from ..families import contrastive as family
from ..ops._common import replays, scratch_bytes
from ..ops._group import Layout, Shift

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
    tiles: list = field(default_factory=list)  # per block: (row tiles, column tiles) or None
    block: tuple[int, int] = (0, 0)  # the forward's (block_m, block_n)
    last_block: Tensor | None = None  # the block held at the forward's last step: r + 1's


@dataclass(frozen=True)
class RingCall:
    """One call's ring: the group's layout, the loss (a kind of ``families.contrastive``), the
    backward's filter bound (None: exact) and the engine's backend."""

    layout: Layout
    kind: str
    filter_eps: float | None
    backend: str


def forward(call: RingCall, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor | None,
            labels: Tensor | None, record: bool) -> tuple[Tensor, Saved]:
    """Per-row losses (n,) fp32 of this rank's rows against the global columns (the table in
    ``fusedloss/ops/contrastive.py``), and what the backward needs (``record``: keep the
    per-step tile statistics that filtering reads). Replayed where ``_replays``."""
    return _run(_forward, call, a, b, scale, bias, labels, record)


def _forward(call: RingCall, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor | None,
             labels: Tensor | None, record: bool) -> tuple[Tensor, Saved]:
    """``forward`` (its arguments in order)."""
    layout, kind, filter_eps, backend = call.layout, call.kind, call.filter_eps, call.backend
    n, d = a.shape
    dev = a.device
    world = layout.world
    clip, siglip = kind == "clip", kind == "siglip"
    filtering = (record and filter_eps is not None and not siglip and backend == "triton"
                 and _tile_stats_bytes(layout, kind, a) <= TILE_STATS_BUDGET)
    sig_sum = torch.zeros(n, dtype=_F32, device=dev) if siglip else None
    target_logit = torch.zeros(n, dtype=_F32, device=dev)
    rows_so_far = None  # (max, Σ exp) of this rank's rows over the blocks met, packed (2, n)
    tiles_by_block, block = [None] * world, (0, 0)
    rows_of = _RowsOf(kind, layout, n, labels, dev)

    def arriving(k: int) -> _Parcel:
        """What arrives at boundary k (before step k): the block of step k + 1, and for CLIP
        the column statistics of the block held at step k over the rows it has met so far
        (home, complete, at k = W). At k = 0 the statistics are this rank's own: local."""
        specs = [] if k + 1 >= world else [((layout.cols[layout.block_at(k + 1)], d), b.dtype)]
        if clip:
            specs.append(((2, layout.cols[layout.block_at(k)]), _F32))
        return _Parcel(specs, dev)

    parcel = arriving(0)
    shift = _Transfer(layout, [b], parcel.parts[:1]) if world > 1 else None
    held = b
    for step in range(world):
        s = layout.block_at(step)
        m_s = held.shape[0]
        tiles, part_cols = None, None
        if n and m_s:
            stats = engine.row_stats(
                a, held,
                family.logits(kind, held, scale, bias, own_columns=s == layout.rank),
                rows_of(s, m_s),
                wants=engine.Wants(col_stats=clip, sigmoid=siglip, record_tiles=filtering),
                backend=backend)
            if siglip:
                sig_sum += stats.sigmoid_sum
            else:
                packed_rows, packed_cols = stats.packed()
                rows_so_far = (packed_rows[:2] if rows_so_far is None else engine.merge_stats(
                    rows_so_far, packed_rows[:2], out=rows_so_far, backend=backend))
                if clip:
                    part_cols = packed_cols[:2]
                if kind == "info_nce":
                    in_block = _in_block(labels, layout.col_offset(s), m_s)
                    target_logit = torch.where(in_block, stats.target_logit, target_logit)
                elif step == 0:
                    target_logit = stats.target_logit
            block = (stats.block_m, stats.block_n)
            if filtering:
                tiles = (stats.tile_log_mass, stats.col_tile_log_mass)
        tiles_by_block[s] = tiles
        if shift is not None:
            shift.wait()  # the next block; CLIP: the held block's statistics so far
        if step + 1 < world:
            held = parcel.parts[0]
        if clip:  # add this rank's rows to the held block's column statistics
            so_far = parcel.parts[-1]
            if step == 0:
                so_far.copy_(part_cols if part_cols is not None else _no_entries(m_s, dev))
            elif part_cols is not None:
                engine.merge_stats(so_far, part_cols, out=so_far, backend=backend)
        parcel, shift = _pass_on(layout, step, parcel, 1, clip, arriving, world - 1)
    if shift is not None:
        shift.wait()  # CLIP: this rank's columns, over every row
    cols = parcel.parts[-1] if clip else None

    if rows_so_far is None:  # SigLIP, or no rows or columns: no entries
        rows_so_far = _no_entries(n, dev)
    run_max, run_sum = rows_so_far[0], rows_so_far[1]
    saved = Saved(row_max=run_max, row_sum=run_sum, tiles=tiles_by_block, block=block,
                  last_block=held)
    if siglip:
        return sig_sum, saved
    row_margin, col_margin, saved.row_mass, saved.col_mass = engine.margins(
        rows_so_far, target_logit, cols, mass=filtering, backend=backend)
    if clip:
        saved.col_max, saved.col_sum = cols[0], cols[1]
    return family.row_loss(kind, row_margin, col_margin), saved


def backward(call: RingCall, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor | None,
             labels: Tensor | None, saved: Saved, grad_loss: Tensor,
             needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """(dA, dB, d scale, d bias) of Σ_ranks Σ_rows grad_loss · loss for this rank's inputs,
    in their dtypes (d scale, d bias fp32; this rank's tiles' share: the shares sum over the
    ranks to the gradient). For NT-Xent dB is added into dA and returned as None. Replayed
    where ``_replays``."""
    # reuse: the forward's operands, saved by autograd: their buffers may still hold them
    return _run(_backward, call, a, b, scale, bias, labels, saved,
                grad_loss.float().contiguous(), needs, reuse=(a, b, scale, bias, labels))


def _backward(call: RingCall, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor | None,
              labels: Tensor | None, saved: Saved, grad_loss: Tensor,
              needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """``backward`` (its arguments in order; ``grad_loss`` fp32)."""
    layout, kind, filter_eps, backend = call.layout, call.kind, call.filter_eps, call.backend
    need_a, need_b, need_scale, need_bias = needs
    n, d = a.shape
    dev = a.device
    world = layout.world
    clip, siglip = kind == "clip", kind == "siglip"
    g = grad_loss
    half_g = 0.5 * g if clip else None
    row_log_sum = torch.log(saved.row_sum)
    row_lse = saved.row_max + row_log_sum
    rows_of = _RowsOf(kind, layout, n, labels, dev)
    grad_a = torch.zeros((n, d), dtype=_F32, device=dev) if need_a else None
    grad_scale = torch.zeros((), dtype=_F32, device=dev)
    grad_bias = torch.zeros((), dtype=_F32, device=dev)
    # The tour runs the other way round (tour: rank r sends to r − 1): rank r starts with the
    # block it held last in the forward, r + 1's, and ends with its own, so that each block's
    # dB accumulator is complete where its tour ends: at home, nothing to send after the last
    # step. At step k rank r holds block (r + 1 + k) mod W.
    tour = layout.reversed()
    last = world - 1  # the step of this rank's own block

    def block_at(k: int) -> int:
        return (layout.rank + 1 + k) % world

    # What travels ahead with a CLIP block: (col max, col sum, col coefficient, col mass).
    own_cols = None
    if clip:
        mass = saved.col_mass if saved.col_mass is not None else torch.ones_like(saved.col_max)
        own_cols = torch.stack((saved.col_max, saved.col_sum, half_g, mass))
    n_ahead = 2 if clip else 1  # the block, and its column statistics (CLIP)

    def arriving(k: int) -> _Parcel:
        """What arrives at boundary k (before step k): the block of step k + 1 unless that is
        the last, this rank's own (CLIP: with its column statistics and coefficients), and the
        dB accumulator (fp32) of the block held at step k over the ranks it has visited. At
        k = 0 the accumulator is this rank's own: local."""
        specs = []
        if k + 1 < last:
            m = layout.cols[block_at(k + 1)]
            specs += [((m, d), b.dtype)] + ([((4, m), _F32)] if clip else [])
        if need_b and world > 1:  # with one rank dB is the one step's part itself
            specs.append(((layout.cols[block_at(k)], d), _F32))
        return _Parcel(specs, dev)

    parcel, shift = arriving(0), None
    if world == 1:
        ahead = [b, own_cols] if clip else [b]
    else:
        ahead = [saved.last_block]
        if clip:  # the first block's column statistics and coefficients, from its home
            ahead.append(torch.empty((4, saved.last_block.shape[0]), dtype=_F32, device=dev))
            _Transfer(tour, [own_cols], ahead[1:]).wait()
        if 1 < last:  # the first block goes on to rank r − 1, for its step 1
            shift = _Transfer(tour, ahead, parcel.parts[:n_ahead])
    for step in range(world):
        s = block_at(step)
        held = ahead[0]
        m_s = held.shape[0]
        home = step == last
        part_b = None
        if n and m_s:
            tiles = saved.tiles[s] or (None, None)
            stats = RowStats(lse=row_lse, max=saved.row_max, log_sum=row_log_sum,
                             sum=saved.row_sum, target_logit=None, weighted_sum=None,
                             tile_log_mass=tiles[0], col_tile_log_mass=tiles[1],
                             block_m=saved.block[0], block_n=saved.block[1])
            col_mass = None
            if clip:
                stats.set_columns(ahead[1][0], ahead[1][1])
                col_mass = ahead[1][3] if saved.col_mass is not None else None
            rows = rows_of(s, m_s)
            coef = _coefficients(kind, g, half_g, rows, ahead[1] if clip else None, labels,
                                 layout.col_offset(s), m_s)
            # dA adds into its fp32 sum; the first step's dB part starts the accumulator that
            # travels, in its section of the parcel (later ones arrive while this step runs)
            grads = engine.grads(
                a, held,
                family.logits(kind, held, scale, bias, own_columns=home), rows, stats, coef,
                sigmoid=siglip,
                needs=engine.Needs(need_a, need_b, bias is not None and need_bias, need_scale),
                plan=engine.BackwardPlan(
                    filter_eps=filter_eps, filter_scale=(saved.row_mass, col_mass),
                    scratch_bytes=scratch_bytes(a, wide=True), sparse=False, grad_dtype=_F32,
                    backend=backend),
                acc_a=grad_a,
                out_b=parcel.parts[-1] if step == 0 and need_b and world > 1 else None)
            part_b = grads.b
            if need_scale:
                grad_scale += grads.scale
            if grads.bias is not None:
                grad_bias += grads.bias.sum()
            grads = None  # dA's part is added; dB's stays as part_b until added below
        if shift is not None:
            shift.wait()  # the next block; the held block's accumulator so far
        if step + 1 < last:
            ahead = parcel.parts[:n_ahead]
        elif step + 1 == last:  # the last block is this rank's own
            ahead = [b, own_cols] if clip else [b]
        if need_b and world > 1:  # add this rank's part to the held block's accumulator
            _add_part(parcel.parts[-1], part_b, first=step == 0)
            # Freed before the next step's part is formed: three m × D fp32 buffers at most
            # (the accumulator on its way out, the one coming in, the step's part).
            part_b = None
        shift = None
        if step < last:
            parcel, shift = _pass_on(tour, step, parcel, n_ahead, need_b, arriving, last - 1)
    grad_b = None
    if need_b:
        grad_b = parcel.parts[-1] if world > 1 else part_b
        if grad_b is None:  # one rank without rows
            grad_b = torch.zeros((b.shape[0], d), dtype=_F32, device=dev)

    if kind == "nt_xent":  # A and B are the same rows: both sides of the product
        if need_a or need_b:
            total = (grad_a if need_a else 0) + (grad_b if need_b else 0)
            return total.to(a.dtype), None, _opt(grad_scale, need_scale), None
    return (grad_a.to(a.dtype) if need_a else None, grad_b.to(b.dtype) if need_b else None,
            _opt(grad_scale, need_scale), _opt(grad_bias, need_bias and bias is not None))


def siglip(call: RingCall, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor, coef: float,
           needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor, ...]:
    """SigLIP's loss and gradients in one tour, three products a block (the Triton backend;
    ``core.chunked_contrastive``): (coef · Σ over this rank's rows of their terms against every
    column (), dA (n, D) fp32, dB (m, D) fp32, d scale (), d bias ()) for an upstream gradient
    of 1, each None where not in ``needs`` (A, B, scale, bias).

    The tour is the forward's: at step k this rank holds block (r − k) mod W and forms its
    rows' gradient tile against it; dA accumulates at home (fp32), and the held block's dB
    accumulator (fp32) travels behind the block, one step late, as CLIP's column statistics
    do: each rank adds its part, and the last step's hand-over brings every block's
    accumulator home. dB mixes every rank's rows, each weighted as its own rank's loss is: the
    gradients are those of Σ_ranks loss_r when every rank back-propagates the same upstream
    gradient into its loss (``distributed.contrastive._SigLipRing``). Memory per rank: the
    block in flight (c·b_max elements), the dB accumulators on their way out and in and the
    step's part (3·4·c·b_max bytes), dA (4·n·c bytes), and one block's chunk budget.
    Replayed where ``_replays``."""
    return _run(_siglip, call, a, b, scale, bias, coef, needs)


def _siglip(call: RingCall, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor, coef: float,
            needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor, ...]:
    """``siglip`` (its arguments in order)."""
    layout = call.layout
    need_a, need_b, need_scale, need_bias = needs
    n, d = a.shape
    dev = a.device
    world = layout.world
    f32 = dict(dtype=_F32, device=dev)
    loss = torch.zeros((), **f32)
    grad_a = torch.zeros((n, d), **f32) if need_a else None
    grad_scale = torch.zeros((), **f32) if need_scale else None
    grad_bias = torch.zeros((), **f32) if need_bias else None
    carries = need_b and world > 1

    def arriving(k: int) -> _Parcel:
        """What arrives at boundary k (before step k): the block of step k + 1, and the dB
        accumulator of the block held at step k over the rows it has met so far (home,
        complete, at k = W). At k = 0 the accumulator is this rank's own part: local."""
        specs = [] if k + 1 >= world else [((layout.cols[layout.block_at(k + 1)], d), b.dtype)]
        if carries:
            specs.append(((layout.cols[layout.block_at(k)], d), _F32))
        return _Parcel(specs, dev)

    parcel = arriving(0)
    shift = _Transfer(layout, [b], parcel.parts[:1]) if world > 1 else None
    held, grad_b = b, None
    for step in range(world):
        s = layout.block_at(step)
        m_s = held.shape[0]
        part_b = None
        if n and m_s:
            block_loss, _, part_b, block_bias, block_scale = (
                chunked_contrastive.siglip_loss_and_grads(
                    a, held, scale, bias, coef,
                    engine.Needs(need_a, need_b, need_bias, need_scale),
                    positives=s == layout.rank, acc_a=grad_a))
            loss += block_loss
            if need_scale:
                grad_scale += block_scale
            if need_bias:
                grad_bias += block_bias
        if shift is not None:
            shift.wait()  # the next block; the held block's accumulator so far
        if step + 1 < world:
            held = parcel.parts[0]
        if carries:  # add this rank's part to the held block's accumulator
            _add_part(parcel.parts[-1], part_b, first=step == 0)
            part_b = None
        elif need_b:  # one rank: the step's part is dB
            grad_b = part_b if part_b is not None else torch.zeros((b.shape[0], d), **f32)
        parcel, shift = _pass_on(layout, step, parcel, 1, carries, arriving, world - 1)
    if shift is not None:
        shift.wait()  # this rank's block's dB, over every rank's rows
    if carries:
        grad_b = parcel.parts[-1]
    return loss, grad_a, grad_b, grad_scale, grad_bias


def _add_part(acc: Tensor, part: Tensor | None, first: bool) -> None:
    """This rank's dB part (None: no rows met the block) into the travelling accumulator, which
    holds nothing yet at the ``first`` step (the rank's own part starts it, and may have been
    formed there)."""
    if part is acc:
        return
    if part is None:
        if first:
            acc.zero_()
    elif first:
        acc.copy_(part)
    else:
        acc += part


def _run(fn, call: RingCall, a: Tensor, *rest, reuse: tuple = ()):
    """``fn(call, a, *rest)``, through ``replay.call`` (with ``reuse``) where ``_replays``."""
    if _replays(call, a):
        return replay.call(fn, call, a, *rest, reuse=reuse)
    return fn(call, a, *rest)


def _replays(call: RingCall, a: Tensor) -> bool:
    """Whether this rank's side of the ring replays its launches as CUDA graphs
    (``core/replay.py``), its transfers posted and awaited between them (``_Transfer``): the
    Triton backend on CUDA with blocks of at most ``Tuning.replay_work`` multiply-adds (this
    rank's rows against the largest block), where the host, not the GPU, would set the pace:
    a 2-GPU ring of 16384 rows a rank makes ~200 launches and 6 transfers a step. Each rank
    decides for itself: a replay makes the same transfers as a direct call."""
    return replays(a, max(call.layout.cols), call.backend)


class _Transfer:
    """A ``Shift`` (one send to the next rank, one receive from the previous) whose posting and
    waiting are host steps (``replay.host``): in a replayed ring they run between its graphs,
    never inside one. Each posting makes the ``Shift`` this module names then (the ring
    benchmark swaps it to record or stand in for the transfers)."""

    def __init__(self, layout: Layout, send: list[Tensor], recv: list[Tensor]):
        self.args, self.shift = (layout, list(send), list(recv)), None
        replay.host(self._post)

    def _post(self) -> None:
        self.shift = Shift(*self.args)

    def wait(self) -> None:
        replay.host(self._wait)

    def _wait(self) -> None:
        self.shift.wait()
        self.shift = None


def _pass_on(layout: Layout, step: int, parcel: _Parcel, block_sections: int,
             carries: bool, arriving, last_arriving: int) -> tuple[_Parcel, _Transfer | None]:
    """The boundary after ``step``: sends ``parcel`` on to the next rank as one transfer — the
    block it needs next (none once the blocks that arrive by transfer are through: the steps up
    to ``last_arriving`` take one; the parcel's first ``block_sections`` sections then stay) and
    what follows (``carries``: statistics or an accumulator) — and posts the receive of the
    parcel ``arriving(step + 1)``. Returns that parcel and its ``_Transfer`` (None where nothing
    travels). The caller's earlier parcel is released before the new one is allocated."""
    has_block, next_needs_block = step + 1 <= last_arriving, step + 2 <= last_arriving
    if layout.world == 1 or not (carries or next_needs_block):
        return parcel, None
    first = block_sections if has_block and not next_needs_block else 0
    incoming = arriving(step + 1)
    return incoming, _Transfer(layout, [parcel.from_part(first)], [incoming.buffer])


class _Parcel:
    """Tensors of given (shape, dtype) as sections of one byte buffer, each 256-byte aligned,
    so that what crosses a step boundary travels as one transfer: a rank forwards the parcel
    it received (after adding its part in place) as the next rank's parcel, whose sections
    have the same shapes. Each NCCL send or receive costs the host ~0.1 ms, and at 16384 rows
    per rank the host's time per step is close to the GPU's."""

    ALIGN = 256

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        self.offsets, total = [], 0
        for shape, dtype in specs:
            self.offsets.append(total)
            nbytes = math.prod(shape) * dtype.itemsize
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)
        self.parts = [
            self.buffer[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), o in zip(specs, self.offsets, strict=True)]

    def from_part(self, i: int) -> Tensor:
        """The buffer from section ``i`` on (the next rank's parcel, when it needs less)."""
        return self.buffer[self.offsets[i]:] if i < len(self.offsets) else self.buffer[:0]


# ---------------------------------------------------------------------------------------------
# per step: which rows have a target in the held block, and how the logits are formed


class _RowsOf:
    """The rows of each step: all n rows in order, with their targets within the held block
    (column ids of the block). Formed once per call, but for InfoNCE's per-block targets."""

    def __init__(self, kind: str, layout: Layout, n: int, labels: Tensor | None,
                 dev: torch.device):
        self.kind, self.layout, self.n, self.labels = kind, layout, n, labels
        self.index = torch.arange(n, device=dev)
        self.n_valid = torch.full((), n, dtype=torch.int64, device=dev)
        self.cached: dict[bool, Rows] = {}

    def __call__(self, s: int, m_s: int) -> Rows:
        """The rows against block ``s`` (``m_s`` columns)."""
        kind, n = self.kind, self.n
        if kind == "info_nce":
            # Each query's positive key lies in one block; elsewhere a stand-in id whose
            # target logit and coefficient are masked out.
            offset = self.layout.col_offset(s)
            return self._rows(torch.where(_in_block(self.labels, offset, m_s),
                                          self.labels - offset, 0))
        home = s == self.layout.rank
        if home not in self.cached:
            target = None
            if home:  # the diagonal pairs live in the home block
                target = (self.index + n // 2) % n if kind == "nt_xent" else self.index
            elif kind == "siglip":  # sigmoid mode needs targets: none of these columns is one
                target = torch.full((n,), -1, dtype=torch.int64, device=self.index.device)
            self.cached[home] = self._rows(target)
        return self.cached[home]

    def _rows(self, target: Tensor | None) -> Rows:
        return Rows(index=self.index, n_valid=self.n_valid, target=target, identity=True,
                    all_valid=True)


def _coefficients(kind: str, g: Tensor, half_g: Tensor | None, rows: Rows,
                  held_cols: Tensor | None, labels: Tensor | None, offset: int,
                  m_s: int) -> GradCoefficients:
    """The table's coefficients (``families/contrastive.py``) for the held block: the target
    term where a row's target lies in it; CLIP's column term from the block's own ½g."""
    if kind == "info_nce":
        target_g = torch.where(_in_block(labels, offset, m_s), g, 0.0)
    else:
        target_g = g if rows.target is not None else None
    return family.grad_coefficients(kind, g, target_g, half_g=half_g,
                                    col_half_g=held_cols[2] if kind == "clip" else None)


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


def _no_entries(m: int, dev: torch.device) -> Tensor:
    """Packed statistics (2, m) [max −inf; sum 0] of m rows or columns that met no entry."""
    return torch.stack((torch.full((m,), float("-inf"), dtype=_F32, device=dev),
                        torch.zeros(m, dtype=_F32, device=dev)))


def _opt(t: Tensor, needed: bool) -> Tensor | None:
    return t if needed else None
