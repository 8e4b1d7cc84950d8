"""The losses never wait for the GPU with their default options: the contrastive losses, the
LM head's training path and its engine path (docs/design.md, "Host synchronization").

A host sync in the middle of a call leaves the GPU idle while the host issues the rest of the
call's small operations one by one; at b = 16384 that cost more than the kernels. CUDA only:
``torch.cuda.set_sync_debug_mode("error")`` raises on any operation that waits for the device,
including a copy from pageable host memory such as ``torch.tensor(x, device="cuda")``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, can_run_triton, requires_cuda, requires_triton

import fusedloss

CALLS = {
    "clip": lambda x, y: fusedloss.clip_loss(x, y, 1 / 0.07),
    "clip-tensor-scale": lambda x, y: fusedloss.clip_loss(
        x, y, torch.full((), 14.0, device=x.device, requires_grad=True)),
    "info-nce": lambda x, y: fusedloss.info_nce_loss(x, y, temperature=0.1),
    "nt-xent": lambda x, y: fusedloss.nt_xent_loss(torch.cat([x, y]), temperature=0.5),
    "siglip": lambda x, y: fusedloss.siglip_loss(x, y, 10.0, -10.0),
    # at these sizes "auto" takes the materialized path; the tiled kernels too:
    "clip-tiled": lambda x, y: fusedloss.clip_loss(x, y, 1 / 0.07, backend="triton"),
    "info-nce-tiled": lambda x, y: fusedloss.info_nce_loss(x, y, temperature=0.1,
                                                           backend="triton"),
    "nt-xent-tiled": lambda x, y: fusedloss.nt_xent_loss(torch.cat([x, y]), temperature=0.5,
                                                         backend="triton"),
    "siglip-tiled": lambda x, y: fusedloss.siglip_loss(x, y, 10.0, -10.0, backend="triton"),
}


def _features(device="cuda", rows=300, width=64, dtype=torch.bfloat16):
    """Two batches of unit feature vectors that require gradients."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.nn.functional.normalize(torch.randn(rows, width, device=device, generator=gen),
                                          dim=1).to(dtype).requires_grad_() for _ in range(2)]


@requires_cuda
@pytest.mark.parametrize("name", list(CALLS))
def test_forward_queues_without_waiting(name):
    x, y = _features()
    CALLS[name](x, y)  # compile first: Triton's first launch may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = CALLS[name](x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()
    assert torch.isfinite(loss)


@requires_cuda
@pytest.mark.parametrize("name", list(CALLS))
def test_backward_queues_without_waiting(name):
    x, y = _features()
    CALLS[name](x, y).backward()  # compile first
    torch.cuda.synchronize()
    loss = CALLS[name](x, y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all()


READ_BACKS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@requires_triton
@pytest.mark.parametrize("check_values", [False, True])
def test_lm_head_training_path_reads_nothing_back(monkeypatch, tune, check_values):
    """On any device: the training path's forward and backward never turn a tensor into a
    host value (the calls that would wait for a GPU), unless ``Tuning.check_values`` asks for
    the target check."""
    tune(check_values=check_values)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 16, generator=g).to(DEVICE).requires_grad_()
    w = torch.randn(100, 16, generator=g).to(DEVICE).requires_grad_()
    target = torch.randint(0, 100, (30,), generator=g).to(DEVICE)
    target[::7] = -100
    weight = torch.rand(100, generator=g).to(DEVICE)
    reads = []
    for name in READ_BACKS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, _n=name, **k: (
            reads.append(_n), _f(self, *a, **k))[1])
    loss = fusedloss.linear_cross_entropy(x, w, target, weight=weight, label_smoothing=0.1,
                                          backend="triton")
    loss.backward()
    monkeypatch.undo()
    assert (reads != []) == check_values, reads
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def _lm_head_problem(device, n=30, v=100, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) / d**0.5).to(device, dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g).to(device)
    target[::7] = -100
    return x, w, target


