"""The contrastive losses as two custom ops over the engine: CLIP, InfoNCE, NT-Xent, SigLIP.

Every loss here is a cheap function of row statistics (and for CLIP column statistics) of
X = s · A Bᵀ (+ bias), which the core computes tile by tile: no N×M similarity matrix exists
in the forward or the backward. The losses' table (per-row loss, gradient coefficients, the
logits) is ``fusedloss/families/contrastive.py``'s, which the ring calls too. Both CLIP
directions come from one pass: each tile feeds the row and the column statistics.
"""

import torch
from torch import Tensor

from ..core import chunked_contrastive, config, engine, materialized, replay
from ..core.engine import Rows, RowStats
from ..families import contrastive as family
from ._common import (
    eager_function,
    grad_or_none,
    nothing,
    op_body,
    replays,
    row_major,
    run_op,
    scratch_bytes,
)

KINDS = family.KINDS


def contrastive(*args) -> tuple[Tensor, ...]:
    """The forward op (``fusedloss::contrastive``, arguments of ``forward``) with its autograd:
    through the dispatcher while ``torch.compile`` traces, straight to the host functions in
    eager mode, where the dispatcher's Python layers cost ~0.3 ms per call."""
    return run_op(forward_op, _EagerFunction, *args)


@op_body
def forward(
    a: Tensor,  # (N, D)
    b: Tensor,  # (M, D); for "nt_xent" the same tensor as a
    scale: Tensor,  # () fp32
    bias: Tensor | None,  # () fp32
    target: Tensor,  # (N,) int64: each row's positive column
    kind: str,  # one of KINDS
    filter_eps: float | None,
    backend: str,  # "triton" or "torch"
    record_tiles: bool,  # keep the per-tile masses that filtering reads in the backward
    user_target: bool,  # the caller's labels: one outside [0, M) gives a NaN row (see below)
) -> tuple[(Tensor,) * 7]:  # type: ignore[misc]  # (a schema needs the count)
    """Per-row losses (N,) fp32 (the table above), then for the backward: the row LSE parts
    (4, N) fp32 (``RowStats.packed``; zeros for "siglip"), the column LSE parts (4, M) for
    "clip" ((0,) otherwise); when the backward will filter, the gradient mass of each row
    (N,) and for "clip" of each column (M,) fp32 (``filtering.gradient_mass``; (0,) otherwise)
    and the per-tile masses by rows and by columns ((0, 0) otherwise).

    ``scale`` is used as it comes: the functional layer has made an invalid tensor scale NaN
    (``losses/contrastive.py``), which every output then carries, without a read-back. So does
    a ``user_target`` outside [0, M): its row's loss is NaN, and the backward makes every
    gradient NaN (``Tuning.check_values`` raises ValueError instead, one wait for the GPU).

    Small calls replay their launches as a CUDA graph (``core/replay.py``)."""
    args = (a, b, scale, bias, target, kind, filter_eps, backend, record_tiles, user_target)
    if replays(a, b.shape[0], backend):
        return replay.call(_forward, *args)
    return _forward(*args)


def _forward(a, b, scale, bias, target, kind, filter_eps, backend, record_tiles, user_target):
    """``forward`` (its arguments in order)."""
    n, m = a.shape[0], b.shape[0]
    row_nan = None
    if user_target:
        if config.tuning().check_values:
            check_labels(target, m)
        target, row_nan = _safe_target(target, m)
    a = row_major(a)
    b = a if kind == "nt_xent" else row_major(b)
    filtering = _filtering(kind, filter_eps, record_tiles)
    stats = engine.row_stats(
        a, b, family.logits(kind, b, scale, bias), _rows(target),
        wants=engine.Wants(col_stats=kind == "clip", sigmoid=kind == "siglip",
                           record_tiles=filtering),
        backend=backend,
    )
    row_mass, col_mass = nothing(a, (0,)), nothing(a, (0,))
    if kind == "siglip":
        loss = stats.sigmoid_sum
        packed_rows, packed_cols = torch.zeros((4, n), dtype=torch.float32, device=a.device), None
    else:
        packed_rows, packed_cols = stats.packed()
        # Each direction's own gradient mass bounds its skipped mass.
        row_margin, col_margin, row_m, col_m = engine.margins(
            packed_rows, stats.target_logit, packed_cols, mass=filtering, backend=backend)
        loss = family.row_loss(kind, row_margin, col_margin)
        if filtering:
            row_mass = row_m
            col_mass = col_m if col_m is not None else col_mass
    if row_nan is not None:
        loss = loss + row_nan
    tiles, col_tiles = (t if t is not None else nothing(a, (0, 0))
                        for t in (stats.tile_log_mass, stats.col_tile_log_mass))
    return (loss, packed_rows, packed_cols if packed_cols is not None else nothing(a, (0,)),
            row_mass, col_mass, tiles, col_tiles)


