"""Contrastive losses on the linear-log-sum-exp core: the functional API.

CLIP, InfoNCE, SimCLR's NT-Xent and SigLIP, without the N×M similarity matrix. Their math and
gradients are written out in ``fusedloss/ops/contrastive.py``, whose custom ops compute them on
the engine; this layer checks the arguments, calls the op and reduces the per-row losses, in
traceable PyTorch with no host sync (``torch.compile`` takes it whole).
"""

from __future__ import annotations

from typing import Literal

import torch

from ..core import engine
from ..core.filtering import resolve_filter_eps
from ..ops import contrastive as ops

Reduction = Literal["none", "mean", "sum"]
Backend = Literal["auto", "triton", "torch"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _run(kind, a, b, scale, bias, target, filter_eps, backend, *, check_target=False,
         check_temperature=False) -> torch.Tensor:
    """Per-row losses (N,) fp32 for validated inputs (``ops.contrastive``)."""
    backend = engine.resolve_backend(backend, a.device)
    eps = resolve_filter_eps(filter_eps, a.dtype)  # validates on every backend
    eps = eps if backend == "triton" else None
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, scale, bias))
    loss, *_ = ops.contrastive(a, b, scale, bias, target, kind, eps, backend, wants_grad,
                               check_target, check_temperature)
    return loss


