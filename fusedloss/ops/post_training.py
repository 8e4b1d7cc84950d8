"""GRPO's, DPO's, CPO's (SimPO's) and KTO's losses fused into the LM head
(``fusedloss.post_training``'s training path on the Triton backend), as custom ops.

The loss is a sum over blocks of whole sequences (GRPO) or whole pairs (DPO)
(``families.post_training``), so a chunk of those rows forms its logits, its log-probabilities,
its part of the loss and at once its gradient (``core.chunked_log_probs.fused_loss_and_grads``):
three of the policy head's products instead of the four a per-token log-probability needs. The
backward scales the gradients by the loss's upstream gradient (``formed_grads_backward``).

    fusedloss::grpo_loss_fused   (loss, d input, d weight, d bias)
    fusedloss::dpo_loss_fused    (loss, d input, d weight, d bias)
    fusedloss::cpo_loss_fused    (CPO, SimPO and ORPO: pairs, no reference)
    fusedloss::kto_loss_fused    (KTO: one completion per group)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core import chunked_log_probs
from ..core.engine import Needs
from ..families import post_training as family
from ._common import eager_function, nothing, op_body, row_major, run_op
from .cross_entropy import formed_grads_backward, formed_grads_setup_context

_F32 = torch.float32


def grpo_loss_fused(*args) -> Tensor:
    """GRPO's loss (() fp32) of ``grpo_forward``'s arguments, with its autograd."""
    return run_op(grpo_op, _EagerGRPO, *args)[0]


def dpo_loss_fused(*args) -> Tensor:
    """DPO's loss (() fp32) of ``dpo_forward``'s arguments, with its autograd."""
    return run_op(dpo_op, _EagerDPO, *args)[0]


def _row_targets(target: Tensor, ignore_index: int, v: int) -> tuple[Tensor, Tensor]:
    """(each row's target column, −1 for an ignored or bad one; whether it is bad: outside
    [0, V) and not ``ignore_index``, which makes its log-probability NaN)."""
    in_range = (target >= 0) & (target < v)
    return torch.where(in_range, target, -1), (target != ignore_index) & ~in_range


def _fused(a: Tensor, b: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int,
           head: tuple[float, float | None], groups: Tensor, group_loss,
           needs: Needs) -> tuple[Tensor, ...]:
    """The op's outputs from ``chunked_log_probs.fused_loss_and_grads``: ``head`` = (the
    logits' factor 1/T, the tempered softcap), a bad target's row NaN."""
    row_target, bad = _row_targets(target, ignore_index, b.shape[0])
    loss, *grads = chunked_log_probs.fused_loss_and_grads(
        a, b, None if bias is None else bias.to(a.dtype), row_target, *head, groups, group_loss,
        needs, row_nan=bad)
    return (loss, *(nothing(a, (0,)) if g is None else g for g in grads))


@op_body
def grpo_forward(
    input: Tensor,  # (B·T, D)
    weight: Tensor,  # (V, D)
    bias: Tensor | None,  # (V,)
    target: Tensor,  # (B·T,) int64 completion token ids
    token_weight: Tensor,  # (B, T) fp32: ``family.grpo_token_weights``
    mask: Tensor,  # (B, T) fp32
    advantages: Tensor,  # (B, 1) or (B, T) fp32
    old: Tensor | None,  # (B, T): None, the policy's own (detached)
    ref: Tensor | None,  # (B, T) (with beta ≠ 0)
    beta: float,
    epsilon: float,
    epsilon_high: float | None,
    delta: float | None,
    importance_sampling_level: str,
    kl_bias_correction: bool,
    temperature: float,
    softcap: float | None,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d input, d weight fp32, d bias fp32) of ``post_training.grpo_loss`` for an
    upstream gradient of 1, each gradient an empty tensor when not asked for. Token-level
    importance sampling: chunks of any rows (each token's terms are its own); sequence level:
    chunks of whole sequences."""
    a, b = row_major(input), row_major(weight)
    n_seq, t = mask.shape
    options = family.GRPOOptions(beta, epsilon, epsilon_high, delta, importance_sampling_level,
                                 kl_bias_correction)
    per_token = [None if x is None else x.float().expand(n_seq, t)
                 for x in (old, ref, advantages, mask, token_weight)]
    if importance_sampling_level == "token":  # each token a group of its own: any chunk
        t, n_seq = 1, n_seq * t
        per_token = [None if x is None else x.reshape(n_seq, 1) for x in per_token]
    old, ref, advantages, mask, token_weight = per_token
    groups = torch.arange(n_seq * t, device=a.device).view(n_seq, t)

    def group_loss(g0: int, g1: int, log_p: Tensor) -> tuple[Tensor, Tensor]:
        part = slice(g0, g1)
        return family.grpo_loss_and_grad(
            log_p, None if old is None else old[part], None if ref is None else ref[part],
            advantages[part], mask[part], token_weight[part], options)

    return _fused(a, b, bias, target, -100,
                  (1.0 / temperature, None if softcap is None else softcap / temperature),
                  groups, group_loss, Needs(need_input, need_weight, need_bias))


