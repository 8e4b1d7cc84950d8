"""The linear-log-sum-exp engine: one forward and one backward that every loss is built on.

Notation (docs/design.md, top): A (N, D) rows, B (V, D) columns,

    X_ij = softcap(s · <A_i, B_j> + bias_j)        lse_i = log Σ_j exp(X_ij)
                                                   lse^col_j = log Σ_i exp(X_ij)   (optional)

Rows are addressed through a *compact row order*: ``rows.index[p]`` is the row of A that
position p stands for, and positions ``p >= rows.n_valid`` (ignored tokens) are skipped by every
kernel. Statistics and per-row coefficients live in that compact order. Columns may be
visited in a permuted order (vocabulary sorting); outputs always use the original column ids.

``row_stats`` gives lse, the target logit X_{i,y_i} and Σ_j w_j X_ij per row, optionally the
column LSE from the same pass (symmetric contrastive losses), plus per-tile statistics for
filtering; ``grads`` gives dA, dB, dbias and ds for

    dX_ij = r_i · P_ij + c_j · Q_ij − t_i · [j = y_i] − u_i · w_j
    P_ij = exp(X_ij − lse_i),  Q_ij = exp(X_ij − lse^col_j)

(chained through softcap and scale), skipping tiles whose softmax mass (per row, and per column
when Q is used) is provably negligible. ``Logits.diag_mask`` removes the entries X_ii (A and B
being the same rows, as in SimCLR). In ``sigmoid`` mode the statistic is instead the pairwise
sigmoid loss Σ_j softplus(−z_ij X_ij) (z = +1 at the target, −1 elsewhere; SigLIP) and
dX_ij = −r_i · z_ij · σ(−z_ij X_ij).
Two implementations share these signatures: Triton kernels ("triton"; CUDA, or the CPU
through Triton's interpreter) and a chunked pure-PyTorch path ("torch").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
from dataclasses import dataclass

import torch

from . import config
from .filtering import backward_tiles, gradient_mass, live_tiles_into
from .launch import RepeatedLaunch


@dataclass(frozen=True)
class Logits:
    """How the logits are formed from A and B."""

    bias: torch.Tensor | None = None  # (V,)
    scale: torch.Tensor | None = None  # () fp32 on the device; None means 1
    softcap: float | None = None
    col_order: torch.Tensor | None = None  # (V,) int64 permutation of the columns
    diag_mask: bool = False  # drop X_ij where row id == column id (A and B are the same rows)


@dataclass(frozen=True)
class Rows:
    """The rows that count, in compact order, and their targets."""

    index: torch.Tensor  # (N,) int64: compact position p reads A[index[p]]
    n_valid: torch.Tensor  # () int64 on the device
    target: torch.Tensor | None = None  # (N,) int64 original column id per position, or -1
    identity: bool | None = None  # index == arange(N); None: not known (checked when needed)
    all_valid: bool = False  # every row counts (n_valid == N), known without asking the GPU

    def is_identity(self) -> bool:
        if self.identity is None:
            return _is_identity(self.index)
        return self.identity


@dataclass
class RowStats:
    """Forward statistics, in compact row order (entries at p >= n_valid are 0).

    Each LSE is also kept as its parts, lse = max + log(sum) with sum = Σ exp(X − max): the
    losses form lse − X_target as (max − X_target) + log_sum, as PyTorch's log_softmax does, and
    the backward forms P = exp(X − max) / sum. One rounded fp32 lse would lose the small part
    (1 − P_ii on a confident row) that the gradient consists of; and exp((X − max) − log_sum)
    would carry the rounding of the argument, ≈ |log P|·2⁻²⁴ relative (2.4e-7 at log_sum ≈ 6),
    into every P of a flat row, where exp(X − max) / sum is exact to a few 2⁻²⁴ whatever V is.
    """

    lse: torch.Tensor  # (N,) fp32
    target_logit: torch.Tensor | None  # (N,) fp32
    weighted_sum: torch.Tensor | None  # (N,) fp32, Σ_j w_j X_ij
    # Per-tile statistics (Triton only): (row blocks, column tiles) fp32 block maxima of the row
    # tile log-masses.
    tile_log_mass: torch.Tensor | None
    block_m: int = 0
    block_n: int = 0
    max: torch.Tensor | None = None  # (N,) fp32 row max
    log_sum: torch.Tensor | None = None  # (N,) fp32 log Σ_j exp(X_ij − max_i)
    sum: torch.Tensor | None = None  # (N,) fp32 Σ_j exp(X_ij − max_i) (1 on rows p >= n_valid)
    col_lse: torch.Tensor | None = None  # (V,) fp32 by column id, with col_stats
    col_max: torch.Tensor | None = None  # (V,)
    col_log_sum: torch.Tensor | None = None  # (V,)
    col_sum: torch.Tensor | None = None  # (V,)
    # (row blocks, column tiles) block maxima of the column log-masses.
    col_tile_log_mass: torch.Tensor | None = None
    sigmoid_sum: torch.Tensor | None = None  # (N,) fp32 Σ_j softplus(−z_ij X_ij), sigmoid mode
    # (N,) fp32 Σ_j exp(X_ij − max_i)·(X_ij − max_i) ≤ 0, with Wants(entropy=True)
    centered_sum: torch.Tensor | None = None
    # (N,) fp32 Σ_j exp(2·(X_ij − max_i)), with Wants(squares=True): Σ_j P_ij² = this / sum²
    square_sum: torch.Tensor | None = None
    # (max, sum, log sum, lse) as one (4, N) / (4, V) tensor, where the fields above are its
    # rows (the Triton forward writes them so): ``packed`` returns it without a copy.
    rows_packed: torch.Tensor | None = None
    cols_packed: torch.Tensor | None = None

    def set_columns(self, col_max: torch.Tensor, col_sum: torch.Tensor) -> None:
        """Fills the column statistics from (max, Σ exp(X − max)) per column id."""
        self.col_max, self.col_sum = col_max, col_sum
        self.col_log_sum = torch.log(col_sum)
        self.col_lse = col_max + self.col_log_sum

    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows (4, N), columns (4, V) or None): (max, sum, log sum, lse) stacked (what an op
        returns for its backward; ``from_packed`` reads them back)."""
        rows, cols = self.rows_packed, self.cols_packed
        if rows is None:
            rows = torch.stack((self.max, self.sum, self.log_sum, self.lse))
        if cols is None and self.col_max is not None:
            cols = torch.stack((self.col_max, self.col_sum, self.col_log_sum, self.col_lse))
        return rows, cols

    @classmethod
    def from_packed(cls, rows: torch.Tensor, cols: torch.Tensor | None,
                    target_logit: torch.Tensor | None, tile_log_mass: torch.Tensor | None,
                    col_tile_log_mass: torch.Tensor | None, block: tuple[int, int]) -> RowStats:
        """The statistics that ``packed`` and the per-tile tensors describe; ``block`` is the
        forward's (block_m, block_n) (``forward_block``)."""
        row_max, row_sum, row_log_sum, row_lse = rows.unbind(0)
        stats = cls(lse=row_lse, max=row_max, log_sum=row_log_sum, sum=row_sum,
                    target_logit=target_logit, weighted_sum=None, tile_log_mass=tile_log_mass,
                    col_tile_log_mass=col_tile_log_mass, block_m=block[0], block_n=block[1],
                    rows_packed=rows, cols_packed=cols)
        if cols is not None:
            stats.col_max, stats.col_sum, stats.col_log_sum, stats.col_lse = cols.unbind(0)
        return stats

    def lse_minus(self, x: torch.Tensor) -> torch.Tensor:
        """lse_i − x_i, without rounding lse first."""
        return (self.max - x) + self.log_sum


@dataclass(frozen=True)
class GradCoefficients:
    """Weights of dX = r·P + c·Q − t·onehot(y) − u·w + e·P·(X − max): per row in compact
    order, c per column id (the last term is an entropy's, never filtered).

    In sigmoid mode only ``lse`` (r) is used: dX = −r·z·σ(−zX).
    """

    lse: torch.Tensor  # r (N,)
    target: torch.Tensor | None = None  # t (N,)
    uniform: torch.Tensor | None = None  # u (N,)
    col: torch.Tensor | None = None  # c (V,), needs RowStats.col_lse
    logit: torch.Tensor | None = None  # e (N,)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of statistics and accumulations for operands of ``dtype``: fp32, or float64
    for float64 operands (the torch backend's; the kernels take fp32, bf16 and fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compact_rows(valid: torch.Tensor) -> Rows:
    """Compact order for a (N,) bool mask, without a host sync: valid rows first, stable."""
    index = torch.argsort((~valid).to(torch.uint8), stable=True)
    return Rows(index=index, n_valid=valid.sum())


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' → Triton on CUDA, torch elsewhere; 'triton' on CPU needs TRITON_INTERPRET=1."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not config.interpreting():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors; on the CPU the kernels run only through "
            "Triton's interpreter (set TRITON_INTERPRET=1 before importing triton). "
            "Use backend='torch' or 'auto' for CPU tensors."
        )
    return backend


# ---------------------------------------------------------------------------------------------
# forward


@dataclass(frozen=True)
class Wants:
    """What a forward (``row_stats``) computes besides each row's LSE and target logit."""

    weighted_sum: bool = False  # Σ_j w_j X_ij per row (w: ``col_weight``, else 1)
    col_stats: bool = False  # each column's LSE over the valid rows, from the same pass
    sigmoid: bool = False  # the pairwise sigmoid loss per row instead of the LSE (needs targets)
    record_tiles: bool = True  # the per-tile statistics that filtering reads
    entropy: bool = False  # RowStats.centered_sum (a row's entropy is log_sum − centered / sum)
    squares: bool = False  # RowStats.square_sum (Σ_j P_ij² = square_sum / sum²)


def row_stats(
    a: torch.Tensor,  # (·, D)
    b: torch.Tensor,  # (V, D)
    logits: Logits,
    rows: Rows,
    *,
    col_weight: torch.Tensor | None = None,  # (V,) fp32 weights of the weighted row sum
    wants: Wants = Wants(),
    backend: str = "triton",
) -> RowStats:
    """Row log-sum-exp (and target logit, and what ``wants`` asks for) of X without
    materializing it. Per-tile statistics are shaped as ``tile_stats_shapes`` says."""
    if wants.sigmoid and (rows.target is None or wants.col_stats or wants.weighted_sum
                          or wants.entropy or wants.squares):
        raise ValueError("sigmoid mode needs targets and takes no column, weighted, entropy "
                         "or square statistics")
    if backend == "torch":
        return _row_stats_torch(a, b, logits, rows, col_weight, wants)
    return _row_stats_triton(a, b, logits, rows, col_weight, wants)


