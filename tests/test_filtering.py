"""Unit and property tests of ``fusedloss.core.filtering``: which logit tiles may be skipped.

The promise under test: whatever the logits, the tiles ``live_tiles`` skips hold at most ``eps``
of each valid row's softmax mass. Tile statistics are built here by hand from explicit logits
(float64, then rounded to fp32 like the forward's), so the properties are checked against the
true dropped mass.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DEVICE, can_run_triton, requires_triton
from hypothesis import given
from hypothesis import strategies as st

import fusedloss
from fusedloss.core import config, engine, filtering
from fusedloss.core.filtering import (
    AUTO_FILTER_EPS,
    live_tiles,
    live_tiles_into,
    mark_targets_live,
    resolve_filter_eps,
    resolve_lm_head_filter_eps,
)

# The PyTorch rule and its one-launch Triton form (the engine's), where Triton can run.
IMPLS = ["torch", "triton"] if can_run_triton() else ["torch"]


def run_live(impl, tile_log_mass, lse, n_valid, block, eps, scale=None):
    """The live mask by either implementation, on the CPU."""
    if impl == "torch" or eps is None:
        return live_tiles(tile_log_mass, lse, torch.tensor(n_valid), block, eps, scale)
    args = [t.to(DEVICE) for t in (tile_log_mass, lse)]
    out = torch.empty(tile_log_mass.shape, dtype=torch.bool, device=DEVICE)
    live_tiles_into(out, *args, torch.tensor(n_valid, device=DEVICE), block, eps,
                    scale.to(DEVICE) if scale is not None else None)
    return out.cpu()

# ---------------------------------------------------------------------------------------------
# hand-built tile statistics


def make_logits(n: int, v: int, regime: str, seed: int) -> torch.Tensor:
    """(n, v) float64 logits: flat (untrained), peaked (one class per row well above a Zipf
    prior), or sharp (nearly one-hot)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, v, generator=g, dtype=torch.float64)
    if regime == "flat":
        return noise
    prior = -torch.log(torch.randperm(v, generator=g).double() + 1.0)  # Zipf: log 1/rank
    label = torch.randint(0, v, (n,), generator=g)
    peak = 12.0 if regime == "peaked" else 40.0
    logits = noise + 2.0 * prior
    logits[torch.arange(n), label] = peak + noise[torch.arange(n), label]
    return logits


def tile_statistics(logits: torch.Tensor, n_valid: int, block_m: int, block_n: int):
    """What the forward records, from explicit logits: (tile_log_mass, padded lse), fp32.

    tile_log_mass[b, t] = max over the valid rows r of block b of log Σ_{j∈t} exp(X_rj)
    (−inf for a block without valid rows, which the forward never visits); the lse of rows
    past n_valid is padding, set here to garbage that must not matter.
    """
    n, v = logits.shape
    n_blocks, n_tiles = math.ceil(n / block_m), math.ceil(v / block_n)
    padded = torch.full((n_blocks * block_m, n_tiles * block_n), -math.inf, dtype=torch.float64)
    padded[:n, :v] = logits
    per_row = torch.logsumexp(padded.view(-1, n_tiles, block_n), dim=2)  # (rows, tiles)
    valid = torch.arange(n_blocks * block_m) < n_valid
    per_row[~valid] = -math.inf
    tile_log_mass = per_row.view(n_blocks, block_m, n_tiles).amax(dim=1)
    lse = torch.full((n_blocks * block_m,), 1e4, dtype=torch.float64)  # garbage padding
    lse[:n_valid] = torch.logsumexp(logits[:n_valid], dim=1)
    return tile_log_mass.float(), lse.float()


def dropped_mass(logits: torch.Tensor, live: torch.Tensor, n_valid: int, block_m: int,
                 block_n: int) -> torch.Tensor:
    """(n_valid,) true softmax mass of each valid row in the tiles ``live`` skips (float64)."""
    n, v = logits.shape
    probs = torch.softmax(logits[:n_valid], dim=1)
    keep = live.repeat_interleave(block_m, dim=0).repeat_interleave(block_n, dim=1)[:n, :v]
    return torch.where(keep[:n_valid], 0.0, probs).sum(dim=1)


