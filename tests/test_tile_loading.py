"""How the kernels load operand tiles: TMA descriptors where they can serve, pointers elsewhere.

``engine.tile_descriptors`` picks the path; both must give the same results (same dots, same
order over D), and the descriptor path must step aside where TMA cannot read the rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, requires_triton

import fusedloss
from fusedloss.core import config, engine

NO_TMA = (None, None, None)


def _tma_capable() -> bool:
    return config.interpreting() or (
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)


def _rows(n: int, identity: bool | None = None) -> engine.Rows:
    return engine.Rows(index=torch.arange(n, device=DEVICE),
                       n_valid=torch.tensor(n, device=DEVICE), identity=identity)


@requires_triton
@pytest.mark.skipif(not _tma_capable(), reason="TMA needs a Hopper GPU or the interpreter")
def test_descriptors_where_tma_can_read(tune):
    a = torch.randn(40, 32, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(50, 32, device=DEVICE, dtype=torch.bfloat16)
    a_desc, b_desc, a_rows = engine.tile_descriptors(a, b, engine.Logits(), _rows(40),
                                                     16, 16, 16)
    assert a_desc is not None and b_desc is not None
    assert a_rows is a  # every row counts, in order: no copy
    # Rows that are not the identity are read from a compact copy: still by TMA.
    rows = engine.Rows(index=torch.arange(39, -1, -1, device=DEVICE),
                       n_valid=torch.tensor(40, device=DEVICE))
    assert not rows.is_identity()
    a_desc, _, a_rows = engine.tile_descriptors(a, b, engine.Logits(), rows, 16, 16, 16)
    assert a_desc is not None and torch.equal(a_rows, a.flip(0))
    tune(tma=False)
    assert engine.tile_descriptors(a, b, engine.Logits(), _rows(40), 16, 16, 16) == NO_TMA


@requires_triton
def test_pointer_path_where_tma_cannot_read():
    # A row of 7 fp32 values is 28 bytes: not a multiple of 16.
    a = torch.randn(40, 7, device=DEVICE)
    b = torch.randn(50, 7, device=DEVICE)
    assert engine.tile_descriptors(a, b, engine.Logits(), _rows(40), 16, 16, 16) == NO_TMA
    # Vocabulary sorting reads B in a permuted order: rows are gathered by pointer.
    a16 = torch.randn(40, 32, device=DEVICE, dtype=torch.bfloat16)
    b16 = torch.randn(50, 32, device=DEVICE, dtype=torch.bfloat16)
    order = engine.Logits(col_order=torch.randperm(50, device=DEVICE))
    assert engine.tile_descriptors(a16, b16, order, _rows(40), 16, 16, 16) == NO_TMA


def test_rows_identity_is_checked_when_unknown():
    assert _rows(5).is_identity()
    assert _rows(5, identity=True).is_identity()
    shuffled = engine.Rows(index=torch.tensor([1, 0, 2], device=DEVICE),
                           n_valid=torch.tensor(3, device=DEVICE))
    assert not shuffled.is_identity()


def _lm_head(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(2, 23, 32, device=DEVICE, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(101, 32, device=DEVICE, generator=g) / 6).to(dtype).requires_grad_()
    y = torch.randint(0, 101, (2, 23), device=DEVICE, generator=g)
    y[0, :5] = -100  # ignored tokens: the compact row order is not the identity
    loss = fusedloss.linear_cross_entropy(x, w, y, shift=True, backend="triton")
    return [loss.detach(), *torch.autograd.grad(loss, (x, w))]


def _clip(dtype):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    i = F.normalize(torch.randn(45, 32, device=DEVICE, generator=g), dim=1).to(dtype)
    t = F.normalize(torch.randn(45, 32, device=DEVICE, generator=g), dim=1).to(dtype)
    i.requires_grad_()
    t.requires_grad_()
    loss = fusedloss.clip_loss(i, t, 20.0, backend="triton")
    return [loss.detach(), *torch.autograd.grad(loss, (i, t))]


@requires_triton
@pytest.mark.parametrize("dtype", [
    torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("run", [pytest.param(_lm_head, marks=pytest.mark.slow), _clip],
                         ids=["lm-head", "clip"])
def test_tma_and_pointer_paths_agree(tune, run, dtype):
    """The same dots in the same order over D: the two load paths agree to the last bit under
    the interpreter, and to a few ulps on a GPU (where the compiler may pick other MMAs)."""
    with_tma = run(dtype)
    tune(tma=False)
    with_pointers = run(dtype)
    for ours, theirs in zip(with_tma, with_pointers, strict=True):
        if config.interpreting():
            assert torch.equal(ours, theirs)
        else:
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(ours, theirs, rtol=4 * eps,
                                       atol=4 * eps * float(theirs.abs().max()))


@pytest.mark.parametrize("groups, tiles, slots", [(64, 1000, 132), (64, 501, 132), (64, 126, 132),
                                                  (1, 1000, 132), (3, 7, 4), (128, 1000, 132),
                                                  (7, 123, 16)])
def test_forward_splits_fill_the_last_wave(groups, tiles, slots):
    """Column splits cover every tile once, and the waves they make take at most 5% more
    tile-times than the best split (a fixed 4 programs per SM took 15% more on LM heads)."""
    splits, per = engine._balanced_splits(groups, tiles, slots)
    assert (splits - 1) * per < tiles <= splits * per

    def time(s: int) -> int:
        p = -(-tiles // s)
        return -(-groups * -(-tiles // p) // slots) * p

    assert time(splits) <= 1.05 * min(time(s) for s in range(1, tiles + 1))
    if (groups, tiles, slots) == (64, 1000, 132):  # gemma2-2b on an H100: one wave, 2 splits
        assert (splits, per) == (2, 500)


@pytest.mark.parametrize("n_rb, per_group, n_ct, near, slots", [
    (4096, 128, 2048, 17, 132),  # CLIP b = 262144 on an H200 (64 × 128 tiles)
    (2048, 64, 1024, 17, 132),   # b = 131072
    (1024, 32, 512, 17, 132),    # b = 65536: 17 splits already end together
    (1024, 32, 512, 17, 114),    # b = 65536 on an H100 PCIe
    (37, 5, 19, 7, 16), (3, 1, 1, 1, 132), (300, 10, 7, 4, 264)])
def test_column_statistics_splits_fill_the_last_wave(n_rb, per_group, n_ct, near, slots):
    """With one program an SM, the forward's column splits are the most, up to the 4·SMs
    programs' count, whose programs, each taking the next free SM, end within 3% of the best
    count from half as many; at b = 262144 the 17 splits of before left the SMs 16% idle."""
    splits, per = engine._wave_filling_splits(n_rb, per_group, n_ct, near, slots)
    assert (splits - 1) * per < n_ct <= splits * per and splits <= near

    def time(s):
        return engine._makespan(n_rb, per_group, n_ct, -(-n_ct // s), slots)

    counts = {-(-n_ct // -(-n_ct // s)) for s in range(max(1, near // 2), min(n_ct, near) + 1)}
    best = min(time(s) for s in counts)
    assert time(splits) <= 1.03 * best
    assert all(time(s) > 1.03 * best for s in counts if s > splits)
    if (n_rb, n_ct, slots) in {(4096, 2048, 132), (2048, 1024, 132)}:
        busy = n_rb * n_ct / slots  # tile-times with every SM busy, no A loads
        assert (splits, busy / time(splits) > 0.95, busy / time(17) < 0.9) == (16, True, True)
    if (n_rb, slots) == (1024, 132):
        assert splits == 17


def test_makespan_of_programs_in_launch_order():
    """Two slots, one group of 3 blocks, 3 splits of 2, 2 and 1 tiles: programs of 3·3, 3·3
    and 3·2 tile-times, the third starting when the first slot frees up, at 9."""
    assert engine._makespan(3, 3, 5, 2, 2) == 15
    assert engine._makespan(4, 2, 2, 2, 1) == 12  # one slot: the sum, 2 · 2·3


def test_the_forward_grid_fills_the_last_wave_with_one_program_an_sm(monkeypatch):
    """On a GPU with one program an SM the column-statistics grid takes the wave-filling
    split count (16 at b = 262144 on 132 SMs), with two it keeps 4·SMs programs (17)."""
    monkeypatch.setattr(engine.config, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert engine._forward_grid(4096, 2048, True, cuda, resident=1) == (32, 128, 16, 128)
    assert engine._forward_grid(4096, 2048, True, cuda, resident=2) == (32, 128, 17, 121)


def test_ids_past_32_bits_are_refused():
    """The kernels compare row and column ids in 32 bits: the host says so instead."""
    with pytest.raises(ValueError, match="2\\^31"):
        engine._check_ids(2**31, 10)
    with pytest.raises(ValueError, match="2\\^31"):
        engine._check_ids(10, 2**31)
    engine._check_ids(2**31 - 1, 2**31 - 1)
