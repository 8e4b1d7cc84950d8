"""Linear cross-entropy (the "cut cross-entropy" LM head): the functional API.

The loss and its gradient are written out in ``fusedloss/ops/cross_entropy.py``, whose custom
ops compute them on the engine. This layer checks the arguments, flattens the tokens (and
shifts the targets for a causal LM), calls the op and applies the reduction: traceable PyTorch
with no host sync, so that the loss compiles into a model's graph (``torch.compile``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, overload

import torch

from ..core import config, engine
from ..core.filtering import resolve_lm_head_filter_eps
from ..core.vocab_order import order_by_mean_logit
from ..families import cross_entropy as family
from ..ops import _group, vocab_parallel
from ..ops import cross_entropy as ops
from ..ops._common import autocast_operands
from ..ops._group import device_code, dtype_code, exchange, float_code
from ..options import REDUCTIONS, CrossEntropyOptions

Reduction = Literal["none", "mean", "sum"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# PyTorch's chunking options (torch >= 2.13), accepted for its signature (``check_linear_options``).
LinearCrossEntropyOptions = getattr(torch.nn, "LinearCrossEntropyOptions", None)


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
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options=None,  # torch.nn.LinearCrossEntropyOptions | None
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

    A drop-in for ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13): every call it
    accepts is accepted here with the same meaning, and equals ``F.cross_entropy(F.linear(
    input, linear_weight, linear_bias).float(), target, weight=weight, reduction=reduction,
    ignore_index=ignore_index, label_smoothing=label_smoothing)``, with these additions:
    any number of leading dimensions in ``input``, the options from ``softcap`` on, and a batch
    in which every token is ignored gives 0 (PyTorch: NaN).

    Under ``torch.autocast`` (CUDA or CPU) ``input``, ``linear_weight`` and ``linear_bias`` are
    cast to the autocast dtype, as ``F.linear`` would cast them, and the loss is fp32, as
    ``F.cross_entropy`` computes it (the logits themselves are never rounded to the autocast
    dtype). Outside autocast, a dtype mismatch is a TypeError.

    Args:
        input: (*, D) hidden states, fp32/bf16/fp16, or float64 (computed in float64 on the
            torch backend).
        linear_weight: (V, D) classifier, same dtype as ``input``; or PyTorch's K-dimensional
            (V, d1, …, dK, D) with ``input`` (N, D): one (V, D) head per position of
            (d1, …, dK), the loss shaped (N, d1, …, dK), each head through the core.
        target: (*) integer class ids in [0, V), or ``ignore_index``; or class probabilities,
            a floating (*, V) tensor (PyTorch's soft targets: ``ignore_index`` must stay None,
            "mean" divides by the number of rows; not with ``shift``, ``softcap`` or a
            ``process_group``).
        linear_bias: optional (V,) bias ((V, d1, …, dK) with a K-dimensional weight).
        weight: optional (V,) class weights (PyTorch semantics: "mean" divides by the summed
            weights of the non-ignored targets).
        reduction: "none" (per-token, shape of ``target``), "mean" or "sum". A batch in which
            every token is ignored gives 0 (not NaN) and zero gradients.
        ignore_index: targets equal to it contribute 0; None (PyTorch's default) means -100
            for class indices. The training path (a reduced loss with gradients) computes
            their rows, so that it never waits for the GPU; the other paths skip them.
        label_smoothing: α in [0, 1], PyTorch semantics.
        options: None or a ``torch.nn.LinearCrossEntropyOptions``, accepted for PyTorch's
            signature. Its fields choose how PyTorch chunks the logits and the dtype it
            accumulates in; here the logits are never materialized whatever it says, statistics
            accumulate in fp32 (float64 for float64 input), and ``retain_graph=True`` always
            works (the backward recomputes from saved statistics), so it changes nothing.
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
            pure PyTorch, O(chunk·V) memory) or "auto" (Triton on CUDA, torch otherwise and
            for float64 input, which "triton" refuses).
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
        The loss (fp32, float64 for float64 input; a scalar, or per-token for "none"), and with
        ``return_lse`` a tuple ``(loss, lse)``.

    A "mean" or "sum" loss with gradients on the Triton backend (no ``return_lse``, no explicit
    ``filter_eps`` or ``vocab_order``) takes the training path: per chunk of rows the logits in
    the input dtype by cuBLAS, the softmax gradient formed over them, then the two gradient
    products; the backward scales the gradients (three matmul passes; memory: one chunk of at
    most 1 GiB of logits and an fp32 dB; docs/design.md, "The LM head's training path"). It
    never waits for the GPU. Other calls run on the fused engine, which never holds logits;
    with the Triton backend and no ``filter_eps`` they never wait for the GPU either. Values
    that only the GPU sees are not read back: a target outside [0, V) (not ``ignore_index``)
    makes its token's loss NaN and the gradients NaN, a ``vocab_order`` that is not a
    permutation every loss (``fusedloss.core.config.tuned(check_values=True)`` raises the
    named ValueError instead, at one wait per call).

    Example:
        >>> h = torch.randn(4, 16, 64, requires_grad=True)
        >>> w = torch.randn(1000, 64, requires_grad=True)
        >>> y = torch.randint(0, 1000, (4, 16))
        >>> loss = linear_cross_entropy(h, w, y, shift=True)
        >>> loss.backward()
    """
    check_linear_options(options)
    if isinstance(input, torch.Tensor):
        # Under torch.autocast: the operands of the product in the autocast dtype, as F.linear
        # would have them; the statistics and the loss stay fp32 (autocast's fp32 list).
        input, linear_weight, linear_bias = autocast_operands(
            input.device, input, linear_weight, linear_bias)
    linear_bias, weight = dense_vectors(linear_bias, weight)
    opts = CrossEntropyOptions(reduction, ignore_index, label_smoothing, softcap, z_loss, shift,
                               filter_eps, return_lse, backend)
    if isinstance(linear_weight, torch.Tensor) and linear_weight.dim() > 2:
        if process_group is not None or vocab_start is not None:
            raise ValueError("process_group takes a (V, D) linear_weight, not a K-dimensional "
                             f"one of shape {tuple(linear_weight.shape)}")
        return _k_dimensional(input, linear_weight, target, linear_bias, weight, vocab_order,
                              opts)
    if _holds_probabilities(input, linear_weight, target):
        if process_group is not None or vocab_start is not None:
            raise ValueError("process_group takes class indices as target, not probabilities")
        return _soft_targets(input, linear_weight, target, linear_bias, weight, vocab_order,
                             opts)
    if process_group is not None or vocab_start is not None:
        if process_group is None:
            raise ValueError("vocab_start is only meaningful with a process_group")
        return _vocab_parallel(input, linear_weight, target, linear_bias, weight, vocab_order,
                               opts, (process_group, vocab_start))
    return _class_indices(input, linear_weight, target, linear_bias, weight, vocab_order, opts)


