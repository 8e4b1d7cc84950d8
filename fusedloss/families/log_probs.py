"""Token log-probabilities and entropies through an LM head: from the statistics, and the
gradient coefficients.

With X = softcap(α·(A Bᵀ + bias)) / T (the tempered logits, α a model's logit scale;
``tempered_logits`` forms them for the core), m_i = max_j X_ij, S_i = Σ_j exp(X_ij − m_i),
C_i = Σ_j exp(X_ij − m_i)·(X_ij − m_i) ≤ 0 and P the row softmax, a token's

    log p_i = X_{i,y_i} − lse_i                    H_i = −Σ_j P_ij log P_ij = log S_i − C_i / S_i

(the entropy as two terms ≥ 0: no cancellation on a confident row). With g and h the upstream
gradients of log p and H, the gradient with respect to the tempered logits is

    dX_ij = −g_i·(P_ij − [j = y_i]) − h_i·P_ij·((X_ij − m_i) − C_i / S_i)

the core's r·P − t·[j = y] + e·P·(X − m) with r_i = −g_i + h_i·C_i/S_i, t_i = −g_i, e_i = −h_i.
"""

from __future__ import annotations

import torch

from ..core.engine import GradCoefficients, Logits, RowStats


def logit_factor(logit_scale: float, temperature: float) -> float:
    """α / T: what the tempered logits scale the product and the bias by."""
    return logit_scale / temperature


def tempered_logits(bias: torch.Tensor | None, logit_scale: float, temperature: float,
                    softcap: float | None, dtype: torch.dtype, device: torch.device) -> Logits:
    """The core's logits for softcap(α·(A Bᵀ + bias)) / T: softcap_c(x) / T = softcap_{c/T}(x / T),
    so α / T scales the product and the bias, and the soft-cap becomes c / T."""
    factor = logit_factor(logit_scale, temperature)
    if factor == 1.0 and temperature == 1.0:
        return Logits(bias=bias, softcap=softcap)
    return Logits(bias=None if bias is None else bias * factor,
                  scale=torch.full((), factor, dtype=dtype, device=device),
                  softcap=None if softcap is None else softcap / temperature)


def token_log_prob(stats: RowStats) -> torch.Tensor:
    """log p_i (N,) of each row's target (rows without one: −lse_i)."""
    return -stats.lse_minus(stats.target_logit)


def token_entropy(stats: RowStats) -> torch.Tensor:
    """H_i (N,) of each row's tempered distribution; needs ``RowStats.centered_sum``."""
    return stats.log_sum - stats.centered_sum / stats.sum


def log_sum_squares(stats: RowStats) -> torch.Tensor:
    """log Σ_j P_ij² (N,); needs ``RowStats.square_sum``."""
    return torch.log(stats.square_sum) - 2 * stats.log_sum


def mean_logit(stats: RowStats, v: int) -> torch.Tensor:
    """Σ_j X_ij / V (N,); needs ``RowStats.weighted_sum`` without column weights."""
    return stats.weighted_sum / v


def grad_coefficients(g: torch.Tensor,  # (N,) the log-probs' upstream gradient
                      h: torch.Tensor | None,  # (N,) the entropies', or None
                      stats: RowStats) -> GradCoefficients:
    """(r, t, e) of the module doc as the core's ``GradCoefficients``."""
    if h is None:
        return GradCoefficients(lse=-g, target=-g)
    return GradCoefficients(lse=h * (stats.centered_sum / stats.sum) - g, target=-g, logit=-h)
