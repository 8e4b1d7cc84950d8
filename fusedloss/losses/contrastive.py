"""Contrastive losses on the linear-log-sum-exp core: CLIP, InfoNCE, SimCLR NT-Xent, SigLIP.

Every loss here is a cheap function of row statistics (and for CLIP column statistics) of
X = s · A Bᵀ, which the core computes tile by tile: no b×b similarity matrix exists in the
forward or the backward. With P = row softmax, Q = column softmax of X (DESIGN.md §1):

    loss            A, B             per-row loss                   dX (per unit upstream g)
    clip_loss       I, T             ½(l_i − X_ii) + ½(k_i − X_ii)  ½g_i P_ij + ½g_j Q_ij − g_i[i=j]
    info_nce_loss   Q, K             l_i − X_{i,y_i}                g_i (P_ij − [j=y_i])
    nt_xent_loss    Z, Z (X_ii out)  l_i − X_{i,i±B}                g_i (P_ij − [j=i±B])
    siglip_loss     I, T (+ bias)    Σ_j softplus(−z_ij X_ij)       −g_i z_ij σ(−z_ij X_ij)

(l_i row LSE, k_j column LSE, z = +1 on the diagonal and −1 elsewhere; NT-Xent's dZ = dA + dB).
The core turns dX into dA = s·dX·B, dB = s·dXᵀ·A and ds = Σ dX ⊙ A Bᵀ without storing dX
beyond a bounded scratch.
Both CLIP directions come from one pass: each tile feeds the row and the column statistics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from ..core import engine
from ..core.engine import GradCoefficients, Logits, Rows
from ..core.filtering import gradient_mass, resolve_filter_eps

Reduction = Literal["none", "mean", "sum"]
Backend = Literal["auto", "triton", "torch"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# the autograd function shared by the four losses


@dataclass(frozen=True)
class _Spec:
    """What one contrastive call computes (everything that is not a differentiable tensor)."""

    kind: Literal["clip", "info_nce", "nt_xent", "siglip"]
    rows: Rows  # all rows valid; target = the positive column of each row
    filter_eps: float | None
    backend: str


class ContrastiveFunction(torch.autograd.Function):
    """Per-row losses (fp32, (N,)) of a contrastive loss over X = scale · A Bᵀ (+ bias).

    ``forward(a (N, D), b (M, D), scale () fp32, bias () fp32 or None, spec)``. For
    "nt_xent" pass the same tensor as ``a`` and ``b``: autograd adds the two gradients.
    """

    @staticmethod
    def forward(ctx, a, b, scale, bias, spec: _Spec):
        logits = _logits(spec, b, scale, bias)
        needs_grad = any(ctx.needs_input_grad[:4])
        stats = engine.row_stats(
            a, b, logits, spec.rows,
            col_stats=spec.kind == "clip", sigmoid=spec.kind == "siglip",
            record_tiles=needs_grad and spec.filter_eps is not None, backend=spec.backend,
        )
        if spec.kind == "siglip":
            loss = stats.sigmoid_sum
        elif spec.kind == "clip":
            x_ii = stats.target_logit
            row_margin, col_margin = stats.lse_minus(x_ii), stats.col_lse_minus(x_ii)
            loss = 0.5 * (row_margin + col_margin)
        else:
            loss = stats.lse_minus(stats.target_logit)
        ctx.save_for_backward(a, b, scale, bias)
        ctx.spec, ctx.stats = spec, stats
        ctx.filter_scale = None
        if spec.kind == "clip":  # each direction's own gradient mass bounds its skipped mass
            ctx.filter_scale = (gradient_mass(row_margin), gradient_mass(col_margin))
        elif spec.kind != "siglip":
            ctx.filter_scale = (gradient_mass(loss), None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        a, b, scale, bias = ctx.saved_tensors
        spec: _Spec = ctx.spec
        g = grad_loss.float().contiguous()  # a reduction may hand us a stride-0 expand
        if spec.kind == "clip":
            half = 0.5 * g
            coef = GradCoefficients(lse=half, col=half, target=g)
        elif spec.kind == "siglip":
            coef = GradCoefficients(lse=g)
        else:
            coef = GradCoefficients(lse=g, target=g)
        need_a, need_b, need_scale, need_bias = ctx.needs_input_grad[:4]
        sparse = _sparse_slabs()
        split = not sparse and bias is None and _split_accumulator(a)
        grads = engine.grads(
            a, b, _logits(spec, b, scale, bias), spec.rows, ctx.stats, coef,
            filter_eps=spec.filter_eps, need_a=need_a, need_b=need_b,
            need_bias=bias is not None and need_bias, need_scale=need_scale,
            sigmoid=spec.kind == "siglip", filter_scale=ctx.filter_scale,
            scratch_bytes=_scratch_bytes(a, split), sparse=sparse, split_accumulator=split,
            backend=spec.backend,
        )
        grad_bias = grads.bias.sum() if grads.bias is not None else None
        return grads.a, grads.b, grads.scale, grad_bias, None


def _sparse_slabs() -> bool:
    """Whether the backward may send a slab with few live tiles through the sparse matmul
    kernels (``FUSEDLOSS_SPARSE_SLABS=1``). That choice needs the live counts on the host, one
    wait for the GPU per call. By default every slab takes the dense path and the backward never
    waits: on the measured inputs the filter keeps every tile (docs/results.md), and at
    b ≤ 16384 the wait, which leaves the GPU idle while the host issues the slabs, costs more
    than the sparse path could save.
    """
    return os.environ.get("FUSEDLOSS_SPARSE_SLABS", "0") == "1"


def _split_accumulator(a: torch.Tensor) -> bool:
    """Whether dA accumulates over the backward's slabs as a bf16 pair (half the bytes of fp32;
    ``engine.grads(split_accumulator=...)``) rather than in fp32 through cuBLAS: for bf16
    features up to 16384 rows, where it lets a step fit in 64 MiB (see ``_scratch_bytes``).
    Beyond, cuBLAS's addmm is faster than the split kernel (H100, 2026-11-22: 0.42 against
    0.59 ms per slab at N = 65536, K = 4096, D = 512) and the memory is far below inf-cl's.
    ``FUSEDLOSS_SPLIT_ACCUMULATOR=0`` or ``1`` overrides.
    """
    if (setting := os.environ.get("FUSEDLOSS_SPLIT_ACCUMULATOR")) is not None:
        return setting == "1"
    return a.dtype == torch.bfloat16 and a.shape[0] <= 16384


def _scratch_bytes(a: torch.Tensor, split: bool) -> int | None:
    """dX scratch per column slab: 64 MiB up to N = 16384 rows (44 MiB with the split
    accumulator), 4096 columns wide beyond, up to 1 GiB. ``FUSEDLOSS_SCRATCH_MB`` overrides.

    Measured on H100s (2026-11-22, CLIP fwd+bwd, bf16, c = 512). At b = 16384, 64 MiB (97.5
    MiB in all with the fp32 dA accumulator) took 3.0–3.2 ms. A 28 MiB scratch (896 columns,
    61.5 MiB in all) took 3.6–3.7 ms on one machine and 5.0–5.6 ms on another, where 64 MiB
    took 3.16: each slab costs a launch of the recompute kernel and two cuBLAS calls, and at
    19 slabs the host issuing them sets the pace, at the host's speed. With the split
    accumulator (16 MiB where fp32 took 32), 44 MiB of scratch (1408 columns, 12 slabs)
    keeps a step at b = 16384, c = 512 within 64 MiB in all (61.5 MiB).
    Beyond 16384 rows: each slab's read-modify-write of the fp32 dA accumulator (8·N·D bytes)
    costs as much as a few hundred columns of matmul, and the slab's dB matmul (slab columns ×
    D outputs, N deep) needs width to fill the GPU. In alternating runs, 4096 columns against
    2048 took b = 65536 from 49.7–49.9 to 47.9 ms and b = 131072, c = 768 from 267–268 to
    258–259 ms (8192 columns: no further gain).
    """
    if "FUSEDLOSS_SCRATCH_MB" in os.environ:
        return None
    n = a.shape[0]
    if n <= 16384:
        return 44 * 2**20 if split else 2**26
    return int(min(2**30, n * 4096 * a.element_size()))


def _logits(spec: _Spec, b: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    # A scalar bias becomes a per-column one: (M,) floats, and its gradient is their sum.
    column_bias = bias.expand(b.shape[0]).contiguous() if bias is not None else None
    return Logits(bias=column_bias, scale=scale, diag_mask=spec.kind == "nt_xent")


def _run(kind, a, b, scale, bias, target, filter_eps, backend) -> torch.Tensor:
    """Per-row losses (N,) fp32 for validated inputs."""
    backend = engine.resolve_backend(backend, a.device)
    eps = resolve_filter_eps(filter_eps, a.dtype)  # validates on every backend
    eps = eps if backend == "triton" else None
    n = a.shape[0]
    rows = Rows(
        index=torch.arange(n, device=a.device),
        n_valid=torch.full((), n, dtype=torch.int64, device=a.device),  # a fill: no host sync
        target=target,
        identity=True,
        all_valid=True,
    )
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = a if kind == "nt_xent" else (b if b.stride(-1) == 1 else b.contiguous())
    spec = _Spec(kind=kind, rows=rows, filter_eps=eps, backend=backend)
    return ContrastiveFunction.apply(a, b, scale, bias, spec)


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
        target = _check_labels(labels, n, m, query.device)
    scale = 1.0 / _as_scalar(temperature, "temperature", query.device, positive=True)
    per_row = _run("info_nce", query, keys, scale, None, target, filter_eps, backend)
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
    per_row = _run("nt_xent", features, features, scale, None, target, filter_eps, backend)
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
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, D), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.shape[0] == 0:
        raise ValueError(f"{name} is empty: a contrastive loss needs at least one row")
    if t.shape[1] == 0:
        raise ValueError(f"{name} has width D = 0")


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
    """A float or one-element tensor → a 0-dim fp32 tensor on ``device`` (keeping autograd)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got shape "
                             f"{tuple(value.shape)}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the features on {device}")
        out = value.reshape(()).float()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if positive and float(value) <= 0:
            raise ValueError(f"{name} must be > 0, got {float(value)}")
        # A fill kernel: torch.tensor(…, device=…) would copy from pageable host memory, which
        # waits for every kernel queued before it.
        return torch.full((), float(value), dtype=torch.float32, device=device)
    else:
        raise TypeError(f"{name} must be a float or a one-element tensor, got "
                        f"{type(value).__name__}")
    if positive and bool(out.detach() <= 0):  # NaN passes and gives a NaN loss
        raise ValueError(f"{name} must be > 0, got {out.item()}")
    return out


def _check_labels(labels, n: int, m: int, device) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer key indices, got {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape (N,) = ({n},), got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"labels is on {labels.device} but query on {device}")
    labels = labels.long()
    bad = (labels < 0) | (labels >= m)
    if bool(bad.any()):
        raise ValueError(f"labels holds {int(labels[bad][0])}, outside [0, M) = [0, {m})")
    return labels
