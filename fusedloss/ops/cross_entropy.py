"""Linear cross-entropy (the "cut cross-entropy" LM head) as two custom ops over the engine.

The loss and its gradient coefficients are ``fusedloss/families/cross_entropy.py``'s (which
the vocabulary-parallel head calls too); these ops feed them the engine's statistics. Every
row is computed, an ignored token's too, and an ignored token gives a loss of exactly 0 and no
gradient: which tokens count is never asked of the GPU. Neither op reads anything back to the
host unless ``Tuning.check_values`` asks for the argument checks that need values.

``fusedloss::linear_cross_entropy`` returns the per-token losses and LSEs with the statistics
the backward reads (each token's target and class weight, the row LSE parts, the target
logits, the per-tile masses); ``fusedloss::linear_cross_entropy_backward`` takes them with the
upstream gradients.

``fusedloss::linear_cross_entropy_chunked`` is the training path of a reduced loss: three
matrix products per chunk of rows (``core.chunked_logits``), the gradients formed in the
forward and scaled by the loss's upstream gradient in the backward. It reads nothing back to
the host, so it computes every row, the ignored ones included.
"""

import torch
from torch import Tensor

from ..core import chunked_logits, config, engine
from ..core.engine import Logits, RowStats
from ..families import cross_entropy as family
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

_F32 = torch.float32


def linear_cross_entropy(*args) -> tuple[Tensor, ...]:
    """The forward op (``fusedloss::linear_cross_entropy``, arguments of ``forward``) with its
    autograd: through the dispatcher while ``torch.compile`` traces, straight to the host
    functions in eager mode, where the dispatcher's Python layers cost ~0.3 ms per call."""
    return run_op(forward_op, _EagerFunction, *args)


@op_body
def forward(
    input: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    target: Tensor,  # (N,) int64: class ids in [0, V), or ignore_index
    bias: Tensor | None,  # (V,)
    class_weight: Tensor | None,  # (V,) fp32
    vocab_order: Tensor | None,  # (V,) int64 permutation: column order of the tiles
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    filter_eps: float | None,
    backend: str,  # "triton" or "torch"
    record_tiles: bool,  # keep the per-tile masses that filtering reads in the backward
) -> tuple[(Tensor,) * 7]:  # type: ignore[misc]  # (a schema needs the count)
    """Per-token losses and LSEs ((N,) fp32 each, 0 at ignored tokens), then for the backward:
    each token's target (N,) int64 (−1: none) and class weight (N,) fp32 (0 at ignored
    tokens), the row LSE parts (4, N) fp32 (``RowStats.packed``), the target logits (N,) fp32
    and the per-tile masses ((0, 0) unless recorded). With float64 operands (the torch
    backend) the fp32 outputs are float64.

    Every row is computed, an ignored token's too (as on the training path): which tokens
    count is not asked of the GPU. Nothing is read back to the host: a target outside [0, V)
    other than ``ignore_index`` makes its token's loss NaN (and, through its class weight,
    every gradient), a ``vocab_order`` that is not a permutation every loss (the tiles then
    run in plain order, never reading outside B). ``Tuning.check_values`` raises ValueError
    for either instead (one wait).
    """
    a, b = row_major(input), row_major(weight)
    v = b.shape[0]
    if config.tuning().check_values:
        check_targets(target, ignore_index, v)
        if vocab_order is not None:
            _check_order(vocab_order, v)
    vocab_order, order_nan = _safe_order(vocab_order, v)
    valid = target != ignore_index
    row_target, target_weight = _row_targets(target, valid, class_weight, v)
    target_weight = target_weight.to(engine.accumulation_dtype(a.dtype))  # float64 stays
    if order_nan is not None:
        target_weight = target_weight + order_nan
    rows = all_rows(row_target)

    stats = engine.row_stats(
        a, b, Logits(bias=bias, softcap=softcap, col_order=vocab_order), rows,
        col_weight=class_weight,
        wants=engine.Wants(weighted_sum=label_smoothing > 0,
                           record_tiles=record_tiles and filter_eps is not None),
        backend=backend,
    )
    lse = stats.lse
    total_w = class_weight.sum() if class_weight is not None else v
    loss = family.token_loss(stats.lse_minus(stats.target_logit), lse, target_weight,
                             stats.weighted_sum, total_w, v, label_smoothing, z_loss)
    packed_rows, _ = stats.packed()
    tiles = stats.tile_log_mass if stats.tile_log_mass is not None else nothing(a, (0, 0))
    return (torch.where(valid, loss, 0.0), torch.where(valid, lse, 0.0), row_target,
            target_weight, packed_rows, stats.target_logit, tiles)


