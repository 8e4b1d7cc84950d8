"""Token log-probabilities (and entropies) through an LM head as two custom ops over the engine.

The formulas are ``fusedloss/families/log_probs.py``'s; these ops feed them the engine's
statistics. As for the cross-entropy op, every row is computed, an ignored token's too, which
gives 0 and no gradient; nothing is read back to the host unless ``Tuning.check_values`` asks.
No tile is skipped (the entropy's gradient is not bounded by the softmax mass that filtering
reasons about).

``fusedloss::linear_log_probs`` returns per token log p and H with the statistics the backward
reads; ``fusedloss::linear_log_probs_backward`` takes them with the upstream gradients.

On the Triton backend both run on cuBLAS products per chunk of rows with one Triton pass per row
(``core.chunked_log_probs``: four products in all, as fast as the products allow); the torch
backend (and float64) runs the engine's torch path.
"""

import torch
from torch import Tensor

from ..core import chunked_log_probs, config, engine
from ..core.engine import Needs, RowStats
from ..families import log_probs as family
from ._common import (
    all_rows,
    backward_row_chunk,
    check_targets,
    eager_function,
    grad_or_none,
    nothing,
    op_body,
    row_major,
    run_op,
    scratch_bytes,
)


def linear_log_probs(*args) -> tuple[Tensor, ...]:
    """The forward op (``fusedloss::linear_log_probs``, arguments of ``forward``) with its
    autograd: through the dispatcher while ``torch.compile`` traces, straight to the host
    functions in eager mode."""
    return run_op(forward_op, _EagerFunction, *args)


@op_body
def forward(
    input: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    target: Tensor,  # (N,) int64: token ids in [0, V), or ignore_index
    bias: Tensor | None,  # (V,)
    ignore_index: int,
    logit_scale: float,  # α: the logits are softcap(α·(input Wᵀ + bias)) / temperature
    temperature: float,
    softcap: float | None,
    entropy: bool,
    square_sum: bool,
    logit_sum: bool,
    backend: str,  # "triton" or "torch"
) -> tuple[(Tensor,) * 9]:  # type: ignore[misc]  # (a schema needs the count)
    """Per token ((N,) fp32 each, 0 at ignored tokens) log p(target), the entropy (with
    ``entropy``), log Σ_j p_j² (with ``square_sum``) and the mean logit Σ_j X_j / V (with
    ``logit_sum``), each (0,) when not asked for; then for the backward: each token's target
    (N,) int64 (−1: none), its weight (N,) fp32 (1, 0 at ignored tokens, NaN for a target
    outside [0, V) other than ``ignore_index``, which makes its outputs and the gradients NaN),
    the row LSE parts (4, N) (``RowStats.packed``: the row max first), the target logits (N,)
    and the centered sums (N,) ((0,) without ``entropy``). float64 operands (the torch backend)
    give float64 outputs."""
    a, b = row_major(input), row_major(weight)
    v = b.shape[0]
    if config.tuning().check_values:
        check_targets(target, ignore_index, v)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < v)
    row_target = torch.where(valid & in_range, target, -1)
    acc = engine.accumulation_dtype(a.dtype)
    row_weight = torch.where(valid, torch.where(in_range, 1.0, float("nan")), 0.0).to(acc)
    if backend == "triton":
        return _chunked_forward(a, b, bias, (row_target, valid, row_weight),
                                (logit_scale, temperature, softcap),
                                (entropy, square_sum, logit_sum))
    logits = family.tempered_logits(bias, logit_scale, temperature, softcap, acc, a.device)
    stats = engine.row_stats(
        a, b, logits, all_rows(row_target),
        wants=engine.Wants(record_tiles=False, entropy=entropy, squares=square_sum,
                           weighted_sum=logit_sum),
        backend=backend)

    def per_token(wanted: bool, value) -> Tensor:
        if not wanted:
            return nothing(a, (0,)).to(acc)
        return torch.where(valid, value() * row_weight, 0.0)

    packed_rows, _ = stats.packed()
    return (per_token(True, lambda: family.token_log_prob(stats)),
            per_token(entropy, lambda: family.token_entropy(stats)),
            per_token(square_sum, lambda: family.log_sum_squares(stats)),
            per_token(logit_sum, lambda: family.mean_logit(stats, v)),
            row_target, row_weight, packed_rows, stats.target_logit,
            stats.centered_sum if entropy else nothing(a, (0,)).to(acc))


