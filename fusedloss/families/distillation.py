"""Distillation divergences between a student's and a teacher's token distributions.

With s and t the log-probabilities of the tempered student and teacher distributions over the
same vocabulary, per token:

    forward   KL(p_t ‖ p_s) = Σ_j p_t,j·(t_j − s_j)
    reverse   KL(p_s ‖ p_t) = Σ_j p_s,j·(s_j − t_j)
    jsd       β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m),   m = β·p_t + (1 − β)·p_s

(the generalized Jensen-Shannon divergence of TRL's GKD trainer and liger-kernel, 0 < β < 1,
symmetric at β = 0.5; at β = 0 and β = 1, where the mixture would give 0, they define it as
the forward and the reverse KL, and so does this module). With x_s = z_s / T the tempered
student logits (likewise x_t), the gradients are

    forward   ∂/∂x_s = p_s − p_t                 ∂/∂x_t = p_t ⊙ ((t − s) − KL)
    reverse   ∂/∂x_s = p_s ⊙ ((s − t) − KL)      ∂/∂x_t = p_t − p_s
    jsd       ∂/∂x_s = (1 − β)·p_s ⊙ ((s − log m) − KL(p_s ‖ m))
              ∂/∂x_t = β·p_t ⊙ ((t − log m) − KL(p_t ‖ m))

(the mixture's own derivative sums to a constant, which the softmax's Jacobian removes).
Plain PyTorch on a block of rows.
"""

from __future__ import annotations

import math

import torch

KINDS = ("forward", "reverse", "jsd")


def divergence(student_log_probs: torch.Tensor,  # (rows, V)
               teacher_log_probs: torch.Tensor,  # (rows, V)
               kind: str, beta: float = 0.5) -> torch.Tensor:
    """The divergence of the module doc per row, (rows,)."""
    return divergence_and_grads(student_log_probs, teacher_log_probs, kind, beta, None)[0]


def divergence_and_grads(
    student_log_probs: torch.Tensor,  # (rows, V) s
    teacher_log_probs: torch.Tensor,  # (rows, V) t
    kind: str,
    beta: float,
    upstream: torch.Tensor | None,  # (rows,) the divergences' upstream gradient; None: none
    teacher: bool = False,  # also the teacher's gradient
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(divergence per row, upstream × its gradient with respect to the tempered student
    logits x_s, likewise x_t when ``teacher``), the gradients (rows, V) None without
    ``upstream``."""
    s, t = student_log_probs, teacher_log_probs
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward" if beta == 0.0 else "reverse"
    if kind == "forward":
        (value, d_t), d_s = _kl_and_grad(t, s), s.exp() - t.exp()
    elif kind == "reverse":
        (value, d_s), d_t = _kl_and_grad(s, t), t.exp() - s.exp()
    else:
        mixture = torch.logsumexp(torch.stack((s + math.log1p(-beta), t + math.log(beta))),
                                  dim=0)
        kl_t, d_t = _kl_and_grad(t, mixture)
        kl_s, d_s = _kl_and_grad(s, mixture)
        value, d_s, d_t = beta * kl_t + (1 - beta) * kl_s, (1 - beta) * d_s, beta * d_t
    if upstream is None:
        return value, None, None
    g = upstream[:, None]
    return value, g * d_s, g * d_t if teacher else None


def _kl_and_grad(p_log: torch.Tensor, q_log: torch.Tensor):
    """(KL(p ‖ q) per row, p ⊙ ((p_log − q_log) − KL)): the divergence and its gradient with
    respect to the logits of p with q held; 0·log 0 = 0."""
    p = p_log.exp()
    gap = torch.where(p > 0, p_log - q_log, 0.0)
    kl = (p * gap).sum(dim=-1)
    return kl, p * (gap - kl[:, None])


def top_k_kl_and_grad(
    student_log_probs: torch.Tensor,  # (rows, V) s
    teacher_log_probs: torch.Tensor,  # (rows, k) the teacher's log-probabilities of k tokens
    teacher_ids: torch.Tensor,  # (rows, k) int64 their token ids
    upstream: torch.Tensor | None,  # (rows,)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Offline distillation from a teacher's top k: Σ_k p_t,k·(t_k − s_{id_k}) per row (the
    forward KL's terms on the teacher's k tokens, its remaining mass left out), and upstream ×
    its gradient with respect to x_s, (Σ_k p_t,k)·p_s − Σ_k p_t,k·[j = id_k]."""
    p_t = teacher_log_probs.exp()
    picked = student_log_probs.gather(1, teacher_ids)
    value = torch.where(p_t > 0, p_t * (teacher_log_probs - picked), 0.0).sum(dim=-1)
    if upstream is None:
        return value, None
    grad = p_t.sum(dim=-1, keepdim=True) * student_log_probs.exp()
    grad = grad.scatter_add(1, teacher_ids, -p_t)
    return value, upstream[:, None] * grad
