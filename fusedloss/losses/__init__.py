"""The losses built on the linear-log-sum-exp core, one module per family."""

from .contrastive import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
from .cross_entropy import linear_cross_entropy
from .distillation import linear_jsd, linear_kl_div, linear_top_k_kl
from .log_probs import linear_log_probs

__all__ = [
    "clip_loss", "info_nce_loss", "linear_cross_entropy", "linear_jsd", "linear_kl_div",
    "linear_log_probs", "linear_top_k_kl", "nt_xent_loss", "siglip_loss",
]