def _chunked_forward(a, b, bias, rows, head, wanted):
    """``forward``'s outputs on the Triton backend (``core.chunked_log_probs``) for ``rows`` =
    (target column, valid, weight), ``head`` = (α, T, softcap) and ``wanted`` = (entropy,
    square sum, logit sum); the row statistics it passes on are (max, sum, target logit,
    centered sum)."""
    row_target, valid, row_weight = rows
    logit_scale, temperature, softcap = head
    entropy, square_sum, logit_sum = wanted
    v = b.shape[0]
    stats = chunked_log_probs.row_stats(
        a, b, None if bias is None else bias.to(a.dtype), row_target,
        family.logit_factor(logit_scale, temperature),
        None if softcap is None else softcap / temperature)
    row_max, total, target_logit, centered, squares, logits = stats
    log_sum = torch.log(total)
    values = {"log p": (target_logit - row_max) - log_sum, "H": log_sum - centered / total,
              "log Σp²": torch.log(squares) - 2 * log_sum, "mean": logits / v}

    def per_token(wanted: bool, name: str) -> Tensor:
        if not wanted:
            return nothing(a, (0,)).float()
        return torch.where(valid, values[name] * row_weight, 0.0)

    return (per_token(True, "log p"), per_token(entropy, "H"),
            per_token(square_sum, "log Σp²"), per_token(logit_sum, "mean"),
            row_target, row_weight, stats[:4].clone(), target_logit.clone(),
            centered.clone() if entropy else nothing(a, (0,)).float())


forward_op = torch.library.custom_op("fusedloss::linear_log_probs", forward, mutates_args=())


@forward_op.register_fake
def _(input, weight, target, bias, ignore_index, logit_scale, temperature, softcap, entropy,
      square_sum, logit_sum, backend):
    n = input.shape[0]
    per_row = input.new_empty(n, dtype=engine.accumulation_dtype(input.dtype))

    def if_asked(wanted: bool) -> Tensor:
        return torch.empty_like(per_row) if wanted else per_row.new_empty(0)

    return (per_row, if_asked(entropy), if_asked(square_sum), if_asked(logit_sum),
            input.new_empty(n, dtype=torch.int64), torch.empty_like(per_row),
            input.new_empty((4, n), dtype=per_row.dtype), torch.empty_like(per_row),
            if_asked(entropy))


