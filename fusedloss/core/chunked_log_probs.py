"""Token log-probabilities and entropies on the GPU from cuBLAS products per chunk of rows and
one Triton pass over each row between them (``ops.log_probs``' Triton path).

With X = softcap_{c/T}(f·Z) the tempered logits of Z = A Bᵀ + bias (in the input dtype, as
``F.linear``; f = α/T, ``families.log_probs``), per chunk of R rows
(``config.lm_head_chunk_rows``):

    forward    Z = A_c Bᵀ + bias     cuBLAS (R × V)
               statistics            one Triton program per row (``_row_stats_kernel``): one
                                     read of Z for m = max X, S = Σ exp(X − m), the target's X,
                                     C = Σ exp(X − m)·(X − m), Q = Σ exp(2(X − m)) and Σ X,
                                     each lane keeping its own running values
    backward   Z again               cuBLAS
               G = dL/dZ             one Triton program per row (``_grad_rows_kernel``), over Z:
                                     f·(1 − tanh²)·(g·[j = y] − P·(g + h·(log P + H)))
               dA_c = G B            cuBLAS
               dB += Gᵀ A_c          cuBLAS into fp32 (V, D)

four matrix products in all (the upstream gradients g, h of log p and H are known only in the
backward). Extra memory beside the inputs: one chunk of logits (e·R·V bytes, at most
``Tuning.lm_head_chunk_bytes``), the backward's fp32 dB (4·V·D) and dbias (4·V), and a few fp32
numbers per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import config
from .chunked_logits import ROW_BLOCK, ROW_WARPS, add_weight_grads
from .engine import Needs, cut_classes, pad_classes
from .logits import div, exp, mul_rn, tanh, tanh_approx

#: the rows of ``row_stats``' result
STATS = ("max", "sum", "target_logit", "centered_sum", "square_sum", "logit_sum")


def _chunks(a: torch.Tensor, v: int):
    n = a.shape[0]
    chunk = max(1, min(n, config.lm_head_chunk_rows(n, v, a.element_size())))
    return chunk, range(0, n, chunk)


def _logits_into(z: torch.Tensor, a_c: torch.Tensor, b: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
    if bias is None:
        torch.mm(a_c, b.T, out=z)
    else:
        torch.addmm(bias, a_c, b.T, out=z)


def _launch(a: torch.Tensor, softcap: float | None) -> dict:
    block_v = 16 if config.interpreting() else ROW_BLOCK
    return dict(SOFTCAP=softcap is not None, PRECISE=config.precise_math(a.dtype),
                ROUND=not config.interpreting(), BLOCK_V=block_v,
                num_warps=ROW_WARPS if block_v >= 2048 else 1)


def row_stats(
    a: torch.Tensor,  # (N, D) row-major
    b: torch.Tensor,  # (V, D) row-major
    bias: torch.Tensor | None,  # (V,) in a's dtype
    target: torch.Tensor,  # (N,) int64 column of each row's target, −1 for none
    factor: float,  # f = α / T
    softcap: float | None,  # c / T
) -> torch.Tensor:
    """(6, N) fp32: each row's ``STATS`` over X (the target's logit 0 without a target)."""
    n, v = a.shape[0], b.shape[0]
    stats = torch.empty((len(STATS), n), dtype=torch.float32, device=a.device)
    chunk, starts = _chunks(a, v)
    b, bias = pad_classes(b, bias)
    z = torch.empty((chunk, b.shape[0]), dtype=a.dtype, device=a.device)
    for r0 in starts:
        r1 = min(r0 + chunk, n)
        _logits_into(z[: r1 - r0], a[r0:r1], b, bias)
        _row_stats_kernel[(r1 - r0,)](
            z, z.stride(0), target[r0:r1], stats[:, r0:], stats.stride(0), v, float(factor),
            float(softcap or 1.0), **_launch(a, softcap))
    return stats


def grads(
    a: torch.Tensor,  # (N, D) row-major
    b: torch.Tensor,  # (V, D) row-major
    bias: torch.Tensor | None,  # (V,) in a's dtype
    target: torch.Tensor,  # (N,) int64, −1 for none
    stats: torch.Tensor,  # (≥ 4, N) fp32: ``row_stats``' first four rows
    g: torch.Tensor,  # (N,) fp32: the log-probs' upstream gradient (0 where a row has none)
    h: torch.Tensor | None,  # (N,) fp32: the entropies', or None
    factor: float,
    softcap: float | None,
    needs: Needs,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dA (N, D) in a's dtype, dB (V, D) fp32, dbias (V,) fp32, the bias's as added to Z),
    None where not in ``needs``. A row with g = h = 0 reads nothing and adds nothing."""
    n, v = a.shape[0], b.shape[0]
    need_bias = needs.bias and bias is not None
    grad_a = torch.empty_like(a) if needs.a else None
    chunk, starts = _chunks(a, v)
    b, bias = pad_classes(b, bias)
    v_p = b.shape[0]
    grad_b = (torch.zeros((v_p, a.shape[1]), dtype=torch.float32, device=a.device) if needs.b
              else None)
    grad_bias = torch.zeros(v_p, dtype=torch.float32, device=a.device) if need_bias else None
    z = torch.empty((chunk, v_p), dtype=a.dtype, device=a.device)
    for r0 in starts:
        r1 = min(r0 + chunk, n)
        z_c = z[: r1 - r0]
        _logits_into(z_c, a[r0:r1], b, bias)
        _grad_rows_kernel[(r1 - r0,)](
            z_c, z_c.stride(0), target[r0:r1], stats[:, r0:], stats.stride(0), g[r0:r1],
            h[r0:r1] if h is not None else g[r0:r1], v, float(factor), float(softcap or 1.0),
            ENTROPY=h is not None, **_launch(a, softcap))
        if grad_a is not None:
            torch.mm(z_c, b, out=grad_a[r0:r1])
        add_weight_grads(grad_b, grad_bias, z_c, a[r0:r1], first=r0 == 0)
    return grad_a, cut_classes(grad_b, v), cut_classes(grad_bias, v)


