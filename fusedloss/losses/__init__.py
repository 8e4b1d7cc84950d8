"""The losses built on the linear-log-sum-exp core, one module per family."""

from .cross_entropy import LinearCrossEntropyFunction, linear_cross_entropy

__all__ = ["LinearCrossEntropyFunction", "linear_cross_entropy"]