forward_op = torch.library.custom_op("fusedloss::contrastive", forward, mutates_args=())


@forward_op.register_fake
def _(a, b, scale, bias, target, kind, filter_eps, backend, record_tiles, user_target):
    (n, d), m = a.shape, b.shape[0]
    clip, filtering = kind == "clip", _filtering(kind, filter_eps, record_tiles)
    tiles = col_tiles = (0, 0)
    if filtering and backend == "triton":
        tiles, clip_col_tiles = engine.tile_stats_shapes(n, m, a.device, a.dtype, d,
                                                         col_stats=clip)
        col_tiles = clip_col_tiles if clip else col_tiles
    f32 = torch.float32
    return (a.new_empty(n, dtype=f32), a.new_empty((4, n), dtype=f32),
            a.new_empty((4, m) if clip else (0,), dtype=f32),
            a.new_empty(n if filtering else 0, dtype=f32),
            a.new_empty(m if filtering and clip else 0, dtype=f32),
            a.new_empty(tiles, dtype=f32), a.new_empty(col_tiles, dtype=f32))


@op_body
def backward(
    grad_loss: Tensor,  # (N,)
    a: Tensor,
    b: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    target: Tensor,
    row_stats: Tensor,
    col_stats: Tensor,
    row_mass: Tensor,
    col_mass: Tensor,
    tile_log_mass: Tensor,
    col_tile_log_mass: Tensor,
    kind: str,
    filter_eps: float | None,
    backend: str,
    user_target: bool,
    need_a: bool,
    need_b: bool,
    need_scale: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dA, dB, d scale, d bias) from the forward's statistics; each is an empty tensor when
    not asked for. Small calls replay their launches as a CUDA graph (``core/replay.py``)."""
    args = (grad_loss, a, b, scale, bias, target, row_stats, col_stats, row_mass, col_mass,
            tile_log_mass, col_tile_log_mass, kind, filter_eps, backend, user_target, need_a,
            need_b, need_scale, need_bias)
    if replays(a, b.shape[0], backend):
        # the forward's operands, saved by autograd: their buffers may still hold them
        return replay.call(_backward, *args, reuse=(a, b, scale, bias, target), replayed=True)
    return _backward(*args)


def _backward(grad_loss, a, b, scale, bias, target, row_stats, col_stats, row_mass, col_mass,
              tile_log_mass, col_tile_log_mass, kind, filter_eps, backend, user_target, need_a,
              need_b, need_scale, need_bias, replayed=False):
    """``backward`` (its arguments in order); ``replayed``: the call replays as a CUDA graph
    (its every call, the first one, direct, too), which picks the dA accumulator and the
    scratch: a replayed backward, whose graph holds its fp32 dA beside the scratch anyway,
    takes slabs of 4096 columns (128 MiB at b = 16384, 4 slabs where 64 MiB made 8;
    docs/results.md, "Wider slabs for replayed steps"); a direct one keeps ``scratch_bytes``'
    64 MiB bound."""
    a = row_major(a)
    b = a if kind == "nt_xent" else row_major(b)
    d = a.shape[1]
    clip, siglip = kind == "clip", kind == "siglip"
    given = [t if t.numel() else None for t in (tile_log_mass, col_tile_log_mass, row_mass,
                                                 col_mass)]
    stats = RowStats.from_packed(
        row_stats, col_stats if clip else None, None, *given[:2],
        engine.forward_block(a.device, a.dtype, d, col_stats=clip, sigmoid=siglip))
    g = grad_loss.float().contiguous()  # a reduction hands us a stride-0 expand
    if user_target:
        target, row_nan = _safe_target(target, b.shape[0])
        g = g + row_nan
    coef = family.grad_coefficients(kind, g, g)
    sparse = _sparse_slabs()
    split = not sparse and bias is None and _split_accumulator(a, replayed)
    grads = engine.grads(
        a, b, family.logits(kind, b, scale, bias), _rows(target), stats, coef, sigmoid=siglip,
        needs=engine.Needs(need_a, need_b, bias is not None and need_bias, need_scale),
        plan=engine.BackwardPlan(
            filter_eps=filter_eps, filter_scale=(given[2], given[3]),
            scratch_bytes=scratch_bytes(a, split, wide=replayed), sparse=sparse,
            split_accumulator=split, backend=backend),
    )
    return (grads.a if need_a else nothing(a, (0,)), grads.b if need_b else nothing(a, (0,)),
            grads.scale if need_scale else nothing(a, (0,)),
            grads.bias.sum() if grads.bias is not None else nothing(a, (0,)))


backward_op = torch.library.custom_op("fusedloss::contrastive_backward", backward,
                                      mutates_args=())


@backward_op.register_fake
def _(grad_loss, a, b, scale, bias, target, row_stats, col_stats, row_mass, col_mass,
      tile_log_mass, col_tile_log_mass, kind, filter_eps, backend, user_target, need_a, need_b,
      need_scale, need_bias):
    return (torch.empty_like(a) if need_a else nothing(a, (0,)),
            torch.empty_like(b) if need_b else nothing(a, (0,)),
            torch.empty_like(scale) if need_scale else nothing(a, (0,)),
            torch.empty_like(bias) if bias is not None and need_bias else nothing(a, (0,)))


def _setup_context(ctx, inputs, output):
    a, b, scale, bias, target, kind, filter_eps, backend, _, user_target = inputs
    _, *statistics = output
    ctx.mark_non_differentiable(*statistics)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the statistics
    ctx.save_for_backward(a, b, scale, bias, target, *statistics)
    ctx.options = (kind, filter_eps, backend, user_target)


def _autograd_backward(ctx, grad_loss, *_, backward_fn=backward_op):
    needs = ctx.needs_input_grad[:4]  # a, b, scale, bias
    grads = backward_fn(grad_loss, *ctx.saved_tensors, *ctx.options, *needs)
    return (*(grad_or_none(g, need) for g, need in zip(grads, needs, strict=True)),
            *[None] * 6)


forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


_EagerFunction = eager_function("_EagerFunction", forward, _setup_context, _autograd_backward,
                                backward)


def _filtering(kind: str, filter_eps: float | None, record_tiles: bool) -> bool:
    """Whether the backward filters tiles (then the forward records what it reads)."""
    return record_tiles and filter_eps is not None and kind != "siglip"


def _rows(target: Tensor) -> Rows:
    """Every row counts, in order; a fill, not a host value, so nothing waits for the GPU."""
    n = target.shape[0]
    return Rows(index=torch.arange(n, device=target.device),
                n_valid=torch.full((), n, dtype=torch.int64, device=target.device),
                target=target, identity=True, all_valid=True)


def _safe_target(target: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(the targets clamped into [0, M), so that no kernel reads outside B; NaN (N,) fp32 at
    the rows whose target was outside, 0 elsewhere), on the device."""
    bad = (target < 0) | (target >= m)
    return target.clamp(0, m - 1), torch.where(bad, float("nan"), 0.0).to(torch.float32)


