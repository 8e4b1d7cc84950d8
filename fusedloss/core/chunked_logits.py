"""The LM head's training path: the loss and its gradients from three matrix products per
chunk of rows, the softmax between them in one Triton pass.

For a reduced loss ("mean" or "sum") the gradient is known in the forward up to one scalar (the
loss's upstream gradient), so the forward computes it. Per chunk of R rows
(``config.lm_head_chunk_rows``):

    Z = A_c Bᵀ + bias              cuBLAS, Z in the input dtype (R × V), as ``F.linear``
    G = dloss/dZ                   one Triton program per row (``_softmax_grad_rows_kernel``):
                                   one read of Z for the row's (max, Σ exp), the target logit and
                                   Σ_j w_j X_j; one more read of Z that writes G over it
    dA_c = G B                     cuBLAS, rounded once into dA (N × D, input dtype)
    dB += Gᵀ A_c                   cuBLAS into an fp32 (V, D) accumulator (the first chunk
                                   writes it)

three matmul passes in all, the least an exact gradient needs; the backward multiplies by the
upstream gradient, rounding dB once. Every row is computed, an ignored one (``ignore_index``)
giving a loss of 0 and G = 0: nothing is read back to the host (no count of the valid rows),
so the CPU runs ahead of the GPU and the path can be captured in a CUDA graph.

The products run over V' = V rounded up to a multiple of 16 classes (``engine.pad_classes``: B
with zero rows, whose logits and G are 0), where cuBLAS's fast kernels apply; the row kernel
computes over the first V columns.

Extra memory beside the inputs: the chunk of logits (e·R·V' bytes for e-byte inputs, at most
about ``config.Tuning.lm_head_chunk_bytes``), the fp32 dB accumulator (4·V'·D) and dbias (4·V'),
dA (e·N·D, the gradient itself), 4·N bytes of per-row losses, and where V' ≠ V the padded copy
of B (e·V'·D).

Accuracy: the logits are those of ``F.linear`` in the input dtype (the bias, cast to it, added
in the product's epilogue; one rounding), the logits a materialized loss reads; every statistic
and sum is fp32, G is rounded once to the input dtype, the products accumulate in fp32.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from . import config
from .engine import GradCoefficients, Needs, addmm_f32_, cut_classes, mm_f32, pad_classes
from .logits import div, exp, log, mul_rn, tanh, tanh_approx

# The row kernel's launch: BLOCK_V entries of a row per step, on ROW_WARPS warps; pass 1 keeps
# one running max per ROW_GROUP entries.
ROW_BLOCK, ROW_WARPS, ROW_GROUP = 2048, 8, 8


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The options that define the cross-entropy loss (``families.cross_entropy``), as the row
    kernels take them."""

    ignore_index: int = -100
    label_smoothing: float = 0.0  # α
    softcap: float | None = None  # c: X = c·tanh(Z / c)
    z_loss: float = 0.0  # λ


