"""fusedloss: fused loss kernels on one linear-log-sum-exp core.

    loss = fusedloss.linear_cross_entropy(hidden, lm_head.weight, labels, shift=True)
    loss = fusedloss.clip_loss(image_features, text_features, logit_scale)
    logp, entropy = fusedloss.linear_log_probs(hidden, lm_head.weight, ids, temperature=0.7,
                                               shift=True, return_entropy=True)
"""

from . import post_training as post_training  # fusedloss.post_training.grpo_loss, ...
from .losses.contrastive import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
from .losses.cross_entropy import linear_cross_entropy
from .losses.distillation import linear_jsd, linear_kl_div, linear_top_k_kl
from .losses.log_probs import linear_log_probs
from .nn import ClipLoss, InfoNCELoss, LinearCrossEntropyLoss, NTXentLoss, SigLipLoss

__version__ = "0.1.0"

__all__ = [
    "ClipLoss", "InfoNCELoss", "LinearCrossEntropyLoss", "NTXentLoss", "SigLipLoss",
    "clip_loss", "info_nce_loss", "linear_cross_entropy", "linear_jsd", "linear_kl_div",
    "linear_log_probs", "linear_top_k_kl", "nt_xent_loss",
    "siglip_loss",
]
