"""SigLIP's training path on the GPU: the loss and every gradient from three cuBLAS products
per chunk of rows and one Triton pass over each row between them.

SigLIP's gradient needs no statistic of a whole row or column (``families.contrastive``:
dX_ij = −g·z_ij·σ(−z_ij·X_ij)), so a reduced loss's gradient is known as soon as a chunk's
logits are, and the forward forms it. Per chunk of R rows (``chunk_rows``):

    Z = A_c Bᵀ                 cuBLAS, fp32 output (the logits are never rounded below fp32,
                               as in the tiled kernels)
    G, row sums                one Triton program per row (``_siglip_rows_kernel``): X = s·Z + β,
                               the row's Σ_j softplus(−z·X), G = s·dX in the input dtype, and the
                               row's Σ_j dX·Z and Σ_j dX (the scale's and the bias's gradients)
    dA_c = G B                 cuBLAS into dA (input dtype)
    dB += Gᵀ A_c               cuBLAS into an fp32 (M, D) accumulator

three products in all, against the four of a forward and a backward that recomputes. Extra
memory: the chunk's fp32 logits and its G (6·R·M bytes for 2-byte inputs, at most
``Tuning.lm_head_chunk_bytes`` together), the fp32 dB (4·M·D) and a few fp32 numbers per row.

On Hopper GPUs (bf16/fp16, D a multiple of 64 up to 1024, ``Tuning.gluon``) one Gluon kernel
(``siglip_sm90``) forms each chunk's G and sums from its logits in registers, where the fp32
logits would otherwise make a round trip through memory; its G buffer (2·R·M bytes, rows and
columns padded to whole tiles) takes the chunk budget alone, so chunks hold three times the rows;
its sums take 12 bytes per 64 rows and column split (at most one split per SM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import config
from .chunked_logits import ROW_BLOCK, ROW_WARPS
from .engine import Needs, _tma_ready, addmm_f32_, mm_f32
from .logits import log1p_exp_neg, sigmoid


def siglip_loss_and_grads(
    a: torch.Tensor,  # (N, D) row-major image features
    b: torch.Tensor,  # (M, D) row-major text features
    scale: torch.Tensor,  # () fp32: s
    bias: torch.Tensor | None,  # () fp32: β
    coef: float,  # each row's upstream gradient: 1 / N for "mean", 1 for "sum"
    needs: Needs,  # a, b, bias, scale
    *,
    positives: bool = True,  # column i is row i's positive (else every pair is a negative)
    acc_a: torch.Tensor | None = None,  # (N, D) fp32: dA is added into it (needs.a)
) -> tuple[torch.Tensor, ...]:
    """(coef · Σ_i Σ_j softplus(−z_ij X_ij) (), dA (N, D) in a's dtype (``acc_a`` itself when
    given), dB (M, D) fp32, d bias (), d scale ()) with z = +1 where j = i (``positives``) and
    −1 elsewhere, the gradients for an upstream gradient of 1; each None where not in
    ``needs``. Nothing is read back to the host. ``positives=False`` and ``acc_a`` serve the
    ring's blocks of other ranks' texts (``distributed.ring.siglip``)."""
    n, m = a.shape[0], b.shape[0]
    f32 = dict(dtype=torch.float32, device=a.device)
    grad_a = None
    if needs.a:
        grad_a = acc_a if acc_a is not None else torch.empty_like(a)
    grad_b = torch.zeros((m, a.shape[1]), **f32) if needs.b else None
    bias_t = bias if bias is not None else torch.zeros((), **f32)
    # Row i's label is +1 at column i + shift: none of the M columns when shifted by M.
    shift = 0 if positives else m
    if _hopper(a, b):
        return _siglip_sm90(a, b, scale, bias_t, coef, needs, grad_a, grad_b,
                            has_bias=bias is not None, shift=shift,
                            accumulate=acc_a is not None)
    per_row = torch.zeros((3, max(n, 1)), **f32)  # loss, Σ dX·Z, Σ dX per row
    chunk = max(1, min(n, config.lm_head_chunk_rows(n, m, 4 + a.element_size())))
    z = torch.empty((chunk, m), **f32)
    g = torch.empty((chunk, m), dtype=a.dtype, device=a.device)
    block = 16 if config.interpreting() else ROW_BLOCK
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        z_c, g_c = z[: r1 - r0], g[: r1 - r0]
        mm_f32(a[r0:r1], b.T, out=z_c)
        _siglip_rows_kernel[(r1 - r0,)](
            z_c, g_c, z_c.stride(0), g_c.stride(0), per_row[:, r0:], per_row.stride(0),
            scale.reshape(1), bias_t.reshape(1), m, r0 + shift, float(coef),
            PRECISE=config.precise_math(a.dtype), BLOCK=block,
            num_warps=ROW_WARPS if block >= 2048 else 1)
        _products(g_c, a[r0:r1], b, grad_a, grad_b, r0, r1, acc_a is not None)
    loss = per_row[0, :n].sum() * coef
    grad_scale = per_row[1, :n].sum() if needs.scale else None
    grad_bias = per_row[2, :n].sum() if needs.bias and bias is not None else None
    return loss, grad_a, grad_b, grad_bias, grad_scale


def _hopper(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the Gluon chunk kernel takes these operands (``siglip_sm90``)."""
    if not (a.shape[0] and b.shape[0] and config.gluon_enabled(a.device)):
        return False
    from . import siglip_sm90

    return siglip_sm90.supports(a, b) and _tma_ready(a) and _tma_ready(b)


