"""GRPO's and DPO's losses from token log-probabilities (TRL 1.16's definitions), written once
for ``fusedloss.post_training`` and for the ops that fuse them into the LM head.

Each is split so that a block of whole sequences (GRPO) or of whole pairs (DPO) gives its part
of the loss on its own: GRPO's loss is Σ_tokens w·ℓ(log p) with per-token weights w that hold
the reduction (``grpo_token_weights``, from the masks alone) and terms ℓ that read only their
own sequence (``grpo_token_terms``); DPO's is Σ_pairs ℓ(Δ) / B. For the fused path
(``ops.post_training``), whose op cannot run autograd inside, ``grpo_loss_and_grad`` and
``dpo_loss_and_grad`` give a block's part of the loss with its gradient with respect to each
token's log-probability in closed form (the same rules as autograd's, ties of a min split in
half); the tests hold them to autograd on the formulas above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


@dataclass(frozen=True)
class GRPOOptions:
    """The options of GRPO's per-token terms (``post_training.grpo_loss``' doc)."""

    beta: float = 0.0  # the KL term's weight
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None  # two-sided clipping's bound on the ratio
    importance_sampling_level: str = "token"  # or "sequence"
    kl_bias_correction: bool = True


def grpo_token_terms(
    log_probs: torch.Tensor,  # (B, T) the policy's
    old: torch.Tensor,  # (B, T) the sampling policy's
    ref: torch.Tensor | None,  # (B, T) the reference's (with beta ≠ 0)
    advantages: torch.Tensor,  # (B, 1) or (B, T)
    mask: torch.Tensor,  # (B, T) fp32
    options: GRPOOptions,
) -> torch.Tensor:
    """ℓ per token (B, T): −min(r·A, clamp(r, 1 − ε_low, 1 + ε_high)·A) + β·KL (the
    ``grpo_loss`` doc's terms), r per token or per sequence (the masked mean log-ratio)."""
    beta, epsilon, epsilon_high, delta = (options.beta, options.epsilon, options.epsilon_high,
                                          options.delta)
    log_ratio = log_probs - old
    if options.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * advantages, clipped * advantages)
    if beta != 0.0:
        gap = ref - log_probs
        kl = torch.exp(gap) - gap - 1
        per_token = per_token + beta * (kl * ratio if options.kl_bias_correction else kl)
    return per_token


def grpo_token_weights(
    mask: torch.Tensor,  # (B, T) fp32
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: torch.Tensor | float | None,
) -> torch.Tensor:
    """w (B, T): each token's share of the loss, ``loss_type``'s reduction: "grpo" 1/(B·n_b)
    (n_b the sequence's counted tokens), "bnpo" 1/Σ n_b, "dr_grpo" 1/(B·max_completion_length),
    "dapo" 1/``num_items_in_batch`` (default Σ n_b); 0 where the mask is."""
    b, t = mask.shape
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * b)
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (b * (max_completion_length or t))
    count = mask.sum() if num_items_in_batch is None else torch.as_tensor(
        num_items_in_batch, dtype=mask.dtype, device=mask.device)
    return mask / count.clamp(min=1.0)


def dpo_pair_losses(
    chosen: torch.Tensor,  # (B,) log π − log π_ref of each chosen completion (summed)
    rejected: torch.Tensor,  # (B,) the same of the rejected ones
    chosen_len: torch.Tensor,  # (B,) counted tokens (for "ipo")
    rejected_len: torch.Tensor,  # (B,)
    beta: float,
    loss_type: str,
    label_smoothing: float,
) -> torch.Tensor:
    """Each pair's loss (B,) (``dpo_loss``'s doc)."""
    delta = chosen - rejected
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        return (chosen / chosen_len - rejected / rejected_len - 1 / (2 * beta)) ** 2
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(beta * delta)
            + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)


