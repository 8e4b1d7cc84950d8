"""Contrastive losses over a process group, on the ring (``ring.py``): the functional API.

Each rank passes its local features; the loss is that of the global batch, the concatenation
of the ranks' features in rank order, computed without gathering them.

Gradient convention (as open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``):
the gradients are those of the *sum over the ranks* of each rank's returned loss (times its
upstream gradient), as if the ranks' losses were added into one graph. With "mean" and "sum"
each rank returns W × its rows' share of the global loss L (W = group size):

    mean:  ℓ_r = W / B · Σ_{i ∈ rank r} loss_i    (= the mean over its rows when batches are even)
    sum:   ℓ_r = W · Σ_{i ∈ rank r} loss_i

so Σ_r ℓ_r = W·L, the mean of the ranks' values is L, every rank's features receive
W·∂L/∂f_r, and each rank's share of ∂/∂logit_scale (and logit_bias) sums over the ranks to
W·∂L/∂θ. DDP averages parameter gradients over the ranks: every parameter then holds exactly
the gradient of the global loss. "none" returns the rank's per-row losses, the rank's slice of
the global per-row vector, with gradients of Σ_i g_i · loss_i over the global rows.

Every rank of the group must make the same call (same loss, reduction, options, widths, dtype,
device type, and which inputs need gradients) and run the backward: the ranks exchange these
facts once per call and all raise the same error when they disagree, or when one rank's
arguments are wrong, instead of leaving the others waiting.

The arguments follow the single-process rules (``fusedloss/losses/contrastive.py``): under
``torch.autocast`` the features are cast to the autocast dtype (the dtype the ranks compare),
the scale, temperature and bias stay fp32 scalars and the loss is fp32; a Python scale or
temperature must be finite and > 0, a tensor one that is ≤ 0, ±inf or NaN gives NaN (its value
is not read on the host). A rank may pass 0 rows (and InfoNCE 0 keys) as long as the group
holds some; a width D = 0 is an error.

CUDA graphs: a call made while a graph is being captured (``torch.cuda.graph``) reuses what
the last eager call on this rank with the same arguments found in that exchange, without
communicating, so that the ring's kernels and NCCL transfers replay without the host. Make one
eager call with the same shapes and options on every rank before capturing. What the eager
call reads on the host from input values cannot be read during a capture: InfoNCE with
``labels`` and ``backend="torch"`` raise there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ..core import engine
from ..core.filtering import resolve_filter_eps
from ..losses.contrastive import as_scalar, feature_error, inverse_scalar, matched_features
from ..ops import _group
from ..ops._common import autocast_operands, op_body
from ..ops._group import device_code, dtype_code, exchange, float_code
from ..ops.cross_entropy import _scaled
from . import ring

Reduction = Literal["none", "mean", "sum"]
Backend = Literal["auto", "triton", "torch"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("none", "mean", "sum")
_BACKENDS = ("auto", "triton", "torch")
_KINDS = ("clip", "info_nce", "nt_xent", "siglip")


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def clip_loss(
    image_features: torch.Tensor,  # (b_r, D) this rank's images
    text_features: torch.Tensor,  # (b_r, D) this rank's texts
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    reduction: Reduction = "mean",
    filter_eps: float | Literal["auto"] | None = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """CLIP's symmetric loss over the global batch of the group's ranks, on the ring.

    Pair i of rank r is global pair ``offset_r + i`` (offsets: the ranks' batch sizes in rank
    order; they may differ, and may be 0). Equals :func:`fusedloss.clip_loss` of the
    concatenated features, scaled as the module doc says (``ℓ_r = W/B · Σ`` of the rank's pairs
    for "mean"); "none" returns this rank's (b_r,) per-pair losses. ``logit_bias`` is accepted
    and ignored, as in :func:`fusedloss.clip_loss` (zero gradient).

    Args:
        image_features, text_features: (b_r, D) fp32/bf16/fp16, same device; the same dtype
            outside autocast (under ``torch.autocast`` both are cast to the autocast dtype).
        logit_scale: a float (finite, > 0) or one-element tensor, the same on every rank.
        group: the process group (default: the world).
        reduction, filter_eps, backend: as in :func:`fusedloss.clip_loss`.
    """
    return pair_loss("clip", image_features, text_features, logit_scale, logit_bias,
                     group=group, reduction=reduction, filter_eps=filter_eps, backend=backend)


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def siglip_loss(
    image_features: torch.Tensor,  # (b_r, D)
    text_features: torch.Tensor,  # (b_r, D)
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float,
    *,
    group: dist.ProcessGroup | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """SigLIP's sigmoid loss over the global batch of the group's ranks, on the ring.

    ``−Σ_ij log σ(z_ij · logits_ij) / B`` over the global batch; each rank returns
    ``W / B · Σ`` over its images of their terms against every text (open_clip's per-rank value
    ``Σ / b_r`` when batches are even). Every tile is computed (no filtering). Arguments as in
    :func:`fusedloss.siglip_loss` (``logit_scale`` and ``logit_bias`` the same on every rank),
    but a rank may pass 0 rows.
    """
    return pair_loss("siglip", image_features, text_features, logit_scale, logit_bias,
                     group=group, reduction="mean", filter_eps=None, backend=backend)


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def info_nce_loss(
    query: torch.Tensor,  # (n_r, D) this rank's queries
    keys: torch.Tensor,  # (m_r, D) this rank's keys
    labels: torch.Tensor | None = None,  # (n_r,) global key ids
    *,
    temperature: torch.Tensor | float = 0.07,
    group: dist.ProcessGroup | None = None,
    reduction: Reduction = "mean",
    filter_eps: float | Literal["auto"] | None = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """InfoNCE with the queries at home and the keys travelling: each query against every key of
    the group. ``labels`` are global key ids in [0, M) (M = Σ m_r, keys in rank order); the
    default pairs global query i with global key i (needs M ≥ the global query count).
    ``temperature`` as in :func:`fusedloss.info_nce_loss`, the same on every rank."""
    query, keys, error = _check_pair(query, keys, "query", "keys", same_rows=False)
    if error is None and labels is not None:
        error = _check_labels(labels, query)
    settings = _Settings("info_nce", group, reduction, filter_eps, backend, "temperature")
    return _ring_loss(settings, query, keys, temperature, None, labels, error)


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def nt_xent_loss(
    features: torch.Tensor,  # (2B_r, D): this rank's view 1 stacked over its view 2
    temperature: torch.Tensor | float = 0.5,
    *,
    group: dist.ProcessGroup | None = None,
    reduction: Reduction = "mean",
    filter_eps: float | Literal["auto"] | None = "auto",
    backend: Backend = "auto",
) -> torch.Tensor:
    """SimCLR's NT-Xent over the global batch: every row against every other row of every rank.

    Each rank passes ``cat([z1_r, z2_r])``; the global batch is ``cat([z1, z2])`` with
    ``z1 = cat(z1_r over ranks)`` (likewise z2), so row i of a rank's first view pairs with its
    row i of the second view. "none" returns this rank's (2B_r,) rows in its own order.
    ``temperature`` as in :func:`fusedloss.nt_xent_loss`, the same on every rank.
    """
    error = _check_features(features, "features")
    if error is None:
        (features,) = autocast_operands(features.device, features)
    if error is None and features.shape[0] % 2:
        error = ValueError(f"features must stack two views of B_r samples, (2B_r, D); got an "
                           f"odd number of rows, {features.shape[0]}")
    settings = _Settings("nt_xent", group, reduction, filter_eps, backend, "temperature")
    return _ring_loss(settings, features, features, temperature, None, None, error)


# ---------------------------------------------------------------------------------------------
# the call: one exchange of facts, the ring, the reduction


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def pair_loss(kind, image_features, text_features, logit_scale, logit_bias, *, group,
              reduction, filter_eps, backend, caller_error: Exception | None = None):
    """CLIP or SigLIP on the ring; ``caller_error``: an error the caller (a module) found on
    this rank, raised on every rank at the exchange."""
    image_features, text_features, error = _check_pair(image_features, text_features,
                                                       "image_features", "text_features")
    error = caller_error or error
    settings = _Settings(kind, group, reduction, filter_eps, backend, "logit_scale")
    return _ring_loss(settings, image_features, text_features, logit_scale, logit_bias, None,
                      error)


class _Ring(torch.autograd.Function):
    # Autocast off in both bodies: the features arrive cast by the functional layer, and the
    # ring's fp32 products, statistics and accumulators must not be rounded to the autocast
    # dtype (on the CPU a ``backward()`` called inside an autocast region runs the backward
    # on the same thread, autocast on).
    @staticmethod
    @op_body
    def forward(ctx, a, b, scale, bias, labels, call, needs):
        b = a if b is None else b  # NT-Xent: the rows are the columns
        loss, saved = ring.forward(call, a, b, scale, bias, labels, record=any(needs))
        ctx.save_for_backward(a, b, scale, bias, labels)
        ctx.ring = (call, saved, needs)
        return loss

    @staticmethod
    @op_body
    def backward(ctx, grad_loss):
        call, saved, needs = ctx.ring
        a, b, scale, bias, labels = ctx.saved_tensors
        b = a if b is None else b
        grads = ring.backward(call, a, b, scale, bias, labels, saved, grad_loss, needs)
        return (*grads, None, None, None)


class _SigLipRing(torch.autograd.Function):
    """SigLIP's mean over the global batch on the ring, its gradients formed in the forward's
    tour (``ring.siglip``: three products a block); the backward scales them by the upstream
    gradient. A rank's dB holds every rank's rows' part: exact when each rank back-propagates
    the same upstream gradient into its loss, as data-parallel training does (each rank's
    ``loss.backward()``, a loss scale common to the ranks)."""

    @staticmethod
    @op_body
    def forward(ctx, a, b, scale, bias, call, needs, coef):
        loss, *grads = ring.siglip(call, a, b, scale, bias, coef, needs)
        ctx.grads = grads  # dA, dB, d scale, d bias: fp32 or None
        ctx.dtypes = (a.dtype, b.dtype, torch.float32, torch.float32)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    @op_body
    def backward(ctx, grad_loss):
        grads = [None if g is None or grad_loss is None else _scaled(g, grad_loss, dtype)
                 for g, dtype in zip(ctx.grads, ctx.dtypes, strict=True)]
        ctx.grads = None
        return (*grads, None, None, None)


@dataclass(frozen=True)
class _Settings:
    """A call's arguments other than its tensors, as the public function received them."""

    kind: str  # one of _KINDS
    group: dist.ProcessGroup | None
    reduction: str
    filter_eps: float | str | None
    backend: str
    scale_name: str  # the public name of the scale argument: "logit_scale" or "temperature"