# fp32 statistics round the bound by a few ulps of its exponent: a relative slack suffices.
SLACK = 1e-4


@given(
    n=st.sampled_from([1, 7, 16, 37, 70]),
    v=st.sampled_from([1, 7, 16, 123, 300]),
    block_m=st.sampled_from([1, 4, 16]),
    block_n=st.sampled_from([1, 8, 16, 64]),
    valid_fraction=st.sampled_from([1.0, 0.6, 0.0]),
    regime=st.sampled_from(["flat", "peaked", "sharp"]),
    eps=st.sampled_from([1e-9, 2.0**-15, 2.0**-12, 2.0**-7, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
    impl=st.sampled_from(IMPLS),
)
def test_live_tiles_drop_at_most_eps_per_row(n, v, block_m, block_n, valid_fraction, regime,
                                              eps, seed, impl):
    logits = make_logits(n, v, regime, seed)
    n_valid = int(valid_fraction * n)
    tile_log_mass, lse = tile_statistics(logits, n_valid, block_m, block_n)
    live = run_live(impl, tile_log_mass, lse, n_valid, block_m, eps)
    assert live.shape == tile_log_mass.shape and live.dtype == torch.bool
    dropped = dropped_mass(logits, live, n_valid, block_m, block_n)
    worst = dropped.max().item() if n_valid else 0.0
    assert worst <= eps * (1 + SLACK), f"a row lost {worst:.3e} > eps = {eps:.3e}"
    blocks_with_rows = torch.arange(live.shape[0]) * block_m < n_valid
    assert not live[~blocks_with_rows].any(), "a block without valid rows must keep no tile"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("regime", ["flat", "peaked", "sharp"])
def test_live_tiles_keep_everything_on_flat_logits_and_skip_on_peaked(regime, impl):
    """The bound is not vacuous: peaked softmaxes skip most tiles, flat ones keep all."""
    n, v, block_m, block_n, eps = 64, 512, 16, 16, 2.0**-12
    logits = make_logits(n, v, regime, seed=0)
    tile_log_mass, lse = tile_statistics(logits, n, block_m, block_n)
    live = run_live(impl, tile_log_mass, lse, n, block_m, eps)
    fraction = live.float().mean().item()
    if regime == "flat":
        assert fraction == 1.0
    else:
        # A tile stays live while any row of its block has mass there: 16 rows with random
        # labels keep up to 16 of the 32 tiles.
        assert fraction < 0.5, f"live fraction {fraction:.2f}"
    assert dropped_mass(logits, live, n, block_m, block_n).max() <= eps * (1 + SLACK)


@given(
    regime=st.sampled_from(["flat", "peaked", "sharp"]),
    seed=st.integers(0, 2**16),
    eps_small=st.sampled_from([1e-9, 2.0**-15, 2.0**-12]),
    eps_large=st.sampled_from([2.0**-7, 0.1, 1.0]),
    impl=st.sampled_from(IMPLS),
)
def test_live_tiles_monotone_in_eps(regime, seed, eps_small, eps_large, impl):
    """A larger eps never brings a skipped tile back."""
    logits = make_logits(37, 300, regime, seed)
    stats = tile_statistics(logits, 37, 16, 16)
    small = run_live(impl, *stats, 37, 16, eps_small)
    large = run_live(impl, *stats, 37, 16, eps_large)
    assert not (large & ~small).any()


@pytest.mark.skipif("triton" not in IMPLS, reason="needs Triton")
@pytest.mark.parametrize("sorted_in_kernel", [True, False], ids=["kernel", "fallback"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_valid", [5, 37, 48])
def test_triton_rule_agrees_with_torch_rows_then_columns(seed, n_valid, sorted_in_kernel,
                                                         monkeypatch):
    """The engine's one-launch masks equal the PyTorch rule on untied bounds: rows with a
    per-row budget scale, then the column direction OR-ed in through the transposed view,
    leaving row blocks without valid rows dead. Also through the fallback for tile counts too
    large for one program's sort."""
    if not sorted_in_kernel:
        monkeypatch.setattr(filtering, "MAX_SORTED_TILES", 1)
    n, v, block_m, block_n, eps = 48, 200, 16, 8, 0.1
    logits = make_logits(n, v, "peaked", seed)
    tile_log_mass, lse = tile_statistics(logits, n_valid, block_m, block_n)
    scale = 0.5 + 0.5 * torch.rand(n_valid, generator=torch.Generator().manual_seed(seed))
    # Column statistics: the same construction on (v, n) logits of their own, every column
    # peaked on the last row, so the column direction keeps the last row block (which holds
    # no valid row when n_valid = 5: it must stay dead) and skips the others.
    col_logits = make_logits(v, n, "flat", seed)
    col_logits[:, n - 1] += 60.0
    col_stat, col_lse = tile_statistics(col_logits, v, block_n, block_m)
    col_stat = col_stat.T.contiguous()  # (row blocks, column tiles), as the forward stores it
    n_rb, n_ct = tile_log_mass.shape
    col_lse = col_lse[: n_ct * block_n]

    expected = live_tiles(tile_log_mass, lse, torch.tensor(n_valid), block_m, eps, scale)
    by_cols = live_tiles(col_stat.T.contiguous(), col_lse, torch.tensor(v), block_n, eps).T
    row_ok = (torch.arange(n_rb) * block_m < n_valid)[:, None]
    expected = (expected | by_cols) & row_ok

    d = DEVICE
    live = torch.empty((n_rb, n_ct), dtype=torch.bool, device=d)
    live_tiles_into(live, tile_log_mass.to(d), lse.to(d), torch.tensor(n_valid, device=d),
                    block_m, eps, scale.to(d))
    live_tiles_into(live.T, col_stat.to(d).T, col_lse.to(d), v, block_n, eps, accumulate=True,
                    tile_rows=block_m, tile_limit=torch.tensor(n_valid, device=d))
    assert torch.equal(live.cpu(), expected)
    assert not expected.all() and expected.any(), "the case should skip some tiles, not all"


@pytest.mark.parametrize("n_valid", [0, 1, 16, 17, 37])
def test_eps_none_keeps_every_tile_of_blocks_with_valid_rows(n_valid):
    logits = make_logits(37, 123, "sharp", seed=1)
    tile_log_mass, lse = tile_statistics(logits, n_valid, 16, 16)
    live = live_tiles(tile_log_mass, lse, torch.tensor(n_valid), 16, None)
    expected = (torch.arange(3) * 16 < n_valid)[:, None].expand(3, 8)
    assert torch.equal(live, expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_statistics_keep_their_tiles(impl):
    """NaN (a NaN input row) never licenses a skip: the whole block stays live."""
    logits = make_logits(32, 256, "sharp", seed=2)
    tile_log_mass, lse = tile_statistics(logits, 32, 16, 16)
    assert not run_live(impl, tile_log_mass, lse, 32, 16, 0.5).all()
    nan_lse = lse.clone()
    nan_lse[3] = float("nan")  # block 0
    live = run_live(impl, tile_log_mass, nan_lse, 32, 16, 0.5)
    assert live[0].all()
    nan_stat = tile_log_mass.clone()
    nan_stat[1, 2] = float("nan")
    assert run_live(impl, nan_stat, lse, 32, 16, 0.5)[1, 2]


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_tiles_are_skipped(impl):
    """A tile with no mass at all (−inf statistics) is skipped for any eps > 0."""
    tile_log_mass = torch.tensor([[0.0, -math.inf, 0.0]])
    lse = torch.full((4,), math.log(2.0))
    live = run_live(impl, tile_log_mass, lse, 4, 4, 1e-9)
    assert live.tolist() == [[True, False, True]]


# ---------------------------------------------------------------------------------------------
# mark_targets_live


def expected_marks(live: torch.Tensor, target_pos: torch.Tensor, block_m: int, block_n: int):
    out = live.clone()
    for p, t in enumerate(target_pos.tolist()):
        if t >= 0:
            out[p // block_m, t // block_n] = True
    return out


@given(
    n=st.integers(1, 70),
    v=st.integers(1, 300),
    block_m=st.sampled_from([1, 4, 16]),
    block_n=st.sampled_from([1, 8, 16]),
    ignored_fraction=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    few_classes=st.booleans(),
    start_live=st.sampled_from(["none", "random"]),
    seed=st.integers(0, 2**16),
)
def test_mark_targets_live_keeps_every_target_tile(n, v, block_m, block_n, ignored_fraction,
                                                   few_classes, start_live, seed):
    """Exactly the tiles holding a target become live (duplicates and −1 rows included)."""
    g = torch.Generator().manual_seed(seed)
    classes = min(v, 3) if few_classes else v  # few classes: many duplicates per tile
    target_pos = torch.randint(0, classes, (n,), generator=g)
    target_pos[torch.rand(n, generator=g) < ignored_fraction] = -1
    shape = (math.ceil(n / block_m), math.ceil(v / block_n))
    if start_live == "none":
        live = torch.zeros(shape, dtype=torch.bool)
    else:
        live = torch.rand(shape, generator=g) < 0.3
    expected = expected_marks(live, target_pos, block_m, block_n)
    mark_targets_live(live, target_pos, block_m, block_n)
    assert torch.equal(live, expected)


def test_mark_targets_live_ignored_rows_do_not_erase_a_mark():
    """An ignored row (−1) aliases tile 0 of its block; it must not undo a real target there,
    in whatever order the rows come."""
    for target_pos in ([-1, 3, -1, -1], [3, -1, -1, -1], [-1, -1, -1, 3], [3, 3, -1, 3]):
        live = torch.zeros(1, 2, dtype=torch.bool)
        mark_targets_live(live, torch.tensor(target_pos), 4, 8)
        assert live.tolist() == [[True, False]], target_pos


# ---------------------------------------------------------------------------------------------
# backward_tiles: the forward's mask on the backward's tiles, in one launch


def expected_backward_tiles(coarse, factors, n_blocks, n_tiles, block_m, block_n, n_valid,
                            target_pos):
    """The same mask from PyTorch operations: expand, keep blocks with valid rows, mark targets."""
    if coarse is None:
        live = torch.ones(n_blocks, n_tiles, dtype=torch.bool)
    else:
        live = coarse.repeat_interleave(factors[0], dim=0)[:n_blocks]
        live = live.repeat_interleave(factors[1], dim=1)[:, :n_tiles]
    live &= (torch.arange(n_blocks) * block_m < n_valid)[:, None]
    if target_pos is not None:
        mark_targets_live(live, target_pos, block_m, block_n)
    return live


@pytest.mark.skipif(not can_run_triton(), reason="needs CUDA or TRITON_INTERPRET=1")
@given(
    n=st.integers(1, 90),
    v=st.integers(1, 200),
    block_m=st.sampled_from([1, 4, 8]),
    block_n=st.sampled_from([1, 4, 16]),
    row_factor=st.sampled_from([1, 2, 4]),
    col_factor=st.sampled_from([1, 2]),
    has_coarse=st.booleans(),
    valid_fraction=st.sampled_from([0.0, 0.4, 1.0]),
    targets=st.sampled_from(["none", "some", "all"]),
    seed=st.integers(0, 2**16),
)
def test_backward_tiles_agrees_with_torch(n, v, block_m, block_n, row_factor, col_factor,
                                          has_coarse, valid_fraction, targets, seed):
    """Expansion from coarse tiles, row-block validity and target marks, against the PyTorch
    composition (``repeat_interleave``, a row mask, ``mark_targets_live``); duplicate targets
    and ignored rows (−1) included."""
    g = torch.Generator().manual_seed(seed)
    n_blocks, n_tiles = math.ceil(n / block_m), math.ceil(v / block_n)
    coarse_shape = (math.ceil(n / (block_m * row_factor)), math.ceil(v / (block_n * col_factor)))
    coarse = torch.rand(coarse_shape, generator=g) < 0.4 if has_coarse else None
    n_valid = int(round(valid_fraction * n))
    target_pos = None
    if targets != "none":
        target_pos = torch.randint(0, min(v, 5 if seed % 2 else v), (n,), generator=g)
        if targets == "some":
            target_pos[torch.rand(n, generator=g) < 0.5] = -1
    factors = (row_factor, col_factor) if has_coarse else (1, 1)
    expected = expected_backward_tiles(coarse, factors, n_blocks, n_tiles, block_m, block_n,
                                       n_valid, None if target_pos is None else
                                       torch.where(torch.arange(n) < n_valid, target_pos, -1))
    got = filtering.backward_tiles(
        None if coarse is None else coarse.to(DEVICE), factors, n_blocks, n_tiles, block_m,
        block_n, torch.tensor(n_valid, device=DEVICE),
        None if target_pos is None else target_pos.to(DEVICE))
    assert torch.equal(got.cpu(), expected)


# ---------------------------------------------------------------------------------------------
# resolve_filter_eps


@pytest.mark.parametrize(
    "dtype, expected",
    [(torch.bfloat16, 2.0**-12), (torch.float16, 2.0**-15), (torch.float32, None)],
    ids=["bf16", "fp16", "fp32"],
)
def test_resolve_filter_eps_auto_by_dtype(dtype, expected):
    assert resolve_filter_eps("auto", dtype) == expected == AUTO_FILTER_EPS[dtype]


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), (0, None), (0.0, None), (1e-3, 1e-3), (1, 1.0), (2.0**-12, 2.0**-12)],
    ids=["None", "int0", "float0", "1e-3", "int1", "2^-12"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_resolve_filter_eps_explicit(value, expected, dtype):
    resolved = resolve_filter_eps(value, dtype)
    assert resolved == expected
    assert resolved is None or isinstance(resolved, float)


@pytest.mark.parametrize("value", ["bogus", "AUTO", "", -1e-3, -1, float("nan")],
                         ids=["bogus", "AUTO", "empty", "negative", "negative-int", "nan"])
def test_resolve_filter_eps_rejects(value):
    with pytest.raises(ValueError, match="filter_eps"):
        resolve_filter_eps(value, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the forward kernel records the statistics the rule assumes

@requires_triton
@pytest.mark.parametrize("regime", ["flat", "sharp"])
@pytest.mark.parametrize("n_valid", [37, 20], ids=["all-valid", "some-ignored"])
def test_forward_records_hand_built_tile_statistics(regime, n_valid):
    """The Triton forward's per-tile log-mass equals the hand-built one (fp32 rounding)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, v, d = 37, 123, 16
    g = torch.Generator().manual_seed(3)
    a = torch.randn(n, d, generator=g)
    b = torch.randn(v, d, generator=g) / math.sqrt(d)
    if regime == "sharp":
        a = 30.0 * b[torch.randint(0, v, (n,), generator=g)] + 0.5 * a
    rows = engine.Rows(index=torch.arange(n, device=device),
                       n_valid=torch.tensor(n_valid, device=device))
    stats = engine.row_stats(a.to(device), b.to(device), engine.Logits(), rows,
                             wants=engine.Wants(record_tiles=True), backend="triton")
    logits = a.double() @ b.double().T
    expected, lse = tile_statistics(logits, n_valid, stats.block_m, stats.block_n)
    got = stats.tile_log_mass.cpu()
    assert got.shape == expected.shape
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.lse.cpu()[:n_valid], lse[:n_valid], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# "auto", and what the forward records


@pytest.mark.parametrize("dtype, expected",
                         [(torch.bfloat16, 2.0**-12), (torch.float16, 2.0**-15),
                          (torch.float32, None)], ids=["bf16", "fp16", "fp32"])
def test_resolve_filter_eps_auto_follows_the_dtype(dtype, expected):
    assert resolve_filter_eps("auto", dtype) == expected
    assert resolve_filter_eps(1e-3, dtype) == 1e-3  # an explicit value is the user's
    assert resolve_filter_eps(None, dtype) is None and resolve_filter_eps(0.0, dtype) is None


def test_lm_head_auto_is_exact():
    """The LM heads' "auto" computes every tile in every dtype; None and floats mean what they
    mean elsewhere, and bad values are refused by name."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert resolve_lm_head_filter_eps("auto", dtype) is None
        assert resolve_lm_head_filter_eps(None, dtype) is None
        assert resolve_lm_head_filter_eps(0.0, dtype) is None
        assert resolve_lm_head_filter_eps(2.0**-12, dtype) == 2.0**-12
    for bad in ("sometimes", -1.0, float("nan")):
        with pytest.raises(ValueError, match="filter_eps"):
            resolve_lm_head_filter_eps(bad, torch.bfloat16)


@requires_triton
def test_lm_head_auto_skips_no_tile_where_a_float_does():
    """Logits X = E (C = I) whose rows split their mass between the target and its neighbour
    y ^ 1 (both in the first tile; P_y ≈ ½, so each row's budget is the whole ε) over a
    background ~20 nats below: filter_eps = 2⁻⁶ skips the background tiles (the recorded
    count drops below the total), while "auto" computes every tile and its gradients equal
    filter_eps=None's bit for bit. (Per-token losses: the engine's backward, which records
    tiles; a reduced loss takes the training path, which filters nothing.)"""
    tile = 16 if config.interpreting() else 128  # the widest forward or backward tile here
    n, v = 2 * tile, 4 * tile
    device = torch.device(DEVICE)
    assert max(*engine.forward_block(device, torch.float32, v),
               config.backward_config(device, torch.float32, v).block_n) <= tile
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, tile, (n,), generator=g)  # every target in the first tile
    e = -12.0 + 0.5 * torch.randn(n, v, generator=g)
    e[torch.arange(n), y] = 8.0
    e[torch.arange(n), y ^ 1] = 8.0
    c = torch.eye(v)

    def run(filter_eps):
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in (e, c)]
        with engine.recording_backward_tiles() as record:
            fusedloss.linear_cross_entropy(*leaves, y.to(DEVICE), filter_eps=filter_eps,
                                           reduction="none", backend="triton").sum().backward()
        (computed, total), = [r.tolist() for r in record]
        return computed, total, [t.grad for t in leaves]

    filtered, total, _ = run(2.0**-6)
    assert filtered < total, "the explicit bound should skip tiles on these rows"
    computed, total, auto = run("auto")
    assert computed == total
    _, _, exact = run(None)
    assert all(torch.equal(a, b) for a, b in zip(auto, exact, strict=True))


@requires_triton
@pytest.mark.parametrize("n_valid", [37, 20], ids=["all-valid", "some-ignored"])
def test_forward_records_the_block_maxima(n_valid):
    """The forward records, per (row block, column tile), the largest tile log-mass over the
    block's valid rows, in the shapes ``tile_stats_shapes`` gives the ops' fakes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, v, d = 37, 123, 16
    g = torch.Generator().manual_seed(3)
    a = torch.randn(n, d, generator=g)
    b = torch.randn(v, d, generator=g) / math.sqrt(d)
    rows = engine.Rows(index=torch.arange(n, device=device),
                       n_valid=torch.tensor(n_valid, device=device))
    logits = a.double() @ b.double().T
    stats = engine.row_stats(a.to(device), b.to(device), engine.Logits(), rows,
                             wants=engine.Wants(col_stats=True, record_tiles=True),
                             backend="triton")
    bm, bn = stats.block_m, stats.block_n
    assert stats.tile_log_mass.shape == (math.ceil(n / bm), math.ceil(v / bn))
    shapes = engine.tile_stats_shapes(n, v, torch.device(device), a.dtype, d, col_stats=True)
    assert (tuple(stats.tile_log_mass.shape), tuple(stats.col_tile_log_mass.shape)) == shapes
    block_stat, _ = tile_statistics(logits, n_valid, bm, bn)
    torch.testing.assert_close(stats.tile_log_mass.cpu(), block_stat, rtol=1e-5, atol=1e-5)
