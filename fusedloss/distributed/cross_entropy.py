"""The vocabulary-parallel LM head: linear cross-entropy with the classifier's rows sharded.

The Megatron / flash-attention layout: every rank of the group holds the same hidden states E
(N, D) and targets (global class ids), and its shard C_r of the classifier: the rows
[start_r, start_r + V_r) of the (V, D) weight (shards may be uneven; by default they follow each
other in rank order). Each rank computes its shard's row statistics on the engine, and the
ranks combine them:

    M_i = max_r max_r,i                       (all-reduce max)
    S_i = Σ_r sum_r,i · exp(max_r,i − M_i)    lse_i = M_i + log S_i
    X_{i,y_i}, Σ_j w_j X_ij, w_{y_i}, Σ_j w_j (all-reduce sum; the owner of y_i contributes)

so every rank returns the loss of the full head, equal to the single-GPU head on the whole
weight. Backward: each rank forms dX on its shard's columns from the global statistics; dC_r
(and d bias_r) stay local; dE = Σ_r dX_r C_r is all-reduced in fp32 and rounded once, so every
rank's E receives the full ∂L/∂E (what Megatron's copy-to-tensor-parallel region gives its input:
add no all-reduce of your own). Two collectives in the forward (max, then one packed sum), one
in the backward, each O(N); no rank ever holds more than its shard's statistics.

The training path (a reduced loss with gradients on the Triton backend, no ``return_lse``, no
filtering, no ``vocab_order``: ``_loss_and_grads``) is the single-GPU head's
(``core.chunked_logits``) with the same combine between its two row kernels. Per chunk of rows:

    Z_r = A_c C_rᵀ + bias_r          cuBLAS, in the input dtype (R × V_r)
    (max, Σ exp), X_y, Σ_j w_j X_j   one Triton program per row over the shard's columns,
                                     combined over the shards as above (2 all-reduces, O(R))
    G_r = dloss/dZ_r                 from the combined statistics, written over Z_r
    dA_c = Σ_r G_r C_r               fp32, all-reduced (O(R·D)), rounded once
    dC_r += G_rᵀ A_c                 local, fp32

so the forward forms the gradients and the backward multiplies them by the loss's upstream
gradient (which must then be the same on every rank, as it is when each rank backpropagates the
loss it returned).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import chunked_logits, config, engine
from ..core.engine import Logits, Rows, RowStats, mm_f32
from ..core.filtering import resolve_lm_head_filter_eps
from ..families import cross_entropy as family
from ..losses import cross_entropy as single
from ..ops._common import (
    autocast_operands,
    backward_row_chunk,
    scratch_bytes,
    without_autocast,
)
from . import _group
from ._group import device_code, dtype_code, exchange, float_code

_F32 = torch.float32
_REDUCTIONS = ("none", "mean", "sum")
_BACKENDS = ("auto", "triton", "torch")


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def vocab_parallel_cross_entropy(
    input: Tensor,  # (*, D), the same on every rank
    linear_weight: Tensor,  # (V_r, D) this rank's rows of the classifier
    target: Tensor,  # (*) global class ids in [0, V), or ignore_index; the same on every rank
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    linear_bias: Tensor | None = None,  # (V_r,) this rank's part
    weight: Tensor | None = None,  # (V_r,) this rank's part of the class weights
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    shift: bool = False,
    filter_eps: float | str | None = "auto",
    return_lse: bool = False,
    backend: str = "auto",
    vocab_order: Tensor | str | None = None,  # (V_r,) permutation of this shard, or "auto"
):
    """:func:`fusedloss.linear_cross_entropy` with ``linear_weight`` sharded by rows over
    ``group`` (see the module doc); ``fusedloss.linear_cross_entropy(...,
    process_group=group)`` calls this.

    ``vocab_start``: the global id of this shard's first row; default: the shards follow each
    other in rank order (the sum of the lower ranks' V_r). Given explicitly (on every rank), the
    shards must tile [0, V) in some order. Every other option means what it means for the
    single-GPU head, with ``linear_bias``, ``weight`` and ``vocab_order`` this shard's parts.
    Returns on every rank the loss (and LSE) of the whole head. Under ``torch.autocast`` the
    operands are cast as the single-GPU head casts them; float64 input is refused (the
    single-GPU head computes it). A reduced loss with gradients on the Triton backend (without
    ``return_lse``, filtering or ``vocab_order``, on every rank) takes the training path of the
    module doc: its forward forms the gradients, which the backward scales by the loss's
    upstream gradient, to be the same on every rank.
    """
    if isinstance(input, Tensor):
        input, linear_weight, linear_bias = autocast_operands(
            input.device, input, linear_weight, linear_bias)
    linear_bias, weight = single.dense_vectors(linear_bias, weight)
    ignore_index = -100 if ignore_index is None else ignore_index
    error, prepared = None, None
    try:
        if _group.capturing(_device(input)):
            raise RuntimeError("vocab_parallel_cross_entropy reads values on the host, which a "
                               "CUDA graph capture cannot do: call it outside the capture")
        prepared = _prepare(input, linear_weight, target, linear_bias, weight, reduction,
                            ignore_index, label_smoothing, softcap, z_loss, shift, filter_eps,
                            backend, vocab_order)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    a, flat_target, valid, backend, eps, order, facts = prepared or (None,) * 7
    n = a.shape[0] if error is None else 0
    v_r = linear_weight.shape[0] if error is None else 0
    start = -1 if vocab_start is None else int(vocab_start)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
    trains = (error is None and backend == "triton" and wants_grad and reduction != "none"
              and not return_lse and eps is None and order is None and n > 0)
    layout, per_rank = exchange(group, n, v_r, facts or {}, _device(input), error=error,
                                extra=(start, int(trains)))
    starts, v = _shard_starts(layout, [row[0] for row in per_rank])
    if all(row[1] for row in per_rank):  # one path on every rank: their collectives differ
        return _VocabParallelTraining.apply(
            a, linear_weight, flat_target, linear_bias,
            weight.float() if weight is not None else None, layout.group, starts[layout.rank],
            v, _HeadOptions(int(ignore_index), float(label_smoothing),
                            None if softcap is None else float(softcap), float(z_loss)),
            reduction == "mean")
    loss_tok, lse, target_weight = _VocabParallel.apply(
        a, linear_weight, flat_target, linear_bias,
        weight.float() if weight is not None else None, order, layout.group,
        starts[layout.rank], v, int(ignore_index), float(label_smoothing),
        None if softcap is None else float(softcap), float(z_loss), eps, backend, wants_grad)
    # (with class weights, each token's w_y comes from the shard that owns its target)
    return single.reduce_tokens(
        loss_tok, lse, target.shape, shift, reduction,
        lambda: target_weight.sum() if weight is not None else valid.sum().float(), return_lse)


def _prepare(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
             label_smoothing, softcap, z_loss, shift, filter_eps, backend, vocab_order):
    """This rank's checks and inputs (as the single-GPU head's), and the facts every rank must
    share."""
    single.check_inputs(input, linear_weight, target, linear_bias, weight, reduction,
                         label_smoothing, softcap, z_loss, shift)
    if input.dtype == torch.float64:
        raise TypeError("the vocabulary-parallel head takes float32, bfloat16 or float16 "
                        "input, got torch.float64")
    backend = engine.resolve_backend(backend, input.device)
    eps = resolve_lm_head_filter_eps(filter_eps, input.dtype)
    eps = eps if backend == "triton" else None
    d = linear_weight.shape[1]
    a = input.reshape(-1, d)
    flat_target = single.shifted_targets(target, shift, ignore_index)
    valid = flat_target != ignore_index
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
    order = single.resolve_vocab_order(vocab_order, a, linear_weight, linear_bias, valid, eps,
                                        backend, wants_grad)
    needs = [t is not None and t.requires_grad for t in (input, linear_weight, linear_bias)]
    facts = {
        "the input dtype": (dtype_code(input.dtype), str(input.dtype)),
        "the hidden size D": (d, str(d)),
        "the number of tokens": (a.shape[0], str(a.shape[0])),
        "the device type": (device_code(input.device), input.device.type),
        "reduction": (_REDUCTIONS.index(reduction), repr(reduction)),
        "ignore_index": (int(ignore_index), str(ignore_index)),
        "label_smoothing": (float_code(label_smoothing), str(label_smoothing)),
        "softcap": (float_code(softcap), str(softcap)),
        "z_loss": (float_code(z_loss), str(z_loss)),
        "shift": (int(bool(shift)), str(shift)),
        "filter_eps": (float_code(eps), str(eps)),
        "backend": (_BACKENDS.index(backend), repr(backend)),
        "whether linear_bias is given": (int(linear_bias is not None),
                                         str(linear_bias is not None)),
        "whether weight is given": (int(weight is not None), str(weight is not None)),
        "which inputs require grad (input, linear_weight, linear_bias)": (
            sum(int(x) << i for i, x in enumerate(needs)), str(needs)),
    }
    return a, flat_target, valid, backend, eps, order, facts


def _device(t) -> torch.device:
    return t.device if isinstance(t, Tensor) else torch.device("cpu")


def _shard_starts(layout, given: list[int]) -> tuple[list[int], int]:
    """Each rank's first global class id, and V."""
    v = sum(layout.cols)
    if all(s < 0 for s in given):
        return [layout.col_offset(r) for r in range(layout.world)], v
    if any(s < 0 for s in given):
        raise ValueError(f"vocab_start must be given on every rank or on none; the ranks "
                         f"passed {[None if s < 0 else s for s in given]}")
    spans = sorted(zip(given, layout.cols, strict=True))
    end = 0
    for s, size in spans:
        if s != end:
            raise ValueError(f"the shards must tile [0, V) = [0, {v}): the ranks' (vocab_start, "
                             f"V_r) are {list(zip(given, layout.cols, strict=True))}")
        end = s + size
    return given, v


