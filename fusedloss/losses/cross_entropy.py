"""Linear cross-entropy (the "cut cross-entropy" LM head): the functional API.

The loss and its gradient are written out in ``fusedloss/ops/cross_entropy.py``, whose custom
ops compute them on the engine. This layer checks the arguments, flattens the tokens (and
shifts the targets for a causal LM), calls the op and applies the reduction: traceable PyTorch
with no host sync, so that the loss compiles into a model's graph (``torch.compile``).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from ..core import engine
from ..core.filtering import resolve_lm_head_filter_eps
from ..core.vocab_order import order_by_mean_logit
from ..ops import cross_entropy as ops

Reduction = Literal["none", "mean", "sum"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    process_group=None,
    vocab_start: int | None = None,
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
            docs/design.md). "auto" (the default), None or 0 compute every tile: on LM-head
            inputs, trained models' included, the bound lets the backward skip almost nothing
            at the accuracy bar, and the bookkeeping would cost more than it saves (measured
            in docs/design.md). A float opts in (bf16: 2⁻¹², fp16: 2⁻¹⁵ stay below one
            rounding of the stored gradient). Only the Triton backend filters; the torch
            backend is always exact.
        return_lse: also return the per-token log-sum-exp (float32; 0 at ignored tokens).
        backend: "triton" (CUDA; or the CPU under ``TRITON_INTERPRET=1``), "torch" (chunked
            pure PyTorch, O(chunk·V) memory) or "auto" (Triton on CUDA, torch otherwise).
        vocab_order: column order of the Triton backend's tiles: None (default) keeps the
            natural order, "auto" sorts the vocabulary by average logit when filtering is on,
            a (V,) int64 permutation uses that order (e.g. the previous step's). Sorting helps
            only when filtering skips tiles (docs/lm_head.md has the measurements). Never
            changes the result beyond rounding.
        process_group: a ``torch.distributed`` group over which ``linear_weight`` is sharded by
            rows (the vocabulary-parallel head of Megatron): each rank passes the same
            ``input`` and ``target`` (global class ids) and its own rows of the classifier
            (``linear_bias``, ``weight`` and ``vocab_order``: its parts of them), and gets the
            loss of the whole head; ``input``'s gradient is the full one on every rank.
            See ``fusedloss.distributed.vocab_parallel_cross_entropy``.
        vocab_start: with ``process_group``, the global id of this rank's first row (default:
            the shards follow each other in rank order).

    Returns:
        The loss (fp32; a scalar, or per-token for "none"), and with ``return_lse`` a tuple
        ``(loss, lse)``.

    With many rows (from 131072 on a 128256- or 256000-row head in bf16) and a "mean" or "sum"
    loss on the Triton backend, the forward computes the gradients too, from chunks of fp32
    logits, and the backward scales them (three matmul passes instead of four, never more
    memory than the backward would hold; docs/design.md, "The gradient in the forward").

    Example:
        >>> h = torch.randn(4, 16, 64, requires_grad=True)
        >>> w = torch.randn(1000, 64, requires_grad=True)
        >>> y = torch.randint(0, 1000, (4, 16))
        >>> loss = linear_cross_entropy(h, w, y, shift=True)
        >>> loss.backward()
    """
    if process_group is not None or vocab_start is not None:
        # The distributed layer sits above this one (it reuses these checks).
        from ..distributed.cross_entropy import vocab_parallel_cross_entropy

        if process_group is None:
            raise ValueError("vocab_start is only meaningful with a process_group")
        return vocab_parallel_cross_entropy(
            input, linear_weight, target, group=process_group, vocab_start=vocab_start,
            linear_bias=linear_bias, weight=weight, reduction=reduction,
            ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
            z_loss=z_loss, shift=shift, filter_eps=filter_eps, return_lse=return_lse,
            backend=backend, vocab_order=vocab_order)
    _check_inputs(input, linear_weight, target, linear_bias, weight, reduction,
                  label_smoothing, softcap, z_loss, shift)
    backend = engine.resolve_backend(backend, input.device)
    eps = resolve_lm_head_filter_eps(filter_eps, input.dtype)  # validates on every backend
    eps = eps if backend == "triton" else None
    d = linear_weight.shape[1]
    a = input.reshape(-1, d)
    flat_target = shifted_targets(target, shift, ignore_index)
    valid = flat_target != ignore_index

    if a.shape[0] == 0:
        # Nothing to compute, but keep the graph: gradients are zeros of the right shapes.
        loss_tok = a.float().sum(dim=-1) + linear_weight[:0].float().sum()
        if linear_bias is not None:
            loss_tok = loss_tok + linear_bias[:0].float().sum()
        lse = loss_tok.detach()
    else:
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
        order = _resolve_vocab_order(vocab_order, a, linear_weight, linear_bias, valid, eps,
                                     backend, wants_grad)
        chunk = None
        if (backend == "triton" and wants_grad and reduction != "none" and not return_lse
                and eps is None and order is None):
            chunk = ops.grad_in_forward_chunk(a, linear_weight.shape[0])
        if chunk is not None:
            # Many rows: the gradient in the forward, from chunks of held logits.
            return ops.linear_cross_entropy_grad_in_forward(
                a, linear_weight, flat_target, linear_bias,
                weight.float() if weight is not None else None, int(ignore_index),
                float(label_smoothing), None if softcap is None else float(softcap),
                float(z_loss), reduction == "mean", input.requires_grad,
                linear_weight.requires_grad, linear_bias is not None and linear_bias.requires_grad,
                chunk)
        loss_tok, lse, *_ = ops.linear_cross_entropy(
            a, linear_weight, flat_target, linear_bias,
            weight.float() if weight is not None else None, order, int(ignore_index),
            float(label_smoothing), None if softcap is None else float(softcap), float(z_loss),
            eps, backend, wants_grad,
        )

    def summed_weights():
        if weight is not None:
            return torch.where(valid, weight.float()[flat_target.clamp(min=0)], 0.0).sum()
        return valid.sum().float()

    return reduce_tokens(loss_tok, lse, target.shape, shift, reduction, summed_weights,
                         return_lse)


