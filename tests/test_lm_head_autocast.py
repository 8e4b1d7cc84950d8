"""The LM head under ``torch.autocast``: the operands of the product are cast to the autocast
dtype (as ``F.linear`` casts them), the statistics and the loss stay fp32 (as
``F.cross_entropy`` computes them), eagerly, compiled, in the module and over a process group.

"The same as the cast call" is the property: under autocast, fp32 operands give exactly what
the head gives outside autocast on the operands cast to the autocast dtype — which fails if an
operand is not cast, or if the op's own fp32 work (the torch backend's products, the backward's
matmuls) were rounded by autocast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import DEVICE, assert_close_to_ref, can_run_triton
from workers import all_ok

import fusedloss

AUTOCAST = torch.bfloat16
BACKENDS = ("torch", "triton") if can_run_triton() else ("torch",)


def _problem(n=12, v=37, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) / d**0.5 * 3
    bias = torch.randn(v, generator=g)
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = -100
    return hidden, weight, bias, target


def _leaves(*tensors, dtype=None):
    return [t.to(DEVICE, dtype or t.dtype).requires_grad_() for t in tensors]


def _grads(loss, leaves):
    upstream = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view(loss.shape)
    return torch.autograd.grad((loss * upstream).sum(), leaves)


OPTIONS = [
    pytest.param(dict(), id="plain"),
    pytest.param(dict(reduction="none", label_smoothing=0.1, z_loss=1e-3), id="smoothing-z"),
    pytest.param(dict(softcap=5.0, reduction="sum"), id="softcap"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS)
def test_autocast_equals_the_cast_call(backend, options):
    hidden, weight, bias, target = _problem()
    y = target.to(DEVICE)
    leaves = _leaves(hidden, weight, bias)
    with torch.autocast(DEVICE, dtype=AUTOCAST):
        loss = fusedloss.linear_cross_entropy(leaves[0], leaves[1], y, linear_bias=leaves[2],
                                              backend=backend, **options)
        grads = _grads(loss, leaves)  # the backward inside the region: autocast must not reach it
    assert loss.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.float32] * 3  # the fp32 leaves' own dtype

    cast = _leaves(hidden, weight, bias, dtype=AUTOCAST)
    want = fusedloss.linear_cross_entropy(cast[0], cast[1], y, linear_bias=cast[2],
                                          backend=backend, **options)
    want_grads = _grads(want, cast)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)


def test_autocast_bf16_hidden_with_fp32_weight():
    """What mixed precision hands an LM head: bf16 hidden states, the fp32 weight. Under
    autocast it runs (as PyTorch's function does), at least as accurate as PyTorch's own
    autocast result against float64; outside autocast the mismatch is an error naming the
    argument."""
    hidden, weight, _, target = _problem(n=64, v=301, d=32)
    h, w = hidden.to(DEVICE, AUTOCAST), weight.to(DEVICE)
    y = target.to(DEVICE)
    with torch.autocast(DEVICE, dtype=AUTOCAST):
        ours = fusedloss.linear_cross_entropy(h, w, y, reduction="none")
        theirs = F.cross_entropy(F.linear(h, w), y, reduction="none")
    assert ours.dtype == theirs.dtype == torch.float32
    exact = F.cross_entropy(h.double() @ w.to(AUTOCAST).double().T, y, reduction="none")
    assert_close_to_ref(ours, theirs, exact, name="loss under autocast")
    with pytest.raises(TypeError, match="linear_weight"):
        fusedloss.linear_cross_entropy(h, w, y)


def test_autocast_leaves_float64_alone():
    """Autocast does not cast float64 (PyTorch's rule): the head computes it in float64."""
    hidden, weight, _, target = _problem()
    with torch.autocast(DEVICE, dtype=AUTOCAST):
        loss = fusedloss.linear_cross_entropy(hidden.double().to(DEVICE),
                                              weight.double().to(DEVICE), target.to(DEVICE))
    assert loss.dtype == torch.float64


def test_autocast_under_compile_and_in_the_module():
    hidden, weight, bias, target = _problem()
    y = target.to(DEVICE)
    module = fusedloss.LinearCrossEntropyLoss(label_smoothing=0.1, return_lse=True)
    compiled = torch.compile(fusedloss.linear_cross_entropy, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (module, lambda h, w, t, linear_bias: compiled(h, w, t, linear_bias=linear_bias,
                                                              label_smoothing=0.1,
                                                              return_lse=True)):
        leaves = _leaves(hidden, weight, bias)
        with torch.autocast(DEVICE, dtype=AUTOCAST):
            loss, lse = fn(leaves[0], leaves[1], y, linear_bias=leaves[2])
        assert loss.dtype == lse.dtype == torch.float32
        results.append((loss, lse, _grads(loss + 0.1 * lse.sum(), leaves)))
    cast = _leaves(hidden, weight, bias, dtype=AUTOCAST)
    loss, lse = fusedloss.linear_cross_entropy(cast[0], cast[1], y, linear_bias=cast[2],
                                               label_smoothing=0.1, return_lse=True)
    want_grads = _grads(loss + 0.1 * lse.sum(), cast)
    for got_loss, got_lse, got_grads in results:
        torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
        torch.testing.assert_close(got_lse, lse, rtol=0, atol=0)
        for got, expected in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected.float(), rtol=0, atol=0)


def test_autocast_with_class_probabilities():
    """Soft targets stay in their dtype (PyTorch's cross_entropy runs in fp32 under autocast)."""
    hidden, weight, _, _ = _problem()
    p = torch.softmax(torch.randn(hidden.shape[0], weight.shape[0]), dim=-1).to(DEVICE)
    h, w = hidden.to(DEVICE), weight.to(DEVICE)
    with torch.autocast(DEVICE, dtype=AUTOCAST):
        loss = fusedloss.linear_cross_entropy(h, w, p)
    want = fusedloss.linear_cross_entropy(h.to(AUTOCAST), w.to(AUTOCAST), p)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)


def _vocab_parallel_under_autocast(rank, world):
    hidden, weight, bias, target = _problem()
    lo, hi = rank * 20, min((rank + 1) * 20, weight.shape[0])
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight[lo:hi], bias[lo:hi]))
    with torch.autocast("cpu", dtype=AUTOCAST):
        loss = fusedloss.linear_cross_entropy(h, w, target, linear_bias=b,
                                              process_group=dist.group.WORLD)
        loss.backward()
    return loss.detach(), h.grad, w.grad


def test_vocab_parallel_head_under_autocast(workers):
    results = all_ok(workers(2).run(_vocab_parallel_under_autocast))
    hidden, weight, bias, target = _problem()
    h, w, b = (t.to(AUTOCAST).requires_grad_() for t in (hidden, weight, bias))
    loss = fusedloss.linear_cross_entropy(h, w, target, linear_bias=b)
    loss.backward()
    for rank, (r_loss, r_dh, r_dw) in enumerate(results):
        lo, hi = rank * 20, min((rank + 1) * 20, weight.shape[0])
        assert r_loss.dtype == torch.float32 and r_dh.dtype == torch.float32
        torch.testing.assert_close(r_loss, loss.detach(), rtol=1e-5, atol=1e-5)
        # bf16 gradients on both sides, summed over the shards in another order
        torch.testing.assert_close(r_dh, h.grad.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r_dw, w.grad[lo:hi].float(), rtol=2e-2, atol=2e-2)
