"""Distillation through LM heads: the functional API (``linear_kl_div``, ``linear_jsd`` between
two heads; ``linear_top_k_kl`` from a teacher's stored top-k log-probabilities).

The divergences are ``fusedloss/families/distillation.py``'s, computed a block of rows at a
time by ``fusedloss/ops/distillation.py`` (neither model's (tokens × vocabulary) logits exist
at once); this layer checks the arguments, flattens the tokens and reduces.
"""

from __future__ import annotations

import math

import torch

from ..families.distillation import KINDS
from ..ops import distillation as ops
from ..ops._common import autocast_operands
from ..options import REDUCTIONS
from .cross_entropy import resolve_input_backend

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def linear_kl_div(
    student_input: torch.Tensor,  # (*, D_s)
    student_weight: torch.Tensor,  # (V, D_s)
    teacher_input: torch.Tensor,  # (*, D_t)
    teacher_weight: torch.Tensor,  # (V, D_t)
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    direction: str = "forward",
    reduction: str = "mean",
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    backend: str = "auto",
) -> torch.Tensor:
    """KL divergence per token between a teacher's and a student's next-token distributions,
    each softmax(F.linear(input, weight, bias) / temperature) over the same vocabulary, without
    either model's logits: ``direction="forward"`` is KL(p_teacher ‖ p_student) (what
    ``F.kl_div(student_log_probs, teacher_log_probs, log_target=True)`` sums), "reverse"
    KL(p_student ‖ p_teacher).

    Args:
        student_input, student_weight: the student's (*, D_s) hidden states and (V, D_s) head.
        teacher_input, teacher_weight: the teacher's (*, D_t) and (V, D_t) (D_t may differ).
        student_bias, teacher_bias: optional (V,) biases.
        temperature: T > 0, applied to both models' logits.
        reduction: "mean" (over the tokens that count), "sum" or "none" (per token, shape *,
            0 where a token does not count).
        labels: optional (*) tensor; positions equal to ``ignore_index`` do not count (padding,
            prompts). None: every token counts.
        backend: "triton" (CUDA, or the CPU under ``TRITON_INTERPRET=1``), "torch", or "auto"
            (Triton on CUDA; float64 inputs always take the torch backend).

    Gradients flow to the student, and to the teacher's tensors too where they require them
    (detach or ``no_grad`` the teacher, as distillation usually does). The logits are formed a
    chunk of rows at a time in the input dtype, their softmax in fp32: on the Triton backend
    both models' chunks of logits (``Tuning.lm_head_chunk_bytes`` for the two) and one pass per
    row; a reduced loss whose teacher needs no gradient forms the student's gradients in the
    forward (four matrix products: both models' logits, then d input and d weight). The torch
    backend (and a teacher that needs gradients) forms blocks of ``Tuning.torch_chunk_elements``
    logits with their fp32 softmaxes, and its backward recomputes them.
    """
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    return _divergence(student_input, student_weight, teacher_input, teacher_weight,
                       (student_bias, teacher_bias), labels,
                       _options(direction, 0.5, temperature, reduction, ignore_index), backend)


