"""The forward's partial statistics merged (``engine.combine_partials``): per row and per column,
the log-sum-exp over any number of (max, Σ exp) partials, against float64."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, requires_triton
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedloss.core import engine


def _partials(gen: torch.Generator, parts: int, n: int):
    """(parts, n) float64 entries, and their packed fp32 partials (max, Σ exp(x − max)) the way
    the forward writes them: a partial without entries has max −inf, sum 0."""
    values = torch.randn(parts, n, 5, generator=gen, dtype=torch.float64) * 20 - 100
    empty = torch.rand(parts, n, generator=gen) < 0.3
    values[empty] = float("-inf")
    top = values.amax(2)
    total = torch.exp(values - torch.where(empty, 0.0, top)[..., None]).sum(2)
    return values, top.float(), total.float()


def _expected(values: torch.Tensor) -> torch.Tensor:
    """lse over every partial's entries; −inf where there are none."""
    return torch.logsumexp(values.permute(1, 0, 2).flatten(1), 1)


@requires_triton
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 200), v=st.integers(1, 200), row_parts=st.integers(1, 40),
       col_parts=st.integers(1, 40), n_valid=st.integers(0, 200), ordered=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_combine_partials_matches_float64(n, v, row_parts, col_parts, n_valid, ordered, seed):
    """Any number of partials (not a multiple of the partials read per load), partials without
    entries, rows past ``n_valid`` (max 0, sum 1), a column order (outputs by column id), a row
    or column without any entry (max 0, sum 0), and NaN in one partial (NaN out)."""
    gen = torch.Generator().manual_seed(seed)
    n_valid = min(n_valid, n)
    row_values, row_max, row_sum = _partials(gen, row_parts, n)
    col_values, col_max, col_sum = _partials(gen, col_parts, v)
    row_max[:, 0], row_sum[:, 0] = float("-inf"), 0.0  # a row without entries
    row_values[:, 0] = float("-inf")
    col_sum[-1, -1] = float("nan")  # the last position's column: NaN
    order = torch.randperm(v, generator=gen) if ordered else None

    to = dict(device=DEVICE)
    rows, cols = engine.combine_partials(
        row_max.to(**to), row_sum.to(**to), torch.tensor(n_valid, **to),
        (col_max.to(**to), col_sum.to(**to)), order.to(**to) if order is not None else None)
    rows, cols = rows.cpu().double(), cols.cpu().double()

    want_rows = _expected(row_values)
    valid = torch.arange(n) < n_valid
    empty_rows = torch.isneginf(want_rows)
    want_max = torch.where(valid & ~empty_rows, row_values.amax((0, 2)), 0.0)
    assert torch.equal(rows[0], want_max.float().double())  # the max is exact
    want_sum = torch.where(valid, torch.where(empty_rows, 0.0, torch.exp(want_rows - want_max)),
                           1.0)
    # fp32 partials at |x| ≈ 100: each exp(max_k − max) carries ~100 · 2⁻²⁴ of relative error
    torch.testing.assert_close(rows[1], want_sum, rtol=3e-5, atol=0)
    finite = valid & ~empty_rows
    torch.testing.assert_close(rows[3][finite], want_rows[finite], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rows[2], torch.log(rows[1]), rtol=0, atol=1e-6)

    want_cols = _expected(col_values)
    want_cols[-1] = float("nan")
    if order is not None:  # position j holds column order[j]: outputs by column id
        by_id = torch.empty_like(want_cols)
        by_id[order] = want_cols
        want_cols = by_id
    nan = torch.isnan(want_cols)
    assert torch.equal(torch.isnan(cols[3]), nan)
    some = ~nan & ~torch.isneginf(want_cols)
    torch.testing.assert_close(cols[3][some], want_cols[some], rtol=1e-6, atol=1e-6)


@requires_triton
@pytest.mark.parametrize("row_parts", [1, 16, 33])
def test_combine_partials_rows_only(row_parts):
    """Without column partials only the rows are merged (one partial: copied through)."""
    gen = torch.Generator().manual_seed(row_parts)
    values, top, total = _partials(gen, row_parts, 70)
    rows, cols = engine.combine_partials(top.to(DEVICE), total.to(DEVICE),
                                         torch.tensor(70, device=DEVICE))
    assert cols is None
    want = _expected(values)
    some = ~torch.isneginf(want)
    torch.testing.assert_close(rows[3].cpu().double()[some], want[some], rtol=1e-6, atol=1e-6)