def forward_block(device: torch.device, dtype: torch.dtype, d: int, *, col_stats: bool = False,
                  sigmoid: bool = False) -> tuple[int, int]:
    """(block_m, block_n) of the Triton forward's tiles: the per-tile statistics of ``row_stats``
    are (⌈N / block_m⌉, ⌈V / block_n⌉)."""
    cfg = config.forward_config(device, dtype, d, sigmoid=sigmoid, col_stats=col_stats)
    return cfg.block_m, cfg.block_n


def tile_stats_shapes(n: int, v: int, device: torch.device, dtype: torch.dtype, d: int, *,
                      col_stats: bool = False, sigmoid: bool = False
                      ) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of ``RowStats.tile_log_mass`` and ``col_tile_log_mass`` as the Triton
    ``row_stats`` records them for n rows and v columns (what an op's fake returns): (row
    blocks, column tiles) for each."""
    bm, bn = forward_block(device, dtype, d, col_stats=col_stats, sigmoid=sigmoid)
    n_rb, n_ct = triton_cdiv(n, bm), triton_cdiv(v, bn)
    return (n_rb, n_ct), (n_rb, n_ct)


def dot_flags(t: torch.Tensor) -> tuple[bool, str]:
    """(upcast before tl.dot, tl.dot input_precision) for operands of t's dtype.

    fp32 operands multiply exactly ("ieee", not TF32: three-TF32 products lose accuracy on
    peaked logits; docs/design.md, "fp32 inputs"); the kernels then keep the FMA chains short
    (``PRECISE``, see ``logits.accumulate``). The interpreter casts bf16 operands up first (its
    bf16 dot is wrong).
    """
    return config.interpreting() and t.dtype != torch.float32, (
        "ieee" if t.dtype == torch.float32 else "tf32")


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether the bulk tensor copy engine (TMA) can read t's rows: a Hopper or later GPU (or
    the interpreter), row-major, with 16-byte aligned base and row stride."""
    if not (config.interpreting() or (t.is_cuda and config.capability(t.device)[0] >= 9)):
        return False
    size = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * size) % 16 == 0)


def compact_operand(a: torch.Tensor, rows: Rows) -> torch.Tensor:
    """A in compact row order: A itself when every row counts in order, else a copy (N·D)."""
    return a if rows.is_identity() else a.index_select(0, rows.index)


