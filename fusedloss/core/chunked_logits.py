"""The LM head's loss and gradients in the forward, from row chunks of materialized logits.

The engine never holds logits: its forward computes the LSEs and its backward recomputes every
tile, four matmul passes over N·V·D in all. When the rows are many (a training step of hundreds
of thousands of tokens), a chunk of R rows' logits (R × V) is small beside the engine's
backward buffers, and holding it lets one pass do the work of two: per chunk,

    Z = A_c Bᵀ                     cuBLAS, fp32 out (bf16 inputs: fp32 products, not rounded)
    G = dloss/dZ                   one Triton program per row: two reads of Z (+ bias, soft
                                   cap), G in the input dtype written over Z's bytes
    dA_c = G B                     cuBLAS, rounded once into dA
    dB += Gᵀ A_c                   cuBLAS into an fp32 (V, D) accumulator

three matmul passes in all, with the gradient of a loss whose upstream gradient is known up to
one scalar: ``reduction`` "sum" or "mean" (the autograd backward multiplies by it and rounds dB
once). Extra memory: the fp32 chunk (4·R·V bytes, ``chunk_rows``) and the fp32 dB accumulator
(4·V·D bytes); dA (N·D) is held from the forward to the backward in place of the input rows.
The LM head takes this path where that fits in what the engine's backward would hold
(``ops.cross_entropy.grad_in_forward_chunk``).

Accuracy: as the engine's, the logits are never rounded (the softmax reads fp32 products) and
every sum is in fp32; G is rounded once to the input dtype, as the engine's dX scratch. Not
taken with filtering or ``reduction="none"``.
"""

import os

import torch
import triton
import triton.language as tl

from . import config
from .engine import addmm_f32_, mm_f32
from .logits import div, exp, log, mul_rn, tanh

# The fp32 chunk of logits holds at most this many bytes and at least this many rows (cuBLAS
# needs rows to fill the GPU). Each chunk also reads and writes the fp32 dB accumulator once
# (8·V·D bytes), so chunks want to be tall: at 2 GiB, 4096 rows of a 128256 vocabulary.
MAX_CHUNK_BYTES = 2**31
MIN_CHUNK_ROWS = 1024


def forced() -> bool | None:
    """``FUSEDLOSS_GRAD_IN_FORWARD``: 1 / 0 forces the path on / off (for measurements and
    tests); None when unset."""
    spec = os.environ.get("FUSEDLOSS_GRAD_IN_FORWARD")
    if spec is None:
        return None
    if spec not in ("0", "1"):
        raise ValueError(f"FUSEDLOSS_GRAD_IN_FORWARD must be 0 or 1, got {spec!r}")
    return spec == "1"


def chunk_rows(n: int, v: int, d: int, budget: int) -> int | None:
    """Rows per chunk for N rows when the path may hold ``budget`` bytes beyond its inputs and
    dA: its fp32 dB accumulator (4·V·D) and a chunk of fp32 logits in the rest (at most
    ``MAX_CHUNK_BYTES``; a multiple of 256 rows, or all N); None when that leaves fewer than
    ``MIN_CHUNK_ROWS`` rows (or N, if fewer)."""
    rows = min(budget - 4 * v * d, MAX_CHUNK_BYTES) // (4 * v)
    if rows >= n:
        return n
    if rows < MIN_CHUNK_ROWS:
        return None
    return rows // 256 * 256


def rows_override() -> int | None:
    """``FUSEDLOSS_CHUNK_ROWS``: the rows per chunk where the path is taken (for measurements
    and tests); None when unset."""
    if spec := os.environ.get("FUSEDLOSS_CHUNK_ROWS"):
        rows = int(spec) if spec.isdigit() else 0
        if rows <= 0:
            raise ValueError(f"FUSEDLOSS_CHUNK_ROWS must be a positive integer, got {spec!r}")
        return rows
    return None


