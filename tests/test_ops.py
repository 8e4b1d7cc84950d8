"""The custom ops (fusedloss/ops) pass ``torch.library.opcheck``: schema (no mutation, no
aliasing), autograd registration, fake implementations that agree with the real ones in shape,
dtype, device and strides, and AOT dispatch with dynamic shapes, forward and backward.

Both of the engine's backends: the torch path, and the Triton kernels where they run (the CPU
through Triton's interpreter, at tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from helpers import can_run_triton

import fusedloss  # noqa: F401  (registers the ops)
from fusedloss.ops import contrastive as contrastive_ops
from fusedloss.ops import cross_entropy as ce_ops

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        not can_run_triton(), reason="needs CUDA or TRITON_INTERPRET=1")),
]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _leaf(*shape, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).to(_device()).requires_grad_()


# (id, options): the op's keyword arguments after the tensors
CE_CASES = [
    ("plain", dict()),
    ("smoothing-zloss", dict(label_smoothing=0.2, z_loss=1e-3)),
    ("softcap-bias-weights", dict(softcap=5.0, bias=True, class_weight=True)),
    ("ignored-rows-order", dict(ignored=True, vocab_order=True)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [pytest.param(o, id=i) for i, o in CE_CASES])
def test_linear_cross_entropy_opcheck(backend, case):
    n, v, d = 11, 21, 16
    device = _device()
    a, b = _leaf(n, d), _leaf(v, d, scale=0.5)
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)).to(device)
    if case.get("ignored"):
        target[[2, 5]] = -100
    bias = _leaf(v, scale=0.1) if case.get("bias") else None
    class_weight = torch.rand(v, generator=torch.Generator().manual_seed(2)).to(device) + 0.5 \
        if case.get("class_weight") else None
    order = torch.randperm(v, generator=torch.Generator().manual_seed(3)).to(device) \
        if case.get("vocab_order") else None
    eps = 2.0**-12 if backend == "triton" else None
    args = (a, b, target, bias, class_weight, order, -100, case.get("label_smoothing", 0.0),
            case.get("softcap"), case.get("z_loss", 0.0), eps, backend, True)
    torch.library.opcheck(ce_ops.forward_op, args)

    # The backward op on what the forward saved, with the upstream gradients of both outputs,
    # then of the loss alone (autograd passes None for an output without a gradient).
    _, _, *saved = ce_ops.forward_op(*args)
    bias = bias.detach() if bias is not None else None
    for grads in ((torch.rand(n, device=device), torch.rand(n, device=device)),
                  (torch.rand(n, device=device), None)):
        backward_args = (*grads, a.detach(), b.detach(), bias, class_weight, order, *saved,
                         *args[7:12], True, True, bias is not None)
        torch.library.opcheck(ce_ops.backward_op, backward_args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(contrastive_ops.KINDS))
def test_contrastive_opcheck(backend, kind):
    n, d = 9, 16
    device = _device()
    a = _leaf(n, d)
    b = a if kind == "nt_xent" else _leaf(n + (4 if kind == "info_nce" else 0), d)
    scale = torch.full((), 3.0, device=device, requires_grad=True)
    bias = torch.full((), -2.0, device=device, requires_grad=True) if kind == "siglip" else None
    target = torch.arange(n, device=device)
    if kind in ("nt_xent", "info_nce_no_diag"):
        target = (target + 1) % n  # any pairing works for the op (the diagonal is left out)
    eps = 2.0**-12 if backend == "triton" and kind != "siglip" else None
    args = (a, b, scale, bias, target, kind, eps, backend, True, kind == "info_nce")
    torch.library.opcheck(contrastive_ops.forward_op, args)

    _, *saved = contrastive_ops.forward_op(*args)
    detached = [t.detach() if t is not None else None for t in (a, b, scale, bias)]
    backward_args = (torch.rand(n, device=device), *detached, target, *saved, kind, eps,
                     backend, kind == "info_nce", True, True, True, bias is not None)
    torch.library.opcheck(contrastive_ops.backward_op, backward_args)