forward_op = torch.library.custom_op("fusedloss::linear_cross_entropy", forward, mutates_args=())


@forward_op.register_fake
def _(input, weight, target, bias, class_weight, vocab_order, ignore_index, label_smoothing,
      softcap, z_loss, filter_eps, backend, record_tiles):
    n, d = input.shape
    v = weight.shape[0]
    tiles = (0, 0)
    if backend == "triton" and record_tiles and filter_eps is not None:
        tiles, _ = engine.tile_stats_shapes(n, v, input.device, input.dtype, d)
    per_row = input.new_empty(n, dtype=engine.accumulation_dtype(input.dtype))
    return (per_row, torch.empty_like(per_row), input.new_empty(n, dtype=torch.int64),
            torch.empty_like(per_row), input.new_empty((4, n), dtype=per_row.dtype),
            torch.empty_like(per_row), input.new_empty(tiles, dtype=_F32))


@op_body
def backward(
    grad_loss: Tensor | None,  # (N,)
    grad_lse: Tensor | None,  # (N,)
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    vocab_order: Tensor | None,
    row_target: Tensor,
    row_weight: Tensor,
    row_stats: Tensor,
    target_logit: Tensor,
    tile_log_mass: Tensor,
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    filter_eps: float | None,
    backend: str,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d input, d weight, d bias) from the forward's statistics; each is an empty tensor when
    not asked for."""
    a, b = row_major(input), row_major(weight)
    (n, d), v = a.shape, b.shape[0]
    rows = all_rows(row_target)
    vocab_order, _ = _safe_order(vocab_order, v)  # as the forward ran it
    stats = RowStats.from_packed(
        row_stats, None, target_logit, tile_log_mass if tile_log_mass.numel() else None, None,
        engine.forward_block(a.device, a.dtype, d))

    # Upstream gradients, 0 at the tokens without a target (autograd passes None for an output
    # that got no gradient); a bad target's NaN class weight makes its coefficients NaN.
    valid = row_target >= 0
    acc = engine.accumulation_dtype(a.dtype)
    g = torch.zeros(n, dtype=acc, device=a.device) if grad_loss is None else torch.where(
        valid, grad_loss.to(acc), 0.0)
    g_lse = 0.0
    if grad_lse is not None:
        g_lse = torch.where(valid, grad_lse.to(acc), 0.0)
    total_w = class_weight.sum() if class_weight is not None else v
    coef = family.grad_coefficients(g, g_lse, stats.lse, row_weight, total_w, v,
                                    label_smoothing, z_loss)
    grads = engine.grads(
        a, b, Logits(bias=bias, softcap=softcap, col_order=vocab_order), rows, stats, coef,
        col_weight=class_weight,
        needs=engine.Needs(need_input, need_weight, bias is not None and need_bias),
        plan=engine.BackwardPlan(
            filter_eps=filter_eps, filter_scale=(family.gradient_mass(stats, coef), None),
            scratch_bytes=scratch_bytes(a), row_chunk=backward_row_chunk(a), backend=backend,
            sparse=filter_eps is not None),  # filtering's sparse slabs: its one wait
    )
    grad_bias = grads.bias.to(bias.dtype) if grads.bias is not None else nothing(a, (0,))
    return (grads.a if need_input else nothing(a, (0,)),
            grads.b if need_weight else nothing(a, (0,)), grad_bias)


backward_op = torch.library.custom_op("fusedloss::linear_cross_entropy_backward", backward,
                                      mutates_args=())


@backward_op.register_fake
def _(grad_loss, grad_lse, input, weight, bias, class_weight, vocab_order, row_target,
      row_weight, row_stats, target_logit, tile_log_mass, label_smoothing, softcap, z_loss,
      filter_eps, backend, need_input, need_weight, need_bias):
    return (torch.empty_like(input) if need_input else nothing(input, (0,)),
            torch.empty_like(weight) if need_weight else nothing(input, (0,)),
            torch.empty_like(bias) if bias is not None and need_bias else nothing(input, (0,)))


def _setup_context(ctx, inputs, output):
    (input, weight, _, bias, class_weight, vocab_order, _, label_smoothing, softcap, z_loss,
     filter_eps, backend, _) = inputs
    _, _, *saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for unused outputs
    ctx.save_for_backward(input, weight, bias, class_weight, vocab_order, *saved)
    ctx.options = (label_smoothing, softcap, z_loss, filter_eps, backend)


def _autograd_backward(ctx, grad_loss, grad_lse, *_, backward_fn=backward_op):
    need_input, need_weight, _, need_bias = ctx.needs_input_grad[:4]
    grad_input, grad_weight, grad_bias = backward_fn(
        grad_loss, grad_lse, *ctx.saved_tensors, *ctx.options,
        need_input, need_weight, need_bias)
    return (grad_or_none(grad_input, need_input), grad_or_none(grad_weight, need_weight), None,
            grad_or_none(grad_bias, need_bias), *[None] * 9)


forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


_EagerFunction = eager_function("_EagerFunction", forward, _setup_context, _autograd_backward,
                                backward)


def _safe_order(vocab_order: Tensor | None, v: int) -> tuple[Tensor | None, Tensor | None]:
    """(the column order the kernels run, NaN or 0 as a () tensor to add to every token's class
    weight) for a ``vocab_order`` that may not be a permutation of 0..V-1 (None: (None,
    None)). Found on the device: a bad order runs as the plain one, its losses NaN."""
    if vocab_order is None:
        return None, None
    plain = torch.arange(v, device=vocab_order.device)
    bad = (torch.sort(vocab_order).values != plain).any()
    return (torch.where(bad, plain, vocab_order),
            torch.where(bad, float("nan"), 0.0).to(_F32))


def _check_order(vocab_order: Tensor, v: int) -> None:
    """ValueError for a ``vocab_order`` that is not a permutation of 0..V-1 (a read-back)."""
    if (torch.sort(vocab_order).values != torch.arange(v, device=vocab_order.device)).any():
        raise ValueError("vocab_order must be a permutation of 0..V-1")


def _row_targets(target: Tensor, valid: Tensor, class_weight: Tensor | None, v: int):
    """(each token's target column (N,) int64, −1 for none; its class weight w_y (N,) fp32, 0
    at ignored tokens). A target outside [0, V) becomes −1 (no kernel reads by it) with weight
    NaN, which makes its loss and the gradients NaN."""
    in_range = (target >= 0) & (target < v)
    row_target = torch.where(valid & in_range, target, -1)
    if class_weight is None:
        weight = torch.ones_like(target, dtype=_F32)
    else:
        weight = class_weight[target.clamp(0, v - 1)]
    weight = torch.where(in_range, weight, float("nan"))
    return row_target, torch.where(valid, weight, 0.0)


# ---------------------------------------------------------------------------------------------
# The training path (``core.chunked_logits``): a reduced loss whose gradient the forward forms.


def linear_cross_entropy_chunked(*args) -> Tensor:
    """The reduced loss (() fp32) of ``forward_chunked``'s arguments, with its autograd: the
    gradients are computed in the forward and scaled by the loss's upstream gradient in the
    backward, or (``deferred``) computed in the backward with it."""
    return run_op(chunked_op, _EagerChunked, *args)[0]


@op_body
def forward_chunked(
    input: Tensor,  # (N, D)
    weight: Tensor,  # (V, D)
    target: Tensor,  # (N,) int64: class ids in [0, V), or ignore_index
    bias: Tensor | None,  # (V,)
    class_weight: Tensor | None,  # (V,) fp32
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    mean: bool,  # reduction "mean" (else "sum")
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
    deferred: bool,  # the gradients in the backward (``config.lm_head_deferred``)
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(the loss () fp32, d input (N, D), d weight (V, D) fp32, d bias (V,) fp32) for an
    upstream gradient of 1; each gradient an empty tensor when not asked for or ``deferred``
    (then ``backward_chunked`` computes them: the loss alone here, one product and the row
    pass). "mean" divides by the valid tokens' count or summed class weights (a batch with
    none gives 0).

    Reads nothing back to the host: the CPU runs ahead and the op can be captured in a CUDA
    graph. Every row is computed (an ignored one gives loss 0 and a zero gradient row); a
    target outside [0, V) other than ``ignore_index`` makes the loss and the gradients NaN,
    or, with ``Tuning.check_values``, raises ValueError (one wait for the GPU)."""
    a, b = row_major(input), row_major(weight)
    v = b.shape[0]
    if config.tuning().check_values:
        check_targets(target, ignore_index, v)
    needs = (chunked_logits.Needs(False, False, False) if deferred
             else chunked_logits.Needs(need_input, need_weight, need_bias))
    # The logits of F.linear in the input dtype: the bias cast to it, as autocast casts it.
    loss, grad_a, grad_b, grad_bias = chunked_logits.loss_and_grads(
        a, b, None if bias is None else bias.to(a.dtype), target, class_weight,
        _mean_coef(target, class_weight, v, ignore_index, mean, a.device),
        chunked_logits.LossOptions(ignore_index, label_smoothing, softcap, z_loss), needs)
    return (loss, grad_a if grad_a is not None else nothing(a, (0,)),
            grad_b if grad_b is not None else nothing(a, (0,)),
            grad_bias if grad_bias is not None else nothing(a, (0,)))


