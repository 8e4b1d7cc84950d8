"""The vocabulary-parallel LM head: linear cross-entropy with the classifier's rows sharded.

The Megatron / flash-attention layout: every rank of the group holds the same hidden states E
(N, D) and targets (global class ids), and its shard C_r of the classifier: the rows
[start_r, start_r + V_r) of the (V, D) weight (shards may be uneven; by default they follow each
other in rank order). Each rank computes its shard's row statistics on the engine, and the
ranks combine them:

    M_i = max_r max_r,i                       (all-reduce max)
    S_i = Σ_r sum_r,i · exp(max_r,i − M_i)    lse_i = M_i + log S_i
    X_{i,y_i}, Σ_j w_j X_ij, w_{y_i}, Σ_j w_j (all-reduce sum; the owner of y_i contributes)

so every rank returns the loss of the full head, equal to the single-GPU head on the whole
weight. Backward: each rank forms dX on its shard's columns from the global statistics; dC_r
(and d bias_r) stay local; dE = Σ_r dX_r C_r is all-reduced in fp32 and rounded once, so every
rank's E receives the full ∂L/∂E (what Megatron's copy-to-tensor-parallel region gives its input:
add no all-reduce of your own). Two collectives in the forward (max, then one packed sum), one
in the backward, each O(N); no rank ever holds more than its shard's statistics.

The training path (a reduced loss with gradients on the Triton backend, no ``return_lse``, no
filtering, no ``vocab_order``: ``_loss_and_grads``) is the single-GPU head's
(``core.chunked_logits``) with the same combine between its two row kernels. Per chunk of rows:

    Z_r = A_c C_rᵀ + bias_r          cuBLAS, in the input dtype (R × V_r)
    (max, Σ exp), X_y, Σ_j w_j X_j   one Triton program per row over the shard's columns,
                                     combined over the shards as above (2 all-reduces, O(R))
    G_r = dloss/dZ_r                 from the combined statistics, written over Z_r
    dA_c = Σ_r G_r C_r               fp32, all-reduced (O(R·D)), rounded once
    dC_r += G_rᵀ A_c                 local, fp32

so the forward forms the gradients and the backward multiplies them by the loss's upstream
gradient (which must then be the same on every rank, as it is when each rank backpropagates the
loss it returned).

Where the code is: ``fusedloss.linear_cross_entropy(..., process_group=group)`` checks the
arguments and exchanges the facts the ranks must agree on (``losses.cross_entropy``); the
autograd Functions are ``ops.vocab_parallel``'s. This module is the entry point under the
distributed layer's name.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..losses.cross_entropy import linear_cross_entropy
from ..ops._group import group_rank_world


def vocab_parallel_cross_entropy(
    input: Tensor,  # (*, D), the same on every rank
    linear_weight: Tensor,  # (V_r, D) this rank's rows of the classifier
    target: Tensor,  # (*) global class ids in [0, V), or ignore_index; the same on every rank
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    linear_bias: Tensor | None = None,  # (V_r,) this rank's part
    weight: Tensor | None = None,  # (V_r,) this rank's part of the class weights
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    shift: bool = False,
    filter_eps: float | str | None = "auto",
    return_lse: bool = False,
    backend: str = "auto",
    vocab_order: Tensor | str | None = None,  # (V_r,) permutation of this shard, or "auto"
):
    """:func:`fusedloss.linear_cross_entropy` with ``linear_weight`` sharded by rows over
    ``group`` (see the module doc; None: the default group); the same as
    ``fusedloss.linear_cross_entropy(..., process_group=group)``.

    ``vocab_start``: the global id of this shard's first row; default: the shards follow each
    other in rank order (the sum of the lower ranks' V_r). Given explicitly (on every rank), the
    shards must tile [0, V) in some order. Every other option means what it means for the
    single-GPU head, with ``linear_bias``, ``weight`` and ``vocab_order`` this shard's parts.
    Returns on every rank the loss (and LSE) of the whole head. Under ``torch.autocast`` the
    operands are cast as the single-GPU head casts them; float64 input is refused (the
    single-GPU head computes it). A reduced loss with gradients on the Triton backend (without
    ``return_lse``, filtering or ``vocab_order``, on every rank) takes the training path of the
    module doc: its forward forms the gradients, which the backward scales by the loss's
    upstream gradient, to be the same on every rank.
    """
    group_rank_world(group)  # a clear error without an initialized process group
    return linear_cross_entropy(
        input, linear_weight, target, linear_bias=linear_bias, weight=weight,
        reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
        softcap=softcap, z_loss=z_loss, shift=shift, filter_eps=filter_eps,
        return_lse=return_lse, backend=backend, vocab_order=vocab_order,
        process_group=dist.group.WORLD if group is None else group, vocab_start=vocab_start)
