"""The one tuning place: block sizes, launch parameters and path selection of the kernels.

Configs are frozen per (device architecture, dtype, width D). Every knob beyond them is a field
of :class:`Tuning`, read once from the ``FUSEDLOSS_*`` environment variables at import (the
only place the library reads its environment, besides Triton's ``TRITON_INTERPRET``) and
overridden in a block with :func:`tuned`. Under Triton's CPU interpreter, small blocks keep the
tests fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """One kernel's tile shape.

    block_m: rows of A per tile; block_n: rows of B (columns of the logits) per tile;
    block_k: reduction step over D; block_d: output chunk of D in the gradient matmuls;
    gemm_stages: pipeline depth of the block-sparse gradient matmuls (their operand tiles are
    larger than the recompute's, so fewer stages fit in shared memory); 0 = num_stages.
    """

    block_m: int
    block_n: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    gemm_stages: int = 0

    @property
    def matmul_stages(self) -> int:
        return self.gemm_stages or self.num_stages


@dataclass(frozen=True)
class Tuning:
    """Every knob of the kernels that is not an argument: for measurements, fallbacks and tests.

    The defaults are the measured choices; :meth:`from_environment` reads the
    ``FUSEDLOSS_<FIELD>`` variables (once, at import), :func:`tuned` overrides fields in a block.
    """

    # Operand tiles through TMA descriptors (off: pointer loads, for comparison or a fallback).
    tma: bool = True
    # The Hopper Gluon kernels where they apply (off: the Triton kernels).
    gluon: bool = True
    # The Gluon recompute serves a backward's dense slabs from this many 64 × 128 tiles (b ≥
    # 16384 for a square CLIP batch), the Triton kernel below: there its host setup (the range
    # check's extremes, descriptors) outweighs its faster tiles (docs/design.md, "The Hopper
    # backward").
    gluon_recompute_tiles: int = 1 << 15
    # Tiles of the forward, backward and split-accumulator kernels, replacing the frozen ones.
    forward_tile: TileConfig | None = None
    backward_tile: TileConfig | None = None
    split_tile: TileConfig | None = None
    # The backward's dX scratch per slab in MiB (None: ``ops._common.scratch_bytes``' rule).
    scratch_mb: float | None = None
    # A slab whose live fraction reaches this goes through cuBLAS as a dense matrix.
    dense_slab_fraction: float = 0.25
    # The contrastive backward may send a slab with few live tiles through the sparse kernels
    # (one read of the live counts per call; the LM head's does when it filters).
    sparse_slabs: bool = False
    # The contrastive dA as a bf16 pair over the slabs (None: ``ops.contrastive``'s rule).
    split_accumulator: bool | None = None
    # The contrastive losses' backend="auto" materializes the N × M similarity matrix while it
    # takes at most this many bytes in the features' dtype (``losses.contrastive.resolve_backend``):
    # b = 8192 in bf16, where it still took a third of the tiled kernels' time; at 16384 they
    # were as fast in an eighth of the memory (docs/results.md, "Where the materialized path
    # hands over").
    materialized_bytes: int = 128 * 2**20
    # Elements of logits per chunk of the torch backend.
    torch_chunk_elements: int = 1 << 24
    # The LM head's training path (``core.chunked_logits``) holds one chunk of logits, rows × V
    # in the input dtype, of at most this many bytes: 4096 rows of a 128256-row head in bf16,
    # 2048 of a 256000-row one.
    lm_head_chunk_bytes: int = 2**30
    # Up to this many rows (and in one chunk) the training path forms the gradient in the
    # backward, with the upstream gradient folded in, rather than in the forward: one more
    # product, but no fp32 (V, D) dB to hold and scale (``ops.cross_entropy.forward_chunked``).
    lm_head_deferred_rows: int = 512
    # The engine's calls whose products take at most this many multiply-adds (rows × columns ×
    # D) replay their launches as a CUDA graph from the second call of a signature on
    # (``core/replay.py``): there the host, not the GPU, sets the pace. 2³⁸: b = 16384 at
    # c = 1024. 0: never.
    replay_work: int = 1 << 38
    # Read argument values back to the host so that a bad one raises a named error: a wait for
    # the GPU per call, not under CUDA graphs (a debugging aid). Off, nothing is read back and
    # such values give NaN: a target outside [0, V), an InfoNCE label outside [0, M), a
    # vocab_order that is not a permutation.
    check_values: bool = False
    # StableAdamW's fused step launch, "block,num_warps,lag[,sub_block]" (None: frozen).
    optim_config: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Tuning:
        """The tuning the ``FUSEDLOSS_*`` variables of ``environ`` set (the defaults for the
        rest); ValueError naming the variable for a value it cannot read."""
        fields = {}
        for field in dataclasses.fields(cls):
            name = f"FUSEDLOSS_{field.name.upper()}"
            spec = environ.get(name)
            if spec is None or spec == "":
                continue
            try:
                fields[field.name] = _parse(field.name, spec)
            except ValueError:
                raise ValueError(f"{name}: cannot read {spec!r} as {field.type}") from None
        return cls(**fields)


def _parse(field: str, spec: str):
    if field in ("tma", "gluon", "sparse_slabs", "split_accumulator",
                 "check_values"):
        if spec not in ("0", "1"):
            raise ValueError(spec)
        return spec == "1"
    if field.endswith("_tile"):
        return TileConfig(*(int(x) for x in spec.split(",")))
    if field in ("scratch_mb", "dense_slab_fraction"):
        return float(spec)
    if field in ("torch_chunk_elements", "lm_head_chunk_bytes", "materialized_bytes",
                 "lm_head_deferred_rows", "gluon_recompute_tiles", "replay_work"):
        return int(spec)
    return spec  # optim_config: checked where it is read


_TUNING = Tuning.from_environment(os.environ)


def tuning() -> Tuning:
    """The tuning in effect."""
    return _TUNING


@contextlib.contextmanager
def tuned(**changes) -> Iterator[Tuning]:
    """The tuning with ``changes`` (fields of :class:`Tuning`) within the block."""
    global _TUNING
    saved = _TUNING
    _TUNING = dataclasses.replace(saved, **changes)
    try:
        yield _TUNING
    finally:
        _TUNING = saved


def lm_head_chunk_rows(n: int, v: int, element_size: int, budget: int | None = None) -> int:
    """Rows per chunk of the LM head's training path for N rows of a V-row head: all N when
    they fit in ``budget`` bytes (default ``Tuning.lm_head_chunk_bytes``), else the most that
    do, rounded down to a multiple of 128 (at least 1)."""
    rows = (budget or tuning().lm_head_chunk_bytes) // (element_size * v)
    if rows >= n:
        return n
    return max(1, rows // 128 * 128 if rows >= 128 else rows)


def lm_head_deferred(n: int, v: int, element_size: int) -> bool:
    """Whether the training path forms the gradient of N rows of a V-row head in the backward
    (``Tuning.lm_head_deferred_rows``): few rows, all in one chunk. There the fp32 dB of the
    forward-formed path (4·V·D bytes, written, then read and rounded by the backward's scaling)
    costs more than recomputing the N × V logits in the backward (docs/design.md, "The LM
    head's training path")."""
    return n <= tuning().lm_head_deferred_rows and lm_head_chunk_rows(n, v, element_size) >= n


@functools.cache
def interpreting() -> bool:
    """True when Triton kernels run through Triton's CPU interpreter. Read once: Triton itself
    decides when a kernel is defined (``TRITON_INTERPRET`` is set before Triton is imported),
    and the engine asks on every launch."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def precise_math(dtype: torch.dtype) -> bool:
    """Whether kernels use correctly rounded division and libdevice's exp/log1p (≤ 2 ulp) over
    the hardware approximations: for fp32 inputs, whose results must match PyTorch's fp32
    error; bf16/fp16 results round far above either. Never under the interpreter (numpy's
    functions are exact there, and it has no libdevice)."""
    return dtype == torch.float32 and not interpreting()


def tma_enabled() -> bool:
    """Whether kernels may read operand tiles through TMA descriptors (``Tuning.tma``)."""
    return tuning().tma


def gluon_enabled(device: torch.device) -> bool:
    """Whether the Hopper (sm90) Gluon kernels may run on ``device`` (``lse_forward_sm90``):
    a compute capability 9.x GPU, not the interpreter, a Triton with Gluon's Hopper ops, and
    ``Tuning.gluon`` (off keeps the Triton kernels, for comparison or as a fallback)."""
    if (device.type != "cuda" or interpreting() or not tuning().gluon
            or capability(device)[0] != 9):
        return False
    return _gluon_importable()


@functools.cache
def _gluon_importable() -> bool:
    try:
        from . import lse_forward_sm90  # noqa: F401
    except ImportError:
        return False
    return True


_INTERPRETER = TileConfig(block_m=16, block_n=16, block_k=16, block_d=16, num_warps=1, num_stages=1)


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability (cached)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def sm_count(device: torch.device) -> int:
    """The CUDA device's number of streaming multiprocessors (cached)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def forward_config(device: torch.device, dtype: torch.dtype, d: int, *,
                   sigmoid: bool = False, col_stats: bool = True) -> TileConfig:
    """Tile of the forward (row statistics) kernel; ``sigmoid``: the pairwise sigmoid loss;
    ``col_stats``: column statistics from the same pass (CLIP)."""
    if device.type != "cuda":
        return _INTERPRETER
    if (tile := tuning().forward_tile) is not None:
        return tile
    major, _ = capability(device)
    if dtype == torch.float32:
        return TileConfig(128, 64, 32, 0, num_warps=8, num_stages=3)
    if major >= 9 and sigmoid:
        # The softplus epilogue spills on one warpgroup: two warpgroups per 128 × 128 tile
        # (docs/design.md, "Tile configurations and why").
        return TileConfig(128, 128, 64, 0, num_warps=8, num_stages=3)
    if major >= 9:
        if d <= 1024 and not col_stats:
            # Row statistics only (InfoNCE, NT-Xent): two warpgroups per 128 × 128 tile, half
            # the registers per thread; with column statistics (below) they are slower
            # (docs/design.md, "Tile configurations and why").
            return TileConfig(128, 128, 64, 0, num_warps=8, num_stages=3)
        if d <= 1024 and d % 64 == 0 and gluon_enabled(device):
            # The Gluon kernel (lse_forward_sm90): 64 × 128 tiles, two consumer warpgroups.
            return TileConfig(64, 128, 64, 0, num_warps=4, num_stages=3)
        if d <= 1024:
            # Contrastive widths: one warpgroup on 128×128 tiles, faster than 128×256 on 8 warps,
            # two warpgroups, four stages or 128-wide K steps (docs/design.md, "Tile
            # configurations and why").
            return TileConfig(128, 128, 64, 0, num_warps=4, num_stages=3)
        return TileConfig(128, 256, 64, 0, num_warps=8, num_stages=3)
    return TileConfig(128, 128, 32, 0, num_warps=8, num_stages=3)


def backward_config(device: torch.device, dtype: torch.dtype, d: int) -> TileConfig:
    """Tile of the backward kernels.

    The gradient recompute kernel uses (block_m, block_n, block_k); the two gradient matmul
    kernels reduce over block_m (dB) or block_n (dA) and write block_d-wide chunks of D.
    The forward's column tile must equal block_n so the forward's per-tile statistics
    address the backward's tiles; see :func:`lse_tile_n`.
    """
    if device.type != "cuda":
        return _INTERPRETER
    if (tile := tuning().backward_tile) is not None:
        return tile
    major, _ = capability(device)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, 64, num_warps=4, num_stages=3)
    if major >= 9:
        if d <= 1024:
            # Contrastive widths: narrow recompute tiles (64×256 beat 128×256, and 64×128 on 4
            # warps beat 64×256 on 8; docs/design.md, "Tile configurations and why").
            return TileConfig(64, 128, 64, 64, num_warps=4, num_stages=3, gemm_stages=2)
        # LM widths: 128×256 recompute tiles, faster than 128×128 (docs/design.md, "Tile
        # configurations and why"); the sparse matmuls then need 2 stages and 64-wide D chunks
        # to fit.
        return TileConfig(128, 256, 64, 64, num_warps=8, num_stages=3, gemm_stages=2)
    return TileConfig(128, 128, 32, 128, num_warps=8, num_stages=3)


def split_accumulate_config(device: torch.device, d: int) -> TileConfig:
    """Tile of the split-bf16 dA accumulation (``lse_backward._accumulate_split_kernel``):
    (block_m rows × block_d columns of dA) per program, block_k of the slab per step.

    From D = 256 on, 128 × 256 on 8 warps with 4 stages, the fastest of the tiles tried (still
    slower than cuBLAS's addmm into fp32; docs/design.md, "Tile configurations and why").
    """
    if device.type != "cuda":
        return _INTERPRETER
    if (tile := tuning().split_tile) is not None:
        return tile
    if d >= 256:
        return TileConfig(128, 0, 64, 256, num_warps=8, num_stages=4)
    return TileConfig(128, 0, 64, 128 if d > 64 else 64, num_warps=4, num_stages=3)