@op_body
def backward(
    grad_log_prob: Tensor | None,  # (N,)
    grad_entropy: Tensor | None,  # (N,)
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    row_target: Tensor,
    row_weight: Tensor,
    row_stats: Tensor,
    target_logit: Tensor,
    centered_sum: Tensor,
    logit_scale: float,
    temperature: float,
    softcap: float | None,
    backend: str,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d input, d weight, d bias) from the forward's statistics; each is an empty tensor when
    not asked for."""
    a, b = row_major(input), row_major(weight)
    if backend == "triton":
        return _chunked_backward((grad_log_prob, grad_entropy), a, b, bias,
                                 (row_target, row_weight, row_stats), centered_sum.numel() > 0,
                                 (logit_scale, temperature, softcap),
                                 Needs(need_input, need_weight, need_bias))
    d = a.shape[1]
    stats = RowStats.from_packed(row_stats, None, target_logit, None, None,
                                 engine.forward_block(a.device, a.dtype, d))
    if centered_sum.numel():
        stats.centered_sum = centered_sum
    acc = engine.accumulation_dtype(a.dtype)
    # Upstream gradients times each token's weight: 0 at ignored tokens, NaN at bad targets
    # (autograd passes None for an output that got no gradient).
    counted = row_weight != 0
    g = (torch.zeros_like(row_weight) if grad_log_prob is None
         else torch.where(counted, grad_log_prob.to(acc) * row_weight, 0.0))
    h = None
    if grad_entropy is not None and centered_sum.numel():
        h = torch.where(counted, grad_entropy.to(acc) * row_weight, 0.0)
    logits = family.tempered_logits(bias, logit_scale, temperature, softcap, acc, a.device)
    grads = engine.grads(
        a, b, logits, all_rows(row_target), stats, family.grad_coefficients(g, h, stats),
        needs=engine.Needs(need_input, need_weight, bias is not None and need_bias),
        plan=engine.BackwardPlan(scratch_bytes=scratch_bytes(a), row_chunk=backward_row_chunk(a),
                                 backend=backend),
    )
    grad_bias = nothing(a, (0,))
    if grads.bias is not None:  # the engine's is for bias·α / T
        grad_bias = (grads.bias * family.logit_factor(logit_scale, temperature)).to(bias.dtype)
    return (grads.a if need_input else nothing(a, (0,)),
            grads.b if need_weight else nothing(a, (0,)), grad_bias)


def _chunked_backward(upstream, a, b, bias, rows, has_entropy, head, needs):
    """``backward`` on the Triton backend from ``_chunked_forward``'s row statistics:
    ``upstream`` = the gradients of (log p, H), ``rows`` = (target column, weight, statistics),
    ``head`` = (α, T, softcap)."""
    grad_log_prob, grad_entropy = upstream
    row_target, row_weight, row_stats = rows
    logit_scale, temperature, softcap = head
    counted = row_weight != 0
    g = (torch.zeros_like(row_weight) if grad_log_prob is None
         else torch.where(counted, grad_log_prob.float() * row_weight, 0.0))
    h = None
    if grad_entropy is not None and has_entropy:
        h = torch.where(counted, grad_entropy.float() * row_weight, 0.0)
    grad_a, grad_b, grad_bias = chunked_log_probs.grads(
        a, b, None if bias is None else bias.to(a.dtype), row_target, row_stats, g, h,
        family.logit_factor(logit_scale, temperature),
        None if softcap is None else softcap / temperature, needs)
    return (grad_a if grad_a is not None else nothing(a, (0,)),
            grad_b.to(b.dtype) if grad_b is not None else nothing(a, (0,)),
            grad_bias.to(bias.dtype) if grad_bias is not None else nothing(a, (0,)))


backward_op = torch.library.custom_op("fusedloss::linear_log_probs_backward", backward,
                                      mutates_args=())


@backward_op.register_fake
def _(grad_log_prob, grad_entropy, input, weight, bias, row_target, row_weight, row_stats,
      target_logit, centered_sum, logit_scale, temperature, softcap, backend, need_input,
      need_weight, need_bias):
    return (torch.empty_like(input) if need_input else nothing(input, (0,)),
            torch.empty_like(weight) if need_weight else nothing(input, (0,)),
            torch.empty_like(bias) if bias is not None and need_bias else nothing(input, (0,)))


def _setup_context(ctx, inputs, output):
    input, weight, _, bias, _, logit_scale, temperature, softcap, _, _, _, backend = inputs
    _, _, log_sum_squares, mean_logit, *saved = output
    ctx.mark_non_differentiable(log_sum_squares, mean_logit, *saved)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for unused outputs
    ctx.save_for_backward(input, weight, bias, *saved)
    ctx.options = (logit_scale, temperature, softcap, backend)


def _autograd_backward(ctx, grad_log_prob, grad_entropy, *_, backward_fn=backward_op):
    need_input, need_weight, _, need_bias = ctx.needs_input_grad[:4]
    grad_input, grad_weight, grad_bias = backward_fn(
        grad_log_prob, grad_entropy, *ctx.saved_tensors, *ctx.options,
        need_input, need_weight, need_bias)
    return (grad_or_none(grad_input, need_input), grad_or_none(grad_weight, need_weight), None,
            grad_or_none(grad_bias, need_bias), *[None] * 8)


forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


_EagerFunction = eager_function("_EagerFunction", forward, _setup_context, _autograd_backward,
                                backward)
