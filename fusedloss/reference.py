"""Float64 reference definitions of every loss in fusedloss.

These functions *are* the semantics of the library: the docs quote them and the tests compare
every kernel against them. They are deliberately naive: inputs are upcast to float64, the full
logit matrix (N×V or b×b) is materialized, and everything is built from differentiable torch
ops, so ``loss.backward()`` gives float64-accurate reference gradients (returned to the inputs
in their own dtype by autograd).

Only small problems fit: a reference allocates the logits it exists to avoid.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "linear_cross_entropy_ref",
    "linear_log_probs_ref",
    "linear_divergence_ref",
    "clip_loss_ref",
    "info_nce_loss_ref",
    "nt_xent_loss_ref",
    "siglip_loss_ref",
]

_REDUCTIONS = ("none", "sum", "mean")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _reduce(per_row: Tensor, reduction: str) -> Tensor:
    """Plain "none" / "sum" / "mean" (mean over all rows) of a per-row loss vector."""
    _check_reduction(reduction)
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return per_row.sum()
    return per_row.mean()


def _as_float64(value: Tensor | float) -> Tensor | float:
    """Upcast a tensor (keeping its autograd graph); leave Python numbers alone."""
    return value.double() if isinstance(value, Tensor) else float(value)


def linear_cross_entropy_ref(
    input: Tensor,  # (*, D)
    linear_weight: Tensor,  # (V, D)
    target: Tensor,  # (*) int64
    *,
    linear_bias: Tensor | None = None,  # (V,)
    weight: Tensor | None = None,  # (V,) class weights
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    shift: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of a linear layer's logits (an LM head), in float64.

    Equals ``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
    reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)`` computed
    in float64 (with the leading dims flattened), plus three extensions and one difference:

    - ``softcap=c``: ``logits = c * tanh(logits / c)`` before everything else.
    - ``z_loss=λ``: adds ``λ * lse_i**2`` to the loss of every non-ignored token
      (differentiable; under "mean" it is divided by the same denominator as the rest).
    - ``shift=True``: position t predicts ``target[..., t + 1]``; the loss uses
      ``input[..., :-1, :]`` and ``target[..., 1:]``.
    - Difference: when the "mean" denominator is 0 (every token ignored), the loss is 0 with
      zero gradients, where PyTorch returns NaN.

    For a non-ignored token i with ``y = target_i``, ``lse_i = logsumexp(logits_i)``,
    ``logp = logits_i - lse_i``, ``α = label_smoothing`` and class weights ``w`` (all ones
    without ``weight``)::

        loss_i = (1 - α) * w[y] * (-logp[y]) + (α / V) * Σ_j w[j] * (-logp[j]) + λ * lse_i**2

    An ignored token (``target_i == ignore_index``) has ``loss_i = 0`` exactly.

    Reductions: "none" → ``loss`` with the shape of ``target`` (after the shift); "sum" →
    ``Σ_i loss_i``; "mean" → ``Σ_i loss_i / Σ_{i not ignored} w[target_i]`` (PyTorch's
    weighted mean, also with label smoothing), where a zero denominator is replaced by 1.

    Returns a float64 loss, or ``(loss, lse)`` with ``return_lse=True``: ``lse`` is float64,
    shaped like the per-token loss, and 0 at ignored tokens.

    Example::

        >>> e, c = torch.randn(2, 8, 16), torch.randn(100, 16)
        >>> y = torch.randint(0, 100, (2, 8))
        >>> linear_cross_entropy_ref(e, c, y, shift=True, reduction="none").shape
        torch.Size([2, 7])
    """
    _check_reduction(reduction)
    if shift:
        input = input[..., :-1, :]
        target = target[..., 1:]

    logits = input.double() @ linear_weight.double().T  # (*, V)
    if linear_bias is not None:
        logits = logits + linear_bias.double()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    vocab_size = logits.shape[-1]

    lse = torch.logsumexp(logits, dim=-1)  # (*)
    log_probs = logits - lse.unsqueeze(-1)  # (*, V)
    class_weight = (
        weight.double()
        if weight is not None
        else torch.ones(vocab_size, dtype=torch.float64, device=logits.device)
    )

    not_ignored = target != ignore_index  # (*)
    safe_target = torch.where(not_ignored, target, torch.zeros_like(target))
    target_weight = class_weight[safe_target]  # (*)
    nll = -log_probs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # (*)
    smooth = -(log_probs * class_weight).sum(dim=-1)  # (*)

    per_token = (
        (1.0 - label_smoothing) * target_weight * nll
        + (label_smoothing / vocab_size) * smooth
        + z_loss * lse.square()
    )
    # where() rather than multiplication by a mask: ignored tokens get an exact 0 and an
    # exactly zero gradient.
    per_token = torch.where(not_ignored, per_token, torch.zeros_like(per_token))

    if reduction == "none":
        loss = per_token
    elif reduction == "sum":
        loss = per_token.sum()
    else:
        denominator = torch.where(not_ignored, target_weight, torch.zeros_like(target_weight))
        denominator = denominator.sum()
        denominator = torch.where(denominator == 0, torch.ones_like(denominator), denominator)
        loss = per_token.sum() / denominator

    if return_lse:
        return loss, torch.where(not_ignored, lse, torch.zeros_like(lse))
    return loss


