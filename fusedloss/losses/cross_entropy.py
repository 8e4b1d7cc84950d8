"""Linear cross-entropy (the "cut cross-entropy" LM head) on the linear-log-sum-exp core.

With A = input rows, B = linear_weight, X = softcap(A Bᵀ + bias), lse_i = log Σ_j exp(X_ij),
y = target, w = class weights (1 without ``weight``), W = Σ_j w_j, α = label_smoothing,
λ = z_loss, the per-token loss of a non-ignored token is

    loss_i = (1−α)·w_{y_i}·(lse_i − X_{i,y_i}) + (α/V)·(W·lse_i − Σ_j w_j X_ij) + λ·lse_i²

(exactly ``F.cross_entropy(logits, y, weight, label_smoothing=α, reduction="none")`` plus the
z-loss). Its gradient with respect to the logits is r_i·P_ij − t_i·[j=y_i] − u_i·w_j with

    r_i = g_i·((1−α)·w_{y_i} + α·W/V + 2λ·lse_i) + g^lse_i
    t_i = g_i·(1−α)·w_{y_i}
    u_i = g_i·α/V

which is what the core's backward takes. Ignored tokens are dropped from the compact row order,
so they cost no work, and give a loss of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch

from ..core import engine
from ..core.engine import GradCoefficients, Logits, Rows
from ..core.filtering import resolve_filter_eps
from ..core.vocab_order import order_by_mean_logit

Reduction = Literal["none", "mean", "sum"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Params:
    """Everything about one call that is not a differentiable tensor."""

    rows: Rows
    softcap: float | None
    col_order: torch.Tensor | None
    class_weight: torch.Tensor | None  # (V,) fp32
    target_weight: torch.Tensor  # (N,) fp32 w_{y_i} in compact order, 0 past n_valid
    label_smoothing: float
    z_loss: float
    filter_eps: float | None
    backend: str


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-token losses and LSEs (both (N,) fp32, original row order) of a linear CE head."""

    @staticmethod
    def forward(ctx, a, b, bias, params: _Params):
        n, v = a.shape[0], b.shape[0]
        logits = Logits(bias=bias, softcap=params.softcap, col_order=params.col_order)
        alpha = params.label_smoothing
        needs_grad = any(ctx.needs_input_grad[:3])
        stats = engine.row_stats(
            a, b, logits, params.rows,
            col_weight=params.class_weight, weighted_sum=alpha > 0,
            record_tiles=needs_grad and params.filter_eps is not None,
            backend=params.backend,
        )
        lse, w_y = stats.lse, params.target_weight
        loss = (1 - alpha) * w_y * stats.lse_minus(stats.target_logit)
        if alpha > 0:
            total_w = params.class_weight.sum() if params.class_weight is not None else v
            loss = loss + (alpha / v) * (total_w * lse - stats.weighted_sum)
        if params.z_loss:
            loss = loss + params.z_loss * lse * lse
        valid = _valid_positions(params.rows, n)
        loss = torch.where(valid, loss, 0.0)

        ctx.save_for_backward(a, b, bias, lse)
        ctx.params, ctx.stats = params, stats
        return _to_original_order(loss, params.rows), _to_original_order(lse, params.rows)

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        a, b, bias, lse = ctx.saved_tensors
        params: _Params = ctx.params
        rows, n, v = params.rows, a.shape[0], b.shape[0]
        valid = _valid_positions(rows, n)
        zeros = torch.zeros(n, dtype=torch.float32, device=a.device)
        g = grad_loss[rows.index].float() if grad_loss is not None else zeros
        g = torch.where(valid, g, 0.0)
        g_lse = 0.0
        if grad_lse is not None:
            g_lse = torch.where(valid, grad_lse[rows.index].float(), 0.0)

        alpha, w_y = params.label_smoothing, params.target_weight
        total_w = params.class_weight.sum() if params.class_weight is not None else v
        coef_lse = g * ((1 - alpha) * w_y + alpha * total_w / v + 2 * params.z_loss * lse) + g_lse
        coef = GradCoefficients(
            lse=coef_lse,
            target=g * (1 - alpha) * w_y,
            uniform=g * (alpha / v) if alpha > 0 else None,
        )
        grads = engine.grads(
            a, b, Logits(bias=bias, softcap=params.softcap, col_order=params.col_order),
            rows, ctx.stats, coef,
            col_weight=params.class_weight, filter_eps=params.filter_eps,
            filter_scale=(_gradient_mass(ctx.stats, coef), None),
            need_a=ctx.needs_input_grad[0], need_b=ctx.needs_input_grad[1],
            need_bias=bias is not None and ctx.needs_input_grad[2],
            backend=params.backend,
        )
        grad_bias = grads.bias.to(bias.dtype) if grads.bias is not None else None
        return grads.a, grads.b, grad_bias, None


