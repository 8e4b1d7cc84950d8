"""The Hopper (sm90) gradient recompute (``core/lse_backward_sm90.py``) against the Triton
kernel it replaces there (``Tuning.gluon_recompute_tiles`` out of reach), through the public
losses.

Gluon kernels do not run under Triton's interpreter: these tests need an sm90 GPU (H100,
H200) and skip elsewhere. Each case runs the same loss twice, the recompute's dX tiles from
the Gluon kernel and from the Triton one, and compares the loss and every gradient (the dX
tiles are formed by the same arithmetic, so the gradients agree to the last bits; the logit
scale's gradient sums the tiles in another order). A counter checks that the Gluon kernel did
run. Cases above D = 512 take the kernel with A streamed through the ring (``STREAM_A``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import requires_sm90

import fusedloss

pytestmark = requires_sm90

DEV = torch.device("cuda")


@pytest.fixture
def use_gluon(tune):
    """``use_gluon(on)``: the engine's dense slabs through the Gluon recompute whatever their
    size, or never."""
    return lambda on: tune(gluon_recompute_tiles=0 if on else 2**62)


@pytest.fixture
def launches(monkeypatch):
    """How many slabs the Gluon recompute has computed."""
    from fusedloss.core import lse_backward_sm90

    calls = []
    original = lse_backward_sm90.Recompute.__call__
    monkeypatch.setattr(lse_backward_sm90.Recompute, "__call__",
                        lambda self, *args: calls.append(args) or original(self, *args))
    return calls


def _features(n, d, dtype, seed, direction=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, d, device=DEV, generator=g)
    if direction is not None:
        x = x * 0.05 + direction
    return torch.nn.functional.normalize(x, dim=1).to(dtype)


def _grads(use_gluon, gluon, loss_fn, *leaves):
    use_gluon(gluon)
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    loss = loss_fn(*leaves)
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _assert_same(use_gluon, launches, loss_fn, *leaves, scale_index=None):
    loss, grads = _grads(use_gluon, True, loss_fn, *leaves)
    assert launches, "the Gluon recompute did not run"
    ref_loss, ref_grads = _grads(use_gluon, False, loss_fn, *leaves)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for i, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        if i == scale_index:  # Σ dX·raw per tile, reduced in another order
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        else:
            # the same dX tiles into the same cuBLAS products: equal, bar an FMA contracted
            # differently in a tile (one bf16 ulp of a few entries)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-6)
            assert (got == want).float().mean() > 0.999


CLIP_CASES = [
    # b, d, dtype, scale, filter_eps
    (333, 64, torch.bfloat16, 14.3, None),
    (1000, 128, torch.bfloat16, 30.0, "auto"),
    (200, 448, torch.float16, 50.0, None),
    (2112, 512, torch.bfloat16, 100.0, "auto"),
    (4096, 256, torch.bfloat16, 20.0, None),
    # A streamed through the ring
    (333, 768, torch.float16, 14.3, "auto"),
    (2112, 1024, torch.bfloat16, 100.0, None),
]


@pytest.mark.parametrize("case", CLIP_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}".replace(
    "torch.", ""))
def test_clip_gradients_match_the_triton_kernel(use_gluon, launches, case):
    b, d, dtype, scale, filter_eps = case
    img, txt = _features(b, d, dtype, b), _features(b, d, dtype, b + 1)
    logit_scale = torch.tensor(scale, device=DEV)
    _assert_same(use_gluon, launches, lambda x, y, s: fusedloss.clip_loss(
        x, y, s, filter_eps=filter_eps, backend="triton"), img, txt, logit_scale, scale_index=2)


def test_clip_wide_tiles_take_the_exact_column_terms(use_gluon, launches):
    """Texts of two opposite directions at scale 100: columns whose max lies 200 below the
    rows' (the per-entry form of Q, beside tiles of the factored one)."""
    d = 256
    u = torch.nn.functional.normalize(torch.randn(d, device=DEV), dim=0)
    img = _features(640, d, torch.bfloat16, 1, direction=u)
    txt = torch.cat([_features(320, d, torch.bfloat16, 2, direction=u),
                     _features(320, d, torch.bfloat16, 3, direction=-u)])
    logit_scale = torch.tensor(100.0, device=DEV)
    _assert_same(use_gluon, launches, lambda x, y, s: fusedloss.clip_loss(
        x, y, s, filter_eps=None, backend="triton"), img, txt, logit_scale, scale_index=2)