def _mean_coef(target: Tensor, class_weight: Tensor | None, v: int, ignore_index: int,
               mean: bool, device: torch.device) -> Tensor:
    """Each row's share of the loss, () fp32: 1 / (valid tokens or summed class weights) for
    "mean" (1 where there are none), 1 for "sum"."""
    if mean:
        denom = family.summed_weights(target, ignore_index, class_weight, v, _F32)
        return torch.where(denom == 0, 1.0, denom).reciprocal()
    return torch.ones((), dtype=_F32, device=device)


chunked_op = torch.library.custom_op(
    "fusedloss::linear_cross_entropy_chunked", forward_chunked, mutates_args=())


@chunked_op.register_fake
def _(input, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_loss,
      mean, need_input, need_weight, need_bias, deferred):
    return (input.new_empty((), dtype=_F32),
            torch.empty_like(input) if need_input and not deferred else nothing(input, (0,)),
            weight.new_empty(weight.shape, dtype=_F32) if need_weight and not deferred
            else nothing(input, (0,)),
            bias.new_empty(bias.shape, dtype=_F32) if bias is not None and need_bias
            and not deferred else nothing(input, (0,)))


def _chunked_setup_context(ctx, inputs, output):
    input, weight, target, bias, class_weight, *options = inputs
    _, *grads = output
    ctx.mark_non_differentiable(*grads)
    ctx.set_materialize_grads(False)
    ctx.deferred = options[-1]
    if ctx.deferred:  # the inputs, for the backward to compute the gradients from
        ctx.save_for_backward(input, weight, target, bias, class_weight)
        ctx.options = tuple(options[:5])  # ignore_index, label_smoothing, softcap, z_loss, mean
    else:
        ctx.save_for_backward(*grads)
    ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)