def _ring_loss(settings: _Settings, a, b, scale_arg, bias_arg, labels, error):
    kind, group, reduction = settings.kind, settings.group, settings.reduction
    backend = settings.backend
    device = a.device if isinstance(a, torch.Tensor) else torch.device("cpu")
    facts, scale, bias, eps, needs = {}, None, None, None, None
    if error is None and _group.capturing(device):
        error = _capture_error(kind, labels, backend)
    if error is None:
        try:
            scale, bias, eps, backend, needs, facts = _options(settings, a, b, scale_arg,
                                                               bias_arg)
        except (TypeError, ValueError, RuntimeError) as e:
            error = e
    n = a.shape[0] if error is None else 0
    m = 0 if error is not None or kind == "nt_xent" else b.shape[0]
    extra = _label_range(labels) if error is None and labels is not None else (0, 0)
    layout, per_rank = exchange(group, n, n if kind == "nt_xent" else m, facts, device,
                                error=error, extra=extra)
    total_rows, total_cols = sum(layout.rows), sum(layout.cols)
    if total_rows == 0:
        raise ValueError(f"the global batch is empty: every rank passed 0 rows to {kind}_loss")
    if total_cols == 0:
        raise ValueError(f"there are no keys: every rank passed 0 keys to {kind}_loss")
    if kind == "info_nce":
        labels = _global_labels(labels, layout, per_rank, a.device)
    call = ring.RingCall(layout, kind, eps, backend)
    if kind == "siglip" and backend == "triton":  # the reduced loss, gradients in the forward
        return _SigLipRing.apply(a, b, scale, bias, call, needs, layout.world / total_rows)
    per_row = _Ring.apply(a, None if kind == "nt_xent" else b, scale,
                          bias if kind == "siglip" else None, labels, call, needs)
    if kind == "clip" and bias is not None:
        per_row = per_row + 0.0 * bias  # the loss ignores it: a zero gradient, NaN stays NaN
    if reduction == "none":
        return per_row
    total = per_row.sum() * layout.world
    return total if reduction == "sum" else total / total_rows