def loss_and_grads(
    a: torch.Tensor,  # (N, D) row-major
    b: torch.Tensor,  # (V, D) row-major
    bias: torch.Tensor | None,  # (V,)
    row_index: torch.Tensor,  # (N,) int64: the compact order, valid rows first
    n_valid: int,
    row_target: torch.Tensor,  # (N,) int64 in compact order (valid positions: in [0, V))
    row_weight: torch.Tensor,  # (N,) fp32 class weight of each row's target (1 without)
    class_weight: torch.Tensor | None,  # (V,) fp32
    coef: torch.Tensor,  # () fp32: each row's upstream gradient (1 for "sum", 1/count "mean")
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    need_a: bool,
    need_b: bool,
    need_bias: bool,
    chunk: int,  # rows per chunk (``chunk_rows``)
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(Σ over valid rows of coef · loss_i (() fp32), dA (N, D) in a's dtype, dB (V, D) fp32,
    dbias (V,) fp32) of the loss ``ops.cross_entropy`` describes, each gradient None when not
    needed (dB stays fp32 so that the backward's scale rounds it once). Ignored rows get
    dA = 0."""
    n, d = a.shape
    v = b.shape[0]
    device = a.device
    identity = n_valid == n  # every row counts: the compact order is 0..N-1
    losses = torch.zeros(max(n_valid, 1), dtype=torch.float32, device=device)
    grad_a = (torch.empty_like(a) if identity else torch.zeros_like(a)) if need_a else None
    grad_b = torch.zeros((v, d), dtype=torch.float32, device=device) if need_b else None
    grad_bias = torch.zeros(v, dtype=torch.float32, device=device) if need_bias else None
    total_w = float(v) if class_weight is None else class_weight.sum()
    total_w = torch.as_tensor(total_w, dtype=torch.float32, device=device).reshape(1)
    buffer = torch.empty((min(chunk, max(n_valid, 1)), v), dtype=torch.float32, device=device)
    # G (input dtype) over the same bytes, row i at the start of Z's row i: each program reads
    # a block of its row before it writes the (narrower or equal) block of G over it
    grads_view = buffer if a.dtype == torch.float32 else buffer.view(a.dtype)[:, :v]
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    block_v = 16 if config.interpreting() else 2048
    for r0 in range(0, n_valid, chunk):
        r1 = min(r0 + chunk, n_valid)
        a_c = a[r0:r1] if identity else a.index_select(0, row_index[r0:r1])
        z, g = buffer[: r1 - r0], grads_view[: r1 - r0]
        mm_f32(a_c, b.T, out=z)
        _softmax_grad_rows_kernel[(r1 - r0,)](
            z, z.stride(0), g, g.stride(0), bias if bias is not None else dummy,
            row_target[r0:r1], row_weight[r0:r1],
            class_weight if class_weight is not None else dummy, total_w,
            coef.reshape(1), losses[r0:r1], v,
            float(label_smoothing), float(z_loss), float(softcap or 0.0),
            HAS_BIAS=bias is not None, HAS_CLASS_WEIGHT=class_weight is not None,
            SMOOTHING=label_smoothing > 0, SOFTCAP=softcap is not None,
            PRECISE=config.precise_math(a.dtype), ROUND=not config.interpreting(),
            BLOCK_V=block_v,
            num_warps=8 if block_v >= 2048 else 1,
        )
        if need_a:
            if identity:
                torch.mm(g, b, out=grad_a[r0:r1])
            else:
                grad_a.index_copy_(0, row_index[r0:r1], g @ b)
        if need_b:
            addmm_f32_(grad_b, g.T, a_c)
        if need_bias:
            grad_bias += g.sum(dim=0, dtype=torch.float32)
    loss = losses.sum() * coef
    return loss, grad_a, grad_b, grad_bias


@triton.jit
def _softmax_grad_rows_kernel(
    z_ptr, stride_z,  # (R, V) fp32 logits without the bias
    g_ptr, stride_g,  # (R, V) their gradient, over the same bytes (see loss_and_grads)
    bias_ptr,  # (V,) if HAS_BIAS
    target_ptr, target_weight_ptr,  # (R,) int64, (R,) fp32
    class_weight_ptr, total_w_ptr,  # (V,) fp32 (if HAS_CLASS_WEIGHT), (1,) fp32: W
    coef_ptr,  # (1,) fp32: the upstream gradient of each row's loss
    loss_ptr,  # (R,) fp32 out: each row's loss
    V, alpha, z_loss, softcap,
    HAS_BIAS: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr, ROUND: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row: X = softcap(Z + bias); its LSE (online, per lane, then combined), the target's logit
    and (label smoothing) Σ_j w_j X_j; the loss
    (1−α)·w_y·(lse − X_y) + (α/V)·(W·lse − Σ_j w_j X_j) + λ·lse²; then, over Z, the gradient
    dloss/dZ = (r·P − t·[j = y] − u·w_j) · (1 − (X/c)²) with r, t, u as in
    ``ops.cross_entropy`` (upstream gradient ``coef``)."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    g_base = g_ptr + row.to(tl.int64) * stride_g
    offs = tl.arange(0, BLOCK_V)
    y = tl.load(target_ptr + row)
    m_lane = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s_lane = tl.zeros([BLOCK_V], tl.float32)
    ws_lane = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        in_row = cols < V
        x = tl.load(base + cols, mask=in_row, other=float("-inf"))
        if HAS_BIAS:
            x += tl.load(bias_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = tl.where(in_row, _capped(x, softcap, PRECISE, ROUND), x)
        m_new = tl.maximum(m_lane, x)
        # a lane that has seen only -inf keeps its sum at 0 (no inf - inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_lane = s_lane * exp(m_lane - m_safe, PRECISE) + exp(x - m_safe, PRECISE)
        m_lane = m_new
        if SMOOTHING:
            if HAS_CLASS_WEIGHT:
                w = tl.load(class_weight_ptr + cols, mask=in_row, other=0.0)
                ws_lane += tl.where(in_row, w * x, 0.0)
            else:
                ws_lane += tl.where(in_row, x, 0.0)
    # lse = m + log s, kept apart where it meets a logit: X − m is exact near the max, where
    # m + log s would be rounded at the magnitude of m
    m = tl.max(m_lane, axis=0)
    m_row = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_lane * exp(m_lane - m_row, PRECISE), axis=0)
    log_s = log(s, PRECISE)
    lse = m_row + log_s

    x_y = tl.load(base + y)
    if HAS_BIAS:
        x_y += tl.load(bias_ptr + y).to(tl.float32)
    if SOFTCAP:
        x_y = _capped(x_y, softcap, PRECISE, ROUND)
    w_y = tl.load(target_weight_ptr + row)
    total_w = tl.load(total_w_ptr)
    g = tl.load(coef_ptr)
    loss = (1 - alpha) * w_y * ((m_row - x_y) + log_s) + z_loss * lse * lse
    if SMOOTHING:
        loss += (alpha / V) * (total_w * lse - tl.sum(ws_lane, axis=0))
    tl.store(loss_ptr + row, loss)

    # r·P = (r / s) · exp(X − m)
    r = div(g * ((1 - alpha) * w_y + alpha * total_w / V + 2 * z_loss * lse), s, PRECISE)
    t = g * (1 - alpha) * w_y
    u = g * alpha / V
    for w0 in range(0, V, BLOCK_V):
        cols_w = w0 + offs
        in_row_w = cols_w < V
        xw = tl.load(base + cols_w, mask=in_row_w, other=0.0)
        if HAS_BIAS:
            xw += tl.load(bias_ptr + cols_w, mask=in_row_w, other=0.0).to(tl.float32)
        if SOFTCAP:
            xw = _capped(xw, softcap, PRECISE, ROUND)
        grad = r * exp(xw - m_row, PRECISE) - tl.where(cols_w == y, t, 0.0)
        if SMOOTHING:
            if HAS_CLASS_WEIGHT:
                grad -= u * tl.load(class_weight_ptr + cols_w, mask=in_row_w, other=0.0)
            else:
                grad -= u
        if SOFTCAP:
            capped = div(xw, softcap, PRECISE)
            grad = grad * (1.0 - capped * capped)
        # G's block k lies over Z's block k/2 (bf16 over fp32): every warp must have read its
        # part of this block, and so of every earlier one, before any warp writes
        tl.debug_barrier()
        tl.store(g_base + cols_w, grad.to(g_ptr.dtype.element_ty), mask=in_row_w)


@triton.jit
def _capped(x, softcap, PRECISE: tl.constexpr, ROUND: tl.constexpr):
    """c · tanh(x / c), the product rounded as written (``logits.mul_rn``): the max of pass 1
    and the X − max of pass 2 must see the same number."""
    t = tanh(div(x, softcap, PRECISE), PRECISE)
    return mul_rn(t, tl.zeros_like(t) + softcap, ROUND)
