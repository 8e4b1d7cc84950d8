"""Thin nn.Modules: they validate and store options, then call the functional API."""

from __future__ import annotations

import torch
from torch import nn

from .core.filtering import resolve_filter_eps
from .core.vocab_order import order_by_mean_logit
from .losses.contrastive import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
from .losses.cross_entropy import check_options, linear_cross_entropy


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedloss.linear_cross_entropy`; same options.

    ``forward(input (*, D), linear_weight (V, D), target (*), linear_bias=None)``.

    ``vocab_order_every``: None (default) keeps the natural vocabulary order; k ≥ 1 sorts the
    vocabulary by average logit every k-th call and reuses that order in between (the
    classifier moves slowly, so a slightly stale order is nearly as good and costs nothing).
    k > 1 keeps that order in Python between calls and runs in eager mode only (under
    ``torch.compile`` it raises).
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        reduction: str = "mean",
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        z_loss: float = 0.0,
        shift: bool = False,
        filter_eps: float | str | None = "auto",
        return_lse: bool = False,
        backend: str = "auto",
        vocab_order_every: int | None = None,
    ) -> None:
        super().__init__()
        check_options(reduction, label_smoothing, softcap, z_loss)
        resolve_filter_eps(filter_eps, torch.bfloat16)  # raises on a bad value
        if vocab_order_every is not None and (
            not isinstance(vocab_order_every, int) or vocab_order_every < 1
        ):
            raise ValueError(
                f"vocab_order_every must be None or an int >= 1, got {vocab_order_every!r}"
            )
        self.register_buffer("weight", weight, persistent=weight is not None)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.label_smoothing, self.softcap, self.z_loss = label_smoothing, softcap, z_loss
        self.shift, self.filter_eps, self.return_lse = shift, filter_eps, return_lse
        self.backend, self.vocab_order_every = backend, vocab_order_every
        self._calls = 0
        self._order: torch.Tensor | None = None

    def forward(self, input, linear_weight, target, linear_bias=None):
        return linear_cross_entropy(
            input, linear_weight, target,
            linear_bias=linear_bias, weight=self.weight, reduction=self.reduction,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            softcap=self.softcap, z_loss=self.z_loss, shift=self.shift,
            filter_eps=self.filter_eps, return_lse=self.return_lse, backend=self.backend,
            vocab_order=self._vocab_order(input, linear_weight, target, linear_bias),
        )

    def _vocab_order(self, input, linear_weight, target, linear_bias):
        if self.vocab_order_every is None:
            return None
        if self.vocab_order_every == 1:
            return "auto"
        if torch.compiler.is_compiling():
            # The stale order and the call count are Python state between calls: a compiled
            # graph would bake them in (and recompile at every count).
            raise RuntimeError(
                "LinearCrossEntropyLoss(vocab_order_every > 1) keeps the order between calls "
                "in Python and does not run under torch.compile; use vocab_order_every=1, or "
                "pass a vocab_order tensor to fusedloss.linear_cross_entropy"
            )
        stale = self._order is None or self._order.shape[0] != linear_weight.shape[0]
        if stale or self._calls % self.vocab_order_every == 0:
            with torch.no_grad():
                d = linear_weight.shape[1]
                valid = (target != self.ignore_index).reshape(-1)
                self._order = order_by_mean_logit(
                    input.detach().reshape(-1, d), linear_weight.detach(),
                    None if linear_bias is None else linear_bias.detach(), valid,
                )
        self._calls += 1
        return self._order

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, "
                f"z_loss={self.z_loss}, shift={self.shift}, filter_eps={self.filter_eps!r}")


def _check_options(reduction: str, filter_eps) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    resolve_filter_eps(filter_eps, torch.bfloat16)  # raises on a bad value


class ClipLoss(nn.Module):
    """Drop-in for open_clip's ``ClipLoss`` on one process, computed by :func:`clip_loss`.

    ``forward(image_features (b, D), text_features (b, D), logit_scale, logit_bias=None,
    output_dict=False)`` returns the scalar loss, or ``{"contrastive_loss": loss}``.

    open_clip's constructor arguments are accepted so that existing code runs unchanged; only
    the single-process setting (``world_size=1``) is computed here. ``cache_labels`` has
    nothing to cache (no label tensor is built) and ``local_loss`` / ``gather_with_grad``
    only matter across processes.
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        reduction: str = "mean",
        filter_eps: float | str | None = "auto",
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if world_size != 1 or use_horovod:
            raise ValueError(
                f"ClipLoss computes the single-process loss (world_size=1); got "
                f"world_size={world_size}, use_horovod={use_horovod}"
            )
        _check_options(reduction, filter_eps)
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.reduction, self.filter_eps, self.backend = reduction, filter_eps, backend

    def forward(self, image_features, text_features, logit_scale, logit_bias=None,
                output_dict: bool = False):
        loss = clip_loss(image_features, text_features, logit_scale, logit_bias,
                         reduction=self.reduction, filter_eps=self.filter_eps,
                         backend=self.backend)
        return {"contrastive_loss": loss} if output_dict else loss

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, filter_eps={self.filter_eps!r}"


class SigLipLoss(nn.Module):
    """Drop-in for open_clip's ``SigLipLoss`` on one process, computed by :func:`siglip_loss`.

    ``forward(image_features (b, D), text_features (b, D), logit_scale, logit_bias,
    output_dict=False)`` returns the scalar loss, or ``{"contrastive_loss": loss}``.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if world_size != 1:
            raise ValueError(f"SigLipLoss computes the single-process loss (world_size=1); got "
                             f"world_size={world_size}")
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.dist_impl, self.backend = dist_impl, backend

    def forward(self, image_features, text_features, logit_scale, logit_bias,
                output_dict: bool = False):
        loss = siglip_loss(image_features, text_features, logit_scale, logit_bias,
                           backend=self.backend)
        return {"contrastive_loss": loss} if output_dict else loss


class _TemperatureLoss(nn.Module):
    """Shared constructor of the softmax losses with a fixed temperature (a float > 0 here;
    pass a tensor to the functional forms to learn it)."""

    def __init__(self, temperature: float, *, reduction: str = "mean",
                 filter_eps: float | str | None = "auto", backend: str = "auto") -> None:
        super().__init__()
        if not float(temperature) > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        _check_options(reduction, filter_eps)
        self.temperature, self.reduction = float(temperature), reduction
        self.filter_eps, self.backend = filter_eps, backend

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, reduction={self.reduction!r}"


class InfoNCELoss(_TemperatureLoss):
    """Module form of :func:`info_nce_loss`: ``forward(query (N, D), keys (M, D), labels=None)``.

    ``temperature`` is a float > 0 here; pass a tensor to the functional form to learn it.
    Keyword options: ``reduction``, ``filter_eps``, ``backend``, as in the functional form.
    """

    def __init__(self, temperature: float = 0.07, **options) -> None:
        super().__init__(temperature, **options)

    def forward(self, query, keys, labels=None):
        return info_nce_loss(query, keys, labels, temperature=self.temperature,
                             reduction=self.reduction, filter_eps=self.filter_eps,
                             backend=self.backend)


class NTXentLoss(_TemperatureLoss):
    """Module form of :func:`nt_xent_loss`: ``forward(features (2B, D))`` or
    ``forward(z1 (B, D), z2 (B, D))`` (the two views, stacked for you). Keyword options:
    ``reduction``, ``filter_eps``, ``backend``, as in the functional form."""

    def __init__(self, temperature: float = 0.5, **options) -> None:
        super().__init__(temperature, **options)

    def forward(self, features, second_view=None):
        if second_view is not None:
            features = torch.cat([features, second_view], dim=0)
        return nt_xent_loss(features, self.temperature, reduction=self.reduction,
                            filter_eps=self.filter_eps, backend=self.backend)