def check_labels(target: Tensor, m: int) -> None:
    """Raises if a label is outside [0, M): one read-back, only when asked for
    (``Tuning.check_values``)."""
    out_of_range = (target < 0) | (target >= m)
    if out_of_range.any():
        bad = int(target[out_of_range][0])
        raise ValueError(f"labels holds {bad}, outside [0, M) = [0, {m})")


def _sparse_slabs() -> bool:
    """Whether the backward may send a slab with few live tiles through the sparse matmul
    kernels (``Tuning.sparse_slabs``). That choice needs the live counts on the host, one
    wait for the GPU per call. By default every slab takes the dense path and the backward never
    waits: on the measured inputs the filter keeps every tile (docs/results.md), and at
    b ≤ 16384 the wait, which leaves the GPU idle while the host issues the slabs, costs more
    than the sparse path could save.
    """
    return config.tuning().sparse_slabs


def _split_accumulator(a: Tensor, replayed: bool) -> bool:
    """Whether dA accumulates over the backward's slabs as a bf16 pair (half the bytes of fp32;
    ``engine.grads(split_accumulator=...)``) rather than in fp32 through cuBLAS: for bf16
    features up to 16384 rows whose backward does not replay, where it lets a step fit in
    64 MiB (see ``scratch_bytes``). It is slower than cuBLAS's addmm (H200, 2026-11-29,
    b = 16384, c = 512, replayed steps: CLIP 3.22 against 2.79 ms, InfoNCE 2.77 against 2.39;
    H100, 2026-11-22: 0.59 against 0.42 ms per slab at N = 65536, K = 4096, D = 512), so a
    replayed backward, whose graph holds more than 64 MiB anyway, takes the fp32 accumulator;
    beyond 16384 rows the memory is far below inf-cl's. ``Tuning.split_accumulator``
    overrides.
    """
    if (setting := config.tuning().split_accumulator) is not None:
        return setting
    if replayed:
        return False
    return a.dtype == torch.bfloat16 and a.shape[0] <= 16384




