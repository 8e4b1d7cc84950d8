"""Distillation divergences through two LM heads, a block of rows at a time, as custom ops.

``fusedloss::linear_divergence`` gives each row's divergence and ``..._backward`` its
gradients for an upstream gradient per row; ``fusedloss::linear_divergence_reduced`` is the
training path of a reduced loss (the student's gradients formed in the forward, scaled by the
loss's upstream gradient in the backward: four matrix products in all).

On the Triton backend (inputs below float64) a block is a chunk of rows of both models' logits
in the input dtype and one Triton pass per row (``core.chunked_divergence``); for float64 inputs,
the torch backend and a teacher that needs gradients, the block's tempered log-softmaxes are
formed in fp32 (float64 for float64 inputs) and the divergences and their gradients with
respect to the logits in PyTorch (``families.distillation``), the backward recomputing each
block. Memory: two blocks of logits (and on the torch path their softmaxes,
``Tuning.torch_chunk_elements`` logits per block), never the (tokens × vocabulary) logits of
either model. As custom ops they are opaque to ``torch.compile``, which traces a loss into a
graph without a break.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import chunked_divergence, config, engine
from ..core.engine import Needs, addmm_f32_, mm_f32
from ..families import distillation as family
from ._common import eager_function, grad_or_none, nothing, op_body, row_major, run_op
from .cross_entropy import formed_grads_backward, formed_grads_setup_context


def linear_divergence(*args) -> Tensor:
    """The forward op (arguments of ``forward``) with its autograd."""
    return run_op(forward_op, _EagerFunction, *args)


def _block_rows(v: int) -> int:
    return max(1, config.tuning().torch_chunk_elements // max(1, v))


def _log_probs(z: Tensor, temperature: float) -> Tensor:
    """The tempered log-softmax of a block of logits, in fp32 (float64 for float64 ones)."""
    z = z.to(engine.accumulation_dtype(z.dtype))
    return torch.log_softmax(z / temperature, dim=-1)


@op_body
def forward(
    a_s: Tensor,  # (N, D_s)
    w_s: Tensor,  # (V, D_s)
    b_s: Tensor | None,  # (V,)
    a_t: Tensor,  # (N, D_t)
    w_t: Tensor,  # (V, D_t)
    b_t: Tensor | None,  # (V,)
    kind: str,  # "forward", "reverse" or "jsd"
    beta: float,
    temperature: float,
    backend: str,  # "triton" or "torch"
) -> Tensor:
    """Each row's divergence, (N,) fp32 (float64 for float64 inputs)."""
    if _on_triton(a_s, backend):
        return _chunked((a_s, w_s, b_s), (a_t, w_t, b_t), (kind, beta, temperature), None,
                        Needs(False, False, False))[0]
    n, v = a_s.shape[0], w_s.shape[0]
    out = torch.empty(n, dtype=engine.accumulation_dtype(a_s.dtype), device=a_s.device)
    rows = _block_rows(v)
    for r0 in range(0, n, rows):
        part = slice(r0, min(r0 + rows, n))
        out[part] = family.divergence(_log_probs(F.linear(a_s[part], w_s, b_s), temperature),
                                      _log_probs(F.linear(a_t[part], w_t, b_t), temperature),
                                      kind, beta)
    return out


forward_op = torch.library.custom_op("fusedloss::linear_divergence", forward, mutates_args=())


@forward_op.register_fake
def _(a_s, w_s, b_s, a_t, w_t, b_t, kind, beta, temperature, backend):
    return a_s.new_empty(a_s.shape[0], dtype=engine.accumulation_dtype(a_s.dtype))