def fused_loss_and_grads(
    a: torch.Tensor,  # (N, D) row-major
    b: torch.Tensor,  # (V, D) row-major
    bias: torch.Tensor | None,  # (V,) in a's dtype
    target: torch.Tensor,  # (N,) int64, −1 for none
    factor: float,
    softcap: float | None,
    groups: torch.Tensor,  # (G, r) int64: the rows of each group (a sequence, a pair)
    group_loss: Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    needs: Needs,
    row_nan: torch.Tensor | None = None,  # (N,) bool: rows whose log p is NaN (a bad target)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss () fp32, dA (N, D), dB (V, D) fp32, dbias (V,) fp32) of a loss that is a sum over
    groups of rows; ``group_loss(g0, g1, log_p)`` gives the part of groups [g0, g1) and its
    gradient with respect to their rows' log-probabilities log_p (g1 − g0, r) fp32: the
    gradient formed in the forward, three products per chunk of whole groups (the logits, dA,
    dB). Per chunk, the statistics pass gives log p, ``group_loss`` each row's upstream
    gradient (in closed form: an op's body runs below autograd), and the gradient pass writes
    dL/dZ over the logits. Rows no group holds get no gradient (dA 0)."""
    n, v = a.shape[0], b.shape[0]
    n_groups, rows_per_group = groups.shape
    need_bias = needs.bias and bias is not None
    grad_a = torch.zeros_like(a) if needs.a else None
    per_chunk = max(1, config.lm_head_chunk_rows(n, v, a.element_size()) // rows_per_group)
    b, bias = pad_classes(b, bias)
    v_p = b.shape[0]
    grad_b = (torch.zeros((v_p, a.shape[1]), dtype=torch.float32, device=a.device) if needs.b
              else None)
    grad_bias = torch.zeros(v_p, dtype=torch.float32, device=a.device) if need_bias else None
    z = torch.empty((min(per_chunk, n_groups) * rows_per_group, v_p), dtype=a.dtype,
                    device=a.device)
    stats = torch.empty((len(STATS), z.shape[0]), dtype=torch.float32, device=a.device)
    loss = torch.zeros((), dtype=torch.float32, device=a.device)
    launch = _launch(a, softcap)
    for g0 in range(0, n_groups, per_chunk):
        g1 = min(g0 + per_chunk, n_groups)
        rows = groups[g0:g1].reshape(-1)
        r = rows.numel()
        a_c, t_c, z_c = a[rows], target[rows], z[:r]
        _logits_into(z_c, a_c, b, bias)
        _row_stats_kernel[(r,)](z_c, z_c.stride(0), t_c, stats, stats.stride(0), v,
                                float(factor), float(softcap or 1.0), **launch)
        row_max, total, target_logit = stats[0, :r], stats[1, :r], stats[2, :r]
        log_p = (target_logit - row_max) - torch.log(total)
        if row_nan is not None:
            log_p = torch.where(row_nan[rows], float("nan"), log_p)
        part, g = group_loss(g0, g1, log_p.view(g1 - g0, rows_per_group))
        loss += part
        g = torch.where(t_c >= 0, g.reshape(-1), 0.0).float()
        _grad_rows_kernel[(r,)](z_c, z_c.stride(0), t_c, stats, stats.stride(0), g, g,
                                v, float(factor), float(softcap or 1.0), ENTROPY=False,
                                **launch)
        if grad_a is not None:
            grad_a[rows] = torch.mm(z_c, b)
        add_weight_grads(grad_b, grad_bias, z_c, a_c, first=False)
    return loss, grad_a, cut_classes(grad_b, v), cut_classes(grad_bias, v)


@triton.jit
def _tempered_logit(base, cols, in_row, factor, softcap, SOFTCAP: tl.constexpr,
                    PRECISE: tl.constexpr, ROUND: tl.constexpr):
    """(X = softcap_c(f·Z), dX/dZ) at ``cols`` of one row in fp32 (X = 0 outside the row)."""
    y = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32) * factor
    slope = tl.zeros_like(y) + factor
    if SOFTCAP:
        if PRECISE:
            capped = tanh(div(y, softcap, PRECISE), PRECISE)
        else:
            capped = tanh_approx(y * (1.0 / softcap), ROUND)
        y = mul_rn(capped, tl.zeros_like(capped) + softcap, ROUND)
        slope = factor * (1.0 - capped * capped)
    return y, slope


@triton.jit
def _row_stats_kernel(
    z_ptr, stride_z,  # (R, V) logits Z of the chunk, input dtype
    target_ptr,  # (R,) int64: the target's column, −1 for none
    stats_ptr, stride_stats,  # (6, ≥ R) fp32 out: ``STATS``
    V, factor, softcap,
    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROUND: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row's statistics in one read, each lane keeping a running max m_l and, relative to
    it, s_l = Σ e, c_l = Σ e·(X − m_l), q_l = Σ e² (e = exp(X − m_l)), then combined."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(target_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    c = tl.zeros([BLOCK_V], tl.float32)
    q = tl.zeros([BLOCK_V], tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    x_y = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        in_row = cols < V
        x, _ = _tempered_logit(base, cols, in_row, factor, softcap, SOFTCAP, PRECISE, ROUND)
        x_y += tl.where(cols == y, x, 0.0)
        total += x
        x = tl.where(in_row, x, float("-inf"))
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane of only -inf keeps 0s
        alpha = exp(m - m_safe, PRECISE)
        e = exp(x - m_safe, PRECISE)
        # c relative to the new max: Σ e'·(X − m') = α·(c + (m − m')·s) for the old entries
        c = alpha * (c + tl.where(s > 0, (m - m_safe) * s, 0.0)) + tl.where(
            in_row, e * (x - m_safe), 0.0)
        s = alpha * s + e
        q = alpha * alpha * q + e * e
        m = m_new
    m_row = tl.max(m, axis=0)
    m_row = tl.where(m_row == float("-inf"), 0.0, m_row)
    alpha = exp(m - m_row, PRECISE)
    shift = tl.where(s > 0, (m - m_row) * s, 0.0)
    out = stats_ptr + row
    tl.store(out, m_row)
    tl.store(out + stride_stats, tl.sum(alpha * s, axis=0))
    tl.store(out + 2 * stride_stats, tl.sum(x_y, axis=0))
    tl.store(out + 3 * stride_stats, tl.sum(alpha * (c + shift), axis=0))
    tl.store(out + 4 * stride_stats, tl.sum(alpha * alpha * q, axis=0))
    tl.store(out + 5 * stride_stats, tl.sum(total, axis=0))


@triton.jit
def _grad_rows_kernel(
    z_ptr, stride_z,  # (R, V) logits Z of the chunk; G is written over them
    target_ptr,  # (R,) int64, −1 for none
    stats_ptr, stride_stats,  # (≥ 4, ≥ R) fp32: max, sum, target logit, centered sum
    g_ptr, h_ptr,  # (R,) fp32 each: upstream gradients of log p and (if ENTROPY) H
    V, factor, softcap,
    ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """G = dX/dZ · (g·[j = y] − P·(g + h·(log P + H))) over one row, written over Z."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(target_ptr + row)
    g = tl.load(g_ptr + row)
    h = 0.0
    if ENTROPY:
        h = tl.load(h_ptr + row)
    m = tl.load(stats_ptr + row)
    s = tl.load(stats_ptr + stride_stats + row)
    offs = tl.arange(0, BLOCK_V)
    if (g == 0.0) & (h == 0.0):  # an ignored token: no gradient
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            tl.store(base + cols, tl.zeros([BLOCK_V], base.dtype.element_ty), mask=cols < V)
    else:
        inv_s = div(1.0, s, PRECISE)
        # log P = (X − m) − log S and H = log S − C / S: log P + H = (X − m) − C / S
        entropy_shift = 0.0
        if ENTROPY:
            entropy_shift = -tl.load(stats_ptr + 3 * stride_stats + row) * inv_s
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            in_row = cols < V
            x, slope = _tempered_logit(base, cols, in_row, factor, softcap, SOFTCAP, PRECISE,
                                       ROUND)
            p = exp(x - m, PRECISE) * inv_s
            coef = g
            if ENTROPY:  # log P + H = (X − m) − C / S
                coef = g + h * ((x - m) + entropy_shift)
            grad = tl.where(cols == y, g, 0.0) - p * coef
            tl.store(base + cols, (slope * grad).to(base.dtype.element_ty), mask=in_row)
