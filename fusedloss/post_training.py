"""Preference and RL losses through an LM head, without its logits.

Each loss is TRL 1.16's definition of the same loss (its trainers' ``_compute_loss``), computed
from the policy's per-token log-probabilities, which ``fusedloss.linear_log_probs`` forms from
the hidden states and the head in O(N + V·D) memory. The reference model enters through its
precomputed log-probabilities or its own hidden states and head (then under ``no_grad``).

    loss = fusedloss.post_training.grpo_loss(hidden, lm_head.weight, completion_ids,
                                             completion_mask, advantages, temperature=0.7)
    loss = fusedloss.post_training.dpo_loss(hidden, lm_head.weight, labels, shift=True,
                                            ref_log_probs=ref_logps, beta=0.1)

Also ``kto_loss`` (KTOTrainer), ``orpo_loss`` (the experimental ORPOTrainer), ``cpo_loss`` and
``simpo_loss`` (the experimental CPOTrainer). A loss here is one micro-batch's: TRL divides by
the gradient-accumulation steps in its trainer, which is the caller's to do.
"""

from __future__ import annotations

import dataclasses

import torch

from .families import post_training as family
from .families.post_training import (
    CPO_LOSS_TYPES,
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    KTO_LOSS_TYPES,
)
from .losses.log_probs import fused_head_operands, linear_log_probs
from .ops import post_training as ops

__all__ = ["cpo_loss", "dpo_loss", "grpo_loss", "kto_loss", "orpo_loss", "simpo_loss"]