def _capture_error(kind, labels, backend) -> Exception | None:
    """Why this call cannot be captured in a CUDA graph (None: it can). A captured call skips
    the exchange of facts (it reuses the last eager call's, ``exchange``); what the eager call
    reads on the host from the inputs' values cannot be read during a capture."""
    if labels is not None:
        return RuntimeError(f"{kind}_loss reads the labels' range on the host, which a CUDA "
                            f"graph capture cannot do: capture it with labels=None")
    if backend == "torch":
        return RuntimeError("backend='torch' reads on the host, which a CUDA graph capture "
                            "cannot do: capture the Triton kernels (backend 'auto' or 'triton')")
    return None


def _options(settings: _Settings, a, b, scale_arg, bias_arg):
    """The validated scale, bias, filter bound and backend, which inputs need gradients (for
    the ring: A, B, scale, bias), and the facts every rank must share."""
    kind, reduction, filter_eps = settings.kind, settings.reduction, settings.filter_eps
    backend, scale_name = settings.backend, settings.scale_name
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    resolved = engine.resolve_backend(backend, a.device)  # raises if the kernels cannot run
    eps = resolve_filter_eps(filter_eps, a.dtype)
    # Not read on the host: an invalid tensor scale or temperature becomes NaN (``as_scalar``).
    scale = (inverse_scalar(scale_arg, scale_name, a.device) if scale_name == "temperature"
             else as_scalar(scale_arg, scale_name, a.device, positive=True))
    bias = None if bias_arg is None else as_scalar(bias_arg, "logit_bias", a.device)
    grad_on = torch.is_grad_enabled()
    need_a, need_b, need_scale, need_bias = (
        grad_on and t is not None and t.requires_grad for t in (a, b, scale, bias))
    # NT-Xent's rows are its columns: their gradient has both parts. CLIP ignores the bias.
    needs = (need_a, need_a if kind == "nt_xent" else need_b, need_scale,
             need_bias and kind == "siglip")
    # The facts every rank must share; the ones that explain others first (a dtype decides
    # what filter_eps="auto" means).
    facts = {
        "the loss": (_KINDS.index(kind), kind),
        "the feature dtype": (dtype_code(a.dtype), str(a.dtype)),
        "the feature width D": (a.shape[1], str(a.shape[1])),
        "the device type": (device_code(a.device), a.device.type),
        "reduction": (_REDUCTIONS.index(reduction), repr(reduction)),
        "backend": (_BACKENDS.index(backend), repr(backend)),
        "filter_eps": (float_code(eps), repr(eps)),
        f"whether {scale_name} is given": (int(scale_arg is not None), str(scale_arg is not None)),
        "whether logit_bias is given": (int(bias is not None), str(bias is not None)),
        "which inputs require grad (features, scale, bias)": (
            sum(int(x) << i for i, x in enumerate(needs)), str(needs)),
    }
    return scale, bias, eps if resolved == "triton" else None, resolved, needs, facts