def loss_and_grads(
    a: torch.Tensor,  # (N, D) row-major
    b: torch.Tensor,  # (V, D) row-major
    bias: torch.Tensor | None,  # (V,), cast to a's dtype
    target: torch.Tensor,  # (N,) int64: class ids in [0, V), or options.ignore_index
    class_weight: torch.Tensor | None,  # (V,) fp32
    coef: torch.Tensor,  # () fp32: each row's upstream gradient (1 for "sum", 1/count "mean")
    options: LossOptions,
    needs: Needs,
    chunk: int | None = None,  # rows per chunk; None: ``config.lm_head_chunk_rows``
    weight_grad_dtype: torch.dtype = torch.float32,  # dB's; another than fp32: one chunk only
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(Σ over the rows of coef · loss_i (() fp32), dA (N, D) in a's dtype, dB (V, D) in
    ``weight_grad_dtype``, dbias (V,) fp32) of the loss ``ops.cross_entropy`` describes, each
    gradient None when not in ``needs`` (dB fp32 by default, so that a later scale rounds it
    once; in b's dtype when ``coef`` already holds the upstream gradient, rounded once by its
    product; dbias only with a ``bias``). Every row is computed,
    an ignored one giving a loss of 0 and a zero gradient row; a target outside [0, V) that is
    not ``ignore_index`` gives NaN (its loss and every gradient). Nothing is read back to the
    host."""
    n, d = a.shape
    v = b.shape[0]
    b, bias = pad_classes(b, bias)  # the products over V_p ≥ V classes
    v_p = b.shape[0]
    device = a.device
    label_smoothing, softcap = options.label_smoothing, options.softcap
    need_a, need_b, need_bias = needs.a, needs.b, needs.bias and bias is not None
    chunk = max(1, min(n, chunk or config.lm_head_chunk_rows(n, v, a.element_size())))
    if weight_grad_dtype != torch.float32 and chunk < n:
        raise ValueError(f"dB in {weight_grad_dtype} needs all {n} rows in one chunk, got {chunk}")
    # every row's loss is written by the row kernel (no fill needed, unless there is none)
    losses = (torch.empty if n else torch.zeros)(max(n, 1), dtype=torch.float32, device=device)
    grad_a = torch.empty_like(a) if need_a else None
    grad_b = ((torch.zeros if n == 0 else torch.empty)((v_p, d), dtype=weight_grad_dtype,
                                                        device=device) if need_b else None)
    grad_bias = torch.zeros(v_p, dtype=torch.float32, device=device) if need_bias else None
    if class_weight is None:  # W = V (a fill, not a copy from the host: no wait)
        total_w = torch.full((1,), float(v), dtype=torch.float32, device=device)
    else:
        total_w = class_weight.sum().reshape(1)
    buffer = torch.empty((chunk, v_p), dtype=a.dtype, device=device)
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    block_v = 16 if config.interpreting() else ROW_BLOCK
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        a_c = a[r0:r1]
        z = buffer[: r1 - r0]
        if bias is None:
            torch.mm(a_c, b.T, out=z)
        else:
            torch.addmm(bias, a_c, b.T, out=z)
        _softmax_grad_rows_kernel[(r1 - r0,)](
            z, z.stride(0), target[r0:r1],
            class_weight if class_weight is not None else dummy, total_w, coef.reshape(1),
            losses[r0:r1], v, v_p, options.ignore_index,
            float(label_smoothing), float(options.z_loss), float(softcap or 0.0),
            HAS_CLASS_WEIGHT=class_weight is not None,
            SMOOTHING=label_smoothing > 0, SOFTCAP=softcap is not None,
            PRECISE=config.precise_math(a.dtype), ROUND=not config.interpreting(),
            BLOCK_V=block_v, GROUP=ROW_GROUP, num_warps=ROW_WARPS if block_v >= 2048 else 1,
        )
        if need_a:
            torch.mm(z, b, out=grad_a[r0:r1])
        add_weight_grads(grad_b, grad_bias, z, a_c, first=r0 == 0)
    loss = losses.sum() * coef
    return loss, grad_a, cut_classes(grad_b, v), cut_classes(grad_bias, v)


def add_weight_grads(grad_b: torch.Tensor | None, grad_bias: torch.Tensor | None,
                     g: torch.Tensor, a_c: torch.Tensor, first: bool) -> None:
    """One chunk's part of the weight gradients, in fp32: dB (+)= Gᵀ A_c (the first chunk
    writes it; a dB below fp32, of one chunk, takes the product rounded once) and dbias +=
    Σ_rows G; None skips either."""
    if grad_b is not None:
        if grad_b.dtype != torch.float32:  # one chunk (``loss_and_grads``' weight_grad_dtype)
            torch.mm(g.T, a_c, out=grad_b)
        elif first:
            mm_f32(g.T, a_c, out=grad_b)
        else:
            addmm_f32_(grad_b, g.T, a_c)
    if grad_bias is not None:
        grad_bias += g.sum(dim=0, dtype=torch.float32)


@triton.jit
def _softmax_grad_rows_kernel(
    z_ptr, stride_z,  # (R, V) logits before the softcap, input dtype; G is written over them
    target_ptr,  # (R,) int64
    class_weight_ptr, total_w_ptr,  # (V,) fp32 (if HAS_CLASS_WEIGHT), (1,) fp32: W
    coef_ptr,  # (1,) fp32: the upstream gradient of each row's loss
    loss_ptr,  # (R,) fp32 out: each row's loss
    V, V_ROW,  # the classes; the columns each row holds (≥ V: padding of 0 logits, G = 0)
    ignore_index, alpha, z_loss, softcap,
    HAS_CLASS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROUND: tl.constexpr, BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One row: X = softcap(Z); its LSE (online, per lane, then combined), the target's
    logit and (label smoothing) Σ_j w_j X_j; the loss
    (1−α)·w_y·(lse − X_y) + (α/V)·(W·lse − Σ_j w_j X_j) + λ·lse²; then, over Z, the gradient
    dloss/dZ = (r·P − t·[j = y] − u·w_j) · (1 − (X/c)²) with r, t, u as in
    ``families.cross_entropy`` (upstream gradient ``coef``). An ignored row gets loss 0 and
    G = 0; a target outside [0, V) gives NaN."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(target_ptr + row)
    if y == ignore_index:
        _write_zeros(base, V_ROW, BLOCK_V)
        tl.store(loss_ptr + row, 0.0)
    else:
        m_row, s, x_y, ws = _row_statistics(
            base, class_weight_ptr, y, V, V_ROW, softcap, HAS_CLASS_WEIGHT, SMOOTHING, SOFTCAP,
            PRECISE, ROUND, BLOCK_V, GROUP)
        # lse = m + log s, kept apart where it meets a logit: X − m is exact near the max,
        # where m + log s would be rounded at the magnitude of m
        log_s = log(s, PRECISE)
        lse = m_row + log_s

        in_range = (y >= 0) & (y < V)
        w_y = 1.0
        if HAS_CLASS_WEIGHT:
            w_y = tl.load(class_weight_ptr + tl.where(in_range, y, 0))
        # NaN for a target outside [0, V): the loss and the whole row's gradient
        bad = tl.where(in_range, 0.0, float("nan"))
        total_w = tl.load(total_w_ptr)
        g = tl.load(coef_ptr)
        loss = (1 - alpha) * w_y * ((m_row - x_y) + log_s) + z_loss * lse * lse + bad
        if SMOOTHING:
            loss += (alpha / V) * (total_w * lse - ws)
        tl.store(loss_ptr + row, loss)

        # r·P = (r / s) · exp(X − m)
        r = div(g * ((1 - alpha) * w_y + alpha * total_w / V + 2 * z_loss * lse), s, PRECISE)
        _write_gradient(base, class_weight_ptr, y, V, V_ROW, m_row, r + bad, g * (1 - alpha) * w_y,
                        g * alpha / V, softcap, HAS_CLASS_WEIGHT, SMOOTHING, SOFTCAP, PRECISE,
                        ROUND, BLOCK_V)


@triton.jit
def _write_zeros(base, V, BLOCK_V: tl.constexpr):
    """G = 0 over an ignored row."""
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        tl.store(base + cols, tl.zeros([BLOCK_V], base.dtype.element_ty), mask=cols < V)


@triton.jit
def _row_statistics(base, class_weight_ptr, y_col, V, V_ROW, softcap,
                    HAS_CLASS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_V: tl.constexpr, GROUP: tl.constexpr):
    """The first pass over a row of V columns of X = softcap(Z): (m, Σ_j exp(X_j − m), X at
    column ``y_col`` (0 when the row has no such column), Σ_j w_j X_j (0 without label
    smoothing)). One running (max, Σ exp) per GROUP adjacent entries of a lane block (held by
    one thread): one rescaling exponential per GROUP entries, not per entry. The loads run to
    V_ROW ≥ V columns (a multiple of 16 when the row is padded: whole vector loads)."""
    offs = tl.arange(0, BLOCK_V)
    inv_softcap = 1.0
    if SOFTCAP:
        inv_softcap = 1.0 / softcap
    m_grp = tl.full([BLOCK_V // GROUP], float("-inf"), tl.float32)
    s_grp = tl.zeros([BLOCK_V // GROUP], tl.float32)
    ws_lane = tl.zeros([BLOCK_V], tl.float32)
    xy_lane = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        in_row = cols < V
        x, _ = _logit(base, cols, cols < V_ROW, softcap, inv_softcap, SOFTCAP, PRECISE, ROUND)
        xy_lane += tl.where(cols == y_col, x, 0.0)  # X is 0 outside the row
        if SMOOTHING:
            if HAS_CLASS_WEIGHT:
                w = tl.load(class_weight_ptr + cols, mask=in_row, other=0.0)
                ws_lane += tl.where(in_row, w * x, 0.0)
            else:
                ws_lane += tl.where(in_row, x, 0.0)
        x = tl.where(in_row, x, float("-inf"))
        x2 = tl.reshape(x, [BLOCK_V // GROUP, GROUP])
        m_new = tl.maximum(m_grp, tl.max(x2, axis=1))
        # a group that has seen only -inf keeps its sum at 0 (no inf - inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_grp = (s_grp * exp(m_grp - m_safe, PRECISE)
                 + tl.sum(exp(x2 - m_safe[:, None], PRECISE), axis=1))
        m_grp = m_new
    m = tl.max(m_grp, axis=0)
    m_row = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_grp * exp(m_grp - m_row, PRECISE), axis=0)
    return m_row, s, tl.sum(xy_lane, axis=0), tl.sum(ws_lane, axis=0)


@triton.jit
def _write_gradient(base, class_weight_ptr, y_col, V, V_ROW, m, p_scale, t, u, softcap,
                    HAS_CLASS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr,
                    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_V: tl.constexpr):
    """The second pass: G = (p_scale·exp(X − m) − t·[j = y_col] − u·w_j) · (1 − (X/c)²) over
    the row's V columns, written over Z (and 0 over its padding up to V_ROW). Each lane reads
    and writes the entries it read in the first pass, so G may overwrite Z without a
    barrier."""
    offs = tl.arange(0, BLOCK_V)
    inv_softcap = 1.0
    if SOFTCAP:
        inv_softcap = 1.0 / softcap
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        in_row = cols < V
        in_memory = cols < V_ROW
        x, capped = _logit(base, cols, in_memory, softcap, inv_softcap, SOFTCAP, PRECISE, ROUND)
        grad = p_scale * exp(x - m, PRECISE) - tl.where(cols == y_col, t, 0.0)
        if SMOOTHING:
            if HAS_CLASS_WEIGHT:
                grad -= u * tl.load(class_weight_ptr + cols, mask=in_row, other=0.0)
            else:
                grad -= u
        if SOFTCAP:  # dX/dZ = 1 − tanh²(Z/c)
            grad = grad * (1.0 - capped * capped)
        grad = tl.where(in_row, grad, 0.0)
        tl.store(base + cols, grad.to(base.dtype.element_ty), mask=in_memory)


@triton.jit
def _logit(base, cols, loaded, softcap, inv_softcap, SOFTCAP: tl.constexpr,
           PRECISE: tl.constexpr, ROUND: tl.constexpr):
    """(X = softcap(Z), tanh(Z / c)) at ``cols`` of one row, in fp32 (0 where not ``loaded``;
    the second is Z itself without a softcap)."""
    x = tl.load(base + cols, mask=loaded, other=0.0).to(tl.float32)
    capped = x
    if SOFTCAP:
        # c · tanh(Z / c), the product rounded as written (``logits.mul_rn``): both passes
        # must see the same number. Below fp32 inputs the pass is bound by the special-function
        # unit: Z · (1/c) saves a division, the hardware tanh an exponential and a division
        # (its 2^-11 relative error is a quarter of the logit's bf16 rounding; measured in
        # docs/results.md)
        if PRECISE:
            capped = tanh(div(x, softcap, PRECISE), PRECISE)
        else:
            capped = tanh_approx(x * inv_softcap, ROUND)
        x = mul_rn(capped, tl.zeros_like(capped) + softcap, ROUND)
    return x, capped


def scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad · scale (a () fp32 tensor, read on the device) in fp32, rounded once to ``dtype``:
    one read and one write (the backward's upstream gradient on the forward's gradients)."""
    if config.interpreting():
        # the interpreter stores bf16 by truncation; PyTorch rounds to nearest, as a GPU does
        return (grad.float() * scale).to(dtype)
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    n = grad.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, 8192),)](grad, out, scale.reshape(1), n, BLOCK=8192,
                                               num_warps=8)
    return out