def _products(g_c, a_c, b, grad_a, grad_b, r0: int, r1: int, accumulate: bool) -> None:
    """A chunk's two products: dA_c = G B (added in fp32 where ``accumulate``), dB += Gᵀ A_c."""
    if grad_a is not None:
        if accumulate:
            addmm_f32_(grad_a[r0:r1], g_c, b)
        else:
            torch.mm(g_c, b, out=grad_a[r0:r1])
    if grad_b is not None:
        addmm_f32_(grad_b, g_c.T, a_c)


# The Gluon path's chunks hold whole rows of G while the budget holds at least COLUMN_CHUNK_BELOW
# of them; for wider batches (M beyond Tuning.lm_head_chunk_bytes / (2 · 4096) bf16 columns:
# b = 262144 at 1 GiB) they take COLUMN_CHUNK_ROWS rows and as many columns as fit, so that dB's
# fp32 accumulator (4·M·D bytes, read and written by every chunk's Gᵀ A product) is swept by
# M / COLUMN_CHUNK_ROWS chunks instead of 2·M·b / budget.
COLUMN_CHUNK_BELOW = 4096
COLUMN_CHUNK_ROWS = 16384


def chunk_shape(n: int, m: int, element_size: int, chunk_bytes: int | None = None,
                block: int = 64) -> tuple[int, int]:
    """(rows, columns) of the Gluon path's chunks of G for N rows against M columns: whole rows
    (columns = M) within ``chunk_bytes`` (default ``Tuning.lm_head_chunk_bytes``) while at
    least ``COLUMN_CHUNK_BELOW`` of them fit, else ``COLUMN_CHUNK_ROWS`` rows and the columns
    that fit; rows a multiple of ``block`` unless all N, columns a multiple of ``block`` unless
    all M, at least ``block`` of each."""
    width = -(-m // block) * block
    rows = config.lm_head_chunk_rows(n, width, element_size, chunk_bytes)
    if rows >= n:
        return n, m
    whole_rows = min(n, max(block, rows // block * block))
    if rows >= COLUMN_CHUNK_BELOW or n <= COLUMN_CHUNK_BELOW:
        return whole_rows, m
    rows = min(n, COLUMN_CHUNK_ROWS)
    budget = chunk_bytes or config.tuning().lm_head_chunk_bytes
    cols = max(block, budget // (element_size * (-(-rows // block) * block)) // block * block)
    return (rows, cols) if cols < m else (whole_rows, m)


def _siglip_sm90(a, b, scale, bias, coef, needs, grad_a, grad_b, has_bias: bool, shift: int,
                 accumulate: bool) -> tuple[torch.Tensor, ...]:
    """``siglip_loss_and_grads`` through the Gluon chunk kernel: per chunk of rows (a multiple
    of its 64-row blocks) and of columns (``chunk_shape``), G and the chunk's sums from one
    kernel, then the two products; over several column chunks dA's rows add up in fp32."""
    from . import siglip_sm90 as sm90

    n, m = a.shape[0], b.shape[0]
    rows, cols = chunk_shape(n, m, a.element_size(), block=sm90.BLOCK_M)
    g = torch.empty((-(-rows // sm90.BLOCK_M) * sm90.BLOCK_M,
                     -(-cols // sm90.BLOCK_N) * sm90.BLOCK_N), dtype=a.dtype, device=a.device)
    scale, bias = scale.reshape(()), bias.reshape(())
    column_chunks = [(c0, b[c0:c0 + cols]) for c0 in range(0, m, cols)]
    # Row i's positive is column i + shift: i + shift − c0 of the chunk from column c0 on.
    kernels = [sm90.Chunks(b_c, scale, bias, coef, g, n, rows, shift - c0)
               for c0, b_c in column_chunks]
    acc_rows = None  # dA's rows summed over the column chunks, fp32
    if grad_a is not None and not accumulate and len(kernels) > 1:
        acc_rows = torch.empty((rows, a.shape[1]), dtype=torch.float32, device=a.device)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        a_c = a[r0:r1]
        if acc_rows is not None:
            acc_rows.zero_()
        for (c0, b_c), kernel in zip(column_chunks, kernels, strict=True):
            kernel(a_c, r0)
            g_c = g[: r1 - r0, : b_c.shape[0]]
            grad_b_c = None if grad_b is None else grad_b[c0:c0 + b_c.shape[0]]
            if acc_rows is None:
                _products(g_c, a_c, b_c, grad_a, grad_b_c, r0, r1, accumulate)
            else:
                _products(g_c, a_c, b_c, acc_rows, grad_b_c, 0, r1 - r0, True)
        if acc_rows is not None:
            grad_a[r0:r1].copy_(acc_rows[: r1 - r0])
    totals = sum(kernel.totals() for kernel in kernels)
    loss = totals[0] * coef
    grad_scale = totals[1] if needs.scale else None
    grad_bias = totals[2] if needs.bias and has_bias else None
    return loss, grad_a, grad_b, grad_bias, grad_scale


@triton.jit
def _siglip_rows_kernel(
    z_ptr, g_ptr, stride_z, stride_g,  # (R, M) fp32 logits A_c Bᵀ; G out (input dtype)
    rows_ptr, stride_rows,  # (3, ≥ R) fp32 out: loss, Σ_j dX·Z, Σ_j dX per row
    scale_ptr, bias_ptr,  # (1,) fp32 each
    M, row0, coef,  # row0: the column of the chunk's first row's positive (M or more: none)
    PRECISE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One row (program p, its positive at column i = row0 + p): X = s·Z + β, z = +1 at column
    i; the row's Σ softplus(−z·X), dX = −coef·z·σ(−z·X), G = s·dX, Σ dX·Z and Σ dX."""
    row = tl.program_id(0)
    i = row0 + row
    z_base = z_ptr + row.to(tl.int64) * stride_z
    g_base = g_ptr + row.to(tl.int64) * stride_g
    s = tl.load(scale_ptr)
    beta = tl.load(bias_ptr)
    offs = tl.arange(0, BLOCK)
    loss = tl.zeros([BLOCK], tl.float32)
    d_scale = tl.zeros([BLOCK], tl.float32)
    d_bias = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, M, BLOCK):
        cols = c0 + offs
        inside = cols < M
        zz = tl.load(z_base + cols, mask=inside, other=0.0)
        sign = tl.where(cols == i, 1.0, -1.0)
        y = sign * (s * zz + beta)  # z·X
        # softplus(−y) = max(−y, 0) + log(1 + e^(−|y|)); σ(−y)
        lost = tl.maximum(-y, 0.0) + log1p_exp_neg(tl.abs(y), PRECISE)
        dx = -coef * sign * sigmoid(-y, PRECISE)
        loss += tl.where(inside, lost, 0.0)
        d_scale += tl.where(inside, dx * zz, 0.0)
        d_bias += tl.where(inside, dx, 0.0)
        tl.store(g_base + cols, (s * dx).to(g_base.dtype.element_ty), mask=inside)
    tl.store(rows_ptr + row, tl.sum(loss, axis=0))
    tl.store(rows_ptr + stride_rows + row, tl.sum(d_scale, axis=0))
    tl.store(rows_ptr + 2 * stride_rows + row, tl.sum(d_bias, axis=0))

