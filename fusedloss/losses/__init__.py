"""The losses built on the linear-log-sum-exp core, one module per family."""

from .contrastive import ContrastiveFunction, clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
from .cross_entropy import LinearCrossEntropyFunction, linear_cross_entropy

__all__ = [
    "ContrastiveFunction", "LinearCrossEntropyFunction", "clip_loss", "info_nce_loss",
    "linear_cross_entropy", "nt_xent_loss", "siglip_loss",
]