@triton.jit
def _scale_kernel(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=inside)


# ---------------------------------------------------------------------------------------------
# The vocabulary-parallel head's training path (``ops.vocab_parallel``): each rank holds
# the columns [start, start + V_r) of a chunk's logits. ``shard_row_stats`` gives the ranks'
# partial row statistics, which they combine (all-reduces); ``shard_softmax_grad_`` writes G
# over the shard's columns from the combined ones.


def shard_row_stats(
    z: torch.Tensor,  # (R, V_r) this shard's logits before the softcap, input dtype, row-major
    target: torch.Tensor,  # (R,) int64: global class ids, or ignore_index
    start: int,  # the global id of the shard's first column
    class_weight: torch.Tensor | None,  # (V_r,) fp32: the shard's class weights
    options: LossOptions,
) -> torch.Tensor:
    """(4, R) fp32 over the shard's columns of X = softcap(Z): each row's max m and
    Σ_j exp(X_j − m), its target logit X_y where the shard holds y (else 0), and Σ_j w_j X_j
    (0 without label smoothing). An ignored row reads nothing and gets (0, 1, 0, 0) on every
    shard."""
    rows, v_r = z.shape
    softcap = options.softcap
    stats = torch.empty((4, rows), dtype=torch.float32, device=z.device)
    block_v = 16 if config.interpreting() else ROW_BLOCK
    _shard_row_stats_kernel[(rows,)](
        z, z.stride(0), target, _or_dummy(class_weight, z), stats, rows, v_r, start,
        options.ignore_index, float(softcap or 0.0),
        HAS_CLASS_WEIGHT=class_weight is not None, SMOOTHING=options.label_smoothing > 0,
        SOFTCAP=softcap is not None, PRECISE=config.precise_math(z.dtype),
        ROUND=not config.interpreting(), BLOCK_V=block_v, GROUP=ROW_GROUP,
        num_warps=ROW_WARPS if block_v >= 2048 else 1,
    )
    return stats


