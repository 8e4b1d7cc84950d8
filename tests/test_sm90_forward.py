"""The Hopper (sm90) forward (``core/lse_forward_sm90.py``), with column statistics and without,
against the Triton kernel it replaces there and against float64.

Gluon kernels do not run under Triton's interpreter: these tests need an sm90 GPU (H100,
H200) and skip elsewhere. On such a GPU every contrastive test of a softmax loss runs through
this kernel as well; here it is compared with the Triton kernel (``Tuning.gluon`` off) on odd
shapes, both paths of its column sums (one reference per tile, and each column's own max on
wide tiles), the per-tile records of both filtering rules (the row records merged into the
forward's 128-row tiles without column statistics), the diagonal mask, and NaN inputs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import requires_sm90

from fusedloss.core import config, engine

pytestmark = requires_sm90

DEV = torch.device("cuda")


def _features(n, d, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, d, device=DEV, generator=g)
    return torch.nn.functional.normalize(x, dim=1).to(dtype)


def _stats(a, b, scale, bias=None, n_valid=None, record=True, col_stats=True, diag=False):
    n = a.shape[0]
    n_valid = n if n_valid is None else n_valid
    target = (torch.arange(n, device=DEV) + (n // 2 if diag else 0)) % b.shape[0]
    rows = engine.Rows(index=torch.arange(n, device=DEV),
                       n_valid=torch.tensor(n_valid, device=DEV),
                       target=target, identity=True, all_valid=n_valid == n)
    logits = engine.Logits(scale=torch.tensor(scale, device=DEV), bias=bias, diag_mask=diag)
    return engine.row_stats(a, b, logits, rows,
                            wants=engine.Wants(col_stats=col_stats, record_tiles=record))


def _both(tune, *args, **kw):
    tune(gluon=True)
    hopper = _stats(*args, **kw)
    tune(gluon=False)
    triton = _stats(*args, **kw)
    tune(gluon=True)
    return hopper, triton


CASES = [
    # n, v, d, n_valid, bias, dtype, scale, identical features (wide diagonal tiles)
    (333, 517, 64, 333, False, torch.bfloat16, 14.3, False),
    (1000, 700, 128, 931, True, torch.bfloat16, 30.0, False),
    (200, 300, 448, 190, True, torch.bfloat16, 50.0, False),
    (2112, 1000, 512, 2112, False, torch.float16, 20.0, False),
    (2048, 2048, 256, 2048, False, torch.bfloat16, 100.0, True),
    (2048, 2048, 512, 2000, True, torch.bfloat16, 100.0, True),
    # wider than two resident A blocks: A streamed through the ring
    (333, 517, 768, 333, True, torch.float16, 14.3, False),
    (2048, 2048, 1024, 2000, False, torch.bfloat16, 100.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}")
def test_matches_triton_kernel_and_float64(tune, case):
    n, v, d, n_valid, with_bias, dtype, scale, same = case
    a = _features(n, d, dtype, n)
    b = a.clone() if same else _features(v, d, dtype, v + 1)
    bias = torch.randn(v, device=DEV) if with_bias else None
    hopper, triton = _both(tune, a, b, scale, bias, n_valid)
    assert (hopper.block_m, hopper.block_n) == (64, 128)
    assert (triton.block_m, triton.block_n) == (128, 128)

    x = scale * (a[:n_valid].double() @ b.double().T)
    if bias is not None:
        x = x + bias.double()
    for got, ref_got, ref in ((hopper.lse[:n_valid], triton.lse[:n_valid], x.logsumexp(1)),
                              (hopper.col_lse, triton.col_lse, x.logsumexp(0))):
        err, ref_err = (got.double() - ref).abs().max(), (ref_got.double() - ref).abs().max()
        assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)
    # The same rounded logits: row maxima and target logits agree bit for bit (a confident
    # row's loss, lse - target, is then exactly what the Triton path gives).
    assert torch.equal(hopper.max[:n_valid], triton.max[:n_valid])
    assert torch.equal(hopper.target_logit[:n_valid], triton.target_logit[:n_valid])

    # Per-tile records at the kernel's 64 x 128 tiles, against float64.
    tiles = _check_row_records(hopper.tile_log_mass, x, n, v, n_valid, 64)
    expect_cols = tiles.logsumexp(1).amax(2)  # (n_rb, n_ct)
    got_cols = hopper.col_tile_log_mass
    assert got_cols.shape == expect_cols.shape
    finite = torch.isfinite(expect_cols)
    assert torch.equal(torch.isfinite(got_cols), finite)
    tol = 2e-6 * expect_cols[finite].abs() + 1e-5
    err = (got_cols[finite].double() - expect_cols[finite]).abs()
    assert (err <= tol).all(), err.max()


def _check_row_records(got_rows, x, n, v, n_valid, bm):
    """The rows' per-tile records (bm-row blocks × 128 columns) against float64 logits ``x``
    (n_valid × v); returns the padded float64 tiles (blocks, bm, column tiles, 128)."""
    bn = 128
    n_rb, n_ct = -(-n // bm), -(-v // bn)
    padded = torch.full((n_rb * bm, n_ct * bn), float("-inf"), dtype=torch.float64, device=DEV)
    padded[:n_valid, :v] = x
    tiles = padded.view(n_rb, bm, n_ct, bn)
    row_mass = tiles.logsumexp(3)  # (n_rb, bm, n_ct)
    expect_rows = row_mass.amax(1)
    # A row's exponentials are taken against its running max, and those below e⁻⁸⁷ of it are
    # flushed to 0 (_exp_ftz): a row record is exact where the tile's top row holds mass within
    # 60 nats of that max (here the max over the row's tiles so far, never below the kernel's
    # running max), elsewhere at most the true mass (a tile far below any filter's threshold).
    running = tiles.amax(3).cummax(2).values  # (n_rb, bm, n_ct)
    top = row_mass.argmax(1, keepdim=True)
    rel = (row_mass.gather(1, top) - running.gather(1, top)).squeeze(1)
    exact_rows = torch.isfinite(expect_rows) & (rel >= -60)
    assert exact_rows.float().mean() > 0.25  # (half the tiles of the scale-100 cases)
    # fp32 logits of magnitude up to ~100 (scale 100): a few ulp of each.
    tol_rows = 2e-6 * expect_rows.abs().nan_to_num(0, 0, 0) + 1e-5
    assert got_rows.shape == expect_rows.shape
    assert torch.isfinite(got_rows[exact_rows]).all()
    assert not torch.isfinite(got_rows[~torch.isfinite(expect_rows)]).any()
    err = (got_rows.double() - expect_rows).abs()
    assert (err[exact_rows] <= tol_rows[exact_rows]).all(), err[exact_rows].max()
    below = ~exact_rows & torch.isfinite(expect_rows)
    assert (got_rows.double()[below] <= (expect_rows + tol_rows)[below]).all()
    return tiles


ROW_CASES = [
    # n, v, d, n_valid, bias, dtype, scale, diagonal masked (A = B, NT-Xent)
    (333, 517, 64, 333, False, torch.bfloat16, 14.3, False),
    (1000, 4100, 128, 931, True, torch.bfloat16, 30.0, False),
    (2112, 1000, 512, 2112, False, torch.float16, 20.0, False),
    (2048, 2048, 512, 2048, False, torch.bfloat16, 100.0, True),
    (390, 390, 256, 390, False, torch.bfloat16, 10.0, True),
    (333, 900, 768, 300, True, torch.float16, 14.3, False),
    (2048, 2048, 1024, 2048, False, torch.bfloat16, 50.0, True),
]


@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[7]}")
def test_row_statistics_match_triton_kernel_and_float64(tune, monkeypatch, case):
    """Row statistics alone (InfoNCE, NT-Xent with its diagonal masked): the Hopper kernel's
    64-row records merged into the Triton kernel's 128 x 128 forward tiles."""
    n, v, d, n_valid, with_bias, dtype, scale, diag = case
    from fusedloss.core import lse_forward_sm90

    launched = []
    launch = lse_forward_sm90.launch
    monkeypatch.setattr(lse_forward_sm90, "launch", lambda *a, **k: launched.append(1)
                        or launch(*a, **k))
    a = _features(n, d, dtype, n)
    b = a if diag else _features(v, d, dtype, v + 1)
    bias = torch.randn(v, device=DEV) if with_bias else None
    hopper, triton = _both(tune, a, b, scale, bias, n_valid, col_stats=False, diag=diag)
    assert len(launched) == 1  # the Hopper kernel ran once (the Triton path's call after it)
    assert (hopper.block_m, hopper.block_n) == (triton.block_m, triton.block_n) == (128, 128)

    x = scale * (a[:n_valid].double() @ b.double().T)
    if bias is not None:
        x = x + bias.double()
    if diag:
        x.fill_diagonal_(float("-inf"))
    ref = x.logsumexp(1)
    got, ref_got = hopper.lse[:n_valid].double(), triton.lse[:n_valid].double()
    err, ref_err = (got - ref).abs().max(), (ref_got - ref).abs().max()
    assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)
    assert torch.equal(hopper.max[:n_valid], triton.max[:n_valid])
    assert torch.equal(hopper.target_logit[:n_valid], triton.target_logit[:n_valid])
    assert hopper.tile_log_mass.shape == triton.tile_log_mass.shape
    _check_row_records(hopper.tile_log_mass, x, n, v, n_valid, 128)