def _class_indices(input, linear_weight, target, linear_bias, weight, vocab_order,
                   opts: CrossEntropyOptions):
    """The loss of (*, D) input under a (V, D) head against class ids, on one process."""
    check_inputs(input, linear_weight, target, linear_bias, weight, opts)
    reduction, ignore_index = opts.reduction, opts.index_to_ignore
    backend = resolve_input_backend(opts.backend, input)
    eps = resolve_lm_head_filter_eps(opts.filter_eps, input.dtype)  # checked on every backend
    eps = eps if backend == "triton" else None
    d = linear_weight.shape[1]
    a = input.reshape(-1, d)
    flat_target = shifted_targets(target, opts.shift, ignore_index)
    valid = flat_target != ignore_index

    acc = engine.accumulation_dtype(input.dtype)
    if a.shape[0] == 0:
        # Nothing to compute, but keep the graph: gradients are zeros of the right shapes.
        loss_tok = a.to(acc).sum(dim=-1) + linear_weight[:0].to(acc).sum()
        if linear_bias is not None:
            loss_tok = loss_tok + linear_bias[:0].to(acc).sum()
        lse = loss_tok.detach()
    else:
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
        order = resolve_vocab_order(vocab_order, a, linear_weight, linear_bias, valid, eps,
                                     backend, wants_grad)
        loss = opts.loss()
        if (backend == "triton" and wants_grad and reduction != "none" and not opts.return_lse
                and eps is None and order is None):
            # Training: three products per chunk of rows, the gradient formed in the forward.
            return ops.linear_cross_entropy_chunked(
                a, linear_weight, flat_target, linear_bias,
                weight.float() if weight is not None else None, loss.ignore_index,
                loss.label_smoothing, loss.softcap, loss.z_loss, reduction == "mean",
                input.requires_grad, linear_weight.requires_grad,
                linear_bias is not None and linear_bias.requires_grad,
                config.lm_head_deferred(a.shape[0], linear_weight.shape[0], a.element_size()))
        loss_tok, lse, *_ = ops.linear_cross_entropy(
            a, linear_weight, flat_target, linear_bias,
            weight.to(acc) if weight is not None else None, order, loss.ignore_index,
            loss.label_smoothing, loss.softcap, loss.z_loss, eps, backend, wants_grad,
        )

    return reduce_tokens(loss_tok, lse, target.shape, opts, lambda: family.summed_weights(
        flat_target, ignore_index, weight, linear_weight.shape[0], acc))