def shard_softmax_grad_(
    z: torch.Tensor,  # (R, V_r) as for ``shard_row_stats``; G is written over it
    target: torch.Tensor,  # (R,) int64: global class ids, or ignore_index
    start: int,
    class_weight: torch.Tensor | None,  # (V_r,) fp32
    row_max: torch.Tensor,  # (R,) fp32: M, the max of X over every shard
    row_sum: torch.Tensor,  # (R,) fp32: S, Σ over every shard of exp(X − M)
    coef: GradCoefficients,  # (R,) fp32 each: r, t, u (None without label smoothing)
    options: LossOptions,
) -> None:
    """G = dloss/dZ = ((r/S)·exp(X − M) − t·[j = y] − u·w_j) · (1 − (X/c)²) over the shard's
    columns, in place (the coefficients of ``families.cross_entropy``; the target term only on
    the shard that holds y); an ignored row gets G = 0 without reading Z."""
    rows, v_r = z.shape
    softcap = options.softcap
    smoothing = coef.uniform is not None
    block_v = 16 if config.interpreting() else ROW_BLOCK
    _shard_softmax_grad_kernel[(rows,)](
        z, z.stride(0), target, _or_dummy(class_weight, z),
        row_max, coef.lse / row_sum, coef.target, _or_dummy(coef.uniform, z),
        v_r, start, options.ignore_index, float(softcap or 0.0),
        HAS_CLASS_WEIGHT=class_weight is not None, SMOOTHING=smoothing,
        SOFTCAP=softcap is not None, PRECISE=config.precise_math(z.dtype),
        ROUND=not config.interpreting(), BLOCK_V=block_v,
        num_warps=ROW_WARPS if block_v >= 2048 else 1,
    )