def reduce_tokens(loss_tok: torch.Tensor, lse: torch.Tensor, token_shape: torch.Size,
                  shift: bool, reduction: str, summed_weights, return_lse: bool):
    """The per-token outputs (N,) in the targets' shape (without the shifted-out positions),
    reduced; "mean" divides by ``summed_weights()`` (the valid tokens' count or class
    weights; a batch with none gives 0)."""
    loss_tok, lse = loss_tok.view(token_shape), lse.view(token_shape)
    if shift:
        loss_tok, lse = loss_tok[..., :-1], lse[..., :-1]
    if reduction == "none":
        loss = loss_tok
    elif reduction == "sum":
        loss = loss_tok.sum()
    else:
        denom = summed_weights()
        loss = loss_tok.sum() / torch.where(denom == 0, 1.0, denom)
    return (loss, lse) if return_lse else loss


def shifted_targets(target: torch.Tensor, shift: bool, ignore_index: int) -> torch.Tensor:
    """The (N,) int64 targets, each position's own, or with ``shift`` the next position's
    (the last position of each sequence ignored, so that ``input`` needs no copy)."""
    if shift:
        if target.shape[-1] == 0:
            raise ValueError("shift=True needs at least one position along target's last dim")
        pad = torch.full_like(target[..., :1], ignore_index)
        return torch.cat([target[..., 1:], pad], dim=-1).reshape(-1).long()
    return target.reshape(-1).long()


def _resolve_vocab_order(vocab_order, a, b, bias, valid, eps, backend, wants_grad):
    """Validates ``vocab_order`` on every backend (that it is a permutation is checked by the
    op, which reads its values); returns the column order the kernels use."""
    v = b.shape[0]
    if isinstance(vocab_order, str):
        if vocab_order != "auto":
            raise ValueError(f"vocab_order must be 'auto', None or a permutation tensor, "
                             f"got {vocab_order!r}")
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
    return vocab_order


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
    check_options(reduction, label_smoothing, softcap, z_loss)


def check_options(reduction, label_smoothing, softcap, z_loss) -> None:
    """The options that need no tensor (shared with ``LinearCrossEntropyLoss``)."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not 0.0 < float(softcap) < float("inf"):
        raise ValueError(f"softcap must be None or a finite value > 0, got {softcap}")
    if not float(z_loss) >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