def grpo_loss(
    input: torch.Tensor,  # (B, T, D) hidden states at the positions that predict the completion
    linear_weight: torch.Tensor,  # (V, D)
    completion_ids: torch.Tensor,  # (B, T) int64
    completion_mask: torch.Tensor,  # (B, T) 1 where a token counts, 0 elsewhere (padding, tools)
    advantages: torch.Tensor,  # (B,) or (B, T)
    *,
    old_log_probs: torch.Tensor | None = None,  # (B, T)
    ref_log_probs: torch.Tensor | None = None,  # (B, T)
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    kl_bias_correction: bool = True,
    temperature: float = 1.0,
    linear_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """GRPO's clipped surrogate objective (TRL 1.16's ``GRPOTrainer``), a scalar.

    With log p the policy's per-token log-probability of each completion token at
    ``temperature``, r = exp(log p − old_log_probs) (per token, or with
    ``importance_sampling_level="sequence"`` the masked mean of the log-ratio over each
    sequence), A the advantages and ε = (``epsilon``, ``epsilon_high`` or ``epsilon``):

        per_token = −min(r·A, clamp(r, 1 − ε_low, 1 + ε_high)·A) + β·KL

    with r first clamped to ≤ ``delta`` in the unclipped term when given (two-sided clipping)
    and KL = exp(ref − log p) − (ref − log p) − 1 (times r with ``kl_bias_correction``, TRL's
    default). The reduction over the masked tokens is ``loss_type``'s: "grpo" the mean over
    each sequence's tokens, then over sequences; "bnpo" the mean over all tokens; "dr_grpo"
    the sum over B·``max_completion_length`` (default T); "dapo" the sum over
    ``num_items_in_batch`` (default: the tokens that count here).

    ``old_log_probs`` None is the policy's own, detached (one optimization step per
    generation, as TRL then does); ``ref_log_probs`` is needed when ``beta`` ≠ 0. The options
    of the head (``linear_bias``, ``softcap``, ``backend``) are ``linear_log_probs``'. On the
    Triton backend, with gradients, the loss is fused into the head: each chunk of tokens (of
    whole sequences at the sequence level) forms its logits, its terms and its gradient at
    once (three of the head's products, ``ops.post_training``); elsewhere, and where one
    sequence holds more logits than ``Tuning.lm_head_chunk_bytes``, it runs on
    ``linear_log_probs``.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError("importance_sampling_level must be 'token' or 'sequence', got "
                         f"{importance_sampling_level!r}")
    if importance_sampling_level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo"):
        raise ValueError(f"importance_sampling_level='sequence' takes loss_type 'grpo', not "
                         f"{loss_type!r} (TRL refuses the pair too)")
    if beta != 0.0 and ref_log_probs is None:
        raise ValueError("beta != 0 needs ref_log_probs (the reference model's per-token "
                         "log-probabilities of the completion)")
    if completion_ids.shape != input.shape[:-1] or completion_mask.shape != completion_ids.shape:
        raise ValueError(f"completion_ids and completion_mask must have shape input.shape[:-1] "
                         f"= {tuple(input.shape[:-1])}, got {tuple(completion_ids.shape)} and "
                         f"{tuple(completion_mask.shape)}")
    # the weights in the log-probabilities' precision (float64 for float64 inputs)
    mask = completion_mask.to(torch.float64 if input.dtype == torch.float64 else torch.float32)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    token_weight = family.grpo_token_weights(mask, loss_type, max_completion_length,
                                             num_items_in_batch)
    options = family.GRPOOptions(float(beta), float(epsilon), _opt_float(epsilon_high),
                                 _opt_float(delta), importance_sampling_level,
                                 bool(kl_bias_correction))
    head = dict(linear_bias=linear_bias, temperature=temperature, softcap=softcap)
    fused = fused_head_operands(
        input, linear_weight, completion_ids, backend=backend, **head,
        group_rows=input.shape[-2] if importance_sampling_level == "sequence" else 1)
    if fused is not None:
        a, w, target, bias = fused
        return ops.grpo_loss_fused(
            a, w, bias, target, token_weight, mask, advantages.float(),
            None if old_log_probs is None else old_log_probs.detach(),
            None if ref_log_probs is None else ref_log_probs.detach(),
            *dataclasses.astuple(options), float(temperature), _opt_float(softcap),
            a.requires_grad, w.requires_grad, bias is not None and bias.requires_grad)
    log_probs = linear_log_probs(input, linear_weight, completion_ids, backend=backend, **head)
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    return (family.grpo_token_terms(log_probs, old, ref_log_probs, advantages, mask, options)
            * token_weight).sum()


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


def dpo_loss(
    input: torch.Tensor,  # (2B, T, D): the B chosen sequences, then the B rejected ones
    linear_weight: torch.Tensor,  # (V, D)
    target: torch.Tensor,  # (2B, T) token ids, ignore_index outside the completions
    *,
    ref_log_probs: torch.Tensor | None = None,  # (2B,) summed over each completion
    ref_input: torch.Tensor | None = None,  # (2B, T, D') the reference model's hidden states
    ref_weight: torch.Tensor | None = None,  # (V, D') its head
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    linear_bias: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Direct preference optimization (TRL 1.16's ``DPOTrainer``, reverse KL), a scalar: the
    mean over the B pairs of

        sigmoid  −log σ(β·Δ)          hinge  relu(1 − β·Δ)
        ipo      (Δ' − 1/(2β))²       robust ((1 − ε)·(−log σ(β·Δ)) + ε·log σ(−β·Δ)) / (1 − 2ε)

    where Δ = (log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected)),
    each log π the sum of the completion's token log-probabilities, Δ' the same with each
    log-ratio divided by its completion's token count, and ε = ``label_smoothing``.

    The reference enters as ``ref_log_probs`` (its summed log-probabilities, e.g. precomputed)
    or as ``ref_input`` and ``ref_weight`` (``ref_bias``), computed here without gradients.
    ``shift``, ``ignore_index``, ``softcap`` and ``backend`` are ``linear_log_probs``'. On the
    Triton backend, with gradients, the loss is fused into the policy's head: each chunk of
    whole pairs forms its logits, its log-ratios, its part of the loss and its gradient at once
    (three of the head's products, ``ops.post_training``), unless a pair holds more logits
    than ``Tuning.lm_head_chunk_bytes`` (then on ``linear_log_probs``).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    _check_reference(ref_log_probs, ref_input, ref_weight)
    _check_pairs(input)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    head = dict(softcap=softcap, ignore_index=ignore_index, shift=shift, backend=backend)
    lengths = _counted(target, head).sum(dim=-1).clamp(min=1).float()
    fused = fused_head_operands(input, linear_weight, target, linear_bias=linear_bias, **head,
                                group_rows=2 * input.shape[-2])  # a pair of sequences
    if fused is not None:
        ref_log_probs = _reference_sums((ref_log_probs, ref_input, ref_weight, ref_bias),
                                        target, head)
        a, w, flat_target, bias = fused
        return ops.dpo_loss_fused(
            a, w, bias, flat_target, ref_log_probs.detach().float(), lengths, target.shape[-1],
            int(ignore_index), float(beta), loss_type, float(label_smoothing),
            _opt_float(softcap), a.requires_grad, w.requires_grad,
            bias is not None and bias.requires_grad)
    log_ratios = _log_ratios(input, linear_weight, target, dict(head, linear_bias=linear_bias),
                             (ref_log_probs, ref_input, ref_weight, ref_bias))
    chosen, rejected = log_ratios.chunk(2, dim=0)
    chosen_len, rejected_len = lengths.chunk(2, dim=0)
    return family.dpo_pair_losses(chosen, rejected, chosen_len, rejected_len, beta, loss_type,
                                  label_smoothing).mean()


def _sequence_log_probs(input, linear_weight, target, head: dict, average: bool):
    """(2B,) or (B,) summed (``average``: mean) log-probs of each sequence's counted tokens."""
    token_log_probs = linear_log_probs(input, linear_weight, target, **head)
    total = token_log_probs.sum(dim=-1)
    return total / _counted(target, head).sum(dim=-1) if average else total


def _counted(target: torch.Tensor, head: dict) -> torch.Tensor:
    """Which target positions count (after the shift, when ``head`` asks for it)."""
    return (target[..., 1:] if head.get("shift") else target) != head.get("ignore_index", -100)


def _check_reference(ref_log_probs, ref_input, ref_weight) -> None:
    if (ref_log_probs is None) == (ref_input is None or ref_weight is None):
        raise ValueError("pass the reference as ref_log_probs, or as ref_input and ref_weight "
                         "(exactly one of the two)")


def _log_ratios(input, linear_weight, target, head: dict, reference: tuple) -> torch.Tensor:
    """Each sequence's summed log π − log π_ref; ``reference`` = (its summed log-probs, or
    None and then its hidden states, head and bias, run without gradients)."""
    log_probs = _sequence_log_probs(input, linear_weight, target, head, average=False)
    return log_probs - _reference_sums(reference, target, head)


def _reference_sums(reference: tuple, target, head: dict) -> torch.Tensor:
    """The reference's summed log-probabilities per sequence: ``reference`` = (them, or None
    and then its hidden states, head and bias, run here without gradients)."""
    ref_log_probs, ref_input, ref_weight, ref_bias = reference
    if ref_log_probs is not None:
        return ref_log_probs
    with torch.no_grad():
        return _sequence_log_probs(ref_input, ref_weight, target,
                                   dict(head, linear_bias=ref_bias), average=False)


def _check_pairs(input: torch.Tensor) -> None:
    if input.dim() < 2 or input.shape[0] % 2:
        raise ValueError(f"input must be (2B, T, D), the chosen sequences then the rejected "
                         f"ones, got shape {tuple(input.shape)}")


def _chosen_nll(input, linear_weight, target, nll_target, head: dict) -> torch.Tensor:
    """The chosen sequences' mean token NLL (against ``nll_target``, default their labels)."""
    from .losses.cross_entropy import linear_cross_entropy

    half = input.shape[0] // 2
    labels = target[:half] if nll_target is None else nll_target
    return linear_cross_entropy(input[:half], linear_weight, labels,
                                linear_bias=head.get("linear_bias"), softcap=head.get("softcap"),
                                ignore_index=head.get("ignore_index", -100),
                                shift=head.get("shift", False))


def orpo_loss(
    input: torch.Tensor,  # (2B, T, D): the B chosen sequences, then the B rejected ones
    linear_weight: torch.Tensor,  # (V, D)
    target: torch.Tensor,  # (2B, T) completion token ids, ignore_index elsewhere
    *,
    nll_target: torch.Tensor | None = None,  # (B, T) the chosen sequences' NLL labels
    beta: float = 0.1,
    linear_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Odds-ratio preference optimization (TRL 1.16's experimental ``ORPOTrainer``), a scalar:

        NLL(chosen) − β·mean(log σ(log odds)),   log odds = (c − r) − (log(1 − e^c) − log(1 − e^r))

    with c and r each sequence's mean completion-token log-probability and NLL the chosen
    sequences' mean token cross-entropy against ``nll_target`` (TRL scores the prompt too: its
    labels are the input ids wherever the attention mask is 1), by default their ``target``.
    On the Triton backend, with gradients and no ``nll_target``, fused into the head as
    ``cpo_loss`` is (chunks of whole pairs, three products).
    """
    _check_pairs(input)
    head = dict(linear_bias=linear_bias, softcap=softcap, ignore_index=ignore_index, shift=shift,
                backend=backend)
    fused = None
    if nll_target is None:  # the NLL on the same targets: in the fused pass
        fused = fused_head_operands(input, linear_weight, target, **head,
                                    group_rows=2 * input.shape[-2])
    if fused is not None:
        a, w, flat_target, bias = fused
        lengths = _counted(target, head).sum(dim=-1).clamp(min=1).float()
        return ops.cpo_loss_fused(
            a, w, bias, flat_target, lengths, target.shape[-1], int(ignore_index), float(beta),
            "orpo", 0.0, 0.0, 1.0, _opt_float(softcap), a.requires_grad, w.requires_grad,
            bias is not None and bias.requires_grad)
    chosen, rejected = _sequence_log_probs(input, linear_weight, target, head,
                                           average=True).chunk(2, dim=0)
    nll = _chosen_nll(input, linear_weight, target, nll_target, head)
    return nll + family.orpo_pair_losses(chosen, rejected, beta).mean()


def cpo_loss(
    input: torch.Tensor,  # (2B, T, D): the B chosen sequences, then the B rejected ones
    linear_weight: torch.Tensor,  # (V, D)
    target: torch.Tensor,  # (2B, T) completion token ids, ignore_index elsewhere
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    nll_target: torch.Tensor | None = None,  # (B, T) the chosen sequences' NLL labels
    linear_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Contrastive preference optimization (TRL 1.16's experimental ``CPOTrainer``), a scalar:
    the mean over the pairs of ``loss_type``'s term in m = c − r (c, r each sequence's summed
    completion log-probability; mean per token for "ipo" and "simpo"),

        sigmoid  −(1 − ε)·log σ(β·m) − ε·log σ(−β·m)       hinge  relu(1 − β·m)
        ipo      (m − 1/(2β))²                             simpo  sigmoid's with m − γ/β

    plus ``cpo_alpha`` × the chosen sequences' mean token NLL (against ``nll_target``, by
    default their ``target``); ε = ``label_smoothing``, γ = ``simpo_gamma``. On the Triton
    backend, with gradients, fused into the head as ``dpo_loss`` is (chunks of whole pairs,
    three products), unless the NLL has targets of its own or a pair exceeds the chunk budget.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, got {loss_type!r}")
    _check_pairs(input)
    head = dict(linear_bias=linear_bias, softcap=softcap, ignore_index=ignore_index, shift=shift,
                backend=backend)
    average = loss_type in ("ipo", "simpo")
    fused = None
    if nll_target is None or not cpo_alpha:  # the NLL on the same targets: in the fused pass
        fused = fused_head_operands(input, linear_weight, target, **head,
                                    group_rows=2 * input.shape[-2])
    if fused is not None:
        a, w, flat_target, bias = fused
        lengths = _counted(target, head).sum(dim=-1).clamp(min=1).float()
        return ops.cpo_loss_fused(
            a, w, bias, flat_target, lengths, target.shape[-1], int(ignore_index), float(beta),
            loss_type, float(label_smoothing), float(simpo_gamma), float(cpo_alpha),
            _opt_float(softcap), a.requires_grad, w.requires_grad,
            bias is not None and bias.requires_grad)
    chosen, rejected = _sequence_log_probs(input, linear_weight, target, head,
                                           average=average).chunk(2, 0)
    margin = chosen - rejected
    if loss_type == "simpo":
        margin = margin - simpo_gamma / beta
    loss = family.cpo_pair_losses(margin, beta, loss_type, label_smoothing).mean()
    if cpo_alpha:
        loss = loss + cpo_alpha * _chosen_nll(input, linear_weight, target, nll_target, head)
    return loss


def simpo_loss(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
               beta: float = 2.0, gamma: float = 0.5, cpo_alpha: float = 0.0,
               **options) -> torch.Tensor:
    """SimPO: ``cpo_loss(..., loss_type="simpo", simpo_gamma=gamma)`` (TRL's CPOTrainer with
    ``loss_type="simpo"``), by default without the NLL term (``cpo_alpha`` 0) and with the
    paper's β = 2; ``options`` are ``cpo_loss``'."""
    return cpo_loss(input, linear_weight, target, beta=beta, loss_type="simpo",
                    simpo_gamma=gamma, cpo_alpha=cpo_alpha, **options)


def kto_loss(
    input: torch.Tensor,  # (B, T, D)
    linear_weight: torch.Tensor,  # (V, D)
    target: torch.Tensor,  # (B, T) completion token ids, ignore_index elsewhere
    desirable: torch.Tensor,  # (B,) bool: each completion's label
    *,
    ref_log_probs: torch.Tensor | None = None,  # (B,) summed over each completion
    ref_input: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    kl: torch.Tensor | float = 0.0,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    linear_bias: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Kahneman-Tversky optimization (TRL 1.16's ``KTOTrainer``), a scalar: the mean over the
    completions of

        desirable    w_d·(1 − σ(β·(ρ − z)))        undesirable  w_u·(1 − σ(β·(z − ρ)))

    (``loss_type="apo_zero_unpaired"``: 1 − σ(β·ρ) and σ(β·ρ)), with ρ = log π − log π_ref of
    the completion (summed token log-probabilities) and z = ``kl``, the batch's KL reference
    point (TRL's: the mean log-ratio of mismatched prompt-completion pairs, clamped at 0,
    detached). The reference enters as ``ref_log_probs`` or ``ref_input`` and ``ref_weight``.
    On the Triton backend, with gradients, fused into the head (chunks of whole completions,
    three products of the policy's head) unless a completion exceeds the chunk budget.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
    _check_reference(ref_log_probs, ref_input, ref_weight)
    if desirable.shape != input.shape[:1]:
        raise ValueError(f"desirable must have shape ({input.shape[0]},), got "
                         f"{tuple(desirable.shape)}")
    head = dict(softcap=softcap, ignore_index=ignore_index, shift=shift, backend=backend)
    good = desirable.to(torch.bool)
    fused = fused_head_operands(input, linear_weight, target, linear_bias=linear_bias, **head,
                                group_rows=input.shape[-2])
    if fused is not None:
        ref_log_probs = _reference_sums((ref_log_probs, ref_input, ref_weight, ref_bias),
                                        target, head)
        a, w, flat_target, bias = fused
        kl_t = torch.as_tensor(kl, dtype=torch.float32, device=a.device).detach().reshape(())
        return ops.kto_loss_fused(
            a, w, bias, flat_target, ref_log_probs.detach().float(), good, kl_t,
            target.shape[-1], int(ignore_index), float(beta), float(desirable_weight),
            float(undesirable_weight), loss_type, _opt_float(softcap), a.requires_grad,
            w.requires_grad, bias is not None and bias.requires_grad)
    ratio = _log_ratios(input, linear_weight, target, dict(head, linear_bias=linear_bias),
                        (ref_log_probs, ref_input, ref_weight, ref_bias))
    kl = torch.as_tensor(kl, dtype=ratio.dtype, device=ratio.device).detach()
    return family.kto_losses(ratio, good, kl, beta, desirable_weight, undesirable_weight,
                             loss_type).mean()