def reduce_tokens(loss_tok: torch.Tensor, lse: torch.Tensor, token_shape: torch.Size,
                  opts: CrossEntropyOptions, summed_weights):
    """The per-token outputs (N,) in the targets' shape (without the shifted-out positions
    with ``opts.shift``), reduced as ``opts.reduction`` says, with the LSE if
    ``opts.return_lse``; "mean" divides by ``summed_weights()`` (the valid tokens' count or
    class weights; a batch with none gives 0)."""
    reduction = opts.reduction
    loss_tok, lse = loss_tok.view(token_shape), lse.view(token_shape)
    if opts.shift:
        loss_tok, lse = loss_tok[..., :-1], lse[..., :-1]
    if reduction == "none":
        loss = loss_tok
    elif reduction == "sum":
        loss = loss_tok.sum()
    else:
        denom = summed_weights()
        loss = loss_tok.sum() / torch.where(denom == 0, 1.0, denom)
    return (loss, lse) if opts.return_lse else loss


def shifted_targets(target: torch.Tensor, shift: bool, ignore_index: int) -> torch.Tensor:
    """The (N,) int64 targets, each position's own, or with ``shift`` the next position's
    (the last position of each sequence ignored, so that ``input`` needs no copy)."""
    if shift:
        if target.shape[-1] == 0:
            raise ValueError("shift=True needs at least one position along target's last dim")
        pad = torch.full_like(target[..., :1], ignore_index)
        return torch.cat([target[..., 1:], pad], dim=-1).reshape(-1).long()
    return target.reshape(-1).long()


def resolve_vocab_order(vocab_order, a, b, bias, valid, eps, backend, wants_grad):
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


def check_inputs(input, linear_weight, target, bias, weight, opts: CrossEntropyOptions) -> None:
    """Clear errors, naming the argument, for every misuse we can detect up front."""
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"input must be float32, bfloat16, float16 or float64, got {input.dtype}")
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight has dtype {linear_weight.dtype} but input has "
                        f"{input.dtype}; they must match (under torch.autocast both are cast "
                        f"to the autocast dtype)")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be (V, D), got shape {tuple(linear_weight.shape)}")
    if input.dim() < 1 or input.shape[-1] != linear_weight.shape[1]:
        raise ValueError(f"input must be (*, D) with D = linear_weight.shape[1] = "
                         f"{linear_weight.shape[1]}, got shape {tuple(input.shape)}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class ids (shape {tuple(input.shape[:-1])}) "
                        f"or class probabilities (shape "
                        f"{(*input.shape[:-1], linear_weight.shape[0])}), got {target.dtype} "
                        f"of shape {tuple(target.shape)}")
    if target.shape != input.shape[:-1]:
        raise ValueError(f"target must have shape input.shape[:-1] = {tuple(input.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if opts.shift and input.dim() < 2:
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
    opts.check()


def check_linear_options(options) -> None:
    """``options`` as ``torch.nn.functional.linear_cross_entropy`` takes it: None or a
    ``torch.nn.LinearCrossEntropyOptions`` (torch >= 2.13). Its fields choose how PyTorch
    chunks and in which dtype it accumulates; fusedloss never materializes the logits and
    always accumulates in fp32 (float64 for float64 inputs), and its backward recomputes from
    saved statistics, so ``retain_graph=True`` always works: the options change nothing here."""
    if options is None:
        return
    if LinearCrossEntropyOptions is None or not isinstance(options, LinearCrossEntropyOptions):
        raise TypeError(f"options must be None or a torch.nn.LinearCrossEntropyOptions, got "
                        f"{type(options).__name__}")


def dense_vectors(*vectors):
    """Each tensor of ``vectors`` with its entries side by side (the kernels read the bias and
    the class weights at unit stride; a strided view, such as one head's bias of a
    K-dimensional weight, becomes a copy); other values as they are."""
    return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in vectors)