grpo_op = torch.library.custom_op("fusedloss::grpo_loss_fused", grpo_forward, mutates_args=())


@op_body
def dpo_forward(
    input: Tensor,  # (2B·T, D): the B chosen sequences' rows, then the B rejected ones'
    weight: Tensor,  # (V, D)
    bias: Tensor | None,  # (V,)
    target: Tensor,  # (2B·T,) int64 token ids, ignore_index outside the completions
    ref_log_probs: Tensor,  # (2B,) the reference's summed log-probabilities
    lengths: Tensor,  # (2B,) fp32 counted tokens per sequence
    seq_len: int,  # T
    ignore_index: int,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    softcap: float | None,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d input, d weight fp32, d bias fp32) of ``post_training.dpo_loss`` for an
    upstream gradient of 1; each chunk holds whole pairs (a chosen sequence with its rejected
    one)."""
    a, b = row_major(input), row_major(weight)
    t = seq_len
    pairs = ref_log_probs.shape[0] // 2
    groups = _pair_groups(pairs, t, a.device)
    counted = (target != ignore_index).float()

    def group_loss(g0: int, g1: int, log_p: Tensor) -> tuple[Tensor, Tensor]:
        rows_of = groups[g0:g1]
        weight_of = counted[rows_of]
        sums = (log_p * weight_of).view(g1 - g0, 2, t).sum(-1)
        part, d_chosen, d_rejected = family.dpo_loss_and_grad(
            sums[:, 0] - ref_log_probs[g0:g1].float(),
            sums[:, 1] - ref_log_probs[pairs + g0:pairs + g1].float(), lengths[g0:g1],
            lengths[pairs + g0:pairs + g1], beta, loss_type, label_smoothing)
        # each counted token of a sequence: its sum's gradient, over the B pairs of the mean
        d_sum = torch.stack((d_chosen, d_rejected), dim=1)[:, :, None] / pairs
        return part / pairs, (d_sum * weight_of.view(g1 - g0, 2, t)).view(g1 - g0, 2 * t)

    return _fused(a, b, bias, target, ignore_index, (1.0, softcap), groups, group_loss,
                  Needs(need_input, need_weight, need_bias))


dpo_op = torch.library.custom_op("fusedloss::dpo_loss_fused", dpo_forward, mutates_args=())


def _pair_groups(pairs: int, t: int, device) -> Tensor:
    """(B, 2T): pair p's rows, its chosen sequence's then its rejected one's."""
    rows = torch.arange(2 * pairs * t, device=device).view(2, pairs, t)
    return torch.cat((rows[0], rows[1]), dim=1)


@op_body
def cpo_forward(
    input: Tensor,  # (2B·T, D): the B chosen sequences' rows, then the B rejected ones'
    weight: Tensor,  # (V, D)
    bias: Tensor | None,  # (V,)
    target: Tensor,  # (2B·T,) int64 token ids, ignore_index outside the completions
    lengths: Tensor,  # (2B,) fp32 counted tokens per sequence
    seq_len: int,  # T
    ignore_index: int,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    simpo_gamma: float,
    nll_weight: float,  # cpo_alpha: × the chosen tokens' mean NLL (their own targets)
    softcap: float | None,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d input, d weight fp32, d bias fp32) of ``post_training.cpo_loss`` (and SimPO's;
    ``loss_type="orpo"``: ``orpo_loss``' odds-ratio term) for an upstream gradient of 1, chunks of
    whole pairs."""
    a, b = row_major(input), row_major(weight)
    t, pairs = seq_len, lengths.shape[0] // 2
    groups = _pair_groups(pairs, t, a.device)
    counted = (target != ignore_index).float()
    average = loss_type in ("ipo", "simpo", "orpo")
    # the NLL's mean over the chosen sequences' counted tokens (0 where there are none)
    chosen_count = counted[: pairs * t].sum().clamp(min=1.0)

    def group_loss(g0: int, g1: int, log_p: Tensor) -> tuple[Tensor, Tensor]:
        rows_of = groups[g0:g1]
        weight_of = counted[rows_of].view(g1 - g0, 2, t)
        log_p = log_p.view(g1 - g0, 2, t) * weight_of
        per_seq = log_p.sum(-1)  # (k, 2)
        norm = torch.stack((lengths[g0:g1], lengths[pairs + g0:pairs + g1]), dim=1)
        if average:
            per_seq = per_seq / norm
        if loss_type == "orpo":
            part, d_chosen, d_rejected = family.orpo_loss_and_grad(per_seq[:, 0],
                                                                   per_seq[:, 1], beta)
        else:
            margin = per_seq[:, 0] - per_seq[:, 1]
            if loss_type == "simpo":
                margin = margin - simpo_gamma / beta
            part, d_chosen = family.cpo_loss_and_grad(margin, beta, loss_type,
                                                      label_smoothing)
            d_rejected = -d_chosen
        d_seq = torch.stack((d_chosen, d_rejected), dim=1) / pairs
        if average:
            d_seq = d_seq / norm
        grad = d_seq[:, :, None] * weight_of
        part = part / pairs
        if nll_weight:
            part = part - nll_weight * log_p[:, 0].sum() / chosen_count
            grad[:, 0] -= nll_weight * weight_of[:, 0] / chosen_count
        return part, grad.view(g1 - g0, 2 * t)

    return _fused(a, b, bias, target, ignore_index, (1.0, softcap), groups, group_loss,
                  Needs(need_input, need_weight, need_bias))


cpo_op = torch.library.custom_op("fusedloss::cpo_loss_fused", cpo_forward, mutates_args=())


def cpo_loss_fused(*args) -> Tensor:
    """CPO's (and SimPO's) loss (() fp32) of ``cpo_forward``'s arguments, with its autograd."""
    return run_op(cpo_op, _EagerCPO, *args)[0]