def _label_range(labels: torch.Tensor) -> tuple[int, int]:
    """(min, max) of this rank's labels: one host read, checked against the global key count
    after the exchange."""
    if labels.numel() == 0:
        return (0, 0)
    lo, hi = torch.stack((labels.min(), labels.max())).tolist()
    return (int(lo), int(hi))


def _global_labels(labels, layout, per_rank, device) -> torch.Tensor:
    """The labels as global key ids, range-checked on every rank (the same error everywhere)."""
    total_keys = sum(layout.cols)
    if labels is None:
        if total_keys < sum(layout.rows):
            raise ValueError(f"labels=None pairs global query i with global key i, which needs "
                             f"M >= N over the group; got N = {sum(layout.rows)} queries and "
                             f"M = {total_keys} keys. Pass labels.")
        offset = layout.row_offset(layout.rank)
        return torch.arange(offset, offset + layout.rows[layout.rank], device=device)
    for r, (lo, hi) in enumerate(per_rank):
        if layout.rows[r] and (lo < 0 or hi >= total_keys):
            bad = lo if lo < 0 else hi
            raise ValueError(f"labels on rank {r} holds {bad}, outside [0, M) = [0, "
                             f"{total_keys}) (M: the keys of every rank)")
    return labels.long()


# ---------------------------------------------------------------------------------------------
# local checks: they return the error instead of raising, so that it is raised on every rank


def _check_features(t, name: str) -> Exception | None:
    return feature_error(t, name, allow_empty=True)  # a rank may hold no rows


def _check_pair(x, y, x_name: str, y_name: str, same_rows: bool = True):
    """(x, y, error): ``matched_features`` (cast under autocast; 0 rows allowed), then one row
    per pair (``same_rows``) or one width."""
    x, y, error = matched_features(x, y, x_name, y_name, allow_empty=True)
    if error is None and (y.shape[1] != x.shape[1] or (same_rows and y.shape[0] != x.shape[0])):
        want = "the same shape (b_r, D): one row per pair" if same_rows else "the same width D"
        error = ValueError(f"{x_name} and {y_name} must have {want}; got {tuple(x.shape)} and "
                           f"{tuple(y.shape)}")
    return x, y, error


def _check_labels(labels, query) -> Exception | None:
    if not isinstance(labels, torch.Tensor):
        return TypeError(f"labels must be a torch.Tensor or None, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return TypeError(f"labels must hold integer key ids, got {labels.dtype}")
    if labels.shape != (query.shape[0],):
        return ValueError(f"labels must have shape (n_r,) = ({query.shape[0]},), got "
                          f"{tuple(labels.shape)}")
    if labels.device != query.device:
        return ValueError(f"labels is on {labels.device} but query on {query.device}")
    return None