@op_body
def backward(
    grad: Tensor,  # (N,)
    a_s: Tensor,
    w_s: Tensor,
    b_s: Tensor | None,
    a_t: Tensor,
    w_t: Tensor,
    b_t: Tensor | None,
    kind: str,
    beta: float,
    temperature: float,
    backend: str,
    needs: list[bool],  # gradients asked for: a_s, w_s, b_s, a_t, w_t, b_t
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The six gradients, each an empty tensor when not asked for."""
    operands = (a_s, w_s, b_s, a_t, w_t, b_t)
    if _on_triton(a_s, backend) and not any(needs[3:]):
        _, *grads = _chunked((a_s, w_s, b_s), (a_t, w_t, b_t), (kind, beta, temperature),
                             grad.float(), Needs(*needs[:3]))
        return (*(nothing(a_s, (0,)) if g is None else g.to(t.dtype)
                  for g, t in zip(grads, operands, strict=False)),
                *(nothing(a_s, (0,)) for _ in range(3)))
    acc = engine.accumulation_dtype(a_s.dtype)
    grads = [torch.zeros_like(t, dtype=acc) if need and t is not None else None
             for need, t in zip(needs, operands, strict=True)]
    teacher = any(g is not None for g in grads[3:])
    n, v = a_s.shape[0], w_s.shape[0]
    rows = _block_rows(v)
    for r0 in range(0, n, rows):
        part = slice(r0, min(r0 + rows, n))
        _, d_s, d_t = family.divergence_and_grads(
            _log_probs(F.linear(a_s[part], w_s, b_s), temperature),
            _log_probs(F.linear(a_t[part], w_t, b_t), temperature), kind, beta,
            grad[part].to(acc) / temperature, teacher)  # (÷ T: the logits' chain rule)
        for side, dz in zip((0, 3), (d_s, d_t), strict=True):
            if dz is None:
                continue
            a, w = operands[side], operands[side + 1]
            if grads[side + 2] is not None:
                grads[side + 2] += dz.to(acc).sum(dim=0)
            dz = dz.to(a.dtype)  # as PyTorch's own backward rounds it, before the products
            if grads[side] is not None:
                mm_f32(dz, w, out=grads[side][part])
            if grads[side + 1] is not None:
                addmm_f32_(grads[side + 1], dz.T, a[part])
    return tuple(nothing(a_s, (0,)) if g is None else g.to(t.dtype)
                 for g, t in zip(grads, operands, strict=True))


backward_op = torch.library.custom_op("fusedloss::linear_divergence_backward", backward,
                                      mutates_args=())


@backward_op.register_fake
def _(grad, a_s, w_s, b_s, a_t, w_t, b_t, kind, beta, temperature, backend, needs):
    return tuple(torch.empty_like(t) if need and t is not None else nothing(a_s, (0,))
                 for need, t in zip(needs, (a_s, w_s, b_s, a_t, w_t, b_t), strict=True))


def _setup_context(ctx, inputs, output):
    a_s, w_s, b_s, a_t, w_t, b_t, *options = inputs
    ctx.save_for_backward(a_s, w_s, b_s, a_t, w_t, b_t)
    ctx.options = tuple(options)  # kind, beta, temperature, backend


def _autograd_backward(ctx, grad, backward_fn=backward_op):
    needs = list(ctx.needs_input_grad[:6])
    grads = backward_fn(grad, *ctx.saved_tensors, *ctx.options, needs)
    return (*(grad_or_none(g, need) for g, need in zip(grads, needs, strict=True)),
            None, None, None, None)


forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)

_EagerFunction = eager_function("_EagerFunction", forward, _setup_context, _autograd_backward,
                                backward)


def _on_triton(a: Tensor, backend: str) -> bool:
    return backend == "triton" and a.dtype != torch.float64


def _chunked(student, teacher, divergence, coef, needs):
    """``core.chunked_divergence`` on row-major operands ((input, weight, bias) of each model),
    the biases cast to their inputs' dtypes (as autocast casts them for ``F.linear``);
    ``divergence`` = (kind, β, T)."""
    kind, beta, temperature = divergence
    if kind == "jsd" and beta in (0.0, 1.0):  # the ends: the forward and the reverse KL
        kind = "forward" if beta == 0.0 else "reverse"

    def prepared(a, w, b):
        a = row_major(a)
        return a, row_major(w), None if b is None else b.to(a.dtype)

    return chunked_divergence.divergence_and_grads(
        prepared(*student), prepared(*teacher), (kind, beta, temperature), coef, needs)


# ---------------------------------------------------------------------------------------------
# The training path of a reduced loss (Triton backend, no teacher gradients).


def linear_divergence_reduced(*args) -> Tensor:
    """The reduced loss (() fp32) of ``reduced_forward``'s arguments, with its autograd."""
    return run_op(reduced_op, _EagerReduced, *args)[0]


@op_body
def reduced_forward(
    a_s: Tensor,  # (N, D_s)
    w_s: Tensor,  # (V, D_s)
    b_s: Tensor | None,  # (V,)
    a_t: Tensor,  # (N, D_t)
    w_t: Tensor,  # (V, D_t)
    b_t: Tensor | None,  # (V,)
    row_weight: Tensor,  # (N,) fp32: each row's share of the loss (0: not counted)
    kind: str,
    beta: float,
    temperature: float,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(Σ_i row_weight_i·divergence_i () fp32, d a_s (N, D_s), d w_s (V, D_s) fp32, d b_s (V,)
    fp32) for an upstream gradient of 1, each gradient an empty tensor when not asked for. A
    row of weight 0 is skipped (a NaN there does not reach the loss)."""
    values, *grads = _chunked((a_s, w_s, b_s), (a_t, w_t, b_t), (kind, beta, temperature),
                              row_weight, Needs(need_input, need_weight, need_bias))
    return ((values * row_weight).sum(), *(nothing(a_s, (0,)) if g is None else g
                                           for g in grads))


reduced_op = torch.library.custom_op("fusedloss::linear_divergence_reduced", reduced_forward,
                                     mutates_args=())


@reduced_op.register_fake
def _(a_s, w_s, b_s, a_t, w_t, b_t, row_weight, kind, beta, temperature, need_input,
      need_weight, need_bias):
    f32 = torch.float32
    return (a_s.new_empty((), dtype=f32),
            torch.empty_like(a_s) if need_input else nothing(a_s, (0,)),
            w_s.new_empty(w_s.shape, dtype=f32) if need_weight else nothing(a_s, (0,)),
            b_s.new_empty(b_s.shape, dtype=f32) if b_s is not None and need_bias
            else nothing(a_s, (0,)))


reduced_op.register_autograd(formed_grads_backward, setup_context=formed_grads_setup_context)

_EagerReduced = eager_function("_EagerReduced", reduced_forward, formed_grads_setup_context,
                               formed_grads_backward, None)


# ---------------------------------------------------------------------------------------------
# Offline distillation from a teacher's top-k log-probabilities (the student's gradient only).


def linear_top_k_kl(*args) -> Tensor:
    """The forward op (arguments of ``top_k_forward``) with its autograd."""
    return run_op(top_k_forward_op, _TopKEagerFunction, *args)


@op_body
def top_k_forward(
    a_s: Tensor,  # (N, D)
    w_s: Tensor,  # (V, D)
    b_s: Tensor | None,  # (V,)
    teacher_log_probs: Tensor,  # (N, k)
    teacher_ids: Tensor,  # (N, k) int64
    temperature: float,
) -> Tensor:
    """Each row's top-k KL (``families.distillation.top_k_kl_and_grad``), (N,)."""
    n, v = a_s.shape[0], w_s.shape[0]
    acc = engine.accumulation_dtype(a_s.dtype)
    out = torch.empty(n, dtype=acc, device=a_s.device)
    rows = _block_rows(v)
    for r0 in range(0, n, rows):
        part = slice(r0, min(r0 + rows, n))
        out[part] = family.top_k_kl_and_grad(
            _log_probs(F.linear(a_s[part], w_s, b_s), temperature),
            teacher_log_probs[part].to(acc), teacher_ids[part], None)[0]
    return out


top_k_forward_op = torch.library.custom_op("fusedloss::linear_top_k_kl", top_k_forward,
                                           mutates_args=())


@top_k_forward_op.register_fake
def _(a_s, w_s, b_s, teacher_log_probs, teacher_ids, temperature):
    return a_s.new_empty(a_s.shape[0], dtype=engine.accumulation_dtype(a_s.dtype))


@op_body
def top_k_backward(grad: Tensor, a_s: Tensor, w_s: Tensor, b_s: Tensor | None,
                   teacher_log_probs: Tensor, teacher_ids: Tensor, temperature: float,
                   needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """(d a_s, d w_s, d b_s), each an empty tensor when not asked for."""
    acc = engine.accumulation_dtype(a_s.dtype)
    operands = (a_s, w_s, b_s)
    grads = [torch.zeros_like(t, dtype=acc) if need and t is not None else None
             for need, t in zip(needs, operands, strict=True)]
    n, v = a_s.shape[0], w_s.shape[0]
    rows = _block_rows(v)
    for r0 in range(0, n, rows):
        part = slice(r0, min(r0 + rows, n))
        _, dz = family.top_k_kl_and_grad(
            _log_probs(F.linear(a_s[part], w_s, b_s), temperature),
            teacher_log_probs[part].to(acc), teacher_ids[part],
            grad[part].to(acc) / temperature)
        if grads[2] is not None:
            grads[2] += dz.sum(dim=0)
        dz = dz.to(a_s.dtype)
        if grads[0] is not None:
            mm_f32(dz, w_s, out=grads[0][part])
        if grads[1] is not None:
            addmm_f32_(grads[1], dz.T, a_s[part])
    return tuple(nothing(a_s, (0,)) if g is None else g.to(t.dtype)
                 for g, t in zip(grads, operands, strict=True))


top_k_backward_op = torch.library.custom_op("fusedloss::linear_top_k_kl_backward",
                                            top_k_backward, mutates_args=())


@top_k_backward_op.register_fake
def _(grad, a_s, w_s, b_s, teacher_log_probs, teacher_ids, temperature, needs):
    return tuple(torch.empty_like(t) if need and t is not None else nothing(a_s, (0,))
                 for need, t in zip(needs, (a_s, w_s, b_s), strict=True))


def _top_k_setup_context(ctx, inputs, output):
    a_s, w_s, b_s, teacher_log_probs, teacher_ids, temperature = inputs
    ctx.save_for_backward(a_s, w_s, b_s, teacher_log_probs, teacher_ids)
    ctx.temperature = temperature


def _top_k_autograd_backward(ctx, grad, backward_fn=top_k_backward_op):
    needs = list(ctx.needs_input_grad[:3])
    grads = backward_fn(grad, *ctx.saved_tensors, ctx.temperature, needs)
    return (*(grad_or_none(g, need) for g, need in zip(grads, needs, strict=True)),
            None, None, None)


top_k_forward_op.register_autograd(_top_k_autograd_backward,
                                   setup_context=_top_k_setup_context)

_TopKEagerFunction = eager_function("_TopKEagerFunction", top_k_forward, _top_k_setup_context,
                                    _top_k_autograd_backward, top_k_backward)
