"""The vocabulary-parallel LM head's autograd Functions: linear cross-entropy with the
classifier's rows sharded over a process group (``fusedloss.distributed.cross_entropy`` has the
layout and the math; ``losses.cross_entropy`` checks the arguments and picks the Function).

``VocabParallel`` — per-token losses and LSEs on the engine: each rank's shard statistics,
combined over the ranks (``_combine_shards``); its backward forms dX on the shard's columns
from the global statistics and all-reduces dE in fp32.

``VocabParallelTraining`` — a reduced loss with gradients on the Triton backend: the
single-GPU training path (``core.chunked_logits``) per shard, with the same combine between
its two row kernels; the backward scales the gradients by the loss's upstream gradient.

The loss and its gradient coefficients are ``families.cross_entropy``'s, as for the single-GPU
head.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import chunked_logits, config, engine
from ..core.engine import Logits, Rows, RowStats, cut_classes, mm_f32, pad_classes
from ..families import cross_entropy as family
from ..families import log_probs as log_probs_family
from ._common import backward_row_chunk, op_body, scratch_bytes

_F32 = torch.float32


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's part of the head: its rows [start, start + V_r) of the V-row classifier,
    sharded over ``group``."""

    group: dist.ProcessGroup | None
    start: int
    v: int


class VocabParallel(torch.autograd.Function):
    """Per-token losses, LSEs and target weights of the whole head from this rank's shard."""

    @staticmethod
    @op_body
    def forward(ctx, a, b, target, bias, class_weight, order, shard, options, eps, backend):
        """``eps``: the backward's filter (None: exact); the forward records the tile masses
        it reads only with one."""
        n, v_r = a.shape[0], b.shape[0]
        group, start, v = shard.group, shard.start, shard.v
        ignore_index, alpha = options.ignore_index, options.label_smoothing
        softcap, z_loss = options.softcap, options.z_loss
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
        stats = engine.row_stats(
            a, b, logits, rows, col_weight=class_weight,
            wants=engine.Wants(weighted_sum=alpha > 0, record_tiles=eps is not None),
            backend=backend)
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
    @op_body
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
            col_weight=class_weight,
            needs=engine.Needs(need_a, need_b, bias is not None and need_bias),
            plan=engine.BackwardPlan(
                filter_eps=eps, filter_scale=(mass, None), scratch_bytes=scratch_bytes(a),
                row_chunk=backward_row_chunk(a), grad_a_dtype=_F32, backend=backend,
                sparse=eps is not None))
        grad_a = None
        if need_a:
            grad_a = grads.a
            dist.all_reduce(grad_a, group=group)  # fp32: Σ over the shards, rounded once
            grad_a = grad_a.to(a.dtype)
        grad_bias = grads.bias.to(bias.dtype) if grads.bias is not None else None
        return (grad_a, grads.b if need_b else None, None, grad_bias, *[None] * 6)


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


class VocabParallelTraining(torch.autograd.Function):
    """The reduced loss of the whole head (() fp32) with this rank's gradients formed in the
    forward (``_loss_and_grads``); the backward multiplies them by the loss's upstream
    gradient (fp32, one rounding to each parameter's dtype)."""

    @staticmethod
    @op_body
    def forward(ctx, a, b, target, bias, class_weight, shard, options, mean):
        need_a, need_b, _, need_bias = ctx.needs_input_grad[:4]
        loss, *grads = _loss_and_grads(a, b, target, bias, class_weight, shard, options, mean,
                                       chunked_logits.Needs(need_a, need_b, need_bias))
        ctx.save_for_backward(*grads)
        ctx.dtypes = (a.dtype, b.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    @op_body
    def backward(ctx, grad_loss):
        if grad_loss is None:
            return (None,) * 8
        scale = grad_loss.float()
        grad_a, grad_b, grad_bias = (
            None if g is None else chunked_logits.scaled(g, scale, dtype)
            for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True))
        return grad_a, grad_b, None, grad_bias, *(None,) * 4