class _VocabParallel(torch.autograd.Function):
    """Per-token losses, LSEs and target weights of the whole head from this rank's shard."""

    @staticmethod
    @without_autocast
    def forward(ctx, a, b, target, bias, class_weight, order, group, start, v, ignore_index,
                alpha, softcap, z_loss, eps, backend, record):
        n, v_r = a.shape[0], b.shape[0]
        dev = a.device
        valid = target != ignore_index
        owned = valid & (target >= start) & (target < start + v_r)
        out_of_range = valid & ((target < 0) | (target >= v))
        rows = engine.compact_rows(valid)
        positions = torch.arange(n, device=dev) < rows.n_valid
        owned_c = owned[rows.index] & positions
        # Targets within this shard; a stand-in 0 where another rank owns the target (its
        # target logit and coefficient are masked out).
        local = torch.where(owned_c, target[rows.index] - start, 0)
        local = torch.where(positions, local, -1)
        any_bad, all_valid = torch.stack((out_of_range.any(), valid.all())).tolist()
        if any_bad:  # the same targets on every rank: every rank raises
            raise _out_of_range(target, out_of_range, v, ignore_index)
        rows = Rows(index=rows.index, n_valid=rows.n_valid, target=local,
                    identity=bool(all_valid))
        logits = Logits(bias=bias, softcap=softcap, col_order=order)
        stats = engine.row_stats(a, b, logits, rows, col_weight=class_weight,
                                 weighted_sum=alpha > 0,
                                 record_tiles=record and eps is not None, backend=backend)
        own_weight = (class_weight[local.clamp(min=0)] if class_weight is not None
                      else torch.ones(n, dtype=_F32, device=dev))
        sums = torch.stack((
            torch.where(owned_c, stats.target_logit, 0.0),
            stats.weighted_sum if alpha > 0 else torch.zeros(n, dtype=_F32, device=dev),
            torch.where(owned_c, own_weight, 0.0),
        ))
        row_max, row_sum, (target_logit, weighted_sum, target_weight), totals = _combine_shards(
            group, stats.max, stats.sum, sums,
            class_weight.sum().reshape(1) if class_weight is not None else None)
        total_w = totals[0] if class_weight is not None else float(v)
        log_sum = torch.log(row_sum)
        lse = row_max + log_sum
        target_weight = torch.where(positions, target_weight, 0.0)
        loss = family.token_loss((row_max - target_logit) + log_sum, lse, target_weight,
                                 weighted_sum, total_w, v, alpha, z_loss)
        loss = torch.where(positions, loss, 0.0)
        lse = torch.where(positions, lse, 0.0)

        ctx.save_for_backward(a, b, bias, class_weight, order)
        ctx.state = (rows, owned_c, row_max, row_sum, log_sum, target_logit, target_weight,
                     total_w, stats.tile_log_mass, (stats.block_m, stats.block_n), group, v,
                     alpha, softcap, z_loss, eps, backend)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(target_weight)
        return (_original_order(loss, rows), _original_order(lse, rows),
                _original_order(target_weight, rows))

    @staticmethod
    @without_autocast
    def backward(ctx, grad_loss, grad_lse, _):
        a, b, bias, class_weight, order = ctx.saved_tensors
        (rows, owned_c, row_max, row_sum, log_sum, target_logit, target_weight, total_w, tiles,
         block, group, v, alpha, softcap, z_loss, eps, backend) = ctx.state
        need_a, need_b, _, need_bias = ctx.needs_input_grad[:4]
        n, dev = a.shape[0], a.device
        positions = torch.arange(n, device=dev) < rows.n_valid
        g = (torch.zeros(n, dtype=_F32, device=dev) if grad_loss is None
             else torch.where(positions, grad_loss[rows.index].float(), 0.0))
        g_lse = 0.0 if grad_lse is None else torch.where(positions,
                                                         grad_lse[rows.index].float(), 0.0)
        lse = row_max + log_sum
        row_coef = family.grad_coefficients(g, g_lse, lse, target_weight, total_w, v, alpha,
                                            z_loss)
        stats = RowStats(lse=lse, max=row_max, log_sum=log_sum, sum=row_sum,
                         target_logit=target_logit, weighted_sum=None, tile_log_mass=tiles,
                         block_m=block[0], block_n=block[1])
        # The filter's per-row scale is a property of the whole row (the owner's target term
        # included), the same on every rank.
        mass = family.gradient_mass(stats, row_coef)
        # The target term on the shard that owns the target only.
        coef = dataclasses.replace(row_coef,
                                   target=torch.where(owned_c, row_coef.target, 0.0))
        grads = engine.grads(
            a, b, Logits(bias=bias, softcap=softcap, col_order=order), rows, stats, coef,
            col_weight=class_weight, filter_eps=eps, filter_scale=(mass, None),
            need_a=need_a, need_b=need_b, need_bias=bias is not None and need_bias,
            scratch_bytes=scratch_bytes(a), row_chunk=backward_row_chunk(a), grad_a_dtype=_F32,
            backend=backend)
        grad_a = None
        if need_a:
            grad_a = grads.a
            dist.all_reduce(grad_a, group=group)  # fp32: Σ over the shards, rounded once
            grad_a = grad_a.to(a.dtype)
        grad_bias = grads.bias.to(bias.dtype) if grads.bias is not None else None
        return (grad_a, grads.b if need_b else None, None, grad_bias, *[None] * 12)


