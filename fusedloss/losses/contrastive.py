"""Contrastive losses on the linear-log-sum-exp core: the functional API.

CLIP, InfoNCE, SimCLR's NT-Xent and SigLIP, without the N×M similarity matrix. Their math and
gradients are written out in ``fusedloss/ops/contrastive.py``, whose custom ops compute them on
the engine; this layer checks the arguments, calls the op and reduces the per-row losses, in
traceable PyTorch with no host sync (``torch.compile`` takes it whole).

Rules shared by the four losses, their modules and their distributed forms:

- Autocast: under ``torch.autocast`` (CUDA or CPU) the features, the operands of the
  similarity product, are cast to the autocast dtype, as a matmul would cast them (features of
  two floating dtypes are then fine); ``logit_scale``, ``logit_bias`` and ``temperature`` stay
  fp32 scalars (elementwise factors, as in open_clip) and the loss is fp32, computed from fp32
  statistics. Outside autocast, features of different dtypes are a TypeError. float64 features
  are refused either way (autocast does not cast float64).
- Scale and temperature: a Python number must be finite and > 0 (``logit_bias``: finite), else
  a ValueError names the argument. A tensor's value is not checked on the host (reading it
  would wait for the device): a tensor scale or temperature that is ≤ 0, ±inf or NaN gives a
  NaN loss and NaN gradients.
- Empty inputs: every feature matrix needs at least one row and a width D ≥ 1, else a
  ValueError names the argument (over a process group a rank may hold 0 rows, as long as the
  group holds some).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from ..core import config, engine
from ..core.filtering import resolve_filter_eps
from ..ops import contrastive as ops
from ..ops import cross_entropy as lm_head_ops
from ..ops._common import autocast_operands

Reduction = Literal["none", "mean", "sum"]
Backend = Literal["auto", "triton", "materialized", "torch"]
BACKENDS = ("auto", "triton", "materialized", "torch")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(backend: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The backend that computes a loss of the features a (N, D) and b (M, D).

    "auto" takes, on CUDA, "materialized" while one N × M array of the features' dtype is at
    most ``Tuning.materialized_bytes`` (128 MiB: b = 8192 in bf16, 5792 in fp32), where the
    similarity matrix in one cuBLAS product and one Triton pass over it beats the tiled
    kernels, whose launches and host work cost more than the GPU's time there
    (docs/results.md, "Small sizes" and "Where the materialized path hands over"); "triton"
    above; "torch" on the CPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'triton', 'materialized' or 'torch', got "
                         f"{backend!r}")
    if backend == "materialized":
        engine.resolve_backend("triton", a.device)  # the same devices as the kernels
        return backend
    resolved = engine.resolve_backend(backend, a.device)
    if (backend == "auto" and resolved == "triton"
            and a.shape[0] * b.shape[0] * a.element_size() <= config.tuning().materialized_bytes):
        return "materialized"
    return resolved


def _run(kind, a, b, scale, bias, labels, filter_eps, backend, reduction) -> torch.Tensor:
    """The fp32 loss for validated inputs, per row (N,) or reduced as ``reduction`` says: the
    ops of ``ops/contrastive.py``. ``labels``: the caller's (N,) int64, or None: row i's
    positive is column i (NT-Xent: row i ± N/2)."""
    backend = resolve_backend(backend, a, b)
    if kind == "info_nce_no_diag" and backend == "materialized":  # the tiled kernels' only
        backend = "triton"
    eps = resolve_filter_eps(filter_eps, a.dtype)  # validates on every backend
    if backend == "materialized":  # exact: every pair is computed, no filtering
        loss, _ = ops.contrastive_materialized(a, b, scale, bias, labels, kind, reduction)
        return loss
    eps = eps if backend == "triton" else None
    n = a.shape[0]
    target = labels
    if labels is None:
        target = torch.arange(n, device=a.device)
        target = (target + n // 2) % n if kind == "nt_xent" else target
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, scale, bias))
    if (kind == "info_nce" and backend == "triton" and a.dtype == torch.float32
            and reduction != "none" and eps is None):
        return _info_nce_fp32_reduced(a, b, scale, target, reduction, labels is not None,
                                      wants_grad)
    loss, *_ = ops.contrastive(a, b, scale, bias, target, kind, eps, backend, wants_grad,
                               labels is not None)
    return _reduce(loss, reduction)


def _info_nce_fp32_reduced(a, b, scale, target, reduction, user_labels: bool,
                           wants_grad: bool) -> torch.Tensor:
    """A reduced fp32 InfoNCE: the LM head's training path
    (``ops.linear_cross_entropy_chunked``; with gradients or without, so that both give the
    same value) on the scaled queries, the keys as its head. On its cuBLAS fp32 products the
    loss takes a third of the tiled kernels' time (docs/contrastive.md, "fp32 inputs"); the
    logits are fp32 as there, the products at PyTorch's fp32 matmul precision (TF32 where the
    user allows it, as for PyTorch's own loss). ``scale``'s gradient flows through the product
    ``a · scale``. A label outside [0, M) makes the loss and the gradients NaN, as on the other
    paths (``Tuning.check_values``: the same ValueError)."""
    n, m = a.shape[0], b.shape[0]
    if user_labels:
        if config.tuning().check_values:
            ops.check_labels(target, m)
        target = torch.where((target >= 0) & (target < m), target, -1)  # -1: NaN, never ignored
    scaled = a * scale
    return lm_head_ops.linear_cross_entropy_chunked(
        scaled, b, target, None, None, -2, 0.0, None, 0.0, reduction == "mean",
        wants_grad and scaled.requires_grad, wants_grad and b.requires_grad, False,
        config.lm_head_deferred(n, m, a.element_size()))


def off_diagonal_margins(query: torch.Tensor,  # (N, D)
                         keys: torch.Tensor,  # (M, D), M ≥ N: key i is paired with query i
                         target: torch.Tensor,  # (N,) int64: a column j ≠ i per row
                         scale: float, backend: Backend = "auto") -> torch.Tensor:
    """LSE_{j≠i} X_ij − X_{i,target_i} per row (N,) fp32 of X = scale · Q Kᵀ, each row's own
    column i out of its denominator: what a loss needs where key i belongs to query i and must
    not count against it (sentence-transformers' query_to_query, doc_to_doc, hardness modes).
    The tiled kernels or the torch backend (no materialized path)."""
    scale_t = torch.full((), float(scale), dtype=torch.float32, device=query.device)
    return _run("info_nce_no_diag", query, keys, scale_t, None, target, "auto", backend, "none")


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

    Under ``torch.autocast`` (CUDA or CPU) both feature matrices are cast to the autocast dtype,
    as the matmul of open_clip's formula would cast them; ``logit_scale`` stays an fp32 scalar
    and the loss is fp32 (open_clip's ``ClipLoss`` under autocast, without the rounding of its
    logits to the autocast dtype).

    Args:
        image_features: (b, D) fp32/bf16/fp16, used as given (normalize them beforehand, as
            open_clip's models do); b ≥ 1 and D ≥ 1, else ValueError.
        text_features: (b, D), same device; same dtype outside autocast (else TypeError).
            Pair i is (image i, text i).
        logit_scale: a float, finite and > 0 (else ValueError), or a one-element tensor (gets
            its gradient; not read on the host: a value ≤ 0, ±inf or NaN gives a NaN loss and
            NaN gradients).
        logit_bias: None, a finite float, or a one-element tensor.
        reduction: "mean" (open_clip), "sum", or "none": the (b,) vector
            ``((lse_row_i − X_ii) + (lse_col_i − X_ii)) / 2`` whose mean is the loss.
        filter_eps: safe gradient filtering: the backward may skip similarity tiles as long as
            each row and each column loses at most this much softmax mass. "auto" picks by dtype
            (bf16 2⁻¹², fp16 2⁻¹⁵, fp32 exact); None or 0 computes every tile. Triton only.
        backend: "auto" (on CUDA "materialized" up to a 128 MiB similarity matrix, then
            "triton"; torch on the CPU: :func:`resolve_backend`), "triton" (the tiled kernels:
            CUDA, or the CPU under ``TRITON_INTERPRET=1``), "materialized" (the b × b matrix
            from one cuBLAS product, one Triton pass over it a side; exact, ``filter_eps``
            unused) or "torch" (chunked, O(chunk · b) memory).

    Returns:
        The fp32 loss: a scalar, or (b,) for "none".

    Example:
        >>> img = torch.nn.functional.normalize(torch.randn(8, 32), dim=1)
        >>> txt = torch.nn.functional.normalize(torch.randn(8, 32), dim=1)
        >>> clip_loss(img, txt, logit_scale=1 / 0.07)
        tensor(...)
    """
    _check_reduction(reduction)
    image_features, text_features = _check_pair(image_features, text_features,
                                                "image_features", "text_features")
    device = image_features.device
    scale = as_scalar(logit_scale, "logit_scale", device, positive=True)
    bias = None if logit_bias is None else as_scalar(logit_bias, "logit_bias", device)
    loss = _run("clip", image_features, text_features, scale, None, None, filter_eps, backend,
                reduction)
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

    Equals ``F.cross_entropy(query @ keys.T / temperature, labels, reduction=reduction)``;
    under ``torch.autocast`` (CUDA or CPU) as that expression runs there, with its matmul's
    operands cast to the autocast dtype: ``query`` and ``keys`` are cast, ``temperature``
    stays an fp32 scalar and the loss is fp32 (the logits are not rounded to the autocast
    dtype).

    Args:
        query: (N, D) fp32/bf16/fp16, N ≥ 1 and D ≥ 1 (else ValueError).
        keys: (M, D), same device; same dtype outside autocast (else TypeError). M ≥ 1 may
            exceed N (a queue of negatives).
        labels: (N,) integers in [0, M): the positive key of each query. Default
            ``arange(N)`` (needs M ≥ N). Not read on the host: a label outside [0, M) makes
            its query's loss NaN and the gradients NaN
            (``fusedloss.core.config.tuned(check_values=True)`` raises ValueError instead).
        temperature: τ, a float, finite and > 0 (else ValueError), or a one-element tensor
            (gets its gradient; not read on the host: τ ≤ 0, ±inf or NaN gives a NaN loss and
            NaN gradients).
        reduction: "mean", "sum" or "none" ((N,) per-query losses).
        filter_eps, backend: as in :func:`clip_loss` (filtering bounds each row's lost mass).
            A "mean" or "sum" loss of fp32 features on the Triton backend without an explicit
            ``filter_eps`` runs on the LM head's training path (cuBLAS fp32 products at
            PyTorch's fp32 matmul precision; docs/contrastive.md, "fp32 inputs").

    Returns:
        The fp32 loss: a scalar, or (N,) for "none".

    Example:
        >>> q = torch.nn.functional.normalize(torch.randn(8, 32), dim=1)
        >>> k = torch.nn.functional.normalize(torch.randn(64, 32), dim=1)
        >>> info_nce_loss(q, k, temperature=0.1)
        tensor(...)
    """
    _check_reduction(reduction)
    query, keys, error = matched_features(query, keys, "query", "keys")
    if error is not None:
        raise error
    if keys.shape[1] != query.shape[1]:
        raise ValueError(f"keys must be (M, D) with D = query.shape[1] = {query.shape[1]}, "
                         f"got shape {tuple(keys.shape)}")
    n, m = query.shape[0], keys.shape[0]
    if labels is None:
        if m < n:
            raise ValueError(f"labels=None pairs query i with key i, which needs M >= N; got "
                             f"N = {n} queries and M = {m} keys. Pass labels.")
    else:
        labels = _check_labels(labels, n, query.device)
    scale = inverse_scalar(temperature, "temperature", query.device)
    return _run("info_nce", query, keys, scale, None, labels, filter_eps, backend, reduction)


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

    Under ``torch.autocast`` (CUDA or CPU) ``features`` is cast to the autocast dtype, as the
    matmul would cast it; ``temperature`` stays an fp32 scalar and the loss is fp32.

    Args:
        features: (2B, D) fp32/bf16/fp16, the two views stacked (``torch.cat([z1, z2])``);
            normalize them first for SimCLR's cosine similarity. B ≥ 1 and D ≥ 1; 0 or an odd
            number of rows, or D = 0, is a ValueError.
        temperature: τ, a float, finite and > 0 (else ValueError), or a one-element tensor
            (gets its gradient; not read on the host: τ ≤ 0, ±inf or NaN gives a NaN loss and
            NaN gradients).
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
    (features,) = autocast_operands(features.device, features)
    rows = features.shape[0]
    if rows % 2:
        raise ValueError(f"features must stack two views of B samples, (2B, D); got an odd "
                         f"number of rows, {rows}")
    scale = inverse_scalar(temperature, "temperature", features.device)
    return _run("nt_xent", features, features, scale, None, None, filter_eps, backend,
                reduction)


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

    Under ``torch.autocast`` (CUDA or CPU) both feature matrices are cast to the autocast dtype;
    ``logit_scale`` and ``logit_bias`` stay fp32 scalars and the loss is fp32.

    Args:
        image_features, text_features: (b, D) fp32/bf16/fp16, same device, used as given; the
            same dtype outside autocast (else TypeError); b ≥ 1 and D ≥ 1 (else ValueError).
        logit_scale: a float, finite and > 0 (else ValueError), or a one-element tensor (gets
            its gradient; not read on the host: a value ≤ 0, ±inf or NaN gives a NaN loss and
            NaN gradients).
        logit_bias: a finite float or a one-element tensor (gets its gradient).
        backend: as in :func:`clip_loss`. Every logit is computed (no filtering); "triton"
            forms the logits a chunk of rows at a time with cuBLAS (fp32 output) and the loss
            and every gradient in one pass over each row, three products in all
            (``fusedloss/core/chunked_contrastive.py``).

    Returns:
        The fp32 scalar loss.
    """
    image_features, text_features = _check_pair(image_features, text_features,
                                                "image_features", "text_features")
    device = image_features.device
    scale = as_scalar(logit_scale, "logit_scale", device, positive=True)
    bias = as_scalar(logit_bias, "logit_bias", device)
    leaves = (image_features, text_features, scale, bias)
    if resolve_backend(backend, image_features, text_features) == "triton":
        # three products per chunk of rows, the gradients formed in the forward (the loss
        # alone without gradients: the same numbers either way)
        grad = torch.is_grad_enabled()
        return ops.siglip_chunked(*leaves, True, *(grad and t.requires_grad for t in leaves))
    return _run("siglip", image_features, text_features, scale, bias, None, None, backend,
                "mean")


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


def matched_features(x, y, x_name: str, y_name: str, *, allow_empty: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, Exception | None]:
    """Two feature matrices checked (``feature_error``) and on one device, cast to the autocast
    dtype while ``torch.autocast`` is on there (as a matmul would cast its operands), then of
    one dtype: ``(x, y, None)``, or the inputs and what is wrong with them. float64 is refused
    before any cast (autocast leaves float64 alone, and the losses do not take it)."""
    error = feature_error(x, x_name, allow_empty=allow_empty) or feature_error(
        y, y_name, allow_empty=allow_empty)
    if error is not None:
        return x, y, error
    if y.device != x.device:
        return x, y, ValueError(f"{y_name} is on {y.device} but {x_name} on {x.device}")
    x, y = autocast_operands(x.device, x, y)
    if y.dtype != x.dtype:
        return x, y, TypeError(f"{y_name} has dtype {y.dtype} but {x_name} has {x.dtype}; they "
                               f"must match (under torch.autocast both are cast to the autocast "
                               f"dtype)")
    return x, y, None


def _check_pair(x, y, x_name: str, y_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and text features: ``matched_features``, and one row per pair."""
    x, y, error = matched_features(x, y, x_name, y_name)
    if error is not None:
        raise error
    if y.shape != x.shape:
        raise ValueError(f"{x_name} and {y_name} must have the same shape (b, D): one row per "
                         f"pair; got {tuple(x.shape)} and {tuple(y.shape)}")
    return x, y


def check_positive(value: float, name: str) -> None:
    """A Python number for a logit scale or a temperature: finite and > 0, else ValueError."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0 and finite, got {value}")


def as_scalar(value, name: str, device: torch.device, *, positive: bool = False
               ) -> torch.Tensor:
    """A float or one-element tensor → a 0-dim fp32 tensor on ``device`` (keeping autograd).

    A Python number must be finite; with ``positive`` (a logit scale, a temperature) also > 0.
    A tensor's value is not read (that would wait for the device); with ``positive`` one that
    is ≤ 0, ±inf or NaN becomes NaN, gradient included, so that the loss and every gradient
    are NaN rather than silently wrong (a negative scale flips the softmax; 1/τ for τ = ±inf is
    0, a uniform softmax).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got shape "
                             f"{tuple(value.shape)}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the features on {device}")
        scalar = value.reshape(()).float()
        if positive:  # × 1 where valid (exact, gradient 1), × NaN elsewhere (NaN, gradient too)
            valid = (scalar > 0) & (scalar < math.inf)
            scalar = scalar * torch.where(valid, 1.0, math.nan)
        return scalar
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if positive:
            check_positive(float(value), name)
        elif not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {float(value)}")
        # A fill kernel: torch.tensor(…, device=…) would copy from pageable host memory, which
        # waits for every kernel queued before it.
        return torch.full((), float(value), dtype=torch.float32, device=device)
    raise TypeError(f"{name} must be a float or a one-element tensor, got "
                    f"{type(value).__name__}")


def inverse_scalar(value, name: str, device: torch.device) -> torch.Tensor:
    """1 / ``value`` for a temperature: ``as_scalar(value, positive=True)`` inverted, a Python
    number on the host (one fill on the device, not a fill and a division)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        check_positive(float(value), name)
        return as_scalar(1.0 / float(value), name, device)
    return 1.0 / as_scalar(value, name, device, positive=True)


def _check_labels(labels, n: int, device) -> torch.Tensor:
    """Type, shape and device of ``labels``; the op handles values out of range."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer key indices, got {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape (N,) = ({n},), got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but query on {device}")
    return labels.long()