def linear_log_probs_ref(
    input: Tensor,  # (*, D)
    linear_weight: Tensor,  # (V, D)
    target: Tensor,  # (*) int64
    *,
    linear_bias: Tensor | None = None,  # (V,)
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
) -> tuple[Tensor, Tensor]:
    """(log p(target), entropy) per token of softmax(softcap(input Wᵀ + b) / T), float64, 0 at
    ignored positions (``fusedloss.linear_log_probs``; with ``shift`` the last dim one shorter,
    position t scored against ``target[..., t + 1]``)."""
    if shift:
        input, target = input[..., :-1, :], target[..., 1:]
    logits = input.double() @ linear_weight.double().T
    if linear_bias is not None:
        logits = logits + linear_bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    valid = target != ignore_index
    picked = logp_all.gather(-1, torch.where(valid, target, 0).long()[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)


def linear_divergence_ref(
    student_input: Tensor,  # (*, D_s)
    student_weight: Tensor,  # (V, D_s)
    teacher_input: Tensor,  # (*, D_t)
    teacher_weight: Tensor,  # (V, D_t)
    *,
    kind: str = "forward",  # "forward" KL(t‖s), "reverse" KL(s‖t), "jsd"
    beta: float = 0.5,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Per-token divergence (float64, shape *) between the tempered teacher and student
    distributions (``fusedloss.linear_kl_div``, ``linear_jsd``): KL(p_t ‖ p_s), KL(p_s ‖ p_t), or
    β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m) with m = β·p_t + (1 − β)·p_s for 0 < β < 1, and at
    β = 0 and 1 (where the mixture would give 0) the forward and the reverse KL, as TRL's GKD
    loss and liger-kernel define them."""
    def log_probs(a, w, b):
        z = a.double() @ w.double().T
        if b is not None:
            z = z + b.double()
        return torch.log_softmax(z / temperature, dim=-1)

    def kl(p_log, q_log):
        p = p_log.exp()
        return torch.where(p > 0, p * (p_log - q_log), 0.0).sum(-1)

    s = log_probs(student_input, student_weight, student_bias)
    t = log_probs(teacher_input, teacher_weight, teacher_bias)
    if kind == "jsd" and beta in (0.0, 1.0):  # TRL's and liger's ends: the two KLs
        kind = "forward" if beta == 0.0 else "reverse"
    if kind == "forward":
        return kl(t, s)
    if kind == "reverse":
        return kl(s, t)
    m = torch.log(beta * t.exp() + (1 - beta) * s.exp())
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def _contrastive_logits(
    a: Tensor, b: Tensor, logit_scale: Tensor | float, logit_bias: Tensor | float | None
) -> Tensor:
    """``logit_scale * a @ b.T (+ logit_bias)`` in float64."""
    logits = _as_float64(logit_scale) * (a.double() @ b.double().T)
    if logit_bias is not None:
        logits = logits + _as_float64(logit_bias)
    return logits


def clip_loss_ref(
    image_features: Tensor,  # (b, D)
    text_features: Tensor,  # (b, D)
    logit_scale: Tensor | float,  # scalar (already exp()-ed, as in open_clip)
    logit_bias: Tensor | float | None = None,  # scalar
    *,
    reduction: str = "mean",
) -> Tensor:
    """Symmetric CLIP loss (open_clip ``ClipLoss`` on one process), in float64.

    ``logits = logit_scale * image_features @ text_features.T (+ logit_bias)``, shape (b, b);
    pair i is the positive of row i and of column i::

        loss_i = ((lse_row_i - logits_ii) + (lse_col_i - logits_ii)) / 2

    "none" → the (b,) vector ``loss_i``; "sum" → its sum; "mean" → its mean, which equals
    open_clip's ``(CE(logits, arange(b)) + CE(logits.T, arange(b))) / 2``. Features are used
    as given (open_clip normalizes them in the model, not in the loss). A tensor
    ``logit_scale`` / ``logit_bias`` receives gradients.

    Example::

        >>> i, t = torch.randn(4, 8), torch.randn(4, 8)
        >>> clip_loss_ref(i, t, 10.0).shape
        torch.Size([])
    """
    logits = _contrastive_logits(image_features, text_features, logit_scale, logit_bias)
    positive = logits.diagonal()
    row_loss = torch.logsumexp(logits, dim=1) - positive
    column_loss = torch.logsumexp(logits, dim=0) - positive
    return _reduce((row_loss + column_loss) / 2, reduction)


def info_nce_loss_ref(
    query: Tensor,  # (N, D)
    keys: Tensor,  # (M, D), M >= N allowed (e.g. a queue of negatives)
    labels: Tensor | None = None,  # (N,) int64 index of each query's positive key
    *,
    temperature: float = 0.07,
    reduction: str = "mean",
) -> Tensor:
    """One-directional InfoNCE (MoCo-style), in float64.

    ``logits = query @ keys.T / temperature``, shape (N, M); the positive of query i is key
    ``labels[i]`` (default ``arange(N)``)::

        loss_i = logsumexp(logits_i) - logits[i, labels[i]]

    Equals ``F.cross_entropy(logits, labels, reduction=reduction)``.

    Example::

        >>> q, k = torch.randn(4, 8), torch.randn(16, 8)
        >>> info_nce_loss_ref(q, k, reduction="none").shape
        torch.Size([4])
    """
    logits = _contrastive_logits(query, keys, 1.0 / temperature, None)
    if labels is None:
        labels = torch.arange(logits.shape[0], device=logits.device)
    positive = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    return _reduce(torch.logsumexp(logits, dim=1) - positive, reduction)


def nt_xent_loss_ref(
    features: Tensor,  # (2B, D): view 1 of B samples stacked over view 2
    temperature: float = 0.5,
    *,
    reduction: str = "mean",
) -> Tensor:
    """SimCLR's NT-Xent loss, in float64.

    ``logits = features @ features.T / temperature`` with the diagonal (self-similarity)
    excluded; the positive of row i is row ``i + B`` and vice versa::

        loss_i = logsumexp_{j != i}(logits_ij) - logits[i, (i + B) mod 2B]

    "mean" averages over all 2B rows (both views). Features are used as given: pass
    L2-normalized features for SimCLR's cosine similarity.

    Example::

        >>> z = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
        >>> nt_xent_loss_ref(z, reduction="none").shape
        torch.Size([8])
    """
    num_rows = features.shape[0]
    if num_rows % 2:
        raise ValueError(f"features must stack two views: got an odd number of rows {num_rows}")
    logits = _contrastive_logits(features, features, 1.0 / temperature, None)
    self_pairs = torch.eye(num_rows, dtype=torch.bool, device=logits.device)
    logits = logits.masked_fill(self_pairs, float("-inf"))
    rows = torch.arange(num_rows, device=logits.device)
    positive = logits[rows, (rows + num_rows // 2) % num_rows]
    return _reduce(torch.logsumexp(logits, dim=1) - positive, reduction)


def siglip_loss_ref(
    image_features: Tensor,  # (b, D)
    text_features: Tensor,  # (b, D), or (M, D)
    logit_scale: Tensor | float,  # scalar (already exp()-ed, as in open_clip)
    logit_bias: Tensor | float,  # scalar
    *,
    positives: bool = True,
) -> Tensor:
    """Sigmoid loss (open_clip ``SigLipLoss`` on one process), in float64.

    ``logits = logit_scale * image_features @ text_features.T + logit_bias``, shape (b, M);
    labels ``z_ij = +1`` on the diagonal (i = j; none with ``positives=False``, as for another
    rank's texts) and ``-1`` elsewhere::

        loss = -Σ_ij logsigmoid(z_ij * logits_ij) / b

    Example::

        >>> i, t = torch.randn(4, 8), torch.randn(4, 8)
        >>> siglip_loss_ref(i, t, 10.0, -10.0).shape
        torch.Size([])
    """
    logits = _contrastive_logits(image_features, text_features, logit_scale, logit_bias)
    batch, m = logits.shape
    eye = torch.eye(batch, m, dtype=torch.float64, device=logits.device)
    labels = 2.0 * eye - 1.0 if positives else -torch.ones_like(eye)
    return -torch.nn.functional.logsigmoid(labels * logits).sum() / batch