def test_nan_rows_give_nan(tune):
    a = _features(700, 256, torch.bfloat16, 1)
    b = _features(900, 256, torch.bfloat16, 2)
    a[5, 3] = float("nan")
    tune(gluon=True)
    stats = _stats(a, b, 20.0)
    assert stats.block_m == 64
    assert stats.lse[5].isnan()
    assert torch.isfinite(stats.lse[torch.arange(700, device=DEV) != 5]).all()
    assert stats.col_lse.isnan().all()  # every column sees row 5


@pytest.mark.parametrize("why", ["softcap", "order", "diag", "fp32", "wide", "unaligned"])
def test_other_calls_keep_the_triton_kernel(why):
    d = {"wide": 1088, "unaligned": 200}.get(why, 256)
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    a, b = _features(300, d, dtype, 3), _features(300, d, dtype, 4)
    logits = engine.Logits(
        scale=torch.tensor(10.0, device=DEV), softcap=30.0 if why == "softcap" else None,
        col_order=torch.randperm(300, device=DEV) if why == "order" else None,
        diag_mask=why == "diag")
    rows = engine.Rows(index=torch.arange(300, device=DEV), n_valid=torch.tensor(300, device=DEV))
    cols = engine.Wants(col_stats=True)
    cfg = config.forward_config(DEV, dtype, d, col_stats=True)
    assert engine._sm90_operand(a, b, logits, rows, cols, cfg) is None
    if why in ("softcap", "order", "diag"):
        # The same inputs without the option do take the Hopper kernel.
        plain = engine.Logits(scale=logits.scale)
        assert engine._sm90_operand(a, b, plain, rows, cols, cfg) is not None


