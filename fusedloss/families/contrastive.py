"""The contrastive losses: CLIP, InfoNCE, NT-Xent, SigLIP, as functions of the core's
statistics of X = s · A Bᵀ (+ bias). With P the row softmax and Q the column softmax of X:

    kind       A, B             per-row loss                   dX (per unit upstream g)
    clip       I, T             ½(l_i − X_ii) + ½(k_i − X_ii)  ½g_i P_ij + ½g_j Q_ij − g_i[i=j]
    info_nce   Q, K             l_i − X_{i,y_i}                g_i (P_ij − [j=y_i])
    nt_xent    Z, Z (X_ii out)  l_i − X_{i,i±B}                g_i (P_ij − [j=i±B])
    info_nce_no_diag  Q, K (X_ii out)  l_i − X_{i,y_i}         g_i (P_ij − [j=y_i])
    siglip     I, T (+ bias)    Σ_j softplus(−z_ij X_ij)       −g_i z_ij σ(−z_ij X_ij)

(l_i row LSE, k_j column LSE, z = +1 at the target and −1 elsewhere; for NT-Xent the same
tensor is A and B, and autograd adds dA and dB). The core turns dX into dA = s·dX·B,
dB = s·dXᵀ·A and ds = Σ dX ⊙ A Bᵀ. The single-GPU op uses these on the whole batch, the ring
on each block of columns it visits.
"""

from __future__ import annotations

import torch

from ..core.engine import GradCoefficients, Logits

KINDS = ("clip", "info_nce", "nt_xent", "siglip", "info_nce_no_diag")
#: the kinds whose rows leave out column i (row i's own entry) of their denominators
DIAGONAL_OUT = ("nt_xent", "info_nce_no_diag")


def logits(kind: str, columns: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           *, own_columns: bool = True) -> Logits:
    """X = scale · A Bᵀ (+ bias) for the columns B (M, D). A scalar bias becomes a per-column
    one ((M,) floats; its gradient is their sum). NT-Xent leaves out each row's similarity with
    itself, where the columns are the rows' own (``own_columns``; the ring's home block);
    "info_nce_no_diag" leaves out column i of row i (a query against keys paired with the
    queries row for row, without its own)."""
    column_bias = bias.expand(columns.shape[0]).contiguous() if bias is not None else None
    return Logits(bias=column_bias, scale=scale, diag_mask=kind in DIAGONAL_OUT and own_columns)


def row_loss(kind: str, row_margin: torch.Tensor,
             col_margin: torch.Tensor | None = None) -> torch.Tensor:
    """The per-row loss of the table from the margins l_i − X_{i,target} (and, for CLIP,
    k_i − X_ii); SigLIP's is the core's sigmoid sum, not a margin."""
    return 0.5 * (row_margin + col_margin) if kind == "clip" else row_margin


def grad_coefficients(kind: str, g: torch.Tensor, target_g: torch.Tensor | None, *,
                      half_g: torch.Tensor | None = None,
                      col_half_g: torch.Tensor | None = None) -> GradCoefficients:
    """The table's dX as the core's r·P + c·Q − t·onehot(target) for upstream g (N,):
    r = ½g and c = ½g of the columns for CLIP, r = g otherwise (SigLIP: dX = −r·z·σ(−zX));
    t = ``target_g``: g where a row's target is among the columns, else 0 (None: no row's).
    ``half_g``: ½g, when the caller has it; ``col_half_g``: ½g of the columns when they are
    other rows' (the ring), else the rows' own."""
    if kind == "siglip":
        return GradCoefficients(lse=g)
    if kind == "clip":
        half = 0.5 * g if half_g is None else half_g
        return GradCoefficients(lse=half, col=half if col_half_g is None else col_half_g,
                                target=target_g)
    return GradCoefficients(lse=g, target=target_g)
