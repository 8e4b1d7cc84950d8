"""The distillation losses' path on the GPU: a divergence between a student's and a teacher's
tempered softmaxes and the student's gradients, from matrix products per chunk of rows and one
Triton pass over each row between them.

Per chunk of R rows (``config.lm_head_chunk_rows``, one chunk buffer per model):

    Z_s = A_s,c W_sᵀ + b_s        cuBLAS, in the input dtype (R × V), as ``F.linear``
    Z_t = A_t,c W_tᵀ + b_t        likewise for the teacher (its hidden size may differ)
    D, G = div, c·d div/dZ_s      one Triton program per row (``_divergence_rows_kernel``):
                                  a pass for both rows' (max, Σ exp), a pass for the row sums
                                  (the divergence), a pass that writes G over Z_s (the forward
                                  KL's gradient needs no sum: its second pass writes it)
    dA_s,c = G W_s                cuBLAS, into dA (N × D_s, input dtype)
    dW_s += Gᵀ A_s,c              cuBLAS into an fp32 (V, D_s) accumulator

c is each row's upstream gradient: given (the backward of the per-token op), or each row's share
of a reduced loss (1/count, 1 or 0; the forward of the reduced op forms the gradients, four
products in all). A row with c = 0 is skipped (divergence 0, G = 0): an ignored token.

The divergences and gradients are those of ``families.distillation`` with x = Z / T; every
statistic and sum in fp32, G rounded once to the input dtype.

Extra memory beside the inputs: two chunks of logits (2·e·R·V bytes for e-byte inputs), the fp32
dW_s (4·V·D_s) and dbias (4·V), dA_s (e·N·D_s, the gradient itself) and 4·N bytes of divergences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import config
from .chunked_logits import ROW_BLOCK, ROW_WARPS, add_weight_grads
from .engine import Needs, cut_classes, pad_classes
from .logits import div, exp, log, log1p_exp_neg

#: the kernel's KIND for each divergence (``families.distillation.KINDS``)
KIND_CODES = {"forward": 0, "reverse": 1, "jsd": 2}


def divergence_and_grads(
    student: tuple,  # (A_s (N, D_s), W_s (V, D_s), b_s (V,) or None): row-major, b_s in A_s's dtype
    teacher: tuple,  # (A_t (N, D_t), W_t (V, D_t), b_t or None): row-major, b_t in A_t's dtype
    divergence: tuple[str, float, float],  # (kind: "forward", "reverse" or "jsd" (0 < β < 1), β, T)
    coef: torch.Tensor | None,  # (N,) fp32: each row's upstream gradient; None: no gradients
    needs: Needs,  # of the student's input, weight and bias (with ``coef``)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(each row's divergence (N,) fp32, dA_s (N, D_s) in A_s's dtype, dW_s (V, D_s) fp32,
    dbias_s (V,) fp32), the gradients those of Σ_i coef_i·divergence_i, None when not in
    ``needs`` or without ``coef``. A row whose coef is 0 gets divergence 0 and no gradient.
    Nothing is read back to the host."""
    (a_s, w_s, b_s), (a_t, w_t, b_t) = student, teacher
    kind, beta, temperature = divergence
    n, v = a_s.shape[0], w_s.shape[0]
    device = a_s.device
    grads = coef is not None
    need_a, need_b = grads and needs.a, grads and needs.b
    need_bias = grads and needs.bias and b_s is not None
    values = torch.zeros(max(n, 1), dtype=torch.float32, device=device)[:n]
    grad_a = torch.empty_like(a_s) if need_a else None
    # two chunks of logits: at most the training path's chunk bytes for both together
    chunk = max(1, min(n, config.lm_head_chunk_rows(n, v, a_s.element_size() + a_t.element_size())))
    w_s, b_s = pad_classes(w_s, b_s)
    w_t, b_t = pad_classes(w_t, b_t)
    grad_b = (torch.zeros((w_s.shape[0], a_s.shape[1]), dtype=torch.float32, device=device)
              if need_b else None)
    grad_bias = torch.zeros(w_s.shape[0], dtype=torch.float32, device=device) if need_bias else None
    z_s = torch.empty((chunk, w_s.shape[0]), dtype=a_s.dtype, device=device)
    z_t = torch.empty((chunk, w_t.shape[0]), dtype=a_t.dtype, device=device)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    block_v = 16 if config.interpreting() else ROW_BLOCK
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        zs, zt = z_s[: r1 - r0], z_t[: r1 - r0]
        for z, a, w, b in ((zs, a_s, w_s, b_s), (zt, a_t, w_t, b_t)):
            if b is None:
                torch.mm(a[r0:r1], w.T, out=z)
            else:
                torch.addmm(b, a[r0:r1], w.T, out=z)
        _divergence_rows_kernel[(r1 - r0,)](
            zs, zt, zs.stride(0), zt.stride(0), coef[r0:r1] if grads else ones,
            values[r0:r1], v, float(temperature), 1.0 / float(temperature), float(beta),
            KIND=KIND_CODES[kind], GRAD=grads, PRECISE=config.precise_math(a_s.dtype),
            BLOCK_V=block_v, num_warps=ROW_WARPS if block_v >= 2048 else 1,
        )
        if need_a:
            torch.mm(zs, w_s, out=grad_a[r0:r1])
        add_weight_grads(grad_b, grad_bias, zs, a_s[r0:r1], first=r0 == 0)
    return values, grad_a, cut_classes(grad_b, v), cut_classes(grad_bias, v)