@pytest.mark.parametrize("why", ["entropy", "weighted", "sigmoid", "scattered", "wide_tile"])
def test_row_statistics_keep_the_triton_kernel(why):
    """Without column statistics the Hopper kernel takes the diagonal mask of rows in order,
    not the options it lacks, nor rows out of order under the mask, nor other tiles."""
    a = _features(300, 256, torch.bfloat16, 3)
    rows = engine.Rows(index=torch.arange(300, device=DEV), n_valid=torch.tensor(300, device=DEV),
                       identity=True)
    logits = engine.Logits(scale=torch.tensor(10.0, device=DEV), diag_mask=True)
    cfg = config.forward_config(DEV, torch.bfloat16, 256, col_stats=False)
    assert engine._sm90_operand(a, a, logits, rows, engine.Wants(), cfg) is not None
    wants = engine.Wants(entropy=why == "entropy", weighted_sum=why == "weighted",
                         sigmoid=why == "sigmoid")
    if why == "scattered":
        rows = engine.Rows(index=torch.arange(300, device=DEV).flip(0),
                           n_valid=torch.tensor(300, device=DEV))
    if why == "wide_tile":
        cfg = config.TileConfig(128, 256, 64, 0, num_warps=8, num_stages=3)
    assert engine._sm90_operand(a, a, logits, rows, wants, cfg) is None


def test_gluon_switch_turns_it_off(tune):
    tune(gluon=False)
    assert not config.gluon_enabled(DEV)
    assert engine.forward_block(DEV, torch.bfloat16, 512, col_stats=True) == (128, 128)
    tune(gluon=True)
    assert engine.forward_block(DEV, torch.bfloat16, 512, col_stats=True) == (64, 128)
    # Row statistics alone (InfoNCE, NT-Xent) keep the Triton kernel's tile (the Hopper
    # kernel's records are merged into it).
    assert engine.forward_block(DEV, torch.bfloat16, 512, col_stats=False) == (128, 128)
