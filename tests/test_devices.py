"""Tensors on a GPU that is not the current one: the losses launch their kernels on the
tensors' device (``ops._common.op_body``), so a call on cuda:1 while cuda:0 is current gives
what the same call gives on cuda:0 — bit for bit, forward and backward. Launched on the current
device instead, the kernels would read cuda:1's memory from cuda:0: wrong values, or an illegal
address that poisons the process. Needs two GPUs; skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

import fusedloss

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _normalized(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1).bfloat16()


def _lm_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=g).bfloat16()
    w = (torch.randn(1000, 64, generator=g) * 0.1).bfloat16()
    target = torch.randint(0, 1000, (300,), generator=g)
    return (x, w, target), lambda x, w, t: fusedloss.linear_cross_entropy(x, w, t)


def _log_probs():
    (x, w, target), _ = _lm_head()
    return (x, w, target), lambda x, w, t: fusedloss.linear_log_probs(x, w, t).sum()


def _pair(loss):
    return ((_normalized(256, 64, 1), _normalized(256, 64, 2)),
            lambda a, b: loss(a, b))


CASES = {
    "linear_cross_entropy": _lm_head,
    "linear_log_probs": _log_probs,
    "clip": lambda: _pair(lambda a, b: fusedloss.clip_loss(a, b, 10.0, backend="triton")),
    "info_nce": lambda: _pair(
        lambda a, b: fusedloss.info_nce_loss(a, b, temperature=0.1, backend="triton")),
    "siglip": lambda: _pair(
        lambda a, b: fusedloss.siglip_loss(a, b, 10.0, -10.0, backend="triton")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_call_on_another_device_equals_the_same_call_on_the_current_one(name):
    inputs, loss_fn = CASES[name]()
    torch.cuda.set_device(0)
    results = {}
    for device in ("cuda:0", "cuda:1", "cuda:1"):  # the second call on cuda:1 may replay
        leaves = [t.to(device) for t in inputs]
        for t in leaves:
            if t.is_floating_point():
                t.requires_grad_()
        loss = loss_fn(*leaves)
        grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])
        assert loss.device == torch.device(device)
        assert torch.cuda.current_device() == 0
        results.setdefault(device, []).append([loss.detach(), *grads])
    for got in results["cuda:1"]:
        for g, w in zip(got, results["cuda:0"][0], strict=True):
            torch.testing.assert_close(g.to("cuda:0"), w, rtol=0, atol=0)