# ---------------------------------------------------------------------------------------------
# the small-size path: the similarity matrix materialized (``core/materialized.py``)


def contrastive_materialized(*args) -> tuple[Tensor, Tensor]:
    """The materialized op (``fusedloss::contrastive_materialized``, arguments of
    ``materialized_forward``) with its autograd, as ``contrastive`` calls its op."""
    return run_op(materialized_forward_op, _MaterializedFunction, *args)


@op_body
def materialized_forward(
    a: Tensor,  # (N, D)
    b: Tensor,  # (M, D); for "nt_xent" the same tensor as a
    scale: Tensor,  # () fp32
    bias: Tensor | None,  # () fp32
    target: Tensor | None,  # (N,) int64, the caller's labels; None: row i's positive is column i
    kind: str,
    reduction: str,  # "none", "sum" or "mean"
) -> tuple[Tensor, Tensor]:
    """The loss (per row (N,) fp32, or their sum or mean ()) and the row statistics the
    backward reads ((2, N); (2, 2N) for "clip": ``core.materialized.forward``), from
    the N × M similarity matrix, which exists only during each pass. A label outside [0, M)
    gives a NaN row and NaN gradients, as in ``forward``."""
    if target is not None and config.tuning().check_values:
        check_labels(target, b.shape[0])
    a = row_major(a)
    return materialized.forward(a, a if kind == "nt_xent" else row_major(b), scale, bias,
                                target, kind, reduction)


materialized_forward_op = torch.library.custom_op("fusedloss::contrastive_materialized",
                                                  materialized_forward, mutates_args=())


@materialized_forward_op.register_fake
def _(a, b, scale, bias, target, kind, reduction):
    n, m = a.shape[0], b.shape[0]
    return (a.new_empty(n if reduction == "none" else (), dtype=torch.float32),
            a.new_empty((2, n + m if kind == "clip" else n), dtype=torch.float32))


@op_body
def _materialized_grads(grad_loss, a, b, scale, bias, target, lse, kind, reduction, need_a,
                        need_b, need_scale, need_bias) -> tuple[Tensor | None, ...]:
    """(dA, dB, d scale, d bias), None where not needed."""
    a = row_major(a)
    b = a if kind == "nt_xent" else row_major(b)
    return materialized.backward(grad_loss, a, b, scale, bias, target, lse, kind, reduction,
                                 (need_a, need_b, need_scale, need_bias and bias is not None))