def resolve_input_backend(backend: str, input: torch.Tensor) -> str:
    """``engine.resolve_backend``, and float64 inputs on the torch backend (exact in float64;
    the kernels take fp32, bf16 and fp16)."""
    if input.dtype == torch.float64 and backend == "triton":
        raise ValueError("backend='triton' takes float32, bfloat16 or float16 input; float64 "
                         "input runs on backend='torch' (what backend='auto' picks for it)")
    resolved = engine.resolve_backend(backend, input.device)
    return "torch" if input.dtype == torch.float64 else resolved


def _holds_probabilities(input, linear_weight, target) -> bool:
    """Whether ``target`` holds class probabilities: a floating (*, V) tensor beside (*, D)
    input (PyTorch's rule: the target has the logits' shape)."""
    return (isinstance(input, torch.Tensor) and isinstance(linear_weight, torch.Tensor)
            and isinstance(target, torch.Tensor) and target.is_floating_point()
            and linear_weight.dim() == 2
            and target.shape == (*input.shape[:-1], linear_weight.shape[0]))


def _soft_targets(input, linear_weight, target, bias, weight, vocab_order,
                  opts: CrossEntropyOptions):
    """Cross-entropy against class probabilities q (target (*, V), PyTorch's soft targets):

        loss_i = Σ_c w_c q'_ic (lse_i − X_ic)
               = lse_i · Σ_c w_c q'_ic − A_i · (q'_i W B) − q'_i W bias

    with q' = (1 − α)·q + α/V and W = diag(w). The LSE comes from the core; the rest is linear
    in the logits, so two (N, V) × (V, D) products with the target give it (and autograd its
    gradient) without the logits. "mean" divides by the number of rows, as PyTorch does for
    probabilities. The target is read in the accumulation dtype (a copy when it is bf16/fp16).
    """
    if opts.ignore_index is not None:
        raise ValueError("ignore_index cannot be specified when target holds class "
                         "probabilities (as in PyTorch)")
    for name in ("shift", "softcap"):
        if getattr(opts, name):
            raise ValueError(f"{name} needs class indices as target, not class probabilities")
    opts.check()
    v, d = linear_weight.shape
    indices = torch.zeros(target.shape[:-1], dtype=torch.long, device=target.device)
    # the LSE alone: no smoothing or z-loss there, those terms are added below
    _, lse = _class_indices(input, linear_weight, indices, bias, weight, vocab_order,
                            CrossEntropyOptions(reduction="none", filter_eps=opts.filter_eps,
                                                return_lse=True, backend=opts.backend))
    acc, alpha = lse.dtype, float(opts.label_smoothing)
    with torch.autocast(input.device.type, enabled=False):  # products in the accumulation dtype
        q, a, b = target.reshape(-1, v).to(acc), input.reshape(-1, d).to(acc), linear_weight.to(acc)
        w = None if weight is None else weight.to(acc)
        wb = b if w is None else w[:, None] * b  # (V, D)
        mass = q.sum(dim=-1) if w is None else q @ w  # Σ_c w_c q_ic
        dot = (a * (q @ wb)).sum(dim=-1)  # Σ_c w_c q_ic <A_i, B_c>
        if bias is not None:
            wbias = bias.to(acc) if w is None else w * bias.to(acc)
            dot = dot + q @ wbias
        if alpha:
            total_w = float(v) if w is None else w.sum()
            mass = (1 - alpha) * mass + alpha * total_w / v
            uniform = a @ wb.sum(dim=0) + (wbias.sum() if bias is not None else 0.0)
            dot = (1 - alpha) * dot + (alpha / v) * uniform
        loss_tok = mass * lse.reshape(-1) - dot
        if opts.z_loss:
            loss_tok = loss_tok + opts.z_loss * lse.reshape(-1) ** 2
    return reduce_tokens(loss_tok, lse.reshape(-1), target.shape[:-1], opts,
                         lambda: torch.full((), loss_tok.shape[0], dtype=acc,
                                            device=loss_tok.device))