def tile_descriptors(a: torch.Tensor, b: torch.Tensor, logits: Logits, rows: Rows,
                     block_m: int, block_n: int, block_k: int):
    """(A descriptor, B descriptor, A in compact row order) for TMA loads of row block × column
    tile operands, or (None, None, None) where the kernels must gather rows by pointer instead.

    TMA reads whole blocks of consecutive rows: A in compact row order (``compact_operand``) and
    B in column order (with vocabulary sorting the kernels gather, as a sorted copy of B would
    cost V·D). TMA-fed tiles make the forward faster than pointer loads (docs/design.md,
    "Loading tiles").
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_rows = _tma_rows(a, b, logits, rows)
    if a_rows is None:
        return None, None, None
    return (TensorDescriptor.from_tensor(a_rows, [block_m, block_k]),
            TensorDescriptor.from_tensor(b, [block_n, block_k]), a_rows)


def _tma_rows(a: torch.Tensor, b: torch.Tensor, logits: Logits, rows: Rows):
    """A in compact row order where TMA can read both operands' tiles (``tile_descriptors``),
    else None."""
    if (not config.tma_enabled() or logits.col_order is not None
            or not (_tma_ready(a) and _tma_ready(b))):
        return None
    a_rows = compact_operand(a, rows)
    return a_rows if _tma_ready(a_rows) else None


def _program_target(device: torch.device) -> int:
    """How many forward programs fill the device a few times over."""
    if device.type != "cuda":
        return 4
    return 4 * config.sm_count(device)


def _forward_grid(n_rb: int, n_ct: int, col_stats: bool, device: torch.device,
                  resident: int = 1):
    """(row groups, blocks per group, column splits, tiles per split) of the forward.

    Without column statistics every row block is its own group, and the columns are split so
    that the programs' last wave ends with the others (``_balanced_splits``). With them,
    programs own near-square rectangles of tiles so that both the row and the column partials
    stay few (O((N + V) · √programs) floats). ``resident``: programs one SM runs at once.
    """
    target = _program_target(device)
    if not col_stats:
        slots = max(1, target // 4) * resident if device.type == "cuda" else target
        splits, per_split = _balanced_splits(n_rb, n_ct, slots)
        return n_rb, 1, splits, per_split
    groups = max(1, min(n_rb, round((target * n_rb / n_ct) ** 0.5)))
    per_group = triton_cdiv(n_rb, groups)
    groups = triton_cdiv(n_rb, per_group)
    splits = max(1, min(n_ct, triton_cdiv(target, groups)))
    if device.type == "cuda" and resident == 1:
        return (groups, per_group,
                *_wave_filling_splits(n_rb, per_group, n_ct, splits, target // 4))
    per_split = triton_cdiv(n_ct, splits)
    return groups, per_group, triton_cdiv(n_ct, per_split), per_split


@functools.lru_cache(maxsize=256)
def _wave_filling_splits(n_rb: int, per_group: int, n_ct: int, near: int,
                         slots: int) -> tuple[int, int]:
    """(splits, tiles per split) of the forward with column statistics where each SM runs one
    program (``slots`` SMs): of the split counts from ``near``/2 to ``near``, the largest whose
    programs, each taking the next free SM in launch order, end within 3% of the best of them
    (``_makespan``); never more than ``near``, so the row partials stay within their bound.

    ``near`` (4·SMs programs) put 544 programs of equal size on 132 SMs at b = 131072 and
    262144 (CLIP c = 512, 32 row groups, 17 splits): their fifth wave of 16 programs ran alone.
    Measured (H200, the Hopper forward, 2026-11-30): 204 → 177 ms at 262144 with 16 splits,
    49.0 → 44.9 at 131072, unchanged at 65536, where 17 splits end together. With two programs
    an SM (the Triton kernel at c = 1024) the times did not follow this count; those keep
    ``near``.
    """
    options: dict[int, tuple[int, int]] = {}
    for wanted in range(max(1, near // 2), min(n_ct, near) + 1):
        per = triton_cdiv(n_ct, wanted)
        options[triton_cdiv(n_ct, per)] = (_makespan(n_rb, per_group, n_ct, per, slots), per)
    best = min(time for time, _ in options.values())
    splits = max(s for s, (time, _) in options.items() if time <= 1.03 * best)
    return splits, options[splits][1]


def _makespan(n_rb: int, per_group: int, n_ct: int, per_split: int, slots: int) -> int:
    """When the last of the forward's programs ends, each taking the next free slot in launch
    order (row group fastest, as ``program_id(0)``), in tile-times: a program's time is its
    row blocks × (its tiles + 1, the one for each block's A load)."""
    free = [0] * slots  # a heap of the times the slots free up
    for s0 in range(0, n_ct, per_split):
        tiles = min(per_split, n_ct - s0)
        for g0 in range(0, n_rb, per_group):
            blocks = min(per_group, n_rb - g0)
            heapq.heappush(free, heapq.heappop(free) + blocks * (tiles + 1))
    return max(free)


@functools.lru_cache(maxsize=256)
def _balanced_splits(groups: int, n_ct: int, slots: int) -> tuple[int, int]:
    """(splits, tiles per split): the fewest splits whose time, waves × tiles per program, is
    within 5% of the best (each split costs 16 bytes of partials per row).

    ``slots`` programs run at once. A fixed "4 programs per SM" left the last of 5 waves a third
    full on the LM-head shapes (64 row blocks × 9 splits on 132 SMs): 560 tile-times where 485
    suffice. Here gemma2-2b's 64 × 1000 tiles get 2 splits, 128 programs of 500 tiles, one wave.
    """
    options = []
    for splits in range(1, n_ct + 1):
        per = triton_cdiv(n_ct, splits)
        if triton_cdiv(n_ct, per) == splits:
            options.append((triton_cdiv(groups * splits, slots) * per, splits, per))
    best = min(cost for cost, _, _ in options)
    return next((splits, per) for cost, splits, per in options if cost <= 1.05 * best)


def _resident_programs(cfg: config.TileConfig, element_size: int) -> int:
    """Forward programs one SM holds at once, from the pipeline's shared memory (228 KiB per
    SM on Hopper; less elsewhere, where this over-counts at worst by one)."""
    smem = (cfg.block_m + cfg.block_n) * cfg.block_k * element_size * cfg.num_stages
    return max(1, min(228 * 1024 // max(1, smem), 64 // cfg.num_warps // 4))


def _sm90_operand(a, b, logits, rows, wants: Wants, cfg: config.TileConfig
                  ) -> torch.Tensor | None:
    """A in compact row order where the Hopper kernel (``lse_forward_sm90``) computes this
    forward, else None: softmax statistics of the rows (and of the columns) without the options
    it lacks (softcap, vocabulary order, weighted sums, entropy, sigmoid; the diagonal mask only
    of rows in order and without column statistics), on operands that TMA reads, where the
    forward's tiles (``cfg``) are 128 columns wide and a whole number of its 64-row blocks
    high (its per-tile records are merged into them: ``_merge_row_blocks``)."""
    if (wants.sigmoid or wants.weighted_sum or wants.entropy or wants.squares
            or not config.gluon_enabled(a.device)):
        return None
    if logits.softcap or (logits.diag_mask and (wants.col_stats or not rows.is_identity())):
        return None
    from . import lse_forward_sm90

    if cfg.block_n != lse_forward_sm90.BLOCK_N or cfg.block_m % lse_forward_sm90.BLOCK_M:
        return None
    return _tma_rows(a, b, logits, rows) if lse_forward_sm90.supports(a, b) else None


def _merge_row_blocks(tiles: torch.Tensor, n_rb: int) -> torch.Tensor:
    """Per-tile records (blocks, column tiles) of row blocks → of ``n_rb`` blocks, each the
    largest record of the consecutive blocks it holds (records start at -inf; NaN stays)."""
    blocks = tiles.shape[0]
    per = -(-blocks // n_rb)
    if per == 1:
        return tiles
    if blocks != n_rb * per:  # the last group short of blocks: −inf records for the rest
        tiles = torch.cat([tiles, tiles.new_full((n_rb * per - blocks, tiles.shape[1]),
                                                 float("-inf"))])
    return tiles.view(n_rb, per, -1).amax(dim=1)


def _check_ids(n: int, v: int) -> None:
    """The kernels compare row and column ids in 32 bits."""
    if max(n, v) >= 2**31:
        raise ValueError(f"the Triton backend takes fewer than 2^31 rows and columns, got "
                         f"{n} rows and {v} columns; use backend='torch'")


def triton_cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _row_stats_triton(a, b, logits, rows, col_weight, wants: Wants) -> RowStats:
    from .lse_forward import _lse_forward_kernel, _target_logit_kernel

    sigmoid, col_stats, weighted_sum = wants.sigmoid, wants.col_stats, wants.weighted_sum

    n, (v, d) = rows.index.numel(), b.shape
    _check_ids(n, v)
    cfg = config.forward_config(a.device, a.dtype, d, sigmoid=sigmoid, col_stats=col_stats)
    n_rb, n_ct = triton_cdiv(n, cfg.block_m), triton_cdiv(v, cfg.block_n)
    a_sm90 = _sm90_operand(a, b, logits, rows, wants, cfg)
    resident = 1 if a_sm90 is not None else _resident_programs(cfg, a.element_size())
    # The Hopper kernel's programs take rectangles of its 64-row blocks, with column statistics
    # or without (two consumers of one program share each B chunk).
    grid_rb = n_rb
    if a_sm90 is not None:
        from . import lse_forward_sm90

        grid_rb = triton_cdiv(n, lse_forward_sm90.BLOCK_M)
    groups, blocks_per_group, splits, tiles_per_split = _forward_grid(
        grid_rb, n_ct, col_stats or a_sm90 is not None, a.device, resident)
    record_tiles = wants.record_tiles and not sigmoid
    f32 = dict(dtype=torch.float32, device=a.device)
    # Every (split, valid row) partial is written by the kernel; rows past n_valid are not read.
    part_max = torch.empty((splits, n), **f32)
    part_sum = torch.empty((splits, n), **f32)
    has_target = rows.target is not None
    # The sigmoid loss needs each tile's targets (they flip sign); the others take the target
    # logits from a launch of their own (_target_logit_kernel), bit for bit the tiles' values.
    target_in_tiles = has_target and sigmoid
    part_target = torch.zeros((splits, n), **f32) if target_in_tiles else part_sum
    part_wsum = torch.zeros((splits, n), **f32) if weighted_sum else part_sum
    part_centered = torch.empty((splits, n), **f32) if wants.entropy else part_sum
    part_squares = torch.empty((splits, n), **f32) if wants.squares else part_sum
    # Block maxima start at −inf (blocks without valid rows are never visited); the Hopper
    # kernel records its own 64-row blocks, merged into the forward's below.
    tiles = torch.full((grid_rb, n_ct), float("-inf"), **f32) if record_tiles else part_sum
    if col_stats:
        # The Hopper kernel keeps one column partial per consumer warpgroup.
        col_parts = groups * (2 if a_sm90 is not None else 1)
        col_max = torch.full((col_parts, v), float("-inf"), **f32)
        col_sum = torch.zeros((col_parts, v), **f32)
        col_tiles = (torch.full((n_rb, n_ct), float("-inf"), **f32) if record_tiles
                     else col_sum)
    dot_fp32, precision = dot_flags(a)
    dummy = part_sum
    if a_sm90 is not None:
        lse_forward_sm90.launch(
            a_sm90, b, logits, rows.n_valid,
            lse_forward_sm90.Partials(part_max, part_sum, tiles,
                                      *((col_max, col_sum, col_tiles) if col_stats else ())),
            lse_forward_sm90.Schedule(groups, splits, blocks_per_group, tiles_per_split, n_ct),
            record_tiles)
        if record_tiles:
            tiles = _merge_row_blocks(tiles, n_rb)
    else:
        a_desc, b_desc, _ = tile_descriptors(a, b, logits, rows, cfg.block_m, cfg.block_n,
                                             cfg.block_k)
        _lse_forward_kernel[(groups, splits)](
            a, b, a_desc, b_desc,
            logits.bias if logits.bias is not None else dummy,
            logits.scale if logits.scale is not None else dummy,
            rows.index, rows.n_valid,
            logits.col_order if logits.col_order is not None else rows.index,
            rows.target if has_target else rows.index,
            col_weight if col_weight is not None else dummy,
            part_max, part_sum, part_target, part_wsum, part_centered, part_squares, tiles,
            col_max if col_stats else dummy, col_sum if col_stats else dummy,
            col_tiles if col_stats else dummy,
            n, v, d, a.stride(0), b.stride(0), blocks_per_group, tiles_per_split, n_ct,
            HAS_BIAS=logits.bias is not None, HAS_SCALE=logits.scale is not None,
            SOFTCAP=float(logits.softcap or 0.0), HAS_ORDER=logits.col_order is not None,
            HAS_TARGET=target_in_tiles, HAS_WSUM=weighted_sum,
            HAS_COL_WEIGHT=col_weight is not None, RECORD_TILES=record_tiles,
            COL_STATS=col_stats, DIAG_MASK=logits.diag_mask, SIGMOID=sigmoid,
            ENTROPY=wants.entropy, SQUARES=wants.squares,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_FP32=dot_fp32, PRECISION=precision, ROUND=not config.interpreting(),
            PRECISE=config.precise_math(a.dtype), USE_TMA=a_desc is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    target_logit = None
    if target_in_tiles:
        target_logit = part_target.sum(dim=0)
    elif has_target:
        target_logit = torch.empty(n, **f32)
        _target_logit_kernel[(triton_cdiv(n, cfg.block_m),)](
            a, b, logits.bias if logits.bias is not None else dummy,
            logits.scale if logits.scale is not None else dummy,
            rows.index, rows.n_valid, rows.target, target_logit,
            n, d, a.stride(0), b.stride(0),
            HAS_BIAS=logits.bias is not None, HAS_SCALE=logits.scale is not None,
            SOFTCAP=float(logits.softcap or 0.0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_FP32=dot_fp32, PRECISION=precision, ROUND=not config.interpreting(),
            PRECISE=config.precise_math(a.dtype), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    if sigmoid:
        valid = torch.arange(n, device=a.device) < rows.n_valid
        zeros = torch.zeros(n, **f32)
        return RowStats(lse=zeros, max=zeros, log_sum=zeros, target_logit=target_logit,
                        weighted_sum=None, tile_log_mass=None,
                        sigmoid_sum=torch.where(valid, part_sum.sum(dim=0), 0.0))
    row_out, col_out = combine_partials(
        part_max, part_sum, rows.n_valid, (col_max, col_sum) if col_stats else None,
        logits.col_order)
    stats = RowStats(
        lse=row_out[3],
        max=row_out[0],
        log_sum=row_out[2],
        sum=row_out[1],
        target_logit=target_logit,
        weighted_sum=part_wsum.sum(dim=0) if weighted_sum else None,
        tile_log_mass=tiles if record_tiles else None,
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        col_tile_log_mass=col_tiles if col_stats and record_tiles else None,
        rows_packed=row_out,
    )
    if wants.entropy:
        stats.centered_sum = _combine_centered(part_max, part_sum, part_centered, row_out[0],
                                               rows.n_valid)
    if wants.squares:
        stats.square_sum = _combine_squares(part_max, part_sum, part_squares, row_out[0],
                                            rows.n_valid)
    if col_stats:
        stats.col_max, stats.col_sum, stats.col_log_sum, stats.col_lse = col_out.unbind(0)
        stats.cols_packed = col_out
    return stats


def combine_partials(part_max: torch.Tensor, part_sum: torch.Tensor, n_valid: torch.Tensor,
                     cols: tuple[torch.Tensor, torch.Tensor] | None = None,
                     col_order: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward's partial statistics merged, in one launch: ``part_max``, ``part_sum``
    (parts, N) fp32 per row (max, Σ exp(X − max)) → (4, N) fp32 [max; sum; log sum; lse] per
    row (rows ≥ ``n_valid``, a () int64 tensor: max 0, sum 1); ``cols``: the (parts, V) column
    partials, by tile position, likewise → (4, V) by column id (``col_order[j]``: the column
    at position j), else None. A row without entries (no finite partial) gets max 0, sum 0;
    NaN stays NaN."""
    from .lse_forward import _combine_partials_kernel

    (splits, n), dev = part_max.shape, part_max.device
    row_out = torch.empty((4, n), dtype=torch.float32, device=dev)
    col_parts, v = cols[0].shape if cols is not None else (0, 0)
    col_out = torch.empty((4, v), dtype=torch.float32, device=dev) if cols is not None else None
    block = 256 if not config.interpreting() else 64
    row_programs = triton_cdiv(n, block)
    # Partials read per load: a power of 2 from 2 to 16.
    parts = min(16, 1 << (max(2, splits, col_parts) - 1).bit_length())
    order = col_order if col_order is not None else n_valid  # read only with HAS_ORDER
    _combine_partials_kernel[(row_programs + triton_cdiv(v, block),)](
        part_max, part_sum, splits, n, n_valid, row_out,
        *(cols if cols is not None else (part_max, part_sum)), col_parts, v,
        order, col_out if col_out is not None else row_out,
        row_programs, COLUMNS=cols is not None, HAS_ORDER=col_order is not None, BLOCK=block,
        PARTS=parts, PRECISE=not config.interpreting(), num_warps=4,
    )
    return row_out, col_out


def margins(rows: torch.Tensor, target: torch.Tensor, cols: torch.Tensor | None = None, *,
            mass: bool = False, backend: str) -> tuple[torch.Tensor, ...]:
    """lse − x for each row (and, ``cols`` given, for each column) from packed statistics,
    lse = max + log Σ exp(· − max): ``rows`` (2 or 4, n) fp32 with contiguous rows, [max; sum]
    or ``RowStats.packed``'s [max; sum; log sum; lse], and ``cols`` packed alike; ``target``
    (n,) fp32 the x subtracted on both sides (CLIP: X_ii). Returns (row margins (n,), column
    margins or None, and with ``mass`` the gradient masses of each
    (``filtering.gradient_mass``), else None): one launch with the Triton backend, where
    PyTorch would issue up to fourteen."""
    n = rows.shape[1]
    sides = [s for s in (rows, cols) if s is not None]
    if backend == "triton" and n and target.is_contiguous():
        from .lse_forward import _margins_kernel

        # separate tensors, none a view of another (a custom op may return any two of them)
        margin = [torch.empty(n, dtype=torch.float32, device=rows.device) for _ in sides]
        masses = [torch.empty_like(m) for m in margin] if mass else []
        written = masses or margin  # the mass pointers, unused without ``mass``
        block = 1024 if not config.interpreting() else 64
        _margins_kernel[(triton_cdiv(n, block),)](
            rows, sides[-1], target, margin[0], margin[-1], written[0], written[-1], n,
            LOG_SUM=rows.shape[0] > 2, COLS=cols is not None, MASS=mass, BLOCK=block,
            PRECISE=not config.interpreting(), num_warps=4)
    else:
        margin = [(s[0] - target) + (s[2] if s.shape[0] > 2 else torch.log(s[1])) for s in sides]
        masses = [gradient_mass(m) for m in margin] if mass else []
    return (*(margin + [None])[:2], *(masses + [None, None])[:2])


def merge_stats(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None, *,
                backend: str) -> torch.Tensor:
    """(max, Σ exp(· − max)) of two partial statistics of the same n rows (or columns), each
    packed (2, n) fp32 as [max; sum] with contiguous rows (``RowStats.packed()[:2]`` is one):
    the packed pair of their union, written into ``out`` (which may be ``x`` or ``y``;
    default a new tensor). A partial with sum 0 — no entries; ``row_stats`` reports max 0
    there — counts as max −inf, so it cannot swamp entries far below 0. NaN stays NaN.
    One launch with the Triton backend, where PyTorch would issue about fourteen."""
    out = torch.empty_like(x) if out is None else out
    n = x.shape[1]
    if backend == "triton" and n:
        from .lse_forward import _merge_pair_kernel

        block = 1024 if not config.interpreting() else 64
        _merge_pair_kernel[(triton_cdiv(n, block),)](
            x, y, out, n, BLOCK=block, PRECISE=not config.interpreting(), num_warps=4)
        return out
    max1 = torch.where(x[1] > 0, x[0], float("-inf"))
    max2 = torch.where(y[1] > 0, y[0], float("-inf"))
    top = torch.maximum(max1, max2)
    safe = torch.where(torch.isfinite(top), top, 0.0)
    total = x[1] * torch.exp(max1 - safe) + y[1] * torch.exp(max2 - safe)
    out[0], out[1] = top, total
    return out


def _combine_centered(part_max: torch.Tensor, part_sum: torch.Tensor, part_centered: torch.Tensor,
                      top: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Σ_j exp(X − top)·(X − top) per row from the splits' partials (parts, N), each about its
    own max m_k: Σ_k exp(m_k − top)·(C_k + (m_k − top)·S_k); 0 on rows ≥ ``n_valid``."""
    shift = part_max - top
    return _sum_parts((part_centered + shift * part_sum) * torch.exp(shift), part_sum, n_valid)


def _combine_squares(part_max: torch.Tensor, part_sum: torch.Tensor, part_squares: torch.Tensor,
                     top: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """Σ_j exp(2·(X − top)) per row from the splits' partials (parts, N), each about its own
    max m_k: Σ_k exp(2·(m_k − top))·Q_k; 0 on rows ≥ ``n_valid``."""
    return _sum_parts(part_squares * torch.exp(2 * (part_max - top)), part_sum, n_valid)


def _sum_parts(moved: torch.Tensor, part_sum: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """The splits' partials, already moved to the row max, summed over the splits that saw an
    entry (Σ exp > 0; an empty split's partial is not finite); 0 on rows ≥ ``n_valid``."""
    total = torch.where(part_sum > 0, moved, 0.0).sum(dim=0)
    return torch.where(torch.arange(total.shape[0], device=total.device) < n_valid, total, 0.0)


def _combine_partials(part_max: torch.Tensor, part_sum: torch.Tensor):
    """(max, Σ exp(· − max)) of partial (max_k, Σ_k) pairs over dim 0.

    The max is finite wherever some partial is (0 where none is, with sum = 0).
    """
    top = part_max.amax(dim=0)
    safe_top = torch.where(torch.isfinite(top), top, 0.0)
    return safe_top, (part_sum * torch.exp(part_max - safe_top)).sum(dim=0)


def _torch_chunk_rows(v: int) -> int:
    return max(1, config.tuning().torch_chunk_elements // max(1, v))


def _torch_logits(a_rows, b32, logits: Logits, row_ids=None):
    """(raw dots, X) for a chunk of rows (A's row ids ``row_ids`` for the diagonal mask), in
    ``b32``'s dtype (fp32; float64 for float64 operands)."""
    raw = a_rows.to(b32.dtype) @ b32.T
    x = raw * logits.scale if logits.scale is not None else raw
    if logits.bias is not None:
        x = x + logits.bias.to(raw.dtype)
    if logits.softcap:
        x = logits.softcap * torch.tanh(x / logits.softcap)
    if logits.diag_mask:
        cols = torch.arange(b32.shape[0], device=x.device)
        x = x.masked_fill(row_ids[:, None] == cols[None, :], float("-inf"))
    return raw, x


def _softplus_neg_zx(x: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """softplus(−z·X), z = +1 where ``hit`` and −1 elsewhere (= −log σ(z·X))."""
    return torch.nn.functional.softplus(torch.where(hit, -x, x))


def _row_stats_torch(a, b, logits, rows, col_weight, wants: Wants) -> RowStats:
    sigmoid, col_stats, weighted_sum = wants.sigmoid, wants.col_stats, wants.weighted_sum
    n, v = rows.index.numel(), b.shape[0]
    n_valid = n if rows.all_valid else int(rows.n_valid)  # a read-back only when unknown
    acc = accumulation_dtype(a.dtype)
    row_max = torch.zeros(n, dtype=acc, device=a.device)
    row_sum = torch.ones_like(row_max)
    target_logit = torch.zeros_like(row_max) if rows.target is not None else None
    wsum = torch.zeros_like(row_max) if weighted_sum else None
    sig = torch.zeros_like(row_max) if sigmoid else None
    centered = torch.zeros_like(row_max) if wants.entropy else None
    squares = torch.zeros_like(row_max) if wants.squares else None
    if col_stats:  # running (max, Σ exp(X − max)) per column
        col_max = torch.full((v,), float("-inf"), dtype=acc, device=a.device)
        col_sum = torch.zeros(v, dtype=acc, device=a.device)
    b32 = b.to(acc)
    chunk = _torch_chunk_rows(v)
    for start in range(0, n_valid, chunk):
        pos = slice(start, min(start + chunk, n_valid))
        idx = rows.index[pos]
        _, x = _torch_logits(a[idx], b32, logits, idx)
        if rows.target is not None:
            tgt = rows.target[pos]
            picked = x.gather(1, tgt.clamp(min=0)[:, None])[:, 0]
            target_logit[pos] = torch.where(tgt >= 0, picked, 0.0)
        if sigmoid:
            hit = torch.arange(v, device=x.device)[None, :] == tgt[:, None]
            sig[pos] = _softplus_neg_zx(x, hit).sum(dim=1)
            continue
        row_max[pos], row_sum[pos] = _max_sum(x, dim=1)
        if wants.entropy or wants.squares:
            shifted = x - row_max[pos, None]
            e = torch.exp(shifted)
            if wants.entropy:
                centered[pos] = torch.where(e > 0, e * shifted, 0.0).sum(dim=1)
            if wants.squares:
                squares[pos] = (e * e).sum(dim=1)
            del shifted, e
        if col_stats:
            top, total = _max_sum(x, dim=0)
            new_max = torch.maximum(col_max, top)
            safe = torch.where(torch.isfinite(new_max), new_max, 0.0)
            col_sum = col_sum * torch.exp(col_max - safe) + total * torch.exp(top - safe)
            col_max = new_max
        if weighted_sum:
            wsum[pos] = (x @ col_weight.to(acc)) if col_weight is not None else x.sum(dim=1)
    row_log_sum = torch.log(row_sum)
    stats = RowStats(lse=row_max + row_log_sum, max=row_max, log_sum=row_log_sum, sum=row_sum,
                     target_logit=target_logit, weighted_sum=wsum, tile_log_mass=None,
                     sigmoid_sum=sig, centered_sum=centered, square_sum=squares)
    if col_stats:
        stats.set_columns(*_combine_partials(col_max[None], col_sum[None]))
    return stats


def _max_sum(x: torch.Tensor, dim: int):
    """(max, Σ exp(x − max)) along ``dim``; the max is 0 where every entry is −inf."""
    top = x.amax(dim=dim)
    top = torch.where(torch.isfinite(top), top, 0.0)
    return top, torch.exp(x - top.unsqueeze(dim)).sum(dim=dim)


# ---------------------------------------------------------------------------------------------
# backward


@dataclass
class Grads:
    a: torch.Tensor | None  # (·, D) like A (rows outside the compact set are 0)
    b: torch.Tensor | None  # (V, D) like B
    bias: torch.Tensor | None  # (V,) fp32
    scale: torch.Tensor | None  # () fp32


@dataclass(frozen=True)
class Needs:
    """Which gradients a backward forms."""

    a: bool = True
    b: bool = True
    bias: bool = False
    scale: bool = False


@dataclass(frozen=True)
class BackwardPlan:
    """How ``grads`` runs: the filter, the scratch and slab paths, the gradients' dtypes, the
    backend, the row blocks (``grads``' docstring says what each field does)."""

    filter_eps: float | None = None
    filter_scale: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
    scratch_bytes: int | None = None
    sparse: bool = False
    split_accumulator: bool = False
    grad_dtype: torch.dtype | None = None
    grad_a_dtype: torch.dtype | None = None
    backend: str = "triton"
    row_chunk: int | None = None


@dataclass(frozen=True)
class _Problem:
    """A backward's operands and what the forward left for it."""

    a: torch.Tensor
    b: torch.Tensor
    logits: Logits
    rows: Rows
    stats: RowStats
    coef: GradCoefficients
    col_weight: torch.Tensor | None
    sigmoid: bool

    def unpacked(self):
        return (self.a, self.b, self.logits, self.rows, self.stats, self.coef, self.col_weight,
                self.sigmoid)


def grads(
    a: torch.Tensor,
    b: torch.Tensor,
    logits: Logits,
    rows: Rows,
    stats: RowStats,
    coef: GradCoefficients,
    *,
    col_weight: torch.Tensor | None = None,
    sigmoid: bool = False,
    needs: Needs = Needs(),
    plan: BackwardPlan = BackwardPlan(),
    acc_a: torch.Tensor | None = None,
    out_b: torch.Tensor | None = None,
) -> Grads:
    """Gradients of Σ_ij dX_ij · X_ij with respect to A, B, bias and s (see module doc), those
    ``needs`` asks for, computed as ``plan`` says. ``col_weight``: the per-column w_j of the
    uniform term; ``sigmoid`` selects the pairwise sigmoid gradient (never filtered).

    ``acc_a``: an fp32 tensor shaped as A that dA is added to, returned as ``Grads.a`` (a
    caller summing the gradients of several blocks of columns: the ring); where every row is
    valid and in order, the products accumulate into it directly, saving an accumulator's
    fill and a pass over it. ``out_b``: a contiguous tensor of dB's shape and dtype that dB
    is written to, returned as ``Grads.b``.

    The plan's fields: ``filter_eps`` bounds the softmax mass each row (and, with a column
    term, each column) may lose to skipped tiles (Triton only; None computes every tile). The
    uniform term u·w must be free of softcap for filtering: with softcap it is folded into the
    tiles, which are then all computed. ``filter_scale`` = (per row (N,), per column (V,))
    factors ≤ 1 on ``filter_eps``: each row's (column's) gradient mass relative to its softmax
    mass, so that the bound is relative to the gradient (``filtering.gradient_mass``).
    ``scratch_bytes`` caps the dX scratch of one column slab (default: ``FUSEDLOSS_SCRATCH_MB``,
    64 MiB); wider slabs amortize the fp32 dA accumulator's read-modify-write over more
    columns.

    ``sparse``: a slab whose live tiles are few goes through the sparse matmul kernels, which
    the host picks from the live counts, with one wait for the GPU (none while a CUDA graph is
    being captured: every slab is dense then). ``sparse=False`` (the default) takes every slab
    through the dense path (skipped tiles reach cuBLAS as zeros) and never waits for the GPU:
    the valid rows' count stays on the device, the products run over every row, those past
    the count giving zeros.

    ``split_accumulator``: dA accumulates over the slabs as a pair of bf16 matrices — the
    returned gradient (the sum rounded) and one more (the rest) — instead of in fp32: half the
    bytes (2·N·D instead of 4·N·D), ~16 significant bits kept between slabs, and the result
    the sum rounded once, as with fp32 (``_accumulate_split_kernel``). Taken where it applies:
    bf16 inputs, every slab dense (``sparse=False``), every row valid and in order, no bias
    (the scale then goes into dX) and no rank-1 term; elsewhere dA accumulates in fp32.

    ``grad_dtype``: the dtype of dA and dB, default those of A and B (``grad_a_dtype``: of dA
    alone). ``torch.float32`` returns the fp32 accumulations unrounded, for a caller that adds
    gradients of several blocks of columns (``fusedloss.distributed``: the ring, the
    vocabulary-parallel head) and rounds once at the end.

    ``row_chunk`` (Triton, cross-entropy-like calls: no column term, no scale gradient, the
    block rule's statistics): more valid rows than this go through the backward in blocks of
    this many compact rows (``_grads_by_row_chunks``), so that dA's fp32 accumulator, read and
    written once per column slab, holds one block instead of every row, and a bounded scratch
    keeps its slabs wide. Each row's dA is formed as in one call (the same slabs; cuBLAS may
    pick another algorithm for a block's row count, so its fp32 sums may round differently);
    dB and dbias add the blocks' parts in fp32 and round once.
    """
    filter_eps, filter_scale, backend = plan.filter_eps, plan.filter_scale, plan.backend
    grad_dtype, grad_a_dtype, row_chunk = plan.grad_dtype, plan.grad_a_dtype, plan.row_chunk
    if coef.col is not None and stats.col_lse is None:
        raise ValueError("a column coefficient needs column statistics (Wants(col_stats=True))")
    # The kernels read coefficients by offset: a stride-0 expand (a reduction's gradient) won't do.
    acc = accumulation_dtype(a.dtype)
    coef = GradCoefficients(*(None if c is None else c.to(acc).contiguous() for c in (
        coef.lse, coef.target, coef.uniform, coef.col, coef.logit)))
    if not sigmoid:
        # From here on r·P = (r / sum) · exp(X − max): the backends take r / sum (see RowStats).
        # (Dividing in the recompute kernel instead, as it loads r, was slower: two more loads
        # ahead of each tile's exponentials; docs/design.md, "Host cost per call".)
        coef = dataclasses.replace(
            coef, lse=_over(coef.lse, stats.sum),
            col=None if coef.col is None else _over(coef.col, stats.col_sum),
            logit=None if coef.logit is None else _over(coef.logit, stats.sum))
    dtypes = (grad_a_dtype or grad_dtype or a.dtype, grad_dtype or b.dtype)
    if acc_a is not None:
        if acc_a.shape != a.shape or acc_a.dtype != torch.float32 or acc_a.device != a.device:
            raise ValueError(f"acc_a must be fp32 shaped as a {tuple(a.shape)} on {a.device}, "
                             f"got {acc_a.dtype} {tuple(acc_a.shape)} on {acc_a.device}")
        dtypes = (torch.float32, dtypes[1])
    if out_b is not None and (out_b.shape != b.shape or out_b.dtype != dtypes[1]
                              or out_b.device != b.device or not out_b.is_contiguous()):
        raise ValueError(f"out_b must be a contiguous {dtypes[1]} tensor shaped as b "
                         f"{tuple(b.shape)} on {b.device}, got {out_b.dtype} "
                         f"{tuple(out_b.shape)} on {out_b.device}")
    problem = _Problem(a, b, logits, rows, stats, coef, col_weight, sigmoid)
    # the internal plan: the resolved dtypes, a filter pair, no filter for the sigmoid loss
    # (the filter's bound is on the softmax terms: none for the sigmoid loss nor an entropy's)
    plan = dataclasses.replace(plan, grad_a_dtype=dtypes[0], grad_dtype=dtypes[1],
                               filter_eps=None if sigmoid or coef.logit is not None
                               else filter_eps,
                               filter_scale=filter_scale or (None, None))
    if backend == "torch":
        return _delivered(_grads_torch(problem, needs, plan), acc_a, out_b)
    if (row_chunk is not None and rows.index.numel() > row_chunk and not sigmoid
            and coef.col is None and not needs.scale):
        return _delivered(_grads_by_row_chunks(problem, needs, plan), acc_a, out_b)
    return _grads_triton(problem, needs, plan, acc_a=acc_a, out_b=out_b)


def _delivered(grads: Grads, acc_a: torch.Tensor | None, out_b: torch.Tensor | None) -> Grads:
    """``grads`` with dA added to ``acc_a`` and dB copied to ``out_b`` where given (``grads``'
    arguments), for the paths that form their own."""
    if acc_a is not None and grads.a is not None:
        grads.a = acc_a.add_(grads.a)
    if out_b is not None and grads.b is not None:
        grads.b = out_b.copy_(grads.b)
    return grads


def _grads_by_row_chunks(problem: _Problem, needs: Needs, plan: BackwardPlan) -> Grads:
    """``_grads_triton`` over blocks of ``row_chunk`` compact rows (rounded up to whole row
    blocks of the forward's statistics and of the backward), each writing its rows of dA and
    adding to fp32 dB and dbias. One read-back of the valid rows first, then each block's own
    (at most one each)."""
    a, b, logits, rows, stats, coef, col_weight, _ = problem.unpacked()
    need_a, need_b, need_bias = needs.a, needs.b, needs.bias
    dtypes, row_chunk = (plan.grad_a_dtype, plan.grad_dtype), plan.row_chunk
    filter_scale = plan.filter_scale
    n = rows.index.numel()
    # The sparse path reads its live counts back anyway; the dense one runs every block.
    n_valid = (int(rows.n_valid) if plan.sparse and not rows.all_valid and not _capturing(a.device)
               else n)
    align = max(1, stats.block_m, config.backward_config(a.device, a.dtype, b.shape[1]).block_m)
    chunk = -(-row_chunk // align) * align
    # a block never asks for the scale's gradient nor splits its accumulator
    needs = dataclasses.replace(needs, scale=False)
    plan = dataclasses.replace(plan, split_accumulator=False)
    if n_valid <= chunk:
        return _grads_triton(problem, needs, plan)
    f32 = dict(dtype=torch.float32, device=a.device)
    into = Grads(a=torch.zeros_like(a, dtype=dtypes[0]) if need_a else None,
                 b=torch.zeros(b.shape, **f32) if need_b else None,
                 bias=torch.zeros(b.shape[0], **f32) if need_bias else None, scale=None)
    fm, tiles = stats.block_m, stats.tile_log_mass
    for r0 in range(0, n_valid, chunk):
        part = slice(r0, min(r0 + chunk, n))
        rows_of = functools.partial(_rows_of, part=part)
        chunk_rows = Rows(index=rows.index[part],
                          n_valid=(rows.n_valid - r0).clamp(0, part.stop - r0),
                          target=rows_of(rows.target), identity=False, all_valid=rows.all_valid)
        chunk_stats = RowStats(
            lse=stats.lse[part], target_logit=rows_of(stats.target_logit), weighted_sum=None,
            tile_log_mass=None if tiles is None else tiles[r0 // fm:-(-part.stop // fm)],
            block_m=fm, block_n=stats.block_n, max=stats.max[part],
            log_sum=rows_of(stats.log_sum), sum=rows_of(stats.sum))
        chunk_coef = GradCoefficients(lse=coef.lse[part], target=rows_of(coef.target),
                                      uniform=rows_of(coef.uniform), logit=rows_of(coef.logit))
        _grads_triton(
            dataclasses.replace(problem, rows=chunk_rows, stats=chunk_stats, coef=chunk_coef),
            needs, dataclasses.replace(plan, filter_scale=(rows_of(filter_scale[0]), None),
                                       grad_dtype=torch.float32), into=into)
    return Grads(a=into.a, b=into.b.to(dtypes[1]) if need_b else None, bias=into.bias,
                 scale=None)


def _rows_of(x: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if x is None else x[part]


#: the open ``recording_backward_tiles`` blocks' records
_TILE_RECORDS: list[list[torch.Tensor]] = []


@contextlib.contextmanager
def recording_backward_tiles():
    """Within the block, every Triton backward call (``grads``) appends to the yielded list a
    (2,) int64 tensor on its device: (tiles computed, tiles of its valid rows) — what filtering
    skipped is the difference. Nothing is read back while recording. For benchmarks and
    tests."""
    record: list[torch.Tensor] = []
    _TILE_RECORDS.append(record)
    try:
        yield record
    finally:
        _TILE_RECORDS.remove(record)


def recording_tiles() -> bool:
    """Whether a ``recording_backward_tiles`` block is open (a call replayed as a CUDA graph
    would skip the recording: ``ops._common.replays``)."""
    return bool(_TILE_RECORDS)


def _record_tiles(live: torch.Tensor, n_valid: torch.Tensor, block_m: int) -> None:
    n_ct = live.shape[1]
    valid_blocks = (n_valid.reshape(()) + block_m - 1) // block_m
    counts = torch.stack([live.sum(dtype=torch.int64), valid_blocks.to(torch.int64) * n_ct])
    for record in _TILE_RECORDS:
        record.append(counts)


def _over(weight: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """weight / total, 0 where total is 0 (no entry at all); NaN stays NaN."""
    return torch.where(total == 0, 0.0, weight / total)


def _scratch_tiles(n_rb: int, n_ct: int, tile_bytes: int, budget: int | None = None) -> int:
    """Column tiles per slab: the dX scratch of one slab stays under the budget."""
    if budget is None:
        budget = (config.tuning().scratch_mb or 64) * 2**20
    return max(1, min(n_ct, int(budget // max(1, n_rb * tile_bytes))))


# The recompute kernel's programs sweep a slab's tiles in groups of row blocks of about this
# many bytes of A, which stay in L2 (50 MiB on an H100 or H200) beside the slab's B rows
# (``lse_backward._grouped_tile``).
RECOMPUTE_GROUP_BYTES = 24 * 2**20


def _dense_slab_fraction() -> float:
    """A slab whose live fraction reaches this goes through cuBLAS as a dense matrix."""
    return config.tuning().dense_slab_fraction


def _grads_triton(problem: _Problem, needs: Needs, plan: BackwardPlan,
                  into: Grads | None = None, acc_a: torch.Tensor | None = None,
                  out_b: torch.Tensor | None = None) -> Grads:
    """The Triton backward of ``grads`` (``plan`` as ``grads`` resolved it; ``acc_a`` and
    ``out_b`` as there). ``into``: buffers that this call's rows add to instead of new
    gradients (``_grads_by_row_chunks``): dA rows written into ``into.a`` (the rows of other
    calls left alone), dB and dbias accumulated in fp32 into ``into.b`` and ``into.bias``."""
    caller_acc = acc_a
    a, b, logits, rows, stats, coef, col_weight, sigmoid = problem.unpacked()
    need_a, need_b, need_bias, need_scale = needs.a, needs.b, needs.bias, needs.scale
    filter_eps, filter_scale = plan.filter_eps, plan.filter_scale
    scratch_bytes, sparse = plan.scratch_bytes, plan.sparse
    split_accumulator, dtypes = plan.split_accumulator, (plan.grad_a_dtype, plan.grad_dtype)
    from .lse_backward import (
        _accumulate_split_kernel,
        _grad_a_kernel,
        _grad_b_kernel,
        _grad_logits_kernel,
    )

    n, (v, d) = rows.index.numel(), b.shape
    _check_ids(n, v)
    dev = a.device
    cfg = config.backward_config(dev, a.dtype, d)
    bm, bn, bd = cfg.block_m, cfg.block_n, cfg.block_d
    n_rb, n_ct = triton_cdiv(n, bm), triton_cdiv(v, bn)
    f32 = dict(dtype=torch.float32, device=dev)

    # Which tiles to compute. With softcap the uniform term lives inside the tiles: keep all.
    uniform_in_tiles = coef.uniform is not None and bool(logits.softcap)
    eps = None if uniform_in_tiles else filter_eps
    # The forward's statistics cover (fm × fn) tiles; they bound every (bm × bn) sub-tile.
    fm, fn = stats.block_m, stats.block_n
    nested = fm > 0 and fm % bm == 0 and fn % bn == 0
    coarse, factors = None, (1, 1)
    if stats.tile_log_mass is not None and nested and eps is not None:
        lse = _pad(stats.lse, stats.tile_log_mass.shape[0] * fm)
        coarse = torch.empty(stats.tile_log_mass.shape, dtype=torch.bool, device=dev)
        live_tiles_into(coarse, stats.tile_log_mass, lse, rows.n_valid, fm, eps, filter_scale[0])
        if coef.col is not None:
            _add_live_columns(coarse, stats, rows, logits.col_order, v, fm, eps, filter_scale[1])
        factors = (fm // bm, fn // bn)
    targets = None
    if rows.target is not None and coarse is not None:
        targets = _target_positions(rows.target, logits.col_order, v)
    live = backward_tiles(coarse, factors, n_rb, n_ct, bm, bn, rows.n_valid, targets)
    if _TILE_RECORDS:
        _record_tiles(live, rows.n_valid, bm)

    slab = _scratch_tiles(n_rb, n_ct, bm * bn * a.element_size(), scratch_bytes)
    n_slabs = triton_cdiv(n_ct, slab)
    # What the host must read back (below) for the sparse path: the valid rows and each slab's
    # live count. The dense path reads nothing: it runs every row block, and the recompute
    # writes zeros past the valid rows.
    host_needs = None
    if sparse and not _capturing(dev):
        by_slab = _pad(live, n_slabs * slab).view(n_rb, n_slabs, slab)
        host_needs = torch.cat([rows.n_valid.view(1), by_slab.sum(dim=(0, 2))])
    sparse = host_needs is not None

    # Rank-1 terms: the uniform term −u_i·w_j without softcap never needs a tile.
    rank1 = coef.uniform is not None and not uniform_in_tiles
    w = col_weight if col_weight is not None or not rank1 else torch.ones(v, **f32)
    s = logits.scale  # None means 1
    # The recompute writes s·dX to the scratch (one rounding either way), so that the matmuls
    # give dA and dB directly. With a bias, whose gradient needs dX itself, the matmuls' results
    # are scaled instead (whichever gradients are asked for, so that each is the same).
    scale_dx = s is not None and logits.bias is None
    post_scale = s if s is not None and not scale_dx else None
    if rank1:
        rank1_b = _weighted_row_sum(a, _scatter_rows(coef.uniform, rows, a.shape[0]))
        if s is not None:
            rank1_b *= s
        rank1_bias = coef.uniform.sum()

    a_dtype, b_dtype = (dt or t.dtype for dt, t in zip(dtypes, (a, b), strict=True))
    accumulate = into is not None
    if accumulate:
        grad_b, grad_bias = into.b, into.bias
    else:
        grad_b = None
        if need_b:
            grad_b = out_b if out_b is not None else torch.empty_like(b, dtype=b_dtype)
        grad_bias = torch.empty(v, **f32) if need_bias else None
    dscale = torch.zeros(n_rb, n_ct, **f32) if need_scale else None
    # dA's accumulator: fp32, or the split bf16 pair (hi is the returned gradient itself).
    split = (split_accumulator and need_a and a.dtype == torch.bfloat16 == a_dtype and not sparse
             and rows.all_valid and rows.identity and post_scale is None and not rank1)
    # The caller's fp32 dA accumulator takes the products directly where nothing follows
    # them: every row valid and in order, dense slabs, no post-scale nor rank-1 term.
    in_place = (caller_acc is not None and need_a and not split and not sparse and not accumulate
                and rows.identity and rows.all_valid and n == a.shape[0]
                and post_scale is None and not rank1)
    # Otherwise the first slab writes it (below; no fill first), unless there is none.
    acc_a = None
    if in_place:
        acc_a = caller_acc
    elif need_a and not split:
        acc_a = (torch.empty if n_slabs else torch.zeros)(n_rb * bm, d, **f32)
    split_hi = torch.empty_like(a) if split else None
    split_lo = torch.empty_like(a) if split else None
    a_compact = None  # A in compact row order, for the dense path

    dot_fp32, precision = dot_flags(a)
    dummy = stats.lse
    # The dense path multiplies by A in compact row order too: one copy serves both.
    a_desc, b_desc, a_rows = tile_descriptors(a, b, logits, rows, bm, bn, cfg.block_k)
    # The slab's dX as a row-major (rows, slab columns) matrix; a narrower last slab keeps the
    # same row stride (its view is the left part), so every launch sees the same scratch.
    scratch_width = min(slab, n_ct) * bn
    scratch = torch.empty(n_rb * bm, scratch_width, dtype=a.dtype, device=dev)
    common = dict(
        HAS_ORDER=logits.col_order is not None, DOT_FP32=dot_fp32, PRECISION=precision,
        PRECISE=config.precise_math(a.dtype),
    )
    order = logits.col_order if logits.col_order is not None else rows.index
    # One launch per slab, the same arguments but for the slab's tiles and the dense flag:
    # bound once (core/launch.py).
    recompute = RepeatedLaunch(
        _grad_logits_kernel, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        a_ptr=a, b_ptr=b, a_desc=a_desc, b_desc=b_desc,
        bias_ptr=logits.bias if logits.bias is not None else dummy,
        scale_ptr=s if s is not None else dummy,
        row_index_ptr=rows.index, n_valid_ptr=rows.n_valid, col_order_ptr=order,
        target_ptr=rows.target if rows.target is not None else rows.index,
        col_weight_ptr=w if w is not None else dummy, row_max_ptr=stats.max,
        coef_lse_ptr=coef.lse,
        coef_target_ptr=coef.target if coef.target is not None else dummy,
        coef_uniform_ptr=coef.uniform if uniform_in_tiles else dummy,
        coef_logit_ptr=coef.logit if coef.logit is not None else dummy,
        col_max_ptr=stats.col_max if coef.col is not None else dummy,
        coef_col_ptr=coef.col if coef.col is not None else dummy,
        live_ptr=live.view(torch.uint8), scratch_ptr=scratch,
        dscale_ptr=dscale if need_scale else dummy,
        V=v, D=d, stride_a=a.stride(0), stride_b=b.stride(0), slab_tile_start=0,
        slab_tiles=0, group_rows=max(1, RECOMPUTE_GROUP_BYTES // (bm * d * a.element_size())),
        scratch_width=scratch_width, n_col_tiles=n_ct,
        HAS_BIAS=logits.bias is not None, HAS_SCALE=s is not None, SCALE_DX=scale_dx,
        SOFTCAP=float(logits.softcap or 0.0),
        HAS_TARGET=rows.target is not None and coef.target is not None,
        HAS_UNIFORM=uniform_in_tiles, HAS_COL_WEIGHT=col_weight is not None,
        HAS_LOGIT_TERM=coef.logit is not None, GRAD_SCALE=need_scale, ZERO_DEAD=None,
        COL_LSE=coef.col is not None, DIAG_MASK=logits.diag_mask, SIGMOID=sigmoid,
        FACTOR_COLUMNS=a.dtype != torch.float32,
        ROUND=not config.interpreting(), USE_TMA=a_desc is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg.block_k, **common,
    )

    # Every slab dense: the Hopper recompute where it applies.
    sm90 = None if sparse else _sm90_recompute(problem, a_rows, cfg, live, (scratch, dscale))

    def recompute_slab(k: int, row_blocks: int, dense: bool) -> None:
        """Launches slab k's recompute into the scratch."""
        nt = min(slab, n_ct - k * slab)
        if sm90 is not None:
            sm90(k * slab, nt, row_blocks)
        else:
            recompute((row_blocks * nt,), slab_tile_start=k * slab, slab_tiles=nt,
                      ZERO_DEAD=dense)

    # At most one host sync, after everything above is queued: the number of valid rows and
    # each slab's live count pick the grid and the dense or sparse path. The first slab's
    # recompute goes in before the wait, over every row block and dense (right for either
    # path), so that the GPU has work while the host resumes. (No torch.tensor(…, device=…)
    # anywhere on this path: a copy from pageable host memory would be a sync of its own.)
    if host_needs is not None:
        host = _read_back(host_needs, before_waiting=lambda: recompute_slab(0, n_rb, True))
    else:
        host = [n]
    n_valid = host[0]
    slab_live = host[1:] if sparse else None
    n_valid_blocks = triton_cdiv(n_valid, bm)

    dense_fraction = _dense_slab_fraction()
    first_a = not in_place  # the next slab's dA part starts the accumulator
    # Views that every slab uses, formed once (each view costs the host a few µs, and a step at
    # b = 16384 has up to ~20 slabs): the slab's rows of B and of dB, the valid rows of dA.
    slab_cols = slab * bn
    b_slabs = b.split(slab_cols) if logits.col_order is None else None
    grad_b_slabs = grad_b.split(slab_cols) if need_b and logits.col_order is None else None
    acc_valid = acc_a[:n_valid] if acc_a is not None else None
    dx_views = {}  # the scratch's valid rows and the slab's columns, by width
    if split:
        from triton.tools.tensor_descriptor import TensorDescriptor

        sc = config.split_accumulate_config(dev, d)
        use_tma = a_desc is not None and _tma_ready(scratch)
        split_grid = (triton_cdiv(n, sc.block_m), triton_cdiv(d, sc.block_d))
        split_launch = RepeatedLaunch(
            _accumulate_split_kernel, dict(num_warps=sc.num_warps, num_stages=sc.num_stages),
            dx_ptr=scratch, b_ptr=b,
            dx_desc=TensorDescriptor.from_tensor(scratch, [sc.block_m, sc.block_k])
            if use_tma else None,
            b_desc=TensorDescriptor.from_tensor(b, [sc.block_k, sc.block_d]) if use_tma else None,
            hi_ptr=split_hi, lo_ptr=split_lo, n_rows=n, D=d, K=0, c0=0, V=v,
            stride_dx=scratch_width, stride_b=b.stride(0), stride_acc=d, first=1,
            BLOCK_M=sc.block_m, BLOCK_D=sc.block_d, BLOCK_K=sc.block_k,
            DOT_FP32=dot_fp32, PRECISION=precision, USE_TMA=use_tma)
    for k in range(n_slabs):
        t0, t1 = k * slab, min((k + 1) * slab, n_ct)
        nt = t1 - t0
        c0, c1 = t0 * bn, min(t1 * bn, v)
        dense = slab_live is None or slab_live[k] >= dense_fraction * max(1, n_valid_blocks * nt)
        if k > 0 or host_needs is None:  # else queued before the read-back
            recompute_slab(k, n_valid_blocks, dense)
        if c1 - c0 not in dx_views:
            dx_views[c1 - c0] = scratch[:n_valid, : c1 - c0]
        dx = dx_views[c1 - c0]
        cols = logits.col_order[c0:c1] if logits.col_order is not None else None
        if dense:
            if a_compact is None and (need_b or need_a):
                if a_rows is None:
                    a_rows = compact_operand(a, rows)
                a_compact = a_rows[:n_valid]
            if need_b:
                plain = cols is None and post_scale is None and not rank1
                if plain and accumulate:
                    addmm_f32_(grad_b_slabs[k], dx.T, a_compact)  # this block's rows' part
                elif plain and b_dtype == b.dtype:
                    # Plain slab: cuBLAS accumulates in fp32 and rounds once into dB.
                    torch.mm(dx.T, a_compact, out=grad_b_slabs[k])
                elif plain and b_dtype == torch.float32:  # fp32 dB (the ring's): no copy
                    mm_f32(dx.T, a_compact, out=grad_b_slabs[k])
                else:
                    part = mm_f32(dx.T, a_compact)  # (slab columns, D)
                    _finish_grad_b(part, grad_b, cols, c0, c1, post_scale, w,
                                   rank1_b if rank1 else None, accumulate)
            if need_bias:
                bias_part = dx.sum(dim=0, dtype=torch.float32)
                if rank1:
                    bias_part -= _slice_cols(w, cols, c0, c1) * rank1_bias
                _write_cols(grad_bias, bias_part, cols, c0, c1, accumulate)
            if split:
                # hi + lo += dX · B rows c0…c1 (the straddled K step reads this slab's zeros)
                split_launch(split_grid, K=c1 - c0, c0=c0, first=int(first_a))
                first_a = False
            elif need_a:
                b_slab = b.index_select(0, cols) if cols is not None else b_slabs[k]
                if first_a:
                    mm_f32(dx, b_slab, out=acc_valid)
                else:
                    addmm_f32_(acc_valid, dx, b_slab)
                first_a = False
        else:
            if need_b or need_bias:
                col_list, col_count = _live_lists(live[:, t0:t1].T)
                _grad_b_kernel[(nt, triton_cdiv(d, bd) if need_b else 1)](
                    a, scratch, post_scale if post_scale is not None else dummy,
                    rows.index, rows.n_valid, order, col_list, col_count,
                    grad_b if need_b else dummy,
                    grad_bias if need_bias else dummy,
                    w if w is not None else dummy,
                    rank1_b if rank1 else dummy, rank1_bias if rank1 else dummy,
                    v, d, a.stride(0), grad_b.stride(0) if need_b else 0, n_rb, scratch_width,
                    t0,
                    HAS_SCALE=post_scale is not None,
                    GRAD_B=need_b, GRAD_BIAS=need_bias, HAS_RANK1=rank1, ACCUMULATE=accumulate,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                    num_warps=cfg.num_warps, num_stages=cfg.matmul_stages, **common,
                )
            if need_a:
                row_list, row_count = _live_lists(live[:, t0:t1])
                _grad_a_kernel[(n_valid_blocks, triton_cdiv(d, bd))](
                    b, scratch, rows.n_valid, order, row_list, row_count, acc_a,
                    v, d, b.stride(0), nt, scratch_width, t0, FIRST=first_a,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
                    num_warps=cfg.num_warps, num_stages=cfg.matmul_stages, **common,
                )
                first_a = False

    grad_a = None
    if split:
        grad_a = split_hi
    elif need_a:
        # dA_i = s · Σ_j dX_ij B_j  − s · u_i · Σ_j w_j B_j   (the rank-1 term needs no tile)
        acc = acc_a[:n_valid]
        if post_scale is not None:
            acc *= post_scale
        if rank1:
            row_term = _weighted_row_sum(b, w)
            acc -= coef.uniform[:n_valid, None] * (row_term if s is None else s * row_term)
        if in_place:
            grad_a = caller_acc
        elif accumulate:
            grad_a = into.a
            grad_a.index_copy_(0, rows.index[:n_valid], acc.to(a_dtype))
        elif rows.identity and n_valid == a.shape[0]:  # every row, in order
            grad_a = acc.to(a_dtype)
        else:
            grad_a = torch.zeros_like(a, dtype=a_dtype)
            grad_a.index_copy_(0, rows.index[:n_valid], acc.to(a_dtype))
        if caller_acc is not None and not in_place:
            grad_a = caller_acc.add_(grad_a)
    return Grads(
        a=grad_a,
        b=grad_b,
        bias=grad_bias,
        scale=dscale.sum() if need_scale else None,
    )


def _sm90_recompute(problem: _Problem, a_rows: torch.Tensor | None, cfg: config.TileConfig,
                    live: torch.Tensor, out: tuple):
    """The Hopper recompute (``lse_backward_sm90.Recompute``) for this backward's dense slabs,
    or None where the Triton kernel runs: softmax losses on bf16/fp16 operands that TMA reads
    (``a_rows``, A in compact row order), D ≤ 1024, scale, bias and a diagonal mask over rows in
    order (no softcap, vocabulary order or entropy term), on the backward's 64 × 128 tiles."""
    a, b, logits, rows, stats, coef, _, sigmoid = problem.unpacked()
    if (a_rows is None or sigmoid or coef.logit is not None or logits.softcap
            or logits.col_order is not None or (logits.diag_mask and rows.identity is not True)
            or not config.gluon_enabled(a.device)):
        return None
    from . import lse_backward_sm90 as sm90
    from .lse_forward_sm90 import supports

    if (live.numel() < config.tuning().gluon_recompute_tiles or not supports(a, b)
            or (cfg.block_m, cfg.block_n) != (sm90.BLOCK_M, sm90.BLOCK_N)):
        return None
    return sm90.Recompute(a_rows, b, logits, rows, stats, coef, live, out)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (nothing may be
    read back then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _read_back(values: torch.Tensor, before_waiting) -> list:
    """``values.tolist()``, with ``before_waiting()`` (launches that need none of the values)
    queued between the copy and the wait: the GPU works on them while the host waits and
    then resumes, instead of idling until the host's next launch."""
    if not values.is_cuda:
        before_waiting()
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    before_waiting()
    ready.synchronize()
    return host.tolist()


def _add_live_columns(live, stats: RowStats, rows: Rows, col_order, v: int, bm: int, eps,
                      col_scale) -> None:
    """Adds to ``live`` the tiles that some column needs (its column-softmax mass is not
    negligible), in row blocks that hold valid rows.

    A tile is skipped only when both its rows and its columns can afford it, so each row and
    each column still loses at most ``eps`` of its mass.
    """
    if stats.col_tile_log_mass is None:
        return
    bn = stats.block_n
    n_ct = live.shape[1]
    col_lse = stats.col_lse if col_order is None else stats.col_lse[col_order]  # by position
    col_lse = _pad(col_lse, n_ct * bn)
    if col_scale is not None and col_order is not None:
        col_scale = col_scale[col_order]
    # The column direction is the row direction of the transposed statistics.
    live_tiles_into(live.T, stats.col_tile_log_mass.T, col_lse, v, bn, eps, col_scale,
                    accumulate=True, tile_rows=bm, tile_limit=rows.n_valid)


def _is_identity(index: torch.Tensor) -> bool:
    return bool(torch.equal(index, torch.arange(index.numel(), device=index.device)))


def pad_classes(b: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """B (V, D) and its bias (V,) with zero rows appended up to a multiple of 16 classes, for
    the paths that form each chunk's logits with cuBLAS: the padded classes' logits are exactly
    0 and their G too (the row kernels compute over the first V columns and write 0 beyond),
    so dA is unchanged and dB's first V rows are the gradient. With an odd V (GPT-2's 50257)
    every product through unpadded logits falls to cuBLAS's align-1 kernels, 4–5× slower on
    Hopper (inductor pads its matmuls the same way), and a row width that is a multiple of 16
    lets the Triton row kernels load whole vectors. Costs one copy of B where V is not a
    multiple of 16."""
    pad = -b.shape[0] % 16
    if not pad:
        return b, bias
    b = torch.cat((b, b.new_zeros((pad, b.shape[1]))))
    return b, None if bias is None else torch.cat((bias, bias.new_zeros(pad)))


def cut_classes(grad: torch.Tensor | None, v: int) -> torch.Tensor | None:
    """A gradient over ``pad_classes``' padded classes (dB or dbias), cut to the first V (a
    view); None stays None."""
    return None if grad is None else grad[:v]


def mm_f32(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ y with fp32 accumulation and fp32 output (cuBLAS), whatever the input dtype, into
    ``out`` when given (float64 operands: in float64). A CUDA build without fp32 output rounds
    to the input dtype first; the CPU computes in fp32."""
    if x.dtype in (torch.float32, torch.float64):
        return torch.mm(x, y, out=out)
    if x.is_cuda:
        try:
            return torch.mm(x, y, out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError, NotImplementedError):
            product = x @ y
    else:
        product = x.float() @ y.float()
    return product.float() if out is None else out.copy_(product)


def addmm_f32_(acc: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """acc += x @ y, acc fp32 (float64 for float64 operands), in place, accumulated in its
    dtype."""
    if x.dtype == torch.float64:
        acc.addmm_(x, y)
        return
    if x.is_cuda and x.dtype != torch.float32:
        try:
            torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):
            pass
    acc += mm_f32(x, y)


def _slice_cols(values: torch.Tensor, cols: torch.Tensor | None, c0: int, c1: int):
    return values[cols] if cols is not None else values[c0:c1]


def _write_cols(out: torch.Tensor, values: torch.Tensor, cols, c0: int, c1: int,
                accumulate: bool = False) -> None:
    if cols is not None:
        if accumulate:
            out.index_add_(0, cols, values.to(out.dtype))
        else:
            out.index_copy_(0, cols, values.to(out.dtype))
    elif accumulate:
        out[c0:c1] += values
    else:
        out[c0:c1] = values


def _finish_grad_b(part, grad_b, cols, c0, c1, s, w, rank1_b, accumulate=False) -> None:
    """dB_j = s · Σ_i dX_ij A_i − w_j · v for one slab's columns, rounded once (s None: 1);
    ``accumulate``: added to ``grad_b`` (fp32) instead."""
    if rank1_b is None and cols is None and s is not None and not accumulate:
        torch.mul(part, s, out=grad_b[c0:c1])  # scaled and rounded in one pass
        return
    if s is not None:
        part *= s
    if rank1_b is not None:
        part -= _slice_cols(w, cols, c0, c1)[:, None] * rank1_b
    _write_cols(grad_b, part, cols, c0, c1, accumulate)


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """x zero-padded along its last dimension to length n."""
    return x if x.shape[-1] == n else torch.nn.functional.pad(x, (0, n - x.shape[-1]))


def _target_positions(target: torch.Tensor, col_order: torch.Tensor | None, v: int):
    """Position of each target in the column order (−1 stays −1)."""
    if col_order is None:
        return target
    inverse = torch.empty_like(col_order)
    inverse[col_order] = torch.arange(v, device=col_order.device)
    return torch.where(target >= 0, inverse[target.clamp(min=0)], -1)


def _live_lists(live: torch.Tensor):
    """Per row of ``live`` (bool): the indices of its True entries first, and their count."""
    order = torch.argsort((~live).to(torch.uint8), dim=1, stable=True).to(torch.int32)
    return order.contiguous(), live.sum(dim=1, dtype=torch.int32)


def _weighted_row_sum(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_r weights_r · x_r in fp32, in chunks (no fp32 copy of x)."""
    out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    chunk = max(1, (1 << 24) // max(1, x.shape[1]))
    for start in range(0, x.shape[0], chunk):
        out += weights[start : start + chunk].float() @ x[start : start + chunk].float()
    return out


def _scatter_rows(values: torch.Tensor, rows: Rows, n_rows: int) -> torch.Tensor:
    """Compact-order (N,) values → original row order (n_rows,), zero elsewhere."""
    valid = torch.arange(values.numel(), device=values.device) < rows.n_valid
    out = torch.zeros(n_rows, dtype=values.dtype, device=values.device)
    return out.index_put_((rows.index,), torch.where(valid, values, 0), accumulate=True)


def _grads_torch(problem: _Problem, needs: Needs, plan: BackwardPlan) -> Grads:
    a, b, logits, rows, stats, coef, col_weight, sigmoid = problem.unpacked()
    need_a, need_b, need_bias, need_scale = needs.a, needs.b, needs.bias, needs.scale
    dtypes = (plan.grad_a_dtype, plan.grad_dtype)
    n, v = rows.index.numel(), b.shape[0]
    n_valid = n if rows.all_valid else int(rows.n_valid)  # a read-back only when unknown
    acc = accumulation_dtype(a.dtype)
    b32 = b.to(acc)
    grad_a = torch.zeros_like(a, dtype=dtypes[0]) if need_a else None
    grad_b32 = torch.zeros_like(b32) if need_b else None
    grad_bias = torch.zeros(v, dtype=acc, device=a.device) if need_bias else None
    dscale = torch.zeros((), dtype=acc, device=a.device)
    s = logits.scale.to(acc) if logits.scale is not None else 1.0
    chunk = _torch_chunk_rows(v)
    for start in range(0, n_valid, chunk):
        pos = slice(start, min(start + chunk, n_valid))
        idx = rows.index[pos]
        a_rows = a[idx]
        raw, x = _torch_logits(a_rows, b32, logits, idx)
        if sigmoid:
            hit = torch.arange(v, device=x.device)[None, :] == rows.target[pos, None]
            z = torch.where(hit, 1.0, -1.0)
            dx = -coef.lse[pos, None] * z * torch.sigmoid(-z * x)
        elif coef.logit is None:
            dx = coef.lse[pos, None] * torch.exp(x - stats.max[pos, None])
        else:  # the entropy's term, e·P·(X − max): one more chunk-sized array alive
            shifted = x - stats.max[pos, None]
            p = torch.exp(shifted)
            dx = coef.lse[pos, None] * p + coef.logit[pos, None] * torch.where(
                p > 0, p * shifted, 0.0)
            del shifted, p
        if coef.col is not None:
            dx += coef.col[None, :] * torch.exp(x - stats.col_max[None, :])
        if not sigmoid and rows.target is not None and coef.target is not None:
            tgt = rows.target[pos]
            hit = torch.zeros_like(dx).scatter_(1, tgt.clamp(min=0)[:, None], 1.0)
            dx -= hit * (coef.target[pos] * (tgt >= 0))[:, None]
        if coef.uniform is not None:
            w = col_weight.to(acc) if col_weight is not None else 1.0
            dx -= coef.uniform[pos, None] * w
        if logits.softcap:
            dx = dx * (1 - (x / logits.softcap) ** 2)
        if need_scale:
            dscale += (dx * raw).sum()
        if need_bias:
            grad_bias += dx.sum(dim=0)
        dx = dx * s
        if need_a:
            grad_a[idx] = (dx @ b32).to(grad_a.dtype)
        if need_b:
            grad_b32 += dx.T @ a_rows.to(acc)
    return Grads(
        a=grad_a,
        b=grad_b32.to(dtypes[1]) if need_b else None,
        bias=grad_bias,
        scale=dscale if need_scale else None,
    )