def materialized_backward(
    grad_loss: Tensor,  # (N,), or () for a reduced loss
    a: Tensor,
    b: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    target: Tensor | None,
    lse: Tensor,
    kind: str,
    reduction: str,
    need_a: bool,
    need_b: bool,
    need_scale: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dA, dB, d scale, d bias); each is an empty tensor when not asked for."""
    grads = _materialized_grads(grad_loss, a, b, scale, bias, target, lse, kind, reduction,
                                need_a, need_b, need_scale, need_bias)
    return tuple(g if g is not None else nothing(a, (0,)) for g in grads)  # type: ignore


materialized_backward_op = torch.library.custom_op(
    "fusedloss::contrastive_materialized_backward", materialized_backward, mutates_args=())


@materialized_backward_op.register_fake
def _(grad_loss, a, b, scale, bias, target, lse, kind, reduction, need_a, need_b, need_scale,
      need_bias):
    return (torch.empty_like(a) if need_a else nothing(a, (0,)),
            torch.empty_like(b) if need_b else nothing(a, (0,)),
            torch.empty_like(scale) if need_scale else nothing(a, (0,)),
            torch.empty_like(bias) if bias is not None and need_bias else nothing(a, (0,)))


def _materialized_setup(ctx, inputs, output):
    a, b, scale, bias, target, kind, reduction = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(a, b, scale, bias, target, output[1])
    ctx.options = (kind, reduction)


def _materialized_autograd_backward(ctx, grad_loss, _, *, backward_fn=materialized_backward_op):
    needs = ctx.needs_input_grad[:4]  # a, b, scale, bias
    grads = backward_fn(grad_loss, *ctx.saved_tensors, *ctx.options, *needs)
    return (*(grad_or_none(g, need) for g, need in zip(grads, needs, strict=True)),
            None, None, None)


materialized_forward_op.register_autograd(_materialized_autograd_backward,
                                          setup_context=_materialized_setup)

_MaterializedFunction = eager_function("_MaterializedFunction", materialized_forward,
                                       _materialized_setup, _materialized_autograd_backward,
                                       _materialized_grads)


# ---------------------------------------------------------------------------------------------
# SigLIP's training path (``core.chunked_contrastive``): the reduced loss with its gradients
# formed in the forward, three products; the backward scales them by the upstream gradient.


def siglip_chunked(*args) -> Tensor:
    """SigLIP's reduced loss (() fp32) of ``siglip_chunked_forward``'s arguments, with its
    autograd."""
    return run_op(siglip_chunked_op, _EagerSiglipChunked, *args)[0]


@op_body
def siglip_chunked_forward(
    a: Tensor,  # (N, D)
    b: Tensor,  # (M, D)
    scale: Tensor,  # () fp32
    bias: Tensor,  # () fp32
    mean: bool,  # reduction "mean" (÷ N), else "sum"
    need_a: bool,
    need_b: bool,
    need_scale: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, dA, dB fp32, d scale, d bias) for an upstream gradient of 1, each gradient an
    empty tensor when not asked for."""
    a = row_major(a)
    loss, *grads = chunked_contrastive.siglip_loss_and_grads(
        a, row_major(b), scale.float(), bias.float(), 1.0 / a.shape[0] if mean else 1.0,
        engine.Needs(need_a, need_b, need_bias, need_scale))
    grad_a, grad_b, grad_bias, grad_scale = grads
    return (loss, *(nothing(a, (0,)) if g is None else g
                    for g in (grad_a, grad_b, grad_scale, grad_bias)))


siglip_chunked_op = torch.library.custom_op("fusedloss::siglip_chunked", siglip_chunked_forward,
                                            mutates_args=())


@siglip_chunked_op.register_fake
def _(a, b, scale, bias, mean, need_a, need_b, need_scale, need_bias):
    f32 = torch.float32
    return (a.new_empty((), dtype=f32),
            torch.empty_like(a) if need_a else nothing(a, (0,)),
            b.new_empty(b.shape, dtype=f32) if need_b else nothing(a, (0,)),
            a.new_empty((), dtype=f32) if need_scale else nothing(a, (0,)),
            a.new_empty((), dtype=f32) if need_bias else nothing(a, (0,)))


def _siglip_chunked_setup(ctx, inputs, output):
    a, b, scale, bias = inputs[:4]
    _, *grads = output
    ctx.mark_non_differentiable(*grads)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*grads)
    ctx.dtypes = (a.dtype, b.dtype, scale.dtype, bias.dtype)


def _siglip_chunked_backward(ctx, grad_loss, *_, backward_fn=None):
    from .cross_entropy import _scaled

    needs = ctx.needs_input_grad[:4]
    grads = [None] * 4
    if grad_loss is not None:
        grads = [_scaled(g, grad_loss, dtype) if need else None
                 for g, need, dtype in zip(ctx.saved_tensors, needs, ctx.dtypes, strict=True)]
    return (*grads, *[None] * 5)


siglip_chunked_op.register_autograd(_siglip_chunked_backward,
                                    setup_context=_siglip_chunked_setup)

_EagerSiglipChunked = eager_function("_EagerSiglipChunked", siglip_chunked_forward,
                                     _siglip_chunked_setup, _siglip_chunked_backward, None)