@given(blocks=st.integers(1, 9), n_rb=st.integers(1, 5), tiles=st.integers(1, 4),
       seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_merge_row_blocks_keeps_each_groups_largest_record(blocks, n_rb, tiles, seed):
    """Per-tile records of small row blocks merged into ``n_rb`` blocks (the Hopper forward's
    64-row records into the forward's 128-row tiles): each merged record is the largest of the
    consecutive blocks it holds; -inf where it holds none; NaN stays NaN."""
    n_rb = min(n_rb, blocks)
    gen = torch.Generator().manual_seed(seed)
    records = torch.randn(blocks, tiles, generator=gen) * 10
    records[torch.rand(blocks, tiles, generator=gen) < 0.3] = float("-inf")
    records[torch.rand(blocks, tiles, generator=gen) < 0.1] = float("nan")
    merged = engine._merge_row_blocks(records, n_rb)
    per = -(-blocks // n_rb)
    assert merged.shape == (n_rb, tiles)
    for i in range(n_rb):
        group = records[i * per:(i + 1) * per]
        want = (group.amax(0) if len(group)
                else torch.full((tiles,), float("-inf")))
        torch.testing.assert_close(merged[i], want, equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("log_sum", [False, True], ids=["max-sum", "packed"])
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "rows-and-columns"])
@settings(max_examples=15)
@given(n=st.integers(1, 150), seed=st.integers(0, 2**31 - 1))
def test_margins_match_float64(backend, log_sum, columns, n, seed):
    """engine.margins: lse − x of each row (and column) from packed (max, Σ exp) statistics,
    either layout, and the gradient masses min(1, 2(1 − e^(−margin))) — against float64,
    margins from 0 (the masses' cancellation) to large; NaN stays NaN; without ``mass`` no
    masses, without columns none for them."""
    gen = torch.Generator().manual_seed(seed)
    sides = []
    target = torch.randn(n, generator=gen, dtype=torch.float64) * 5
    for _ in range(2 if columns else 1):
        values = torch.randn(n, 6, generator=gen, dtype=torch.float64) * 3
        values[:, 0] = target + torch.rand(n, generator=gen, dtype=torch.float64) * 20
        values[: n // 3, 0] = target[: n // 3]  # margins near 0: the target's entry dominates
        values[: n // 3, 1:] -= 30
        top = values.amax(1)
        total = torch.exp(values - top[:, None]).sum(1)
        packed = [top, total] + ([torch.log(total), top + torch.log(total)] if log_sum else [])
        sides.append((torch.stack(packed).float(), torch.logsumexp(values, 1)))
    sides[0][0][0, -1] = float("nan")  # a NaN row
    target32 = target.float()
    got = engine.margins(*(t.to(DEVICE) for t in (sides[0][0], target32)),
                         sides[1][0].to(DEVICE) if columns else None, mass=True, backend=backend)
    plain = engine.margins(sides[0][0].to(DEVICE), target32.to(DEVICE), mass=False,
                           backend=backend)
    assert plain[1] is None and plain[2] is None and plain[3] is None
    assert (got[1] is None) == (got[3] is None) == (not columns)
    for k, (_, lse) in enumerate(sides):
        margin = lse - target32.double()
        mass = torch.clamp(-2.0 * torch.expm1(-margin), max=1.0)
        if k == 0:
            margin[-1] = mass[-1] = float("nan")
        for value, want in ((got[k], margin), (got[2 + k], mass)):
            value = value.cpu().double()
            assert torch.equal(torch.isnan(value), torch.isnan(want))
            finite = ~torch.isnan(want)
            # fp32 statistics: ~1e-6 of the lse's size in the margin, and so in a small mass
            torch.testing.assert_close(value[finite], want[finite], rtol=1e-5,
                                       atol=4e-6 * (1 + lse.abs().max().item()))
