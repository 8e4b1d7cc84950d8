"""Token log-probabilities and entropies through an LM head: the functional API.

What RL and preference trainers need of a policy's head (each completion token's
log-probability under a temperature, often its entropy), computed by the core without the
(tokens × vocabulary) logits. The formulas are ``fusedloss/families/log_probs.py``'s, the ops
``fusedloss/ops/log_probs.py``'s; this layer checks the arguments, flattens the tokens (and
shifts the targets for a causal LM) and shapes the outputs.
"""

from __future__ import annotations

import math

import torch

from ..core import config, engine
from ..ops import log_probs as ops
from ..ops import vocab_parallel
from ..ops._common import autocast_operands
from ..ops._group import device_code, dtype_code, exchange, float_code
from ..options import CrossEntropyOptions
from .cross_entropy import (
    check_inputs,
    dense_vectors,
    resolve_input_backend,
    shard_starts,
    shifted_targets,
)


def linear_log_probs(
    input: torch.Tensor,  # (*, D)
    linear_weight: torch.Tensor,  # (V, D)
    target: torch.Tensor,  # (*) int64 in [0, V) or ignore_index
    *,
    linear_bias: torch.Tensor | None = None,  # (V,)
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    return_entropy: bool = False,
    backend: str = "auto",
    process_group=None,  # torch.distributed.ProcessGroup | None
    vocab_start: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability of its target under the LM head, without the logits.

    Equals ``torch.log_softmax(F.linear(input, linear_weight, linear_bias).float() /
    temperature, -1).gather(-1, target[..., None])[..., 0]`` (with ``softcap`` c the logits
    ``c·tanh(z / c)`` before the division, as Gemma 2 forms them), in O(N + V·D) memory: the
    (N, V) logits are never formed, forward or backward. Differentiable with respect to
    ``input``, ``linear_weight`` and ``linear_bias``.

    Args:
        input: (*, D) hidden states (float32, bfloat16, float16; float64 on the torch backend).
        linear_weight: (V, D) the head, same dtype as ``input``.
        target: (*) int64 token ids in [0, V), or ``ignore_index``.
        linear_bias: optional (V,) bias of the head.
        temperature: T > 0; the distribution is softmax(logits / T), as RL trainers sample.
        softcap: optional c > 0: logits c·tanh(z / c) (before the temperature).
        ignore_index: target value whose token gets 0 (and no gradient).
        shift: causal-LM shift: position t's log-prob is of ``target[..., t + 1]``; the outputs
            then have the last dim one shorter (the last position has no next token), as
            ``linear_cross_entropy(..., shift=True, reduction="none")``'s.
        return_entropy: also return each token's entropy of softmax(logits / T).
        backend: "triton" (CUDA, or the CPU under ``TRITON_INTERPRET=1``), "torch" (chunked
            PyTorch) or "auto" (Triton on CUDA, torch elsewhere and for float64).
        process_group: a ``torch.distributed`` group over which ``linear_weight`` is sharded by
            rows (the vocabulary-parallel head): each rank passes the same ``input`` and
            ``target`` (global token ids) and its rows of the head (and of ``linear_bias``),
            and gets the log-probs and entropies of the whole head; ``input``'s gradient is
            the full one on every rank. float32, bfloat16 or float16 input. Under
            ``torch.compile`` this call runs eagerly (a graph break), as every distributed call.
        vocab_start: with ``process_group``, the global id of this rank's first row (default:
            the shards follow each other in rank order).

    Returns:
        ``log_probs`` (float32; float64 for float64 input) of ``target``'s shape (its last
        dim one shorter with ``shift``), 0 at ignored positions; with ``return_entropy`` the
        tuple ``(log_probs, entropy)``, the entropy 0 at ignored positions too. A target
        outside [0, V) other than ``ignore_index`` gives NaN (its token, and the gradients).

    Example:
        >>> h = torch.randn(2, 8, 64, requires_grad=True)
        >>> w = torch.randn(1000, 64, requires_grad=True)
        >>> ids = torch.randint(0, 1000, (2, 8))
        >>> logp, ent = linear_log_probs(h, w, ids, temperature=0.7, shift=True,
        ...                              return_entropy=True)
        >>> (logp.sum() + 0.01 * ent.sum()).backward()
    """
    input, linear_weight, linear_bias, opts = _operands(
        input, linear_weight, target, linear_bias, temperature, softcap, ignore_index, shift,
        backend)
    if process_group is not None or vocab_start is not None:
        if process_group is None:
            raise ValueError("vocab_start is only meaningful with a process_group")
        log_prob, entropy = _vocab_parallel(input, linear_weight, target, linear_bias, opts,
                                            (float(temperature), return_entropy),
                                            (process_group, vocab_start))
        log_prob = _token_shaped(log_prob, target.shape, shift)
        if not return_entropy:
            return log_prob
        return log_prob, _token_shaped(entropy, target.shape, shift)
    check_inputs(input, linear_weight, target, linear_bias, None, opts)
    backend = resolve_input_backend(backend, input)
    d = linear_weight.shape[1]
    a = input.reshape(-1, d)
    flat_target = shifted_targets(target, shift, ignore_index)
    if a.shape[0] == 0:
        # Nothing to compute, but keep the graph: gradients are zeros of the right shapes.
        acc = engine.accumulation_dtype(input.dtype)
        log_prob = a.to(acc).sum(dim=-1) + linear_weight[:0].to(acc).sum()
        if linear_bias is not None:
            log_prob = log_prob + linear_bias[:0].to(acc).sum()
        entropy = log_prob
    else:
        log_prob, entropy, *_ = ops.linear_log_probs(
            a, linear_weight, flat_target, linear_bias, int(ignore_index), 1.0,
            float(temperature), None if softcap is None else float(softcap), return_entropy,
            False, False, backend)
    log_prob = _token_shaped(log_prob, target.shape, shift)
    if not return_entropy:
        return log_prob
    return log_prob, _token_shaped(entropy, target.shape, shift)


def _operands(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index,
              shift, backend):
    """The scalar arguments checked, the operands as autocast casts them and the bias dense:
    (input, weight, bias, the head's options)."""
    if isinstance(target, torch.Tensor) and (target.dtype.is_floating_point
                                             or target.dtype == torch.bool):
        raise TypeError(f"target must hold integer token ids, got {target.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite value > 0, got {temperature}")
    if isinstance(input, torch.Tensor):
        input, linear_weight, linear_bias = autocast_operands(
            input.device, input, linear_weight, linear_bias)
    (linear_bias,) = dense_vectors(linear_bias)
    opts = CrossEntropyOptions(reduction="none", ignore_index=ignore_index, softcap=softcap,
                               shift=shift, backend=backend)
    return input, linear_weight, linear_bias, opts


def fused_head_operands(input, linear_weight, target, *, linear_bias=None, temperature=1.0,
                        softcap=None, ignore_index=-100, shift=False, backend="auto",
                        group_rows=1):
    """For a loss fused into the head (``fusedloss.post_training``): ``linear_log_probs``'
    checks, then (input (N, D), weight, target (N,) shifted as ``shift`` asks, bias) when the
    Triton backend computes it with gradients, else None (the loss then runs on
    ``linear_log_probs``). None too where the loss's smallest chunk, ``group_rows`` rows (a
    sequence, a pair of them), holds more logits than ``Tuning.lm_head_chunk_bytes``: the
    fused path's memory stays bounded."""
    input, linear_weight, linear_bias, opts = _operands(
        input, linear_weight, target, linear_bias, temperature, softcap, ignore_index, shift,
        backend)
    check_inputs(input, linear_weight, target, linear_bias, None, opts)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
    group_bytes = group_rows * linear_weight.shape[0] * input.element_size()
    if (not wants_grad or resolve_input_backend(backend, input) != "triton"
            or input.numel() == 0 or group_bytes > config.tuning().lm_head_chunk_bytes):
        return None
    return (input.reshape(-1, linear_weight.shape[1]), linear_weight,
            shifted_targets(target, shift, ignore_index), linear_bias)


def _token_shaped(per_token: torch.Tensor, shape: torch.Size, shift: bool) -> torch.Tensor:
    """(N,) → ``shape``, without the shifted-out last position with ``shift``."""
    per_token = per_token.view(shape)
    return per_token[..., :-1] if shift else per_token


@torch.compiler.disable  # collectives and host reads: eager, a graph break under compile
def _vocab_parallel(input, linear_weight, target, linear_bias, opts: CrossEntropyOptions,
                    tempering: tuple[float, bool], shard):
    """(log-probs, entropies or None) (N,) of the whole head from this rank's rows of it,
    ``shard`` = (process group, vocab_start or None), ``tempering`` = (temperature, whether
    the entropy is asked for): this rank's checks, one exchange of facts that checks the ranks
    agree (every rank raises the same error), then ``ops.vocab_parallel``'s Function."""
    group, vocab_start = shard
    temperature, entropy = tempering
    error, facts = None, {}
    try:
        check_inputs(input, linear_weight, target, linear_bias, None, opts)
        if input.dtype == torch.float64:
            raise TypeError("the vocabulary-parallel head takes float32, bfloat16 or float16 "
                            "input, got torch.float64")
        backend = engine.resolve_backend(opts.backend, input.device)
        needs = [t is not None and t.requires_grad for t in (input, linear_weight, linear_bias)]
        facts = {
            "the input dtype": (dtype_code(input.dtype), str(input.dtype)),
            "the hidden size D": (linear_weight.shape[1], str(linear_weight.shape[1])),
            "the number of tokens": (target.numel(), str(target.numel())),
            "the device type": (device_code(input.device), input.device.type),
            "ignore_index": (int(opts.index_to_ignore), str(opts.index_to_ignore)),
            "temperature": (float_code(temperature), str(temperature)),
            "softcap": (float_code(opts.softcap), str(opts.softcap)),
            "shift": (int(bool(opts.shift)), str(opts.shift)),
            "return_entropy": (int(entropy), str(entropy)),
            "backend": (("triton", "torch").index(backend), repr(backend)),
            "whether linear_bias is given": (int(linear_bias is not None),
                                             str(linear_bias is not None)),
            "which inputs require grad (input, linear_weight, linear_bias)": (
                sum(int(x) << i for i, x in enumerate(needs)), str(needs)),
        }
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    ok = error is None
    device = input.device if isinstance(input, torch.Tensor) else torch.device("cpu")
    layout, per_rank = exchange(group, target.numel() if ok else 0,
                                linear_weight.shape[0] if ok else 0, facts, device,
                                error=error, extra=(-1 if vocab_start is None
                                                    else int(vocab_start),))
    starts, v = shard_starts(layout, [row[0] for row in per_rank])
    a = input.reshape(-1, linear_weight.shape[1])
    flat_target = shifted_targets(target, opts.shift, opts.index_to_ignore)
    options = vocab_parallel.LogProbOptions(opts.index_to_ignore, temperature,
                                            None if opts.softcap is None else float(opts.softcap),
                                            entropy)
    return vocab_parallel.VocabParallelLogProbs.apply(
        a, linear_weight, flat_target, linear_bias,
        vocab_parallel.Shard(layout.group, starts[layout.rank], v), options, backend)
