"""The Hopper (sm90) SigLIP chunk kernel (``core/siglip_sm90.py``) against the cuBLAS and Triton
chunks it replaces there (``Tuning.gluon`` off), and both against float64, through
``fusedloss.siglip_loss``.

Gluon kernels do not run under Triton's interpreter: these tests need an sm90 GPU (H100,
H200) and skip elsewhere. The two paths form the same fp32 logits in another summation order
(the kernel's products against cuBLAS's), so their losses and gradients agree to rounding, not
bit for bit. A counter checks that the Gluon kernel did run.
"""

from __future__ import annotations

import pytest
import torch
from helpers import requires_sm90

import fusedloss
from fusedloss.core import config
from fusedloss.reference import siglip_loss_ref

pytestmark = requires_sm90

DEV = torch.device("cuda")


@pytest.fixture
def chunks(monkeypatch):
    """The row offsets of the chunks the Gluon kernel has computed."""
    from fusedloss.core import siglip_sm90

    calls = []
    original = siglip_sm90.Chunks.__call__
    monkeypatch.setattr(siglip_sm90.Chunks, "__call__",
                        lambda self, a, row0: calls.append(row0) or original(self, a, row0))
    return calls


def _features(n, d, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, device=DEV, generator=g),
                                         dim=1).to(dtype)