# The calls that run on the engine (not the training path), with their default options.
ENGINE_CALLS = {
    "per-token": lambda x, w, y, backend="triton": fusedloss.linear_cross_entropy(
        x, w, y, reduction="none", backend=backend).sum(),
    "return-lse": lambda x, w, y, backend="triton": (lambda loss, lse: loss + lse.sum())(
        *fusedloss.linear_cross_entropy(x, w, y, return_lse=True, label_smoothing=0.1,
                                        backend=backend)),
    "vocab-order": lambda x, w, y, backend="triton": fusedloss.linear_cross_entropy(
        x, w, y, vocab_order=torch.arange(w.shape[0], device=w.device).flip(0),
        backend=backend),
    "info-nce-labels": lambda x, w, y, backend="triton": fusedloss.info_nce_loss(
        x, w, y.clamp(0, w.shape[0] - 1), temperature=0.1, backend=backend),
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(ENGINE_CALLS))
def test_engine_calls_read_nothing_back(monkeypatch, name, backend):
    """On any device and either backend: the engine's LM head (per-token losses, return_lse,
    an explicit vocab_order) and InfoNCE with labels turn no tensor into a host value,
    forward or backward, ignored tokens included."""
    if backend == "triton" and not can_run_triton():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    x, w, target = _lm_head_problem(DEVICE)
    reads = []
    for method in READ_BACKS:
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _f=original, _n=method, **k: (
            reads.append(_n), _f(self, *a, **k))[1])
    loss = ENGINE_CALLS[name](x, w, target, backend)
    loss.backward()
    monkeypatch.undo()
    assert reads == []
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


@requires_cuda
@pytest.mark.parametrize("name", list(ENGINE_CALLS))
def test_engine_calls_queue_without_waiting(name):
    """The same calls on a GPU under ``torch.cuda.set_sync_debug_mode("error")``, in bf16."""
    x, w, target = _lm_head_problem("cuda", n=300, v=1000, d=64, dtype=torch.bfloat16)
    ENGINE_CALLS[name](x, w, target).backward()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ENGINE_CALLS[name](x, w, target).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(w.grad.float()).all()


@requires_cuda
def test_lm_head_training_step_queues_without_waiting():
    """The LM head's training path (a reduced loss with gradients): its forward and backward
    read nothing back to the host, ignored tokens and class weights included."""
    x, _ = _features(rows=300, width=64)
    w = (torch.randn(1000, 64, device="cuda") / 8).bfloat16().requires_grad_()
    target = torch.randint(0, 1000, (300,), device="cuda")
    target[::7] = -100
    weight = torch.rand(1000, device="cuda")

    def step():
        fusedloss.linear_cross_entropy(x, w, target, weight=weight, label_smoothing=0.1,
                                       backend="triton").backward()

    step()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad.float()).all() and torch.isfinite(w.grad.float()).all()


@requires_cuda
def test_sparse_slabs_wait_once(monkeypatch, tune):
    """FUSEDLOSS_SPARSE_SLABS=1 lets a slab take the sparse path: the live counts are read back,
    by one wait on an event recorded behind them (the first slab's recompute is queued after
    it, so the GPU keeps working), never by a sync of the whole stream."""
    tune(sparse_slabs=True)
    x, y = _features()
    CALLS["clip-tiled"](x, y).backward()
    torch.cuda.synchronize()
    waits = []
    synchronize = torch.cuda.Event.synchronize

    def spy(self):
        waits.append(self)
        return synchronize(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", spy)
    loss = CALLS["clip-tiled"](x, y)
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(waits) == 1
    assert torch.isfinite(x.grad.float()).all()


@pytest.mark.skipif(not can_run_triton(), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("sparse", ["0", "1"])
def test_backward_reads_back_only_for_sparse_slabs(monkeypatch, tune, sparse):
    """The engine's one read-back (the live counts) happens only when sparse slabs may be
    taken: the same check as above, on any machine that runs the kernels (a spy on .tolist)."""
    tune(sparse_slabs=sparse == "1")
    x, y = _features("cuda" if torch.cuda.is_available() else "cpu", 37, 16, torch.float32)
    loss = fusedloss.clip_loss(x, y, 1 / 0.07, backend="triton")
    reads = []
    tolist = torch.Tensor.tolist

    def spy(self):
        reads.append(self.shape)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    loss.backward()
    assert len(reads) == (1 if sparse == "1" else 0), reads
    assert torch.isfinite(x.grad).all()
