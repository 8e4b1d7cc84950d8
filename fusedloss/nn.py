"""Thin nn.Modules: they validate and store options, then call the functional API."""

from __future__ import annotations

import torch
from torch import nn

from .core.filtering import resolve_lm_head_filter_eps
from .core.vocab_order import order_by_mean_logit
from .distributed.contrastive import pair_loss
from .losses.contrastive import (
    check_positive,
    clip_loss,
    info_nce_loss,
    matched_features,
    nt_xent_loss,
    siglip_loss,
)
from .losses.cross_entropy import check_linear_options, linear_cross_entropy
from .ops._group import group_rank_world, mean_over_ranks, sum_grad_over_ranks
from .options import CrossEntropyOptions


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedloss.linear_cross_entropy`; same options.

    ``forward(input (*, D), linear_weight (V, D), target (*), linear_bias=None)``.

    ``vocab_order_every``: None (default) keeps the natural vocabulary order; k ≥ 1 sorts the
    vocabulary by average logit every k-th call and reuses that order in between (the
    classifier moves slowly, so a slightly stale order is nearly as good and costs nothing).
    k > 1 keeps that order in Python between calls and runs in eager mode only (under
    ``torch.compile`` it raises).

    ``process_group``: the vocabulary-parallel head: ``linear_weight`` (and ``linear_bias``,
    and the ``weight`` given here) are this rank's rows of the classifier, sharded over the group
    (``vocab_start``: this shard's first class id; default: shards in rank order). Every rank
    gets the loss of the whole head.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        reduction: str = "mean",
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        options=None,
        softcap: float | None = None,
        z_loss: float = 0.0,
        shift: bool = False,
        filter_eps: float | str | None = "auto",
        return_lse: bool = False,
        backend: str = "auto",
        vocab_order_every: int | None = None,
        process_group=None,
        vocab_start: int | None = None,
    ) -> None:
        super().__init__()
        CrossEntropyOptions(reduction, ignore_index, label_smoothing, softcap, z_loss).check()
        check_linear_options(options)
        resolve_lm_head_filter_eps(filter_eps, torch.bfloat16)  # raises on a bad value
        if vocab_order_every is not None and (
            not isinstance(vocab_order_every, int) or vocab_order_every < 1
        ):
            raise ValueError(
                f"vocab_order_every must be None or an int >= 1, got {vocab_order_every!r}"
            )
        self.register_buffer("weight", weight, persistent=weight is not None)
        self.reduction, self.ignore_index, self.options = reduction, ignore_index, options
        self.label_smoothing, self.softcap, self.z_loss = label_smoothing, softcap, z_loss
        self.shift, self.filter_eps, self.return_lse = shift, filter_eps, return_lse
        self.backend, self.vocab_order_every = backend, vocab_order_every
        self.process_group, self.vocab_start = process_group, vocab_start
        self._calls = 0
        self._order: torch.Tensor | None = None

    def forward(self, input, linear_weight, target, linear_bias=None):
        return linear_cross_entropy(
            input, linear_weight, target,
            linear_bias=linear_bias, weight=self.weight, reduction=self.reduction,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            options=self.options, softcap=self.softcap, z_loss=self.z_loss, shift=self.shift,
            filter_eps=self.filter_eps, return_lse=self.return_lse, backend=self.backend,
            vocab_order=self._vocab_order(input, linear_weight, target, linear_bias),
            process_group=self.process_group, vocab_start=self.vocab_start,
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
                ignored = -100 if self.ignore_index is None else self.ignore_index
                valid = (target != ignored).reshape(-1)
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
    resolve_lm_head_filter_eps(filter_eps, torch.bfloat16)  # raises on a bad value


class ClipLoss(nn.Module):
    """Drop-in for open_clip's ``ClipLoss``, on one process or over a process group.

    ``forward(image_features (b, D), text_features (b, D), logit_scale, logit_bias=None,
    output_dict=False)`` returns the scalar loss, or ``{"contrastive_loss": loss}``.

    With ``world_size=1`` it is :func:`fusedloss.clip_loss`. With ``world_size > 1`` each rank
    passes its local features and the loss runs on the ring
    (:func:`fusedloss.distributed.clip_loss`: no rank gathers the others' features), giving what
    open_clip's ``ClipLoss`` gives for the same arguments, value and gradients:

    - ``local_loss=True, gather_with_grad=True``: each rank's loss over its own pairs; the
      gradients of the sum of the ranks' losses (features get W·∂L/∂f; after DDP averages,
      every parameter holds ∂L/∂θ of the global mean L).
    - ``local_loss=False, gather_with_grad=True``: the global L on every rank; the same
      feature gradients; ``logit_scale`` gets ∂L/∂s on every rank.
    - ``local_loss=False, gather_with_grad=False`` (open_clip's default): L on every rank,
      gradients only through the rank's own features: ∂L/∂f_r, and ∂L/∂s.

    ``local_loss=True, gather_with_grad=False`` (the local rows' loss with gradients through
    the local features only) is not computed: it raises. ``rank`` and ``world_size`` must match
    the process group (``group``, default the world); ``use_horovod`` is not supported.
    ``cache_labels`` has nothing to cache (no label tensor is built). ``reduction="mean"``
    only across processes.

    Arguments, autocast, invalid scales and empty inputs as in :func:`fusedloss.clip_loss`
    (over a process group a rank may pass 0 rows, as long as the group holds some).
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
        group=None,
    ) -> None:
        super().__init__()
        if use_horovod:
            raise ValueError("ClipLoss(use_horovod=True) is not supported: fusedloss runs on "
                             "torch.distributed")
        if world_size > 1 and local_loss and not gather_with_grad:
            raise ValueError(
                "ClipLoss(local_loss=True, gather_with_grad=False) backpropagates the local "
                "rows' loss through the local features only; fusedloss computes the gradient "
                "of the global loss. Use gather_with_grad=True (the same training signal "
                "open_clip recommends) or local_loss=False"
            )
        if world_size > 1 and reduction != "mean":
            raise ValueError(f"ClipLoss over {world_size} processes computes the mean; got "
                             f"reduction={reduction!r}")
        _check_options(reduction, filter_eps)
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.reduction, self.filter_eps, self.backend = reduction, filter_eps, backend
        self.group = group

    def forward(self, image_features, text_features, logit_scale, logit_bias=None,
                output_dict: bool = False):
        if self.world_size == 1:
            loss = clip_loss(image_features, text_features, logit_scale, logit_bias,
                             reduction=self.reduction, filter_eps=self.filter_eps,
                             backend=self.backend)
        else:
            loss = self._ring_loss(image_features, text_features, logit_scale, logit_bias)
        return {"contrastive_loss": loss} if output_dict else loss

    def _ring_loss(self, image_features, text_features, logit_scale, logit_bias):
        error = _rank_error(self.rank, self.world_size, self.group, "ClipLoss")
        scale = logit_scale
        w = self.world_size
        if isinstance(scale, torch.Tensor) and not self.local_loss:
            # open_clip computes the whole loss on every rank, so each rank's d logit_scale is
            # the global one: the sum of the ring's per-rank shares (÷ W for their scaling).
            scale = sum_grad_over_ranks(scale, self.group,
                                        divide=w if self.gather_with_grad else 1.0)
        loss = pair_loss("clip", image_features, text_features, scale, logit_bias,
                         group=self.group, reduction="mean", filter_eps=self.filter_eps,
                         backend=self.backend, caller_error=error)
        if self.local_loss:
            return loss
        if not self.gather_with_grad:
            loss = loss / w  # gradients through the local features only: ∂L/∂f_r
        return loss + (mean_over_ranks(loss, self.group) * (w if not self.gather_with_grad
                                                               else 1) - loss).detach()

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, filter_eps={self.filter_eps!r}"


class SigLipLoss(nn.Module):
    """Drop-in for open_clip's ``SigLipLoss``, on one process or over a process group.

    ``forward(image_features (b, D), text_features (b, D), logit_scale, logit_bias,
    output_dict=False)`` returns the scalar loss, or ``{"contrastive_loss": loss}``.

    With ``world_size > 1`` each rank passes its local features and the texts travel around the
    ring (:func:`fusedloss.distributed.siglip_loss`) as in open_clip's neighbour exchange
    (``dist_impl`` "bidir", "shift", "reduce" or "gather" all give the same loss): each rank's
    loss is its images against every text ÷ its batch size, with the gradients of the sum of the
    ranks' losses, as open_clip's. ``rank`` and ``world_size`` must match the process group.

    Arguments, autocast, invalid scales and empty inputs as in :func:`fusedloss.siglip_loss`
    (over a process group a rank may pass 0 rows, as long as the group holds some).
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
        *,
        backend: str = "auto",
        group=None,
    ) -> None:
        super().__init__()
        if dist_impl not in (None, "bidir", "shift", "reduce", "gather"):
            raise ValueError(f"dist_impl must be None, 'bidir', 'shift', 'reduce' or 'gather', "
                             f"got {dist_impl!r}")
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.dist_impl, self.backend, self.group = dist_impl, backend, group

    def forward(self, image_features, text_features, logit_scale, logit_bias,
                output_dict: bool = False):
        if self.world_size == 1:
            loss = siglip_loss(image_features, text_features, logit_scale, logit_bias,
                               backend=self.backend)
        else:
            error = _rank_error(self.rank, self.world_size, self.group, "SigLipLoss")
            loss = pair_loss("siglip", image_features, text_features, logit_scale, logit_bias,
                             group=self.group, reduction="mean", filter_eps=None,
                             backend=self.backend, caller_error=error)
        return {"contrastive_loss": loss} if output_dict else loss


def _rank_error(rank: int, world_size: int, group, name: str) -> Exception | None:
    """open_clip passes rank and world_size explicitly: they must be the group's (the error is
    raised on every rank, at the loss's exchange)."""
    actual = group_rank_world(group)
    if (rank, world_size) != actual:
        return ValueError(f"{name}(rank={rank}, world_size={world_size}) does not match the "
                          f"process group: rank {actual[0]} of {actual[1]}")
    return None


class _TemperatureLoss(nn.Module):
    """Shared constructor of the softmax losses with a fixed temperature (a finite float > 0
    here; pass a tensor to the functional forms to learn it)."""

    def __init__(self, temperature: float, *, reduction: str = "mean",
                 filter_eps: float | str | None = "auto", backend: str = "auto") -> None:
        super().__init__()
        check_positive(float(temperature), "temperature")
        _check_options(reduction, filter_eps)
        self.temperature, self.reduction = float(temperature), reduction
        self.filter_eps, self.backend = filter_eps, backend

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, reduction={self.reduction!r}"


class InfoNCELoss(_TemperatureLoss):
    """Module form of :func:`info_nce_loss`: ``forward(query (N, D), keys (M, D), labels=None)``.

    ``temperature`` is a finite float > 0 here (else ValueError); pass a tensor to the
    functional form to learn it. Keyword options: ``reduction``, ``filter_eps``, ``backend``;
    autocast and empty inputs: as in the functional form.
    """

    def __init__(self, temperature: float = 0.07, **options) -> None:
        super().__init__(temperature, **options)

    def forward(self, query, keys, labels=None):
        return info_nce_loss(query, keys, labels, temperature=self.temperature,
                             reduction=self.reduction, filter_eps=self.filter_eps,
                             backend=self.backend)


class NTXentLoss(_TemperatureLoss):
    """Module form of :func:`nt_xent_loss`: ``forward(features (2B, D))`` or
    ``forward(z1 (B, D), z2 (B, D))`` (the two views, stacked for you: the same shape, and the
    same dtype outside autocast, else an error naming ``second_view``). ``temperature`` is a
    finite float > 0 here. Keyword options: ``reduction``, ``filter_eps``, ``backend``;
    autocast and empty inputs: as in the functional form."""

    def __init__(self, temperature: float = 0.5, **options) -> None:
        super().__init__(temperature, **options)

    def forward(self, features, second_view=None):
        if second_view is not None:
            # Checked before the stacking: torch.cat would promote two dtypes to the wider one
            # and pair row i with row i + (B + B') / 2 of views of different batch sizes.
            features, second_view, error = matched_features(features, second_view, "features",
                                                            "second_view")
            if error is None and second_view.shape != features.shape:
                error = ValueError(f"features and second_view must have the same shape (B, D): "
                                   f"row i of each is a view of sample i; got "
                                   f"{tuple(features.shape)} and {tuple(second_view.shape)}")
            if error is not None:
                raise error
            features = torch.cat([features, second_view], dim=0)
        return nt_xent_loss(features, self.temperature, reduction=self.reduction,
                            filter_eps=self.filter_eps, backend=self.backend)


def __getattr__(name: str):
    # SwitchBackLinear, a companion with its own int8 kernels, is importable from here as from
    # fusedloss.switchback, but loaded only when asked for: `import fusedloss` does not load it.
    if name == "SwitchBackLinear":
        from .switchback import SwitchBackLinear

        return SwitchBackLinear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