def _chunked_backward(ctx, grad_loss, *_, backward_fn=None):
    need_input, need_weight, _, need_bias = ctx.needs_input_grad[:4]
    nones = [None] * 10
    if grad_loss is None:
        return (None, None, None, None, *nones)
    if ctx.deferred:
        grads = (backward_fn or chunked_backward_op)(
            grad_loss, *ctx.saved_tensors, *ctx.options, need_input, need_weight, need_bias)
        return (grads[0] if need_input else None, grads[1] if need_weight else None, None,
                grads[2] if need_bias else None, *nones)
    grad_input, grad_weight, grad_bias = ctx.saved_tensors
    dtypes = ctx.dtypes
    return (_scaled(grad_input, grad_loss, dtypes[0]) if need_input else None,
            _scaled(grad_weight, grad_loss, dtypes[1]) if need_weight else None, None,
            _scaled(grad_bias, grad_loss, dtypes[2]) if need_bias else None, *nones)


@op_body
def backward_chunked(
    grad_loss: Tensor,  # () the loss's upstream gradient
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    mean: bool,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d input, d weight, d bias) in the inputs' dtypes, each an empty tensor when not asked
    for, of a ``deferred`` ``forward_chunked``: the logits again (one chunk), the row pass with
    the upstream gradient folded into each row's coefficient, so that each product rounds its
    gradient once, as the forward-formed path's scaling does (and no fp32 dB exists)."""
    a, b = row_major(input), row_major(weight)
    v = b.shape[0]
    coef = _mean_coef(target, class_weight, v, ignore_index, mean, a.device) * grad_loss.float()
    _, grad_a, grad_b, grad_bias = chunked_logits.loss_and_grads(
        a, b, None if bias is None else bias.to(a.dtype), target, class_weight, coef,
        chunked_logits.LossOptions(ignore_index, label_smoothing, softcap, z_loss),
        chunked_logits.Needs(need_input, need_weight, need_bias), chunk=a.shape[0],
        weight_grad_dtype=weight.dtype)
    return (grad_a if grad_a is not None else nothing(a, (0,)),
            grad_b if grad_b is not None else nothing(a, (0,)),
            grad_bias.to(bias.dtype) if grad_bias is not None else nothing(a, (0,)))