@op_body
def kto_forward(
    input: Tensor,  # (B·T, D)
    weight: Tensor,  # (V, D)
    bias: Tensor | None,  # (V,)
    target: Tensor,  # (B·T,) int64 token ids, ignore_index outside the completions
    ref_log_probs: Tensor,  # (B,) the reference's summed log-probabilities
    desirable: Tensor,  # (B,) bool
    kl: Tensor,  # () fp32, detached
    seq_len: int,  # T
    ignore_index: int,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
    loss_type: str,
    softcap: float | None,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d input, d weight fp32, d bias fp32) of ``post_training.kto_loss`` for an
    upstream gradient of 1, chunks of whole sequences."""
    a, b = row_major(input), row_major(weight)
    t, n_seq = seq_len, ref_log_probs.shape[0]
    groups = torch.arange(n_seq * t, device=a.device).view(n_seq, t)
    counted = (target != ignore_index).float().view(n_seq, t)

    def group_loss(g0: int, g1: int, log_p: Tensor) -> tuple[Tensor, Tensor]:
        weight_of = counted[g0:g1]
        ratio = (log_p * weight_of).sum(-1) - ref_log_probs[g0:g1].float()
        part, d_ratio = family.kto_loss_and_grad(
            ratio, desirable[g0:g1], kl, beta, desirable_weight, undesirable_weight, loss_type)
        return part / n_seq, d_ratio[:, None] * weight_of / n_seq

    return _fused(a, b, bias, target, ignore_index, (1.0, softcap), groups, group_loss,
                  Needs(need_input, need_weight, need_bias))


kto_op = torch.library.custom_op("fusedloss::kto_loss_fused", kto_forward, mutates_args=())


def kto_loss_fused(*args) -> Tensor:
    """KTO's loss (() fp32) of ``kto_forward``'s arguments, with its autograd."""
    return run_op(kto_op, _EagerKTO, *args)[0]


def _fake(input, weight, bias, need_input, need_weight, need_bias):
    return (input.new_empty((), dtype=_F32),
            torch.empty_like(input) if need_input else nothing(input, (0,)),
            weight.new_empty(weight.shape, dtype=_F32) if need_weight else nothing(input, (0,)),
            bias.new_empty(bias.shape, dtype=_F32) if bias is not None and need_bias
            else nothing(input, (0,)))


def _fake_of_any(input, weight, bias, *args):
    """Every fused op's fake: its last three arguments are the need flags."""
    return _fake(input, weight, bias, *args[-3:])


for _op in (grpo_op, dpo_op, cpo_op, kto_op):
    _op.register_fake(_fake_of_any)
    _op.register_autograd(formed_grads_backward, setup_context=formed_grads_setup_context)

_EagerGRPO = eager_function("_EagerGRPO", grpo_forward, formed_grads_setup_context,
                            formed_grads_backward, None)
_EagerDPO = eager_function("_EagerDPO", dpo_forward, formed_grads_setup_context,
                           formed_grads_backward, None)
_EagerCPO = eager_function("_EagerCPO", cpo_forward, formed_grads_setup_context,
                           formed_grads_backward, None)
_EagerKTO = eager_function("_EagerKTO", kto_forward, formed_grads_setup_context,
                           formed_grads_backward, None)