@triton.jit
def _divergence_rows_kernel(
    zs_ptr, zt_ptr, stride_s, stride_t,  # (R, V) the student's and teacher's logits; G over zs
    coef_ptr,  # (R,) fp32 upstream gradients (if GRAD)
    out_ptr,  # (R,) fp32 out: each row's divergence
    V, temperature, inv_temperature, beta,
    KIND: tl.constexpr, GRAD: tl.constexpr, PRECISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row: x = Z / T for both models, s and t their log-softmaxes; the divergence
    (``families.distillation``) and, with ``GRAD``, G = (c / T)·∂div/∂x_s over Z_s."""
    row = tl.program_id(0)
    base_s = zs_ptr + row.to(tl.int64) * stride_s
    base_t = zt_ptr + row.to(tl.int64) * stride_t
    c = 1.0
    if GRAD:
        c = tl.load(coef_ptr + row)
    if c == 0.0:  # an ignored row (or one without a share in the loss)
        if GRAD:
            offs = tl.arange(0, BLOCK_V)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                tl.store(base_s + cols, tl.zeros([BLOCK_V], base_s.dtype.element_ty),
                         mask=cols < V)
        tl.store(out_ptr + row, 0.0)
    else:
        # each row's (max, Σ exp(x − max)): log-probabilities (x − max) − log Σ, rounded at
        # the scale of the log-sum, not of the logits (as log_softmax forms them), and
        # probabilities exp(x − max) / Σ (as softmax forms them)
        max_s, sum_s = _tempered_lse(base_s, V, temperature, inv_temperature, PRECISE, BLOCK_V)
        max_t, sum_t = _tempered_lse(base_t, V, temperature, inv_temperature, PRECISE, BLOCK_V)
        lsum_s = log(sum_s, PRECISE)
        lsum_t = log(sum_t, PRECISE)
        scale = c * inv_temperature  # the chain rule through x = Z / T
        offs = tl.arange(0, BLOCK_V)
        # Σ p_t·(t − s) or Σ p_t·(t − log m), and Σ p_s·(s − t) or Σ p_s·(s − log m): per lane
        # with the rounding errors carried beside (_add_product); the gradient reads the sum,
        # whose error would reach every entry
        acc_t = tl.zeros([BLOCK_V], tl.float32)
        err_t = tl.zeros([BLOCK_V], tl.float32)
        acc_s = tl.zeros([BLOCK_V], tl.float32)
        err_s = tl.zeros([BLOCK_V], tl.float32)
        mass = tl.zeros([BLOCK_V], tl.float32)  # Σ p_s as computed (1 up to its roundings)
        err_mass = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            in_row = cols < V
            gap_st, s_m, t_m, p_s, p_t = _log_probs(base_s, base_t, cols, in_row, max_s, sum_s,
                                                    lsum_s, max_t, sum_t, lsum_t, temperature,
                                                    inv_temperature, beta, KIND, PRECISE)
            if KIND == 0:
                acc_t, err_t = _add_product(acc_t, err_t, p_t, -gap_st)
                if GRAD:  # the forward KL's gradient needs no sum: written in this pass
                    tl.store(base_s + cols, (scale * (p_s - p_t)).to(base_s.dtype.element_ty),
                             mask=in_row)
            elif KIND == 1:
                acc_s, err_s = _add_product(acc_s, err_s, p_s, gap_st)
            else:
                acc_t, err_t = _add_product(acc_t, err_t, p_t, t_m)
                acc_s, err_s = _add_product(acc_s, err_s, p_s, s_m)
            if GRAD and KIND != 0:
                mass, err_mass = _add_product(mass, err_mass, p_s, 1.0)
        kl_t = _total(acc_t, err_t)
        kl_s = _total(acc_s, err_s)
        if KIND == 0:
            value = kl_t
        elif KIND == 1:
            value = kl_s
        else:
            value = beta * kl_t + (1.0 - beta) * kl_s
        tl.store(out_ptr + row, value)
        if GRAD and KIND != 0:
            # reverse: p_s·((s − t) − KL);  jsd: (1 − β)·p_s·((s − log m) − KL(p_s ‖ m)), the KL
            # as the p_s-weighted mean of the same gaps (Σ p·gap / Σ p): the p's rounding,
            # common to a row, then cancels between the two (a peaked row's largest entry)
            kl_mean = kl_s / _total(mass, err_mass)
            weight = 1.0
            if KIND == 2:
                weight = 1.0 - beta
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                in_row = cols < V
                gap_st, s_m, t_m, p_s, p_t = _log_probs(
                    base_s, base_t, cols, in_row, max_s, sum_s, lsum_s, max_t, sum_t, lsum_t,
                    temperature, inv_temperature, beta, KIND, PRECISE)
                if KIND == 1:
                    gap = tl.where(p_s > 0, gap_st, 0.0)
                else:
                    gap = tl.where(p_s > 0, s_m, 0.0)
                grad = (scale * weight) * (p_s * (gap - kl_mean))
                tl.store(base_s + cols, grad.to(base_s.dtype.element_ty), mask=in_row)


@triton.jit
def _add_product(acc, err, p, x):
    """acc + p·x per lane where p > 0 (x may be NaN where p is 0), the roundings of the product
    (exact with a fused multiply-add) and of the sum (Neumaier's) added to ``err``."""
    x = tl.where(p > 0, x, 0.0)
    y = p * x
    total = acc + y
    lost = tl.where(tl.abs(acc) >= tl.abs(y), (acc - total) + y, (y - total) + acc)
    return total, err + (lost + tl.fma(p, x, -y))


@triton.jit
def _total(acc, err):
    """Σ over the lanes of acc + err, in fp64 (once per row), rounded to fp32."""
    return tl.sum(acc.to(tl.float64) + err.to(tl.float64), axis=0).to(tl.float32)


@triton.jit
def _tempered(base, cols, in_row, temperature, inv_temperature, PRECISE: tl.constexpr):
    """x = Z / T at ``cols`` of one row in fp32 (-inf outside the row)."""
    z = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32)
    if base.dtype.element_ty == tl.float32:  # rounded as PyTorch's Z / T (fp32 logits)
        x = div(z, temperature, PRECISE)
    else:  # bf16/fp16 logits: their rounding dwarfs the reciprocal's
        x = z * inv_temperature
    return tl.where(in_row, x, float("-inf"))


@triton.jit
def _tempered_lse(base, V, temperature, inv_temperature, PRECISE: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """(max_j x_j, Σ_j exp(x_j − max)) of x = Z / T over a row: a running (max, Σ exp) per
    lane, then combined."""
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        x = _tempered(base, cols, cols < V, temperature, inv_temperature, PRECISE)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane of only -inf keeps 0
        s = s * exp(m - m_safe, PRECISE) + exp(x - m_safe, PRECISE)
        m = m_new
    m_row = tl.max(m, axis=0)
    return m_row, tl.sum(s * exp(m - m_row, PRECISE), axis=0)


@triton.jit
def _log_probs(base_s, base_t, cols, in_row, max_s, sum_s, lsum_s, max_t, sum_t, lsum_t,
               temperature, inv_temperature, beta, KIND: tl.constexpr, PRECISE: tl.constexpr):
    """(s − t, s − log m, t − log m, p_s, p_t) at ``cols`` from each row's max, Σ exp(x − max)
    and its log, for s and t the log-probabilities (p = 0 outside the row; log m, of the JSD's
    mixture β·p_t + (1 − β)·p_s, only for KIND 2).

    Each is formed at its own scale, not as a difference of log-probabilities (rounded at
    theirs, |s|·2⁻²⁴): s − t from the centered logits, s − log m = −logaddexp(log(1 − β),
    log β − (s − t)) and t − log m = −logaddexp(log β, log(1 − β) + (s − t)); and p =
    exp(x − max) / Σ, as softmax forms it."""
    centered_s = _tempered(base_s, cols, in_row, temperature, inv_temperature, PRECISE) - max_s
    centered_t = _tempered(base_t, cols, in_row, temperature, inv_temperature, PRECISE) - max_t
    gap_st = (centered_s - centered_t) + (lsum_t - lsum_s)
    p_s = div(exp(centered_s, PRECISE), sum_s, PRECISE)
    p_t = div(exp(centered_t, PRECISE), sum_t, PRECISE)
    s_m = gap_st
    t_m = gap_st
    if KIND == 2:
        log_1mb = tl.log(1.0 - beta)
        log_b = tl.log(beta)
        s_m = -_logaddexp(log_1mb, log_b - gap_st, PRECISE)
        t_m = -_logaddexp(log_b, log_1mb + gap_st, PRECISE)
    return gap_st, s_m, t_m, p_s, p_t


@triton.jit
def _logaddexp(x, y, PRECISE: tl.constexpr):
    """log(e^x + e^y) for x finite: the larger plus log1p(e^−|x − y|)."""
    hi = tl.maximum(x, y)
    lo = tl.minimum(x, y)
    return hi + log1p_exp_neg(hi - lo, PRECISE)
