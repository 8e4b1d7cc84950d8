"""The contrastive losses' small-size path: two launches a side, the b × b gradient materialized.

At small batches the tiled engine's cost is the host's: its launches, allocations and Python
layers take ~2 ms per call while the GPU works for tens of microseconds. Here the forward is one
Triton launch: a program per block of rows forms its rows' logits tile by tile (fp32 dot products
of the features, never rounded, as in the engine) and reduces them to each row's statistics and
loss; for CLIP a program per block of columns does the same over the columns. The backward is one
launch that recomputes each tile's logits and writes dS = s·dX (N × M, the features' dtype: the
only N × M array, during the backward), then cuBLAS's dA = dS·B and dB = dSᵀ·A. Extra memory:
N·M elements of the features' dtype in the backward, O(N + M) otherwise.

The per-row losses and dX are the table of ``fusedloss/families/contrastive.py`` (X = s·A Bᵀ +
bias; P, Q the row and column softmax of X; z = ±1 for SigLIP), written here for one tile:

    clip       ½(l_i − X_ii) + ½(k_i − X_ii)     dX = ½g_i P_ij + ½g_j Q_ij − g_i[i=j]
    info_nce   l_i − X_{i,t_i}                   dX = g_i (P_ij − [j=t_i])
    nt_xent    as info_nce, X_ii left out        (t_i = i ± N/2)
    siglip     Σ_j softplus(−z_ij X_ij)          dX = −g_i z_ij σ(−z_ij X_ij)

Targets: ``target`` (N,) int64 when the caller gave labels (InfoNCE); a label outside [0, M)
makes its row's loss NaN and its gradient coefficient NaN (every read stays inside the features).
Without ``target`` row i's positive is column i (for NT-Xent row i ± N/2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import config, engine
from .logits import dot_tile, exp, log, log1p_exp_neg, sigmoid

KIND_CODES = {"clip": 0, "info_nce": 1, "nt_xent": 2, "siglip": 3}

# Rows (columns) per program of the statistics pass and the width of each step of its loop;
# the gradient pass's square tiles; the dot products' steps over D.
_STATS_BLOCK, _STATS_STEP, _GRAD_BLOCK, _BLOCK_K = 64, 64, 64, 64


@triton.jit
def _positives(rows, n, m, target_ptr, HAS_TARGET: tl.constexpr, KIND: tl.constexpr):
    """(each row's positive column, clamped into [0, M); whether the label was outside)."""
    bad = rows < 0  # all false
    if HAS_TARGET:
        target = tl.load(target_ptr + rows, mask=rows < n, other=0)
        bad = (target < 0) | (target >= m)
        target = tl.where(bad, 0, target)
    elif KIND == 2:  # NT-Xent: the other view of the same sample
        half = n // 2
        target = tl.where(rows < half, rows + half, rows - half)
    else:
        target = rows
    return target, bad


@triton.jit
def _logits(p_ptr, q_ptr, stride_p, stride_q, d, rows, cols, n, m, scale, bias,
            KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
            PRECISE: tl.constexpr):
    """(X = scale·P[rows] Q[cols]ᵀ + bias on one tile, fp32, −inf outside the matrix and, for
    NT-Xent, on the diagonal; the raw dot products)."""
    inside = (rows[:, None] < n) & (cols[None, :] < m)
    dots = dot_tile(p_ptr, q_ptr, rows.to(tl.int64), cols.to(tl.int64), rows < n, cols < m,
                    stride_p, stride_q, d, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32,
                    PRECISION, PRECISE)
    x = scale * dots + bias
    if KIND == 2:
        inside &= rows[:, None] != cols[None, :]
    return tl.where(inside, x, float("-inf")), dots


@triton.jit
def _row_pass(
    p_ptr, q_ptr, stride_p, stride_q, d,  # rows of P against every row of Q
    rows, n, m, scale, bias, target_ptr,
    KIND: tl.constexpr, HAS_TARGET: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """(row max, log Σ exp(X − max), loss) of the rows of X = scale·P Qᵀ + bias (SigLIP: the
    loss alone), and whether each row's label was outside [0, M)."""
    target, bad = _positives(rows, n, m, target_ptr, HAS_TARGET, KIND)
    run_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    positive = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, m, STEP):
        cols = start + tl.arange(0, STEP)
        x, _ = _logits(p_ptr, q_ptr, stride_p, stride_q, d, rows, cols, n, m, scale, bias, KIND,
                       BLOCK, STEP, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
        hit = (cols[None, :] == target[:, None]) & (rows[:, None] < n)
        positive += tl.sum(tl.where(hit, x, 0.0), axis=1)
        if KIND == 3:
            # softplus(−zX) = max(−zX, 0) + log(1 + e^−|X|), z = +1 at the target
            terms = tl.maximum(tl.where(hit, -x, x), 0.0) + log1p_exp_neg(tl.abs(x), PRECISE)
            run_sum += tl.sum(tl.where(cols[None, :] < m, terms, 0.0), axis=1)
        else:
            new_max = tl.maximum(run_max, tl.max(x, axis=1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no −inf − (−inf)
            run_sum = (run_sum * exp(run_max - shift, PRECISE)
                       + tl.sum(exp(x - shift[:, None], PRECISE), axis=1))
            run_max = new_max
    if KIND == 3:
        return run_max, run_sum, run_sum, bad
    # max and log-sum apart: for a confident row X − max is exact, where max + log-sum would
    # round away the log-sum (≈ the row's whole loss, or 1 − P in the backward)
    log_sum = log(tl.where(rows < n, run_sum, 1.0), PRECISE)  # (no log 0 past the last row)
    return run_max, log_sum, (run_max - positive) + log_sum, bad


@triton.jit
def _stats_kernel(
    a_ptr, b_ptr, stride_a, stride_b, d,  # the features A (N, D), B (M, D)
    scale_ptr,           # () fp32
    bias_ptr,            # () fp32 (HAS_BIAS)
    target_ptr,          # (N,) int64 (HAS_TARGET)
    loss_ptr,            # (N,) per-row loss; CLIP: (2, N), the row and the column halves
    lse_ptr,             # (2, N) each row's max and log Σ exp(X − max); CLIP: (2, N + M),
                         # the columns' after the rows'; SigLIP: unused
    n, m,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TARGET: tl.constexpr,
    BLOCK: tl.constexpr, STEP: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, PRECISE: tl.constexpr,
):
    """Programs [0, ⌈N/BLOCK⌉) take BLOCK rows each over all columns; for CLIP the next
    ⌈M/BLOCK⌉ take BLOCK columns each over all rows (the rows of Xᵀ = scale·B Aᵀ)."""
    pid = tl.program_id(0)
    row_programs = tl.cdiv(n, BLOCK)
    lse_stride = n + m if KIND == 0 else n
    scale = tl.load(scale_ptr)
    bias = tl.load(bias_ptr) if HAS_BIAS else 0.0
    half = 0.5 if KIND == 0 else 1.0
    if pid < row_programs:
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        row_max, log_sum, loss, bad = _row_pass(
            a_ptr, b_ptr, stride_a, stride_b, d, rows, n, m, scale, bias, target_ptr, KIND,
            HAS_TARGET, BLOCK, STEP, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
        offset = 0
    else:  # CLIP's columns
        rows = (pid - row_programs) * BLOCK + tl.arange(0, BLOCK)
        row_max, log_sum, loss, bad = _row_pass(
            b_ptr, a_ptr, stride_b, stride_a, d, rows, m, n, scale, bias, target_ptr, KIND,
            False, BLOCK, STEP, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
        offset = n
    inside = rows < (n if pid < row_programs else m)
    if KIND != 3:
        tl.store(lse_ptr + offset + rows, row_max, mask=inside)
        tl.store(lse_ptr + lse_stride + offset + rows, log_sum, mask=inside)
    tl.store(loss_ptr + offset + rows, tl.where(bad, float("nan"), half * loss), mask=inside)


@triton.jit
def _grad_kernel(
    a_ptr, b_ptr, stride_a, stride_b, d,  # the features A (N, D), B (M, D)
    scale_ptr, bias_ptr, target_ptr,
    lse_ptr,             # (2, ·) the statistics pass's maxima and log-sums
    g_ptr, g_stride,     # (N,) upstream gradient of the per-row losses (any stride, 0 too)
    g_scale,             # its factor: 1, or 1/N for a mean (g_ptr then the mean's, stride 0)
    ds_ptr,              # (N, M) out: dS = scale·dX in the features' dtype
    partial_ptr,         # (2, tiles) fp32: Σ dX ⊙ A Bᵀ and Σ dX of each tile (NEED_SUMS)
    n, m,
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TARGET: tl.constexpr,
    NEED_SUMS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PRECISE: tl.constexpr,
):
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(m, BLOCK)
    rows = (pid // col_tiles) * BLOCK + tl.arange(0, BLOCK)
    cols = (pid % col_tiles) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr)
    bias = tl.load(bias_ptr) if HAS_BIAS else 0.0
    x, dots = _logits(a_ptr, b_ptr, stride_a, stride_b, d, rows, cols, n, m, scale, bias, KIND,
                      BLOCK, BLOCK, BLOCK_K, DOT_FP32, PRECISION, PRECISE)
    target, bad = _positives(rows, n, m, target_ptr, HAS_TARGET, KIND)
    g = tl.load(g_ptr + rows * g_stride, mask=rows < n, other=0.0).to(tl.float32) * g_scale
    g = tl.where(bad, float("nan"), g)
    hit = cols[None, :] == target[:, None]
    if KIND == 3:
        dx = tl.where(hit, -sigmoid(-x, PRECISE), sigmoid(x, PRECISE)) * g[:, None]
    else:
        lse_stride = n + m if KIND == 0 else n
        row_max = tl.load(lse_ptr + rows, mask=rows < n, other=0.0)
        row_log_sum = tl.load(lse_ptr + lse_stride + rows, mask=rows < n, other=0.0)
        p = exp((x - row_max[:, None]) - row_log_sum[:, None], PRECISE)
        if KIND == 0:
            col_max = tl.load(lse_ptr + n + cols, mask=cols < m, other=0.0)
            col_log_sum = tl.load(lse_ptr + lse_stride + n + cols, mask=cols < m, other=0.0)
            col_g = tl.load(g_ptr + cols * g_stride, mask=cols < m,
                            other=0.0).to(tl.float32) * g_scale
            q = exp((x - col_max[None, :]) - col_log_sum[None, :], PRECISE)
            dx = 0.5 * g[:, None] * p + 0.5 * col_g[None, :] * q - tl.where(hit, g[:, None], 0.0)
        else:
            dx = g[:, None] * (p - tl.where(hit, 1.0, 0.0))
    inside = (rows[:, None] < n) & (cols[None, :] < m)
    dx = tl.where(inside, dx, 0.0)
    tl.store(ds_ptr + rows[:, None].to(tl.int64) * m + cols[None, :],
             (scale * dx).to(ds_ptr.dtype.element_ty), mask=inside)
    if NEED_SUMS:
        tiles = tl.num_programs(0)
        tl.store(partial_ptr + pid, tl.sum(tl.sum(dx * dots, axis=1), axis=0))
        tl.store(partial_ptr + tiles + pid, tl.sum(tl.sum(dx, axis=1), axis=0))


def _common(kind: str, a: Tensor, b: Tensor, bias: Tensor | None, target: Tensor | None
            ) -> dict:
    dot_fp32, precision = engine.dot_flags(a)
    return dict(a_ptr=a, b_ptr=b, stride_a=a.stride(0), stride_b=b.stride(0), d=a.shape[1],
                bias_ptr=a if bias is None else bias,  # an unread pointer when absent
                target_ptr=a if target is None else target, n=a.shape[0], m=b.shape[0],
                KIND=KIND_CODES[kind], HAS_BIAS=bias is not None,
                HAS_TARGET=target is not None, BLOCK_K=_BLOCK_K, DOT_FP32=dot_fp32,
                PRECISION=precision, PRECISE=config.precise_math(a.dtype), num_warps=4)


def forward(a: Tensor, b: Tensor, scale: Tensor, bias: Tensor | None, target: Tensor | None,
            kind: str, reduction: str) -> tuple[Tensor, Tensor]:
    """(the loss: per row (N,) fp32 for ``reduction`` "none", else their "sum" or "mean" (),
    the statistics the backward reads: each row's max and log-sum (2, N), for CLIP each
    column's after the rows' (2, N + M)) of the features a (N, D) and b (M, D), rows
    contiguous; ``scale``, ``bias`` () fp32 tensors; ``target`` (N,) int64 or None (above).
    The reduction is the op's own, so that the backward gets the mean's gradient as one scalar
    (no reduction node in the autograd graph)."""
    n, m = a.shape[0], b.shape[0]
    clip = kind == "clip"
    loss = torch.empty((2, n) if clip else (n,), dtype=torch.float32, device=a.device)
    lse = torch.empty((2, n + m if clip else n), dtype=torch.float32, device=a.device)
    programs = triton.cdiv(n, _STATS_BLOCK) + (triton.cdiv(m, _STATS_BLOCK) if clip else 0)
    _stats_kernel[(programs,)](scale_ptr=scale, loss_ptr=loss, lse_ptr=lse, BLOCK=_STATS_BLOCK,
                               STEP=_STATS_STEP, **_common(kind, a, b, bias, target))
    if reduction == "none":
        return (loss.sum(0) if clip else loss), lse
    if reduction == "sum":
        return loss.sum(), lse
    # CLIP's (2, N) halves: their mean over 2N entries is half the pairs' mean (× 2 is exact).
    return (loss.mean() * 2.0 if clip else loss.mean()), lse


def backward(grad_loss: Tensor, a: Tensor, b: Tensor, scale: Tensor, bias: Tensor | None,
             target: Tensor | None, lse: Tensor, kind: str, reduction: str,
             needs: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """(dA, dB, d scale, d bias) for the upstream gradient of ``forward``'s loss ((N,) for
    ``reduction`` "none", else ()), each None where ``needs`` (a, b, scale, bias) says so."""
    need_a, need_b, need_scale, need_bias = needs
    n, m = a.shape[0], b.shape[0]
    ds = torch.empty((n, m), dtype=a.dtype, device=a.device)
    tiles = triton.cdiv(n, _GRAD_BLOCK) * triton.cdiv(m, _GRAD_BLOCK)
    sums = need_scale or need_bias
    # (an unread pointer without the sums: no allocation)
    partial = torch.empty((2, tiles), dtype=torch.float32, device=a.device) if sums else ds
    _grad_kernel[(tiles,)](
        scale_ptr=scale, lse_ptr=lse, g_ptr=grad_loss,
        g_stride=grad_loss.stride(0) if grad_loss.dim() else 0,
        g_scale=1.0 / n if reduction == "mean" else 1.0,
        ds_ptr=ds, partial_ptr=partial, NEED_SUMS=sums, BLOCK=_GRAD_BLOCK,
        **_common(kind, a, b, bias, target))
    return (torch.mm(ds, b) if need_a else None, torch.mm(ds.T, a) if need_b else None,
            partial[0].sum() if need_scale else None, partial[1].sum() if need_bias else None)