def _k_dimensional(input, linear_weight, target, bias, weight, vocab_order,
                   opts: CrossEntropyOptions):
    """PyTorch's K-dimensional loss: ``linear_weight`` (C, d1, …, dK, D) is one (C, D) head per
    position k of (d1, …, dK); input (N, D); target (N, d1, …, dK) class indices or
    (N, C, d1, …, dK) probabilities; the loss of (n, k) is the cross-entropy of input n under
    head k. Each head runs through the core; "mean" divides by the summed weights of all
    (n, k) (indices) or by their count (probabilities)."""
    c, *out, d = linear_weight.shape
    if not isinstance(input, torch.Tensor) or input.dim() != 2:
        raise ValueError(f"a K-dimensional linear_weight {tuple(linear_weight.shape)} needs "
                         f"input of shape (N, {d})"
                         + (f", got {tuple(input.shape)}" if isinstance(input, torch.Tensor)
                            else ""))
    if opts.shift:
        raise ValueError("shift=True needs a (V, D) linear_weight, not a K-dimensional one")
    if bias is not None and tuple(bias.shape) != (c, *out):
        raise ValueError(f"linear_bias must have shape {(c, *out)}, got {tuple(bias.shape)}")
    n, k = input.shape[0], math.prod(out)
    if k == 0:
        raise ValueError(f"linear_weight {tuple(linear_weight.shape)} has no output position")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    soft = target.is_floating_point()
    expected = (n, c, *out) if soft else (n, *out)
    if tuple(target.shape) != expected:
        raise ValueError(f"target must have shape {expected} for a K-dimensional "
                         f"linear_weight, got {tuple(target.shape)}")
    heads = linear_weight.reshape(c, k, d)
    targets = target.reshape(n, c, k) if soft else target.reshape(n, k)
    losses, lses = [], []
    per_head = dataclasses.replace(opts, reduction="none", return_lse=True)
    head = _soft_targets if soft else _class_indices
    for j in range(k):
        bias_j, = dense_vectors(None if bias is None else bias.reshape(c, k)[:, j])
        loss_j, lse_j = head(input, heads[:, j], targets[..., j], bias_j, weight, vocab_order,
                             per_head)
        losses.append(loss_j)
        lses.append(lse_j)
    loss_tok = torch.stack(losses, dim=1).reshape(-1)
    lse = torch.stack(lses, dim=1).reshape(-1)

    def summed_weights():
        if soft:
            return torch.full((), n * k, dtype=loss_tok.dtype, device=loss_tok.device)
        return family.summed_weights(target.reshape(-1), opts.index_to_ignore, weight, c,
                                     loss_tok.dtype)

    return reduce_tokens(loss_tok, lse, (n, *out), opts, summed_weights)


# ---------------------------------------------------------------------------------------------
# The vocabulary-parallel head (``process_group``; fusedloss/distributed/cross_entropy.py has
# its layout and math, ``ops.vocab_parallel`` its autograd Functions).

_BACKENDS = ("auto", "triton", "torch")


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def _vocab_parallel(input, linear_weight, target, linear_bias, weight, vocab_order,
                    opts: CrossEntropyOptions, shard):
    """The loss of the whole head from this rank's rows of it, ``shard`` = (process group,
    vocab_start or None): this rank's checks, one exchange of facts that checks the ranks
    agree (every rank raises the same error), then one of ``ops.vocab_parallel``'s Functions,
    the same on every rank."""
    group, vocab_start = shard
    error, prepared = None, None
    try:
        if _group.capturing(_device(input)):
            raise RuntimeError("vocab_parallel_cross_entropy reads values on the host, which a "
                               "CUDA graph capture cannot do: call it outside the capture")
        prepared = _prepare_shard(input, linear_weight, target, linear_bias, weight,
                                  vocab_order, opts)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    a, flat_target, valid, backend, eps, order, facts = prepared or (None,) * 7
    n = a.shape[0] if error is None else 0
    v_r = linear_weight.shape[0] if error is None else 0
    start = -1 if vocab_start is None else int(vocab_start)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
    trains = (error is None and backend == "triton" and wants_grad and opts.reduction != "none"
              and not opts.return_lse and eps is None and order is None and n > 0)
    layout, per_rank = exchange(group, n, v_r, facts or {}, _device(input), error=error,
                                extra=(start, int(trains)))
    starts, v = shard_starts(layout, [row[0] for row in per_rank])
    class_weight = weight.float() if weight is not None else None
    shard = vocab_parallel.Shard(layout.group, starts[layout.rank], v)
    options = opts.loss()
    if all(row[1] for row in per_rank):  # one path on every rank: their collectives differ
        return vocab_parallel.VocabParallelTraining.apply(
            a, linear_weight, flat_target, linear_bias, class_weight, shard, options,
            opts.reduction == "mean")
    loss_tok, lse, target_weight = vocab_parallel.VocabParallel.apply(
        a, linear_weight, flat_target, linear_bias, class_weight, order, shard, options,
        eps if wants_grad else None, backend)
    # (with class weights, each token's w_y comes from the shard that owns its target)
    return reduce_tokens(
        loss_tok, lse, target.shape, opts,
        lambda: target_weight.sum() if weight is not None else valid.sum().float())