def _loss_and_grads(
    a: Tensor,  # (N, D)
    b: Tensor,  # (V_r, D) this rank's rows of the classifier
    target: Tensor,  # (N,) int64 global class ids, or ignore_index
    bias: Tensor | None,  # (V_r,)
    class_weight: Tensor | None,  # (V_r,) fp32
    shard: Shard,
    options: chunked_logits.LossOptions,
    mean: bool,  # reduction "mean" (else "sum")
    needs: chunked_logits.Needs,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(the loss of the whole head () fp32 for an upstream gradient of 1, dA (N, D) in a's
    dtype summed over the shards, dB (V_r, D) fp32, dbias (V_r,) fp32; each gradient None when
    not needed), in chunks of rows (``config.lm_head_chunk_rows`` of the shard). Every row is
    computed, an ignored one giving loss 0 and G = 0, so nothing is read back before the work
    is queued; raises ValueError afterwards for a target outside [0, V)."""
    (n, d), v_r, dev = a.shape, b.shape[0], a.device
    group, start, v = shard.group, shard.start, shard.v
    need_a, need_b, need_bias = needs.a, needs.b, needs.bias and bias is not None
    alpha, z_loss = options.label_smoothing, options.z_loss
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
    bias = None if bias is None else bias.to(a.dtype)  # F.linear's logits, as the op forms them
    b, bias = pad_classes(b, bias)  # the products over the padded classes
    grad_b = torch.empty((b.shape[0], d), dtype=_F32, device=dev) if need_b else None
    grad_bias = torch.zeros(b.shape[0], dtype=_F32, device=dev) if need_bias else None
    buffer = torch.empty((chunk, b.shape[0]), dtype=a.dtype, device=dev)
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        a_c, y_c, z = a[r0:r1], target[r0:r1], buffer[: r1 - r0]
        shard_z = z[:, :v_r]  # the shard's own classes, which the row kernels read and write
        if bias is None:
            torch.mm(a_c, b.T, out=z)
        else:
            torch.addmm(bias, a_c, b.T, out=z)
        stats = chunked_logits.shard_row_stats(shard_z, y_c, start, class_weight, options)
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
        chunked_logits.shard_softmax_grad_(shard_z, y_c, start, class_weight, row_max, row_sum,
                                           coef, options)
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
    return losses.sum() * scale, grad_a, cut_classes(grad_b, v_r), cut_classes(grad_bias, v_r)


# ---------------------------------------------------------------------------------------------
# Token log-probabilities and entropies (``fusedloss.linear_log_probs`` over a process group).


@dataclasses.dataclass(frozen=True)
class LogProbOptions:
    ignore_index: int
    temperature: float
    softcap: float | None
    entropy: bool


class VocabParallelLogProbs(torch.autograd.Function):
    """Per-token log p(target) and entropy of the whole head from this rank's shard: each
    shard's (max, Σ exp, centered sum, owned target logit), combined over the ranks
    (``_combine_log_prob_shards``); the backward forms dX on the shard's columns from the global
    statistics and all-reduces dE in fp32. The formulas are ``families.log_probs``'."""

    @staticmethod
    @op_body
    def forward(ctx, a, b, target, bias, shard, options: LogProbOptions, backend):
        n, v_r, dev = a.shape[0], b.shape[0], a.device
        start, v = shard.start, shard.v
        valid = target != options.ignore_index
        out_of_range = valid & ((target < 0) | (target >= v))
        if bool(out_of_range.any()):  # the same targets on every rank: every rank raises
            raise _out_of_range(target, out_of_range, v, options.ignore_index)
        owned = valid & (target >= start) & (target < start + v_r)
        local = torch.where(owned, target - start, -1)
        rows = Rows(index=torch.arange(n, device=dev),
                    n_valid=torch.full((), n, dtype=torch.int64, device=dev), target=local,
                    identity=True, all_valid=True)
        logits = log_probs_family.tempered_logits(bias, 1.0, options.temperature,
                                                  options.softcap, _F32, dev)
        stats = engine.row_stats(a, b, logits, rows,
                                 wants=engine.Wants(record_tiles=False, entropy=options.entropy),
                                 backend=backend)
        glob = _combine_log_prob_shards(shard.group, stats, owned, options.entropy)
        log_prob = torch.where(valid, log_probs_family.token_log_prob(glob), 0.0)
        entropy = (torch.where(valid, log_probs_family.token_entropy(glob), 0.0)
                   if options.entropy else None)
        ctx.save_for_backward(a, b, bias)
        ctx.state = (rows, owned, valid, glob, shard.group, options, backend)
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    @op_body
    def backward(ctx, grad_log_prob, grad_entropy):
        a, b, bias = ctx.saved_tensors
        rows, owned, valid, glob, group, options, backend = ctx.state
        need_a, need_b, _, need_bias = ctx.needs_input_grad[:4]
        g = (torch.zeros(a.shape[0], dtype=_F32, device=a.device) if grad_log_prob is None
             else torch.where(valid, grad_log_prob.float(), 0.0))
        h = None
        if grad_entropy is not None and options.entropy:
            h = torch.where(valid, grad_entropy.float(), 0.0)
        coef = log_probs_family.grad_coefficients(g, h, glob)
        # The target term on the shard that owns the target only.
        coef = dataclasses.replace(coef, target=torch.where(owned, coef.target, 0.0))
        logits = log_probs_family.tempered_logits(bias, 1.0, options.temperature,
                                                  options.softcap, _F32, a.device)
        grads = engine.grads(
            a, b, logits, rows, glob, coef,
            needs=engine.Needs(need_a, need_b, bias is not None and need_bias),
            plan=engine.BackwardPlan(scratch_bytes=scratch_bytes(a),
                                     row_chunk=backward_row_chunk(a), grad_a_dtype=_F32,
                                     backend=backend))
        grad_a = None
        if need_a:
            grad_a = grads.a
            dist.all_reduce(grad_a, group=group)  # fp32: Σ over the shards, rounded once
            grad_a = grad_a.to(a.dtype)
        grad_bias = None
        if grads.bias is not None:  # the engine's is for bias / T
            grad_bias = (grads.bias / options.temperature).to(bias.dtype)
        return grad_a, grads.b if need_b else None, None, grad_bias, None, None, None


def _combine_log_prob_shards(group, stats: RowStats, owned: Tensor, entropy: bool) -> RowStats:
    """The whole head's row statistics from the shards': M = max over the ranks, S = Σ_r S_r ·
    exp(m_r − M), C = Σ_r exp(m_r − M)·(C_r + (m_r − M)·S_r) (each shard's centered sum moved to
    M) and the target logit from the shard that owns it: one all-reduce max, one sum."""
    row_max = stats.max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shift = stats.max - row_max
    moved = torch.exp(shift)
    pieces = [stats.sum * moved, torch.where(owned, stats.target_logit, 0.0)]
    if entropy:
        pieces.append((stats.centered_sum + shift * stats.sum) * moved)
    packed = torch.stack(pieces)
    dist.all_reduce(packed, group=group)
    row_sum = packed[0]
    log_sum = torch.log(row_sum)
    return RowStats(lse=row_max + log_sum, max=row_max, log_sum=log_sum, sum=row_sum,
                    target_logit=packed[1], weighted_sum=None, tile_log_mass=None,
                    centered_sum=packed[2] if entropy else None)
