"""Vocabulary sorting: order columns so that live tiles cluster.

Filtering skips whole tiles, so it pays when a tile's columns are all unlikely together. The
columns are ordered by their average logit over the batch, which is linear in A without
softcap: mean_i X_ij = s · <mean_i A_i, B_j> + bias_j — one matrix-vector product, no tile pass.
The classifier moves slowly between steps, so an order computed at one step stays good for
the next ones (``LinearCrossEntropyLoss(vocab_order_every=k)`` reuses it).
"""

from __future__ import annotations

import torch


def order_by_mean_logit(
    a: torch.Tensor,  # (N, D)
    b: torch.Tensor,  # (V, D)
    bias: torch.Tensor | None,  # (V,)
    row_valid: torch.Tensor,  # (N,) bool: rows that count
) -> torch.Tensor:
    """(V,) int64 permutation of the columns, most likely column first."""
    # 0/1 weights are exact in any dtype; the sum is accumulated in fp32 by the matmul.
    total = (row_valid.to(a.dtype) @ a).float()
    mean_a = total / row_valid.sum().clamp(min=1)
    # One fp32 pass over B; chunked so no (V, D) fp32 copy of B is ever made.
    score = torch.empty(b.shape[0], dtype=torch.float32, device=b.device)
    chunk = max(1, (1 << 24) // max(1, b.shape[1]))
    for start in range(0, b.shape[0], chunk):
        score[start : start + chunk] = b[start : start + chunk].float() @ mean_a
    if bias is not None:
        score += bias.float()
    return torch.argsort(score, descending=True)