def _prepare_shard(input, linear_weight, target, linear_bias, weight, vocab_order,
                   opts: CrossEntropyOptions):
    """This rank's checks and inputs (as the single-GPU head's), and the facts every rank must
    share."""
    check_inputs(input, linear_weight, target, linear_bias, weight, opts)
    reduction, ignore_index = opts.reduction, opts.index_to_ignore
    label_smoothing, softcap, z_loss, shift = (opts.label_smoothing, opts.softcap, opts.z_loss,
                                               opts.shift)
    if input.dtype == torch.float64:
        raise TypeError("the vocabulary-parallel head takes float32, bfloat16 or float16 "
                        "input, got torch.float64")
    backend = engine.resolve_backend(opts.backend, input.device)
    eps = resolve_lm_head_filter_eps(opts.filter_eps, input.dtype)
    eps = eps if backend == "triton" else None
    d = linear_weight.shape[1]
    a = input.reshape(-1, d)
    flat_target = shifted_targets(target, shift, ignore_index)
    valid = flat_target != ignore_index
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
    order = resolve_vocab_order(vocab_order, a, linear_weight, linear_bias, valid, eps,
                                backend, wants_grad)
    needs = [t is not None and t.requires_grad for t in (input, linear_weight, linear_bias)]
    facts = {
        "the input dtype": (dtype_code(input.dtype), str(input.dtype)),
        "the hidden size D": (d, str(d)),
        "the number of tokens": (a.shape[0], str(a.shape[0])),
        "the device type": (device_code(input.device), input.device.type),
        "reduction": (REDUCTIONS.index(reduction), repr(reduction)),
        "ignore_index": (int(ignore_index), str(ignore_index)),
        "label_smoothing": (float_code(label_smoothing), str(label_smoothing)),
        "softcap": (float_code(softcap), str(softcap)),
        "z_loss": (float_code(z_loss), str(z_loss)),
        "shift": (int(bool(shift)), str(shift)),
        "filter_eps": (float_code(eps), str(eps)),
        "backend": (_BACKENDS.index(backend), repr(backend)),
        "whether linear_bias is given": (int(linear_bias is not None),
                                         str(linear_bias is not None)),
        "whether weight is given": (int(weight is not None), str(weight is not None)),
        "which inputs require grad (input, linear_weight, linear_bias)": (
            sum(int(x) << i for i, x in enumerate(needs)), str(needs)),
    }
    return a, flat_target, valid, backend, eps, order, facts


def _device(t) -> torch.device:
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


def shard_starts(layout, given: list[int]) -> tuple[list[int], int]:
    """Each rank's first global class id, and V."""
    v = sum(layout.cols)
    if all(s < 0 for s in given):
        return [layout.col_offset(r) for r in range(layout.world)], v
    if any(s < 0 for s in given):
        raise ValueError(f"vocab_start must be given on every rank or on none; the ranks "
                         f"passed {[None if s < 0 else s for s in given]}")
    spans = sorted(zip(given, layout.cols, strict=True))
    end = 0
    for s, size in spans:
        if s != end:
            raise ValueError(f"the shards must tile [0, V) = [0, {v}): the ranks' (vocab_start, "
                             f"V_r) are {list(zip(given, layout.cols, strict=True))}")
        end = s + size
    return given, v