chunked_backward_op = torch.library.custom_op(
    "fusedloss::linear_cross_entropy_chunked_backward", backward_chunked, mutates_args=())


@chunked_backward_op.register_fake
def _(grad_loss, input, weight, target, bias, class_weight, ignore_index, label_smoothing,
      softcap, z_loss, mean, need_input, need_weight, need_bias):
    return (torch.empty_like(input) if need_input else nothing(input, (0,)),
            torch.empty_like(weight) if need_weight else nothing(input, (0,)),
            torch.empty_like(bias) if bias is not None and need_bias else nothing(input, (0,)))


def formed_grads_setup_context(ctx, inputs, output):
    """The autograd of an op whose inputs begin (input, weight, bias) and whose outputs are
    (loss, d input, d weight fp32, d bias fp32) for an upstream gradient of 1 (a loss whose
    gradients its forward forms: the distillation and post-training losses' training paths):
    the gradients are kept for ``formed_grads_backward``."""
    input, weight, bias = inputs[:3]
    _, *grads = output
    ctx.mark_non_differentiable(*grads)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*grads)
    ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.n_inputs = len(inputs)


def formed_grads_backward(ctx, grad_loss, *_, backward_fn=None):
    """The kept gradients times the loss's upstream gradient, each rounded once to its input's
    dtype."""
    need = ctx.needs_input_grad[:3]
    grads = [None] * 3
    if grad_loss is not None:
        grads = [_scaled(g, grad_loss, dtype) if n else None
                 for g, n, dtype in zip(ctx.saved_tensors, need, ctx.dtypes, strict=True)]
    return (*grads, *[None] * (ctx.n_inputs - 3))


def _scaled(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """grad · scale in fp32, rounded once to ``dtype`` (a bf16 product would round the scale
    first): one Triton pass (``chunked_logits.scaled``), called directly on plain tensors in
    eager mode and through its op wherever the call is traced."""
    if torch.compiler.is_compiling() or type(grad) is not Tensor or type(scale) is not Tensor:
        return scaled_op(grad, scale, dtype)
    return _scale(grad, scale, dtype)


def _scale(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return chunked_logits.scaled(grad.contiguous(), scale.float(), dtype)


scaled_op = torch.library.custom_op("fusedloss::scaled_gradient", _scale, mutates_args=())


@scaled_op.register_fake
def _(grad, scale, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


chunked_op.register_autograd(_chunked_backward, setup_context=_chunked_setup_context)

_EagerChunked = eager_function("_EagerChunked", forward_chunked, _chunked_setup_context,
                               _chunked_backward, backward_chunked)