def _or_dummy(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else torch.empty(1, dtype=torch.float32, device=like.device)


@triton.jit
def _shard_row_stats_kernel(
    z_ptr, stride_z,  # (R, V) the shard's logits before the softcap, input dtype
    target_ptr,  # (R,) int64 global class ids
    class_weight_ptr,  # (V,) fp32 (if HAS_CLASS_WEIGHT)
    stats_ptr,  # (4, R) fp32 out: max, Σ exp(X − max), X_y (0 unless held here), Σ_j w_j X_j
    R, V, start, ignore_index, softcap,
    HAS_CLASS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISE: tl.constexpr, ROUND: tl.constexpr, BLOCK_V: tl.constexpr, GROUP: tl.constexpr,
):
    """One row's partial statistics over a shard of V columns: the first pass of
    ``_softmax_grad_rows_kernel``, with the target's column y − start."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(target_ptr + row)
    if y == ignore_index:
        tl.store(stats_ptr + row, 0.0)
        tl.store(stats_ptr + R + row, 1.0)
        tl.store(stats_ptr + 2 * R + row, 0.0)
        tl.store(stats_ptr + 3 * R + row, 0.0)
    else:
        # the target's column: one of this shard only where it holds the target
        m_row, row_sum, x_y, ws = _row_statistics(
            base, class_weight_ptr, y - start, V, V, softcap, HAS_CLASS_WEIGHT, SMOOTHING,
            SOFTCAP, PRECISE, ROUND, BLOCK_V, GROUP)
        tl.store(stats_ptr + row, m_row)
        tl.store(stats_ptr + R + row, row_sum)
        tl.store(stats_ptr + 2 * R + row, x_y)
        tl.store(stats_ptr + 3 * R + row, ws)


@triton.jit
def _shard_softmax_grad_kernel(
    z_ptr, stride_z,  # (R, V) the shard's logits before the softcap; G is written over them
    target_ptr,  # (R,) int64 global class ids
    class_weight_ptr,  # (V,) fp32 (if HAS_CLASS_WEIGHT and SMOOTHING)
    row_max_ptr, prob_scale_ptr,  # (R,) fp32 each: M and r / S over every shard
    target_coef_ptr, uniform_coef_ptr,  # (R,) fp32 each: t, u (if SMOOTHING)
    V, start, ignore_index, softcap,
    HAS_CLASS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr, SOFTCAP: tl.constexpr,
    PRECISE: tl.constexpr, ROUND: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row's gradient over a shard of V columns: the second pass of
    ``_softmax_grad_rows_kernel``, from statistics combined over the shards."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    y = tl.load(target_ptr + row)
    if y == ignore_index:
        _write_zeros(base, V, BLOCK_V)
    else:
        u = 0.0
        if SMOOTHING:
            u = tl.load(uniform_coef_ptr + row)
        _write_gradient(base, class_weight_ptr, y - start, V, V, tl.load(row_max_ptr + row),
                        tl.load(prob_scale_ptr + row), tl.load(target_coef_ptr + row), u,
                        softcap, HAS_CLASS_WEIGHT, SMOOTHING, SOFTCAP, PRECISE, ROUND, BLOCK_V)