def _gradient_mass(stats, coef: GradCoefficients) -> torch.Tensor:
    """Each row's gradient mass relative to its softmax mass (the filter's per-row scale).

    The tile part of a row's gradient, r·P − t·e_y, has L1 mass r·((1 − P_y) + |P_y − t/r|).
    """
    p_target = torch.exp(-stats.lse_minus(stats.target_logit))
    ratio = torch.where(coef.lse != 0, coef.target / torch.where(coef.lse != 0, coef.lse, 1.0),
                        1.0)
    return torch.clamp((1 - p_target) + (p_target - ratio).abs(), max=1.0)


def _valid_positions(rows: Rows, n: int) -> torch.Tensor:
    return torch.arange(n, device=rows.index.device) < rows.n_valid


def _to_original_order(values: torch.Tensor, rows: Rows) -> torch.Tensor:
    # rows.index is a permutation of all rows, so a plain indexed write is a scatter.
    out = torch.empty_like(values)
    out[rows.index] = values
    return out


@overload
def linear_cross_entropy(
    input, linear_weight, target, *, return_lse: Literal[False] = ..., **kwargs
) -> torch.Tensor: ...


@overload
def linear_cross_entropy(
    input, linear_weight, target, *, return_lse: Literal[True], **kwargs
) -> tuple[torch.Tensor, torch.Tensor]: ...


