"""Thin nn.Modules: they validate and store options, then call the functional API."""

from __future__ import annotations

import torch
from torch import nn

from .core.vocab_order import order_by_mean_logit
from .losses.cross_entropy import linear_cross_entropy


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fusedloss.linear_cross_entropy`; same options.

    ``forward(input (*, D), linear_weight (V, D), target (*), linear_bias=None)``.

    ``vocab_order_every``: None (default) keeps the natural vocabulary order; k ≥ 1 sorts the
    vocabulary by average logit every k-th call and reuses that order in between (the
    classifier moves slowly, so a slightly stale order is nearly as good and costs nothing).
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
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be None or > 0, got {softcap}")
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
