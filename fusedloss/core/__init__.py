"""The shared linear-log-sum-exp engine: Triton kernels, their launchers and the block API.

Every loss in fusedloss is a thin layer over :func:`engine.row_stats` (forward statistics of
X = softcap(s·A Bᵀ + bias) without materializing X) and :func:`engine.grads` (the backward,
with safe gradient filtering and vocabulary sorting).
"""

from .engine import GradCoefficients, Grads, Logits, Rows, RowStats, compact_rows, grads, row_stats

__all__ = [
    "GradCoefficients", "Grads", "Logits", "RowStats", "Rows", "compact_rows", "grads",
    "row_stats",
]
