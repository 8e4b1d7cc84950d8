"""Linear cross-entropy: the per-token loss and the gradient coefficients.

With A = input rows, B = linear_weight, X = softcap(A Bᵀ + bias), lse_i = log Σ_j exp(X_ij),
y the target, w the class weights (1 without
``weight``), W = Σ_j w_j, α = label_smoothing and λ = z_loss, a non-ignored token's loss is

    loss_i = (1−α)·w_{y_i}·(lse_i − X_{i,y_i}) + (α/V)·(W·lse_i − Σ_j w_j X_ij) + λ·lse_i²

(``F.cross_entropy(logits, y, weight, label_smoothing=α, reduction="none")`` plus the z-loss),
and with g the loss's upstream gradient and g^lse the LSE's, its gradient with respect to the
logits is r_i·P_ij − t_i·[j=y_i] − u_i·w_j (P the row softmax), with

    r_i = g_i·((1−α)·w_{y_i} + α·W/V + 2λ·lse_i) + g^lse_i
    t_i = g_i·(1−α)·w_{y_i}
    u_i = g_i·α/V
"""

from __future__ import annotations

import torch

from ..core.engine import GradCoefficients, RowStats


def token_loss(lse_minus_target: torch.Tensor,  # (N,) lse_i − X_{i,y_i}
               lse: torch.Tensor,  # (N,)
               target_weight: torch.Tensor,  # (N,) w_{y_i}
               weighted_sum: torch.Tensor | None,  # (N,) Σ_j w_j X_ij, read when α > 0
               total_weight: torch.Tensor | float,  # W
               v: int, label_smoothing: float, z_loss: float) -> torch.Tensor:
    """loss_i of the module doc, per token (ignored tokens are the caller's to mask)."""
    alpha = label_smoothing
    loss = (1 - alpha) * target_weight * lse_minus_target
    if alpha > 0:
        loss = loss + (alpha / v) * (total_weight * lse - weighted_sum)
    if z_loss:
        loss = loss + z_loss * lse * lse
    return loss


def grad_coefficients(g: torch.Tensor,  # (N,) the per-token loss's upstream gradient
                      g_lse: torch.Tensor | float,  # (N,) the LSE's, or 0
                      lse: torch.Tensor, target_weight: torch.Tensor,
                      total_weight: torch.Tensor | float, v: int, label_smoothing: float,
                      z_loss: float) -> GradCoefficients:
    """(r, t, u) of the module doc as the core's ``GradCoefficients`` (u None without α)."""
    alpha = label_smoothing
    return GradCoefficients(
        lse=g * ((1 - alpha) * target_weight + alpha * total_weight / v + 2 * z_loss * lse)
        + g_lse,
        target=g * (1 - alpha) * target_weight,
        uniform=g * (alpha / v) if alpha > 0 else None,
    )


def gradient_mass(stats: RowStats, coef: GradCoefficients) -> torch.Tensor:
    """Each row's gradient mass relative to its softmax mass (the filter's per-row scale).

    The tile part of a row's gradient, r·P − t·e_y, has L1 mass r·((1 − P_y) + |P_y − t/r|).
    """
    p_target = torch.exp(-stats.lse_minus(stats.target_logit))
    ratio = torch.where(coef.lse != 0, coef.target / torch.where(coef.lse != 0, coef.lse, 1.0),
                        1.0)
    return torch.clamp((1 - p_target) + (p_target - ratio).abs(), max=1.0)


def summed_weights(target: torch.Tensor,  # (N,) int64 class ids, or ignore_index
                   ignore_index: int,
                   class_weight: torch.Tensor | None,  # (V,)
                   v: int, dtype: torch.dtype) -> torch.Tensor:
    """"mean"'s denominator, () in ``dtype``: Σ w_{y_i} over the tokens that are not ignored
    (their count without class weights). A target outside [0, V) is clamped into it: its own
    loss is NaN, and it must not index out of bounds."""
    valid = target != ignore_index
    if class_weight is None:
        return valid.sum(dtype=dtype)
    return torch.where(valid, class_weight.to(dtype)[target.clamp(0, v - 1)], 0.0).sum()