def linear_cross_entropy(
    input: torch.Tensor,  # (*, D)
    linear_weight: torch.Tensor,  # (V, D)
    target: torch.Tensor,  # (*) int64 in [0, V) or ignore_index
    *,
    linear_bias: torch.Tensor | None = None,  # (V,)
    weight: torch.Tensor | None = None,  # (V,) class weights
    reduction: Reduction = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    z_loss: float = 0.0,
    shift: bool = False,
    filter_eps: float | Literal["auto"] | None = "auto",
    return_lse: bool = False,
    backend: Literal["auto", "triton", "torch"] = "auto",
    vocab_order: torch.Tensor | Literal["auto"] | None = None,
):
    """Cross-entropy of a linear head without materializing the (*, V) logits.

    Equals ``F.cross_entropy(F.linear(input, linear_weight, linear_bias).float(), target,
    weight=weight, reduction=reduction, ignore_index=ignore_index,
    label_smoothing=label_smoothing)`` (and ``torch.nn.functional.linear_cross_entropy``), with
    these additions:

    Args:
        input: (*, D) hidden states, fp32/bf16/fp16.
        linear_weight: (V, D) classifier, same dtype as ``input``.
        target: (*) integer class ids in [0, V), or ``ignore_index``.
        linear_bias: optional (V,) bias.
        weight: optional (V,) class weights (PyTorch semantics: "mean" divides by the summed
            weights of the non-ignored targets).
        reduction: "none" (per-token, shape of ``target``), "mean" or "sum". A batch in which
            every token is ignored gives 0 (not NaN) and zero gradients.
        ignore_index: targets equal to it contribute 0 and cost no work.
        label_smoothing: α in [0, 1], PyTorch semantics.
        softcap: c > 0 soft-caps the logits, ``c·tanh(logits / c)`` (Gemma 2).
        z_loss: λ ≥ 0 adds ``λ·lse²`` per token (differentiable; PaLM's auxiliary loss). Under
            "mean" it is divided by the same denominator as the cross-entropy.
        shift: causal LM, position t predicts ``target[..., t+1]``; the last position of each
            sequence is dropped, without copying ``input``. Per-token outputs then have shape
            ``target[..., 1:].shape``.
        filter_eps: gradient filtering: the backward may skip logit tiles whose softmax mass,
            summed per row, stays ≤ filter_eps × the row's gradient mass min(1, 2(1 − P_y)),
            so each row's gradient keeps a relative error ≤ filter_eps (a proven bound, see
            docs/design.md). "auto"
            picks by dtype (bf16 2⁻¹², fp16 2⁻¹⁵, fp32 exact); None or 0 computes everything.
            Only the Triton backend filters; the torch backend is always exact.
        return_lse: also return the per-token log-sum-exp (float32; 0 at ignored tokens).
        backend: "triton" (CUDA; or the CPU under ``TRITON_INTERPRET=1``), "torch" (chunked
            pure PyTorch, O(chunk·V) memory) or "auto" (Triton on CUDA, torch otherwise).
        vocab_order: column order of the Triton backend's tiles: None (default) keeps the
            natural order, "auto" sorts the vocabulary by average logit when filtering is on,
            a (V,) int64 permutation uses that order (e.g. the previous step's). Sorting helps
            only when filtering skips tiles (docs/lm_head.md has the measurements). Never
            changes the result beyond rounding.

    Returns:
        The loss (fp32; a scalar, or per-token for "none"), and with ``return_lse`` a tuple
        ``(loss, lse)``.

    Example:
        >>> h = torch.randn(4, 16, 64, requires_grad=True)
        >>> w = torch.randn(1000, 64, requires_grad=True)
        >>> y = torch.randint(0, 1000, (4, 16))
        >>> loss = linear_cross_entropy(h, w, y, shift=True)
        >>> loss.backward()
    """
    _check_inputs(input, linear_weight, target, linear_bias, weight, reduction,
                  label_smoothing, softcap, z_loss, shift)
    backend = engine.resolve_backend(backend, input.device)
    resolve_filter_eps(filter_eps, input.dtype)  # validates on every backend
    v, d = linear_weight.shape
    a = input.reshape(-1, d)
    if a.stride(-1) != 1:
        a = a.contiguous()
    b = linear_weight if linear_weight.stride(-1) == 1 else linear_weight.contiguous()
    if shift:
        if target.shape[-1] == 0:
            raise ValueError("shift=True needs at least one position along target's last dim")
        pad = torch.full_like(target[..., :1], ignore_index)
        flat_target = torch.cat([target[..., 1:], pad], dim=-1).reshape(-1)
    else:
        flat_target = target.reshape(-1)
    flat_target = flat_target.long()

    valid = flat_target != ignore_index
    out_of_range = valid & ((flat_target < 0) | (flat_target >= v))

    if a.shape[0] == 0:
        # Nothing to compute, but keep the graph: gradients are zeros of the right shapes.
        loss_tok = a.float().sum(dim=-1) + b[:0].float().sum()
        if linear_bias is not None:
            loss_tok = loss_tok + linear_bias[:0].float().sum()
        lse = loss_tok.detach()
    else:
        flags = torch.stack([out_of_range.any(), valid.all()])
        rows = engine.compact_rows(valid)
        compact_target = torch.where(_valid_positions(rows, a.shape[0]),
                                     flat_target[rows.index], -1)
        class_weight = weight.float() if weight is not None else None
        if class_weight is not None:
            # Clamped: an out-of-range target must not index out of bounds before the check.
            picked = class_weight[compact_target.clamp(0, v - 1)]
            w_y = torch.where(compact_target >= 0, picked, 0.0)
        else:
            w_y = (compact_target >= 0).float()
        eps = resolve_filter_eps(filter_eps, input.dtype) if backend == "triton" else None
        order = _resolve_vocab_order(vocab_order, a, b, linear_bias, valid, eps, backend)
        # One host sync, once the work above is queued (the GPU keeps busy while the host
        # waits): the error check, and whether the compact order is the identity (every row
        # counts), which lets the kernels read A by whole blocks.
        any_out_of_range, all_valid = flags.tolist()
        if any_out_of_range:
            bad = int(flat_target[out_of_range][0])
            raise ValueError(
                f"target holds {bad}, outside [0, {v}) and not ignore_index={ignore_index}"
            )
        rows = Rows(index=rows.index, n_valid=rows.n_valid, target=compact_target,
                    identity=bool(all_valid))
        params = _Params(
            rows=rows, softcap=softcap, col_order=order, class_weight=class_weight,
            target_weight=w_y, label_smoothing=float(label_smoothing), z_loss=float(z_loss),
            filter_eps=eps, backend=backend,
        )
        loss_tok, lse = LinearCrossEntropyFunction.apply(a, b, linear_bias, params)

    token_shape = target.shape
    loss_tok, lse = loss_tok.view(token_shape), lse.view(token_shape)
    if shift:
        loss_tok, lse = loss_tok[..., :-1], lse[..., :-1]
    if reduction == "none":
        loss = loss_tok
    elif reduction == "sum":
        loss = loss_tok.sum()
    else:
        if weight is not None:
            denom = torch.where(valid, weight.float()[flat_target.clamp(min=0)], 0.0).sum()
        else:
            denom = valid.sum().float()
        loss = loss_tok.sum() / torch.where(denom == 0, 1.0, denom)
    return (loss, lse) if return_lse else loss