def grpo_loss_and_grad(
    log_probs: torch.Tensor,  # (b, T) the policy's, a block of whole sequences
    old: torch.Tensor | None,  # (b, T); None: log_probs (detached)
    ref: torch.Tensor | None,
    advantages: torch.Tensor,  # (b, 1) or (b, T)
    mask: torch.Tensor,  # (b, T)
    token_weight: torch.Tensor,  # (b, T): ``grpo_token_weights``' rows of the block
    options: GRPOOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ w·ℓ over the block (), its gradient with respect to ``log_probs`` (b, T)), ℓ of
    ``grpo_token_terms``. With ρ the importance ratio, ∂ℓ/∂ρ from the clipped surrogate (and
    β·KL with the bias correction), ∂ρ/∂log p = ρ per token, or ρ·m_s / n for every token s of
    the sequence at the sequence level; plus the KL's own ∂/∂log p = β·(1 − e^(ref − log p))
    (× ρ with the correction)."""
    beta, epsilon, epsilon_high, delta = (options.beta, options.epsilon, options.epsilon_high,
                                          options.delta)
    old = log_probs if old is None else old
    sequence = options.importance_sampling_level == "sequence"
    log_ratio = log_probs - old
    count = mask.sum(-1, keepdim=True).clamp(min=1.0)
    if sequence:
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / count
    ratio = torch.exp(log_ratio)
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    d_clipped = ((ratio >= 1 - epsilon) & (ratio <= 1 + high)).to(ratio.dtype)
    unclipped, d_unclipped = ratio, torch.ones_like(ratio)
    if delta is not None:
        unclipped = torch.clamp(ratio, max=delta)
        d_unclipped = (ratio <= delta).to(ratio.dtype)
    first, second = unclipped * advantages, clipped * advantages
    # ∂/∂ρ of −min(first, second): the smaller one's, half each at a tie
    d_first, d_second = d_unclipped * advantages, d_clipped * advantages
    d_ratio = -torch.where(first < second, d_first,
                           torch.where(first > second, d_second, (d_first + d_second) / 2))
    terms = -torch.min(first, second)
    direct = torch.zeros_like(log_probs)
    if beta != 0.0:
        gap = ref - log_probs
        kl = torch.exp(gap) - gap - 1
        d_kl = 1 - torch.exp(gap)  # ∂KL/∂log p
        if options.kl_bias_correction:
            terms = terms + beta * kl * ratio
            d_ratio = d_ratio + beta * kl
            direct = beta * d_kl * ratio
        else:
            terms = terms + beta * kl
            direct = beta * d_kl
    loss = (terms * token_weight).sum()
    via_ratio = d_ratio * token_weight
    if sequence:  # ρ of the sequence moves with each of its counted tokens
        via_ratio = via_ratio.sum(-1, keepdim=True) * ratio * mask / count
    else:
        via_ratio = via_ratio * ratio
    return loss, via_ratio + direct * token_weight


def dpo_loss_and_grad(
    chosen: torch.Tensor,  # (b,) log π − log π_ref of a block's chosen completions
    rejected: torch.Tensor,  # (b,)
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
    beta: float,
    loss_type: str,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ of the block's pair losses (), ∂/∂chosen (b,), ∂/∂rejected (b,)) of
    ``dpo_pair_losses``."""
    losses = dpo_pair_losses(chosen, rejected, chosen_len, rejected_len, beta, loss_type,
                             label_smoothing)
    delta = chosen - rejected
    if loss_type == "ipo":
        gap = 2 * (chosen / chosen_len - rejected / rejected_len - 1 / (2 * beta))
        return losses.sum(), gap / chosen_len, -gap / rejected_len
    if loss_type == "sigmoid":
        d = -beta * torch.sigmoid(-beta * delta)
    elif loss_type == "hinge":
        d = torch.where(1 - beta * delta > 0, -beta, 0.0).to(delta.dtype)
    else:
        eps = label_smoothing
        d = (-(1 - eps) * beta * torch.sigmoid(-beta * delta)
             - eps * beta * torch.sigmoid(beta * delta)) / (1 - 2 * eps)
    return losses.sum(), d, -d


CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
PAIR_LOSSES = (*CPO_LOSS_TYPES, "orpo")  # the fused pair op's loss types (besides DPO)
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def cpo_pair_losses(margin: torch.Tensor,  # (B,) c − r (minus γ/β for "simpo")
                    beta: float, loss_type: str, label_smoothing: float) -> torch.Tensor:
    """Each pair's CPO loss (B,) (``cpo_loss``' doc) from its margin."""
    if loss_type in ("sigmoid", "simpo"):
        eps = label_smoothing
        return (-F.logsigmoid(beta * margin) * (1 - eps)
                - F.logsigmoid(-beta * margin) * eps)
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    return (margin - 1 / (2 * beta)) ** 2


def cpo_loss_and_grad(margin: torch.Tensor, beta: float, loss_type: str,
                      label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of the pairs' losses (), ∂/∂margin (B,)) of ``cpo_pair_losses``."""
    losses = cpo_pair_losses(margin, beta, loss_type, label_smoothing)
    if loss_type in ("sigmoid", "simpo"):
        eps = label_smoothing
        d = (-(1 - eps) * beta * torch.sigmoid(-beta * margin)
             + eps * beta * torch.sigmoid(beta * margin))
    elif loss_type == "hinge":
        d = torch.where(1 - beta * margin > 0, -beta, 0.0).to(margin.dtype)
    else:
        d = 2 * (margin - 1 / (2 * beta))
    return losses.sum(), d


def kto_losses(ratio: torch.Tensor,  # (B,) log π − log π_ref of each completion
               desirable: torch.Tensor,  # (B,) bool
               kl: torch.Tensor,  # () the KL reference point, detached
               beta: float, desirable_weight: float, undesirable_weight: float,
               loss_type: str) -> torch.Tensor:
    """Each completion's KTO loss (B,) (``kto_loss``' doc)."""
    if loss_type == "kto":
        return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                           undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * ratio)),
                       undesirable_weight * torch.sigmoid(beta * ratio))


def kto_loss_and_grad(ratio, desirable, kl, beta, desirable_weight, undesirable_weight,
                      loss_type) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ of the completions' losses (), ∂/∂ratio (B,)) of ``kto_losses``: σ' = σ·(1 − σ)."""
    losses = kto_losses(ratio, desirable, kl, beta, desirable_weight, undesirable_weight,
                        loss_type)
    good = beta * (ratio - kl) if loss_type == "kto" else beta * ratio
    bad = beta * (kl - ratio) if loss_type == "kto" else beta * ratio
    s_good, s_bad = torch.sigmoid(good), torch.sigmoid(bad)
    d_good = -desirable_weight * beta * s_good * (1 - s_good)
    # kto: w_u·(1 − σ(β(z − ρ))), ∂/∂ρ = +w_u·β·σ'; apo: w_u·σ(βρ), ∂/∂ρ = +w_u·β·σ'
    d_bad = undesirable_weight * beta * s_bad * (1 - s_bad)
    return losses.sum(), torch.where(desirable, d_good, d_bad)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, branching at −ln 2 against cancellation."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)),
                       torch.log(-torch.expm1(x)))


def orpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor,  # (B,) mean log-probs
                     beta: float) -> torch.Tensor:
    """Each pair's −β·log σ(log odds) (B,), log odds = (c − r) − (log(1 − e^c) − log(1 − e^r))
    (``orpo_loss``' doc, without its NLL)."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return -beta * F.logsigmoid(log_odds)


def orpo_loss_and_grad(chosen, rejected, beta) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    """(Σ of ``orpo_pair_losses`` (), ∂/∂chosen (B,), ∂/∂rejected (B,)): with L the log odds,
    ∂L/∂c = 1/(1 − e^c) and ∂L/∂r = −1/(1 − e^r) (= −1/(−expm1(r)))."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    d_odds = -beta * torch.sigmoid(-log_odds)
    return ((-beta * F.logsigmoid(log_odds)).sum(), d_odds / -torch.expm1(chosen),
            -d_odds / -torch.expm1(rejected))