def _run(tune, gluon, image, text, scale, bias):
    tune(gluon=gluon)
    leaves = [t.detach().clone().requires_grad_() for t in (image, text, scale, bias)]
    loss = fusedloss.siglip_loss(*leaves, backend="triton")
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("n, d, dtype, chunk_rows, s, paired", [
    (300, 64, torch.bfloat16, None, 10.0, False),
    (1000, 512, torch.bfloat16, None, 10.0, False),
    (777, 128, torch.float16, None, 10.0, False),
    (1000, 256, torch.bfloat16, 128, 10.0, False),   # eight chunks, the last one short
    (4095, 512, torch.bfloat16, 1024, 10.0, False),  # rows and columns off the tiles
    (2048, 256, torch.bfloat16, None, 100.0, True),  # trained-like: matched pairs, scale 100
    (1000, 768, torch.float16, None, 10.0, False),    # A streamed through the ring
    (1000, 1024, torch.bfloat16, 256, 10.0, False),
])
def test_matches_the_cublas_chunks_and_float64(tune, chunks, n, d, dtype, chunk_rows, s, paired):
    image, text = _features(n, d, dtype, 0), _features(n, d, dtype, 1)
    if paired:  # each text near its image (cosine ≈ 0.9): large positive logits on the diagonal
        text = torch.nn.functional.normalize(image.float() + 0.5 * text.float(), dim=1).to(dtype)
    scale = torch.tensor(s, device=DEV)
    bias = torch.tensor(-10.0, device=DEV)
    if chunk_rows is not None:
        width = -(-n // 128) * 128
        tune(lm_head_chunk_bytes=chunk_rows * width * dtype.itemsize)
    ours, ours_grads = _run(tune, True, image, text, scale, bias)
    assert chunks and chunks[0] == 0, "the Gluon kernel did not run"
    if chunk_rows is not None:
        assert chunks == list(range(0, n, chunk_rows))
    cublas, cublas_grads = _run(tune, False, image, text, scale, bias)
    torch.testing.assert_close(ours, cublas, rtol=1e-5, atol=0)
    leaves = [t.double().requires_grad_() for t in (image, text, scale, bias)]
    ref = siglip_loss_ref(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves)
    assert abs(ours.item() - ref.item()) <= 1e-4 * abs(ref.item())
    for name, g, c, r in zip(("image", "text", "scale", "bias"), ours_grads, cublas_grads,
                             ref_grads, strict=True):
        assert torch.isfinite(g).all(), name
        # the same bar as the chunks it replaces, against float64
        assert _rel(g, r) <= 1.5 * _rel(c, r) + 1e-6, (name, _rel(g, r), _rel(c, r))


def test_no_grad_and_partial_grads(tune, chunks):
    """A call without gradients gives the same loss; a call for the text features alone gives
    the text features' gradient of the full call."""
    image, text = _features(512, 128, torch.bfloat16, 2), _features(512, 128, torch.bfloat16, 3)
    scale, bias = torch.tensor(10.0, device=DEV), torch.tensor(-10.0, device=DEV)
    loss, grads = _run(tune, True, image, text, scale, bias)
    with torch.no_grad():
        assert torch.equal(fusedloss.siglip_loss(image, text, scale, bias, backend="triton"), loss)
    t = text.clone().requires_grad_()
    (only,) = torch.autograd.grad(fusedloss.siglip_loss(image, t, scale, bias, backend="triton"),
                                  (t,))
    assert torch.equal(only, grads[1])
    assert chunks


def test_nan_in_gives_nan_out(tune, chunks):
    image, text = _features(256, 64, torch.bfloat16, 4), _features(256, 64, torch.bfloat16, 5)
    image[3, 7] = float("nan")
    loss, grads = _run(tune, True, image, text, torch.tensor(10.0, device=DEV),
                       torch.tensor(-10.0, device=DEV))
    assert chunks
    assert torch.isnan(loss)
    assert torch.isnan(grads[2])


def test_sums_are_linear_in_the_batch():
    """The per-(row block, split) sums take 12·(n / 64)·splits bytes, splits at most one per
    SM: never a (row blocks × column tiles) array, which grows with b²."""
    from fusedloss.core import siglip_sm90

    n, d = 16384, 64
    b = _features(n, d, torch.bfloat16, 6)
    one = torch.ones((), device=DEV)
    g = torch.empty((1024, n), dtype=torch.bfloat16, device=DEV)
    kernel = siglip_sm90.Chunks(b, one, one, 1.0, g, n, 1024)
    assert kernel._sums.shape[:2] == (3, n // siglip_sm90.BLOCK_M)
    assert kernel._sums.shape[2] <= config.sm_count(DEV) < n // siglip_sm90.BLOCK_N


def test_blocks_without_positives_into_an_accumulator(tune, chunks):
    """The ring's calls (``distributed.ring.siglip``): another rank's block (no positives) and
    dA added into an fp32 accumulator, the Gluon kernel against the cuBLAS chunks."""
    from fusedloss.core import chunked_contrastive, engine

    n, m, d = 700, 1000, 128
    image, text = _features(n, d, torch.bfloat16, 7), _features(m, d, torch.bfloat16, 8)
    # β = 0: σ(X) near ½, so that dA stands well above the accumulator's starting 0.25
    scale, bias = torch.tensor(10.0, device=DEV), torch.tensor(0.0, device=DEV)
    tune(lm_head_chunk_bytes=256 * 1024 * 2)  # G of 256 rows × 1024 padded columns: 3 chunks
    results = {}
    for gluon in (True, False):
        tune(gluon=gluon)
        acc = torch.full((n, d), 0.25, device=DEV)
        results[gluon] = chunked_contrastive.siglip_loss_and_grads(
            image, text, scale, bias, 1.0 / n, engine.Needs(True, True, True, True),
            positives=False, acc_a=acc)
        assert results[gluon][1] is acc
    assert chunks == [0, 256, 512], "the Gluon kernel did not run over three chunks"
    (loss, grad_a, *rest), (loss_c, grad_a_c, *rest_c) = results[True], results[False]
    torch.testing.assert_close(loss, loss_c, rtol=1e-5, atol=0)
    for ours, cublas in zip((grad_a - 0.25, *rest), (grad_a_c - 0.25, *rest_c), strict=True):
        assert _rel(ours, cublas) <= 1e-2, _rel(ours, cublas)
    # no positives: every logit a negative, so the bias's gradient is Σ σ(X) / n > 0
    assert rest[1] > 0


@pytest.mark.parametrize("positives", [True, False])
def test_chunks_of_rows_and_columns(tune, chunks, monkeypatch, positives):
    """A wide batch's chunks of rows and columns (``chunked_contrastive.chunk_shape``; from
    b = 262144 at the default budget), here at small sizes with smaller thresholds: 320 rows ×
    256 columns a chunk, the last ones short, N ≠ M; with positives (dA summed over the column
    chunks in fp32) and without, dA added into an fp32 accumulator (the ring's blocks). Against
    float64, at the cuBLAS chunks' bar."""
    from fusedloss.core import chunked_contrastive, engine

    monkeypatch.setattr(chunked_contrastive, "COLUMN_CHUNK_BELOW", 256)
    monkeypatch.setattr(chunked_contrastive, "COLUMN_CHUNK_ROWS", 320)
    n, m, d = 1000, 900, 128
    image, text = _features(n, d, torch.bfloat16, 9), _features(m, d, torch.bfloat16, 10)
    scale, bias = torch.tensor(10.0, device=DEV), torch.tensor(-5.0, device=DEV)
    tune(lm_head_chunk_bytes=320 * 256 * 2)  # whole rows: 85 (< 256) of 960 padded columns
    assert chunked_contrastive.chunk_shape(n, m, 2) == (320, 256)
    leaves = [t.double().requires_grad_() for t in (image, text, scale, bias)]
    ref = siglip_loss_ref(*leaves, positives=positives)
    ref_grads = torch.autograd.grad(ref, leaves)
    results = {}
    for gluon in (True, False):
        tune(gluon=gluon)
        acc = None if positives else torch.full((n, d), 0.25, device=DEV)
        loss, grad_a, *rest = chunked_contrastive.siglip_loss_and_grads(
            image, text, scale, bias, 1.0 / n, engine.Needs(True, True, True, True),
            positives=positives, acc_a=acc)
        results[gluon] = (loss, grad_a if positives else grad_a - 0.25, *rest)
    assert chunks == [r0 for r0 in range(0, n, 320) for _ in range(4)], chunks
    assert abs(results[True][0].item() - ref.item()) <= 1e-5 * abs(ref.item())
    for name, ours, cublas, want in zip(("image", "text", "bias", "scale"), results[True][1:],
                                        results[False][1:], (*ref_grads[:2], ref_grads[3],
                                                             ref_grads[2]), strict=True):
        assert _rel(ours, want) <= 1.5 * _rel(cublas, want) + 1e-6, (name, _rel(ours, want),
                                                                    _rel(cublas, want))