def linear_jsd(
    student_input: torch.Tensor,  # (*, D_s)
    student_weight: torch.Tensor,  # (V, D_s)
    teacher_input: torch.Tensor,  # (*, D_t)
    teacher_weight: torch.Tensor,  # (V, D_t)
    *,
    beta: float = 0.5,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    backend: str = "auto",
) -> torch.Tensor:
    """The generalized Jensen-Shannon divergence per token (TRL's GKD and liger-kernel's):
    β·KL(p_t ‖ m) + (1 − β)·KL(p_s ‖ m) with m = β·p_t + (1 − β)·p_s, β in [0, 1] (0.5:
    symmetric; β = 0 and 1 are the forward and the reverse KL, as TRL and liger-kernel define
    the ends). Arguments and reductions as
    ``linear_kl_div``'s."""
    if not (isinstance(beta, int | float) and 0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return _divergence(student_input, student_weight, teacher_input, teacher_weight,
                       (student_bias, teacher_bias), labels,
                       _options("jsd", float(beta), temperature, reduction, ignore_index), backend)


def _options(kind, beta, temperature, reduction, ignore_index) -> tuple:
    if kind not in KINDS:
        raise ValueError(f"unknown divergence {kind!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite Python float > 0, got {temperature!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    return (kind, beta, float(temperature)), reduction, int(ignore_index)


def _divergence(a_s, w_s, a_t, w_t, biases, labels, resolved, backend) -> torch.Tensor:
    options, reduction, ignore_index = resolved
    b_s, b_t = biases
    _check(a_s, w_s, b_s, "student")
    _check(a_t, w_t, b_t, "teacher")
    if a_s.shape[:-1] != a_t.shape[:-1]:
        raise ValueError(f"student_input and teacher_input must have the same leading shape, "
                         f"got {tuple(a_s.shape[:-1])} and {tuple(a_t.shape[:-1])}")
    if w_s.shape[0] != w_t.shape[0]:
        raise ValueError(f"the student's and the teacher's heads must have the same vocabulary "
                         f"size, got {w_s.shape[0]} and {w_t.shape[0]}")
    if labels is not None and labels.shape != a_s.shape[:-1]:
        raise ValueError(f"labels must have shape {tuple(a_s.shape[:-1])}, got "
                         f"{tuple(labels.shape)}")
    backend = resolve_input_backend(backend, a_s)
    a_s, w_s, b_s = autocast_operands(a_s.device, a_s, w_s, b_s)
    a_t, w_t, b_t = autocast_operands(a_t.device, a_t, w_t, b_t)
    shape = a_s.shape[:-1]
    flat = (a_s.reshape(-1, a_s.shape[-1]), w_s, None if b_s is None else b_s.contiguous(),
            a_t.reshape(-1, a_t.shape[-1]), w_t, None if b_t is None else b_t.contiguous())
    grad = torch.is_grad_enabled()
    student_grads = [grad and t is not None and t.requires_grad for t in flat[:3]]
    teacher_grads = any(grad and t is not None and t.requires_grad for t in flat[3:])
    if (backend == "triton" and reduction != "none" and any(student_grads)
            and not teacher_grads and flat[0].shape[0] > 0):
        # Training: the student's gradients formed in the forward, each row weighted by its
        # share of the reduced loss
        counted = (torch.ones(shape, dtype=torch.bool, device=a_s.device) if labels is None
                   else labels != ignore_index).reshape(-1).float()
        share = counted / counted.sum().clamp(min=1) if reduction == "mean" else counted
        return ops.linear_divergence_reduced(*flat, share, *options, *student_grads)
    per_token = ops.linear_divergence(*flat, *options, backend).view(shape)
    return _reduce(per_token, labels, ignore_index, reduction)


def _reduce(per_token: torch.Tensor, labels: torch.Tensor | None, ignore_index: int,
            reduction: str) -> torch.Tensor:
    """0 where ``labels`` is ``ignore_index``; "none", "sum", or "mean" over the counted."""
    counted = None if labels is None else labels != ignore_index
    if counted is not None:
        per_token = torch.where(counted, per_token, 0.0)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return total / (per_token.numel() if counted is None else counted.sum().clamp(min=1))


def _check(a, w, b, who: str) -> None:
    for name, t in ((f"{who}_input", a), (f"{who}_weight", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{who}_input must be floating point, got {a.dtype}")
    if w.dim() != 2 or a.dim() < 1 or a.shape[-1] != w.shape[1]:
        raise ValueError(f"{who}_input must be (*, D) and {who}_weight (V, D), got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")
    if w.dtype != a.dtype and not torch.is_autocast_enabled(a.device.type):
        raise TypeError(f"{who}_weight has dtype {w.dtype} but {who}_input has {a.dtype}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"{who}_bias must have shape ({w.shape[0]},), got {tuple(b.shape)}")


def linear_top_k_kl(
    student_input: torch.Tensor,  # (*, D)
    student_weight: torch.Tensor,  # (V, D)
    teacher_log_probs: torch.Tensor,  # (*, k)
    teacher_ids: torch.Tensor,  # (*, k) int64 token ids in [0, V)
    *,
    student_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Offline distillation from a teacher's top-k: per token Σ_k p_t,k·(log p_t,k − log p_s(id_k))
    with p_t,k = exp(``teacher_log_probs``) as given (e.g. the teacher's tempered log-softmax at
    its k most likely tokens, stored once) and p_s the student's softmax(logits / T) over the
    whole vocabulary: the forward KL's terms on the teacher's k tokens (its remaining mass left
    out, as the stored top-k leaves it). Gradients for the student only; reductions, ``labels``
    and memory as ``linear_kl_div``'s. A token whose ids fall outside [0, V) gets NaN."""
    _, reduction, ignore_index = _options("forward", 0.5, temperature, reduction, ignore_index)
    _check(student_input, student_weight, student_bias, "student")
    lead = student_input.shape[:-1]
    k_shape = (*lead, teacher_log_probs.shape[-1] if teacher_log_probs.dim() else 0)
    if teacher_log_probs.shape != k_shape or teacher_ids.shape != k_shape:
        raise ValueError(f"teacher_log_probs and teacher_ids must have shape (*, k) with * = "
                         f"{tuple(lead)}, got {tuple(teacher_log_probs.shape)} and "
                         f"{tuple(teacher_ids.shape)}")
    if teacher_ids.dtype.is_floating_point:
        raise TypeError(f"teacher_ids must hold integer token ids, got {teacher_ids.dtype}")
    if labels is not None and labels.shape != lead:
        raise ValueError(f"labels must have shape {tuple(lead)}, got {tuple(labels.shape)}")
    a, w, b = autocast_operands(student_input.device, student_input, student_weight,
                                student_bias)
    k = k_shape[-1]
    per_token = ops.linear_top_k_kl(
        a.reshape(-1, a.shape[-1]), w, None if b is None else b.contiguous(),
        teacher_log_probs.reshape(-1, k).detach(),
        teacher_ids.reshape(-1, k).long().clamp(0, w.shape[0] - 1), float(temperature)
    ).view(lead)
    # An id outside [0, V) (clamped into it for the op) makes its token's loss NaN.
    bad_id = ((teacher_ids < 0) | (teacher_ids >= w.shape[0])).any(dim=-1)
    per_token = torch.where(bad_id, float("nan"), per_token)
    return _reduce(per_token, labels, ignore_index, reduction)