def _resolve_vocab_order(vocab_order, a, b, bias, valid, eps, backend):
    """Validates ``vocab_order`` on every backend; returns the column order the kernels use."""
    v = b.shape[0]
    if isinstance(vocab_order, str):
        if vocab_order != "auto":
            raise ValueError(f"vocab_order must be 'auto', None or a permutation tensor, "
                             f"got {vocab_order!r}")
        wants_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
        if backend != "triton" or eps is None or not wants_grad:
            return None
        with torch.no_grad():
            return order_by_mean_logit(a, b, bias, valid)
    if vocab_order is None:
        return None
    if not isinstance(vocab_order, torch.Tensor):
        raise TypeError(f"vocab_order must be 'auto', None or a tensor, got "
                        f"{type(vocab_order).__name__}")
    if vocab_order.shape != (v,) or vocab_order.dtype != torch.int64:
        raise ValueError(f"vocab_order must be a ({v},) int64 permutation, got "
                         f"{tuple(vocab_order.shape)} {vocab_order.dtype}")
    if vocab_order.device != b.device:
        raise ValueError(f"vocab_order is on {vocab_order.device}, linear_weight on {b.device}")
    if not torch.equal(torch.sort(vocab_order).values, torch.arange(v, device=b.device)):
        raise ValueError("vocab_order must be a permutation of 0..V-1")
    return vocab_order if backend == "triton" else None


def _check_inputs(input, linear_weight, target, bias, weight, reduction, label_smoothing,
                  softcap, z_loss, shift) -> None:
    """Clear errors, naming the argument, for every misuse we can detect up front."""
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"input must be float32, bfloat16 or float16, got {input.dtype}")
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight has dtype {linear_weight.dtype} but input has "
                        f"{input.dtype}; they must match")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be (V, D), got shape {tuple(linear_weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"input must be (*, D) with D = linear_weight.shape[1] = "
                         f"{linear_weight.shape[1]}, got shape {tuple(input.shape)}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class ids, got {target.dtype}")
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target must have shape input.shape[:-1] = {tuple(input.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if shift and input.dim() < 2:
        raise ValueError("shift=True needs input of shape (*, T, D) with a time dimension")
    if linear_weight.shape[0] == 0:
        raise ValueError("linear_weight must have at least one row (V >= 1)")
    devices = {("input", input.device), ("linear_weight", linear_weight.device),
               ("target", target.device)}
    for name, t in (("linear_bias", bias), ("weight", weight)):
        if t is not None:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None")
            if t.shape != (linear_weight.shape[0],):
                raise ValueError(f"{name} must have shape (V,) = ({linear_weight.shape[0]},), "
                                 f"got {tuple(t.shape)}")
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
            devices.add((name, t.device))
    if len({dev for _, dev in devices}) > 1:
        listed = ", ".join(f"{n} on {dev}" for n, dev in sorted(devices, key=str))
        raise ValueError(f"all tensors must be on one device: {listed}")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not 0.0 < float(softcap) < float("inf"):
        raise ValueError(f"softcap must be None or a finite value > 0, got {softcap}")
    if not float(z_loss) >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