def _reduce(per_row: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return per_row
    return per_row.sum() if reduction == "sum" else per_row.mean()


# ---------------------------------------------------------------------------------------------
# public functions


def clip_loss(
    image_features: torch.Tensor,  # (b, D)
    text_features: torch.Tensor,  # (b, D)
    logit_scale: torch.Tensor | float,  # scalar, already exp()-ed (open_clip convention)
    logit_bias: torch.Tensor | float | None = None,  # scalar
    *,
    reduction: Reduction = "mean",
    filter_eps: float | Literal["auto"] | None = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """Symmetric CLIP loss without the b×b logits: open_clip's ``ClipLoss`` on one process.

    With ``logits = logit_scale · image_features @ text_features.T (+ logit_bias)``::

        loss = (F.cross_entropy(logits, arange(b)) + F.cross_entropy(logits.T, arange(b))) / 2

    Both directions come from one pass over the similarity tiles (row and column statistics
    together). A scalar ``logit_bias`` shifts every logit equally, which no softmax sees: the
    loss ignores it and its gradient is exactly zero (as in open_clip, up to rounding).

    Args:
        image_features: (b, D) fp32/bf16/fp16, used as given (normalize them beforehand, as
            open_clip's models do).
        text_features: (b, D), same dtype and device; pair i is (image i, text i).
        logit_scale: a float or a one-element tensor (gets its gradient).
        logit_bias: None, a float or a one-element tensor.
        reduction: "mean" (open_clip), "sum", or "none": the (b,) vector
            ``((lse_row_i − X_ii) + (lse_col_i − X_ii)) / 2`` whose mean is the loss.
        filter_eps: safe gradient filtering: the backward may skip similarity tiles as long as
            each row and each column loses at most this much softmax mass. "auto" picks by dtype
            (bf16 2⁻¹², fp16 2⁻¹⁵, fp32 exact); None or 0 computes every tile. Triton only.
        backend: "auto" (Triton on CUDA, torch otherwise), "triton" (CUDA, or the CPU under
            ``TRITON_INTERPRET=1``) or "torch" (chunked, O(chunk · b) memory).

    Returns:
        The fp32 loss: a scalar, or (b,) for "none".

    Example:
        >>> img = torch.nn.functional.normalize(torch.randn(8, 32), dim=1)
        >>> txt = torch.nn.functional.normalize(torch.randn(8, 32), dim=1)
        >>> clip_loss(img, txt, logit_scale=1 / 0.07)
        tensor(...)
    """
    _check_reduction(reduction)
    _check_pair(image_features, text_features, "image_features", "text_features")
    scale = _as_scalar(logit_scale, "logit_scale", image_features.device)
    bias = None if logit_bias is None else _as_scalar(logit_bias, "logit_bias",
                                                      image_features.device)
    target = torch.arange(image_features.shape[0], device=image_features.device)
    per_pair = _run("clip", image_features, text_features, scale, None, target,
                    filter_eps, backend)
    loss = _reduce(per_pair, reduction)
    if bias is not None:
        loss = loss + 0.0 * bias  # no effect on the loss, a zero gradient, NaN stays NaN
    return loss


def info_nce_loss(
    query: torch.Tensor,  # (N, D)
    keys: torch.Tensor,  # (M, D)
    labels: torch.Tensor | None = None,  # (N,) int, index of each query's positive key
    *,
    temperature: torch.Tensor | float = 0.07,
    reduction: Reduction = "mean",
    filter_eps: float | Literal["auto"] | None = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """One-directional InfoNCE (MoCo style) without the N×M logits.

    Equals ``F.cross_entropy(query @ keys.T / temperature, labels, reduction=reduction)``.

    Args:
        query: (N, D) fp32/bf16/fp16.
        keys: (M, D), same dtype and device; M may exceed N (a queue of negatives).
        labels: (N,) integers in [0, M): the positive key of each query. Default
            ``arange(N)`` (needs M ≥ N).
        temperature: τ > 0, a float or a one-element tensor (gets its gradient).
        reduction: "mean", "sum" or "none" ((N,) per-query losses).
        filter_eps, backend: as in :func:`clip_loss` (filtering bounds each row's lost mass).

    Returns:
        The fp32 loss: a scalar, or (N,) for "none".

    Example:
        >>> q = torch.nn.functional.normalize(torch.randn(8, 32), dim=1)
        >>> k = torch.nn.functional.normalize(torch.randn(64, 32), dim=1)
        >>> info_nce_loss(q, k, temperature=0.1)
        tensor(...)
    """
    _check_reduction(reduction)
    _check_features(query, "query")
    _check_features(keys, "keys")
    _check_same(query, keys, "query", "keys")
    if keys.shape[1] != query.shape[1]:
        raise ValueError(f"keys must be (M, D) with D = query.shape[1] = {query.shape[1]}, "
                         f"got shape {tuple(keys.shape)}")
    n, m = query.shape[0], keys.shape[0]
    if labels is None:
        if m < n:
            raise ValueError(f"labels=None pairs query i with key i, which needs M >= N; got "
                             f"N = {n} queries and M = {m} keys. Pass labels.")
        target = torch.arange(n, device=query.device)
    else:
        target = _check_labels(labels, n, query.device)
    scale = 1.0 / _as_scalar(temperature, "temperature", query.device, positive=True)
    per_row = _run("info_nce", query, keys, scale, None, target, filter_eps, backend,
                   check_target=labels is not None,
                   check_temperature=isinstance(temperature, torch.Tensor))
    return _reduce(per_row, reduction)


def nt_xent_loss(
    features: torch.Tensor,  # (2B, D): view 1 of B samples stacked over view 2
    temperature: torch.Tensor | float = 0.5,
    *,
    reduction: Reduction = "mean",
    filter_eps: float | Literal["auto"] | None = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """SimCLR's NT-Xent loss without the 2B×2B similarity matrix.

    With ``X = features @ features.T / temperature`` and the self-similarities X_ii left out
    of every denominator, row i's positive is row ``i + B`` and vice versa::

        loss_i = logsumexp_{j≠i} X_ij − X_{i, (i+B) mod 2B}

    The gradient is ``(G + Gᵀ) · Z / τ`` with G the per-logit gradient (the two views share
    the features, so both sides of the product contribute).

    Args:
        features: (2B, D) fp32/bf16/fp16, the two views stacked (``torch.cat([z1, z2])``);
            normalize them first for SimCLR's cosine similarity. An odd row count is an error.
        temperature: τ > 0, a float or a one-element tensor (gets its gradient).
        reduction: "mean" over all 2B rows (SimCLR), "sum" or "none" ((2B,) per-row losses).
        filter_eps, backend: as in :func:`clip_loss`.

    Example:
        >>> z1, z2 = torch.randn(8, 32), torch.randn(8, 32)
        >>> z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
        >>> nt_xent_loss(z, temperature=0.5)
        tensor(...)
    """
    _check_reduction(reduction)
    _check_features(features, "features")
    rows = features.shape[0]
    if rows % 2:
        raise ValueError(f"features must stack two views of B samples, (2B, D); got an odd "
                         f"number of rows, {rows}")
    half = rows // 2
    target = (torch.arange(rows, device=features.device) + half) % rows
    scale = 1.0 / _as_scalar(temperature, "temperature", features.device, positive=True)
    per_row = _run("nt_xent", features, features, scale, None, target, filter_eps, backend,
                   check_temperature=isinstance(temperature, torch.Tensor))
    return _reduce(per_row, reduction)


def siglip_loss(
    image_features: torch.Tensor,  # (b, D)
    text_features: torch.Tensor,  # (b, D)
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """SigLIP's pairwise sigmoid loss without the b×b logits: open_clip's ``SigLipLoss``.

    With ``logits = logit_scale · image_features @ text_features.T + logit_bias`` and labels
    z = +1 on the diagonal, −1 elsewhere::

        loss = −Σ_ij log σ(z_ij · logits_ij) / b

    Args:
        image_features, text_features: (b, D), same dtype and device, used as given.
        logit_scale, logit_bias: floats or one-element tensors (tensors get their gradients).
        backend: as in :func:`clip_loss`. Every tile is computed (no filtering).

    Returns:
        The fp32 scalar loss.
    """
    _check_pair(image_features, text_features, "image_features", "text_features")
    device = image_features.device
    scale = _as_scalar(logit_scale, "logit_scale", device)
    bias = _as_scalar(logit_bias, "logit_bias", device)
    target = torch.arange(image_features.shape[0], device=device)
    per_row = _run("siglip", image_features, text_features, scale, bias, target, None, backend)
    return per_row.sum() / image_features.shape[0]


# ---------------------------------------------------------------------------------------------
# input checks: clear errors that name the argument


def _check_reduction(reduction) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


def _check_features(t, name: str) -> None:
    if (error := feature_error(t, name)) is not None:
        raise error


def feature_error(t, name: str, *, allow_empty: bool = False) -> Exception | None:
    """What is wrong with a (batch, D) feature matrix, or None (``allow_empty``: 0 rows are
    fine, as on one rank of a process group)."""
    if not isinstance(t, torch.Tensor):
        return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        return ValueError(f"{name} must be 2-D (batch, D), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        return TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.shape[0] == 0 and not allow_empty:
        return ValueError(f"{name} is empty: a contrastive loss needs at least one row")
    if t.shape[1] == 0:
        return ValueError(f"{name} has width D = 0")
    return None


def _check_same(x, y, x_name: str, y_name: str) -> None:
    if y.dtype != x.dtype:
        raise TypeError(f"{y_name} has dtype {y.dtype} but {x_name} has {x.dtype}; they must match")
    if y.device != x.device:
        raise ValueError(f"{y_name} is on {y.device} but {x_name} on {x.device}")


def _check_pair(x, y, x_name: str, y_name: str) -> None:
    _check_features(x, x_name)
    _check_features(y, y_name)
    _check_same(x, y, x_name, y_name)
    if y.shape != x.shape:
        raise ValueError(f"{x_name} and {y_name} must have the same shape (b, D): one row per "
                         f"pair; got {tuple(x.shape)} and {tuple(y.shape)}")


def _as_scalar(value, name: str, device: torch.device, positive: bool = False) -> torch.Tensor:
    """A float or one-element tensor → a 0-dim fp32 tensor on ``device`` (keeping autograd).

    ``positive``: a float must be > 0 (a tensor's value is checked by the op, which reads it).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got shape "
                             f"{tuple(value.shape)}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the features on {device}")
        return value.reshape(()).float()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if positive and float(value) <= 0:  # NaN passes and gives a NaN loss
            raise ValueError(f"{name} must be > 0, got {float(value)}")
        # A fill kernel: torch.tensor(…, device=…) would copy from pageable host memory, which
        # waits for every kernel queued before it.
        return torch.full((), float(value), dtype=torch.float32, device=device)
    raise TypeError(f"{name} must be a float or a one-element tensor, got "
                    f"{type(value).__name__}")


def _check_labels(labels, n: int, device) -> torch.Tensor:
    """Type, shape and device of ``labels``; the op checks that they are in range."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer key indices, got {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape (N,) = ({n},), got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but query on {device}")
    return labels.long()