@pytest.mark.parametrize("m", [1000, 3000])
def test_info_nce_with_a_queue_matches_the_triton_kernel(use_gluon, launches, m):
    """Row statistics only (no column terms), M ≠ N, labels, a learnable temperature."""
    q, k = _features(700, 128, torch.bfloat16, 5), _features(m, 128, torch.bfloat16, 6)
    labels = torch.randint(0, m, (700,), device=DEV)
    tau = torch.tensor(0.05, device=DEV)
    _assert_same(use_gluon, launches, lambda x, y, t: fusedloss.info_nce_loss(
        x, y, labels, temperature=t, filter_eps=None, backend="triton"), q, k, tau,
        scale_index=2)


def test_nt_xent_masks_the_self_similarities(use_gluon, launches):
    """NT-Xent: A and B the same rows, the diagonal out of every softmax."""
    x = _features(2 * 333, 256, torch.bfloat16, 10)
    tau = torch.tensor(0.2, device=DEV)
    _assert_same(use_gluon, launches, lambda f, t: fusedloss.nt_xent_loss(
        f, temperature=t, filter_eps=None, backend="triton"), x, tau, scale_index=1)


def test_lm_head_with_bias_ignored_rows_and_smoothing(use_gluon, launches):
    """A narrow LM head per token (the core's backward; a reduced bf16 loss takes the training
    path): bias, ignored targets and label smoothing (the rank-1 term outside the tiles),
    unfiltered (dense slabs)."""
    n, d, v = 777, 256, 5000
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(n, d, device=DEV, generator=g).bfloat16()
    w = (torch.randn(v, d, device=DEV, generator=g) / d**0.5).bfloat16()
    bias = torch.randn(v, device=DEV, generator=g).bfloat16()
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    y[::7] = -100
    upstream = torch.rand(n, device=DEV, generator=g)  # per token: the core's backward
    _assert_same(use_gluon, launches, lambda a, b, c: (upstream * fusedloss.linear_cross_entropy(
        a, b, y, linear_bias=c, label_smoothing=0.1, filter_eps=None, backend="triton",
        reduction="none")).sum(), x, w, bias)


def test_nan_features_give_nan_gradients(use_gluon, launches):
    img, txt = _features(300, 128, torch.bfloat16, 8), _features(300, 128, torch.bfloat16, 9)
    img[5, 3] = float("nan")
    use_gluon(True)
    img.requires_grad_()
    loss = fusedloss.clip_loss(img, txt, 20.0, filter_eps=None, backend="triton")
    (grad,) = torch.autograd.grad(loss, img)
    assert launches and grad.isnan().any()


@pytest.mark.parametrize("why", ["softcap", "fp32", "wide", "sparse", "off"])
def test_other_calls_keep_the_triton_kernel(tune, use_gluon, launches, why):
    d = 1088 if why == "wide" else 256
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    x = _features(300, d, dtype, 3).requires_grad_()
    w = _features(1000, d, dtype, 4)
    y = torch.randint(0, 1000, (300,), device=DEV)
    use_gluon(why != "off")
    tune(sparse_slabs=why == "sparse")
    loss = fusedloss.linear_cross_entropy(
        x, w, y, softcap=30.0 if why == "softcap" else None, backend="triton",
        filter_eps=1e-6 if why == "sparse" else None, reduction="none")
    loss.sum().backward()
    assert not launches
