"""The contrastive forwards never wait for the GPU (docs/design.md, "Host synchronization").

A host sync in the middle of a call leaves the GPU idle while the host issues the rest of the
call's small operations one by one; at b = 16384 that cost more than the kernels. CUDA only:
``torch.cuda.set_sync_debug_mode("error")`` raises on any operation that waits for the device,
including a copy from pageable host memory such as ``torch.tensor(x, device="cuda")``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import requires_cuda

import fusedloss

CALLS = {
    "clip": lambda x, y: fusedloss.clip_loss(x, y, 1 / 0.07),
    "clip-tensor-scale": lambda x, y: fusedloss.clip_loss(
        x, y, torch.full((), 14.0, device=x.device, requires_grad=True)),
    "info-nce": lambda x, y: fusedloss.info_nce_loss(x, y, temperature=0.1),
    "nt-xent": lambda x, y: fusedloss.nt_xent_loss(torch.cat([x, y]), temperature=0.5),
    "siglip": lambda x, y: fusedloss.siglip_loss(x, y, 10.0, -10.0),
}


@requires_cuda
@pytest.mark.parametrize("name", list(CALLS))
def test_forward_queues_without_waiting(name):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.nn.functional.normalize(torch.randn(300, 64, device="cuda", generator=gen),
                                          dim=1).bfloat16().requires_grad_() for _ in range(2))
    CALLS[name](x, y)  # compile first: Triton's first launch may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = CALLS[name](x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()  # the backward syncs once, by design
    assert torch.isfinite(loss)
