"""fusedloss: fused loss kernels on one linear-log-sum-exp core.

    loss = fusedloss.linear_cross_entropy(hidden, lm_head.weight, labels, shift=True)
"""

from .losses.cross_entropy import linear_cross_entropy
from .nn import LinearCrossEntropyLoss

__version__ = "0.1.0"

__all__ = ["LinearCrossEntropyLoss", "linear_cross_entropy"]