def _original_order(values: Tensor, rows: Rows) -> Tensor:
    out = torch.empty_like(values)
    out[rows.index] = values
    return out


def _combine_shards(group, local_max: Tensor, local_sum: Tensor, sums: Tensor,
                    totals: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The shards' row statistics combined: (M, S, sums, totals) with M = max_r max_r,i
    (all-reduce max) and S = Σ_r sum_r,i · exp(max_r,i − M), ``sums`` (k, R) and ``totals``
    (m,) (each rank's parts) summed over the ranks in one all-reduce; ``totals`` None when not
    given."""
    row_max = local_max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    k, rows = sums.shape
    pieces = [local_sum * torch.exp(local_max - row_max), sums.reshape(-1)]
    if totals is not None:
        pieces.append(totals.float())
    packed = torch.cat(pieces)
    dist.all_reduce(packed, group=group)
    end = (k + 1) * rows
    return (row_max, packed[:rows], packed[rows:end].view(k, rows),
            packed[end:] if totals is not None else None)


def _out_of_range(target: Tensor, out_of_range: Tensor, v: int, ignore_index: int) -> ValueError:
    bad = int(target[out_of_range][0])
    return ValueError(f"target holds {bad}, outside [0, V) = [0, {v}) (V: every rank's shard) "
                      f"and not ignore_index={ignore_index}")


# ---------------------------------------------------------------------------------------------
# The training path: three products per chunk of rows, the gradients formed in the forward.


@dataclasses.dataclass(frozen=True)
class _HeadOptions:
    """The loss's options, as the row kernels and ``families.cross_entropy`` take them."""

    ignore_index: int
    label_smoothing: float
    softcap: float | None
    z_loss: float


class _VocabParallelTraining(torch.autograd.Function):
    """The reduced loss of the whole head (() fp32) with this rank's gradients formed in the
    forward (``_loss_and_grads``); the backward multiplies them by the loss's upstream
    gradient (fp32, one rounding to each parameter's dtype)."""

    @staticmethod
    @without_autocast
    def forward(ctx, a, b, target, bias, class_weight, group, start, v, options, mean):
        need_a, need_b, _, need_bias = ctx.needs_input_grad[:4]
        loss, *grads = _loss_and_grads(a, b, target, bias, class_weight, group, start, v,
                                       options, mean, need_a, need_b, need_bias)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    @without_autocast
    def backward(ctx, grad_loss):
        if grad_loss is None:
            return (None,) * 10
        scale = grad_loss.float()
        grad_a, grad_b, grad_bias = (
            None if g is None else chunked_logits.scaled(g, scale, dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True))
        return grad_a, grad_b, None, grad_bias, *(None,) * 6


def _loss_and_grads(
    a: Tensor,  # (N, D)
    b: Tensor,  # (V_r, D) this rank's rows of the classifier
    target: Tensor,  # (N,) int64 global class ids, or ignore_index
    bias: Tensor | None,  # (V_r,)
    class_weight: Tensor | None,  # (V_r,) fp32
    group, start: int, v: int, options: _HeadOptions, mean: bool,
    need_a: bool, need_b: bool, need_bias: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(the loss of the whole head () fp32 for an upstream gradient of 1, dA (N, D) in a's
    dtype summed over the shards, dB (V_r, D) fp32, dbias (V_r,) fp32; each gradient None when
    not needed), in chunks of rows (``config.lm_head_chunk_rows`` of the shard). Every row is
    computed, an ignored one giving loss 0 and G = 0, so nothing is read back before the work
    is queued; raises ValueError afterwards for a target outside [0, V)."""
    (n, d), v_r, dev = a.shape, b.shape[0], a.device
    alpha, softcap, z_loss = options.label_smoothing, options.softcap, options.z_loss
    valid = target != options.ignore_index
    owned = valid & (target >= start) & (target < start + v_r)
    # w_y on the shard that holds y, 0 on the others: each chunk's sums carry it to every rank
    if class_weight is None:
        own_weight = owned.float()
        total_w, denominator, totals = float(v), valid.sum().float(), None
    else:
        own_weight = torch.where(owned, class_weight[torch.where(owned, target - start, 0)], 0.0)
        # W and "mean"'s denominator Σ_i w_{y_i}: summed over the shards with the first chunk's
        totals = torch.stack((class_weight.sum(), own_weight.sum()))
    chunk = min(n, config.lm_head_chunk_rows(n, v_r, a.element_size()))
    losses = torch.empty(n, dtype=_F32, device=dev)
    grad_a = torch.empty_like(a) if need_a else None
    # dA's fp32 part of each chunk, summed over the shards (fp32 input: dA itself)
    grad_a_part = (torch.empty((chunk, d), dtype=_F32, device=dev)
                   if need_a and a.dtype != _F32 else None)
    grad_b = torch.empty((v_r, d), dtype=_F32, device=dev) if need_b else None
    grad_bias = torch.zeros(v_r, dtype=_F32, device=dev) if need_bias else None
    bias = None if bias is None else bias.to(a.dtype)  # F.linear's logits, as the op forms them
    buffer = torch.empty((chunk, v_r), dtype=a.dtype, device=dev)
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        a_c, y_c, z = a[r0:r1], target[r0:r1], buffer[: r1 - r0]
        if bias is None:
            torch.mm(a_c, b.T, out=z)
        else:
            torch.addmm(bias, a_c, b.T, out=z)
        stats = chunked_logits.shard_row_stats(z, y_c, start, options.ignore_index,
                                               class_weight, alpha, softcap)
        row_max, row_sum, (target_logit, weighted_sum, target_weight), call_totals = (
            _combine_shards(group, stats[0], stats[1],
                            torch.cat((stats[2:], own_weight[None, r0:r1])),
                            totals if r0 == 0 else None))
        if r0 == 0:
            if class_weight is not None:
                total_w, denominator = call_totals
            scale = (1.0 / torch.where(denominator == 0, 1.0, denominator) if mean
                     else torch.ones((), dtype=_F32, device=dev))
        log_sum = torch.log(row_sum)
        lse = row_max + log_sum
        losses[r0:r1] = torch.where(valid[r0:r1], family.token_loss(
            (row_max - target_logit) + log_sum, lse, target_weight, weighted_sum, total_w, v,
            alpha, z_loss), 0.0)
        coef = family.grad_coefficients(torch.where(valid[r0:r1], scale, 0.0), 0.0, lse,
                                        target_weight, total_w, v, alpha, z_loss)
        chunked_logits.shard_softmax_grad_(z, y_c, start, options.ignore_index, class_weight,
                                           row_max, row_sum, coef, softcap)
        if need_a:
            part = grad_a[r0:r1] if grad_a_part is None else grad_a_part[: r1 - r0]
            mm_f32(z, b, out=part)
            dist.all_reduce(part, group=group)  # fp32: Σ over the shards, rounded once
            if grad_a_part is not None:
                grad_a[r0:r1] = part
        chunked_logits.add_weight_grads(grad_b, grad_bias, z, a_c, first=r0 == 0)
    out_of_range = valid & ((target < 0) | (target >= v))
    if out_of_range.any():  # the same targets on every rank: every rank raises
        raise _out_of_range(target, out_of_range, v, options.ignore_index)
    return losses.sum() * scale, grad_a, grad_b, grad_bias
