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
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import engine
from ..core.engine import Logits, Rows, RowStats
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
    single-GPU head computes it).
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
    layout, per_rank = exchange(group, n, v_r, facts or {}, _device(input), error=error,
                                extra=(start,))
    starts, v = _shard_starts(layout, [row[0] for row in per_rank])
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
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
            bad = int(target[out_of_range][0])
            raise ValueError(f"target holds {bad}, outside [0, V) = [0, {v}) (V: every "
                             f"rank's shard) and not ignore_index={ignore_index}")
        rows = Rows(index=rows.index, n_valid=rows.n_valid, target=local,
                    identity=bool(all_valid))
        logits = Logits(bias=bias, softcap=softcap, col_order=order)
        stats = engine.row_stats(a, b, logits, rows, col_weight=class_weight,
                                 weighted_sum=alpha > 0,
                                 record_tiles=record and eps is not None, backend=backend)
        # Combine over the shards: the max first, then every sum in one all-reduce.
        row_max = stats.max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        own_weight = (class_weight[local.clamp(min=0)] if class_weight is not None
                      else torch.ones(n, dtype=_F32, device=dev))
        sums = torch.stack((
            stats.sum * torch.exp(stats.max - row_max),
            torch.where(owned_c, stats.target_logit, 0.0),
            stats.weighted_sum if alpha > 0 else torch.zeros(n, dtype=_F32, device=dev),
            torch.where(owned_c, own_weight, 0.0),
        ))
        total_w = class_weight.sum() if class_weight is not None else torch.zeros((), device=dev)
        packed = torch.cat((sums.reshape(-1), total_w.reshape(1).float()))
        dist.all_reduce(packed, group=group)
        row_sum, target_logit, weighted_sum, target_weight = packed[:-1].view(4, n)
        total_w = packed[-1] if class_weight is not None else float(v)
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
