"""fusedloss over torch.distributed: the same losses for a batch spread over many processes.

    fusedloss.distributed.clip_loss(image_features, text_features, logit_scale)  # per rank
    fusedloss.distributed.siglip_loss / info_nce_loss / nt_xent_loss

The contrastive losses run on a ring (``ring.py``): each rank keeps its rows, the column
blocks travel from rank to rank, and the loss is that of the global batch without any rank
gathering it. ``contrastive.py`` says what each rank returns and which gradients it gets.

    fusedloss.linear_cross_entropy(hidden, weight_shard, labels, process_group=group)

is the vocabulary-parallel LM head (``cross_entropy.py``): the classifier's rows sharded over
the group, every rank getting the loss of the whole head.
"""

from .contrastive import clip_loss, info_nce_loss, nt_xent_loss, siglip_loss
from .cross_entropy import vocab_parallel_cross_entropy
from .grad_cache import GradCache, grad_cache_step

__all__ = ["GradCache", "clip_loss", "grad_cache_step", "info_nce_loss", "nt_xent_loss",
           "siglip_loss", "vocab_parallel_cross_entropy"]
