"""PerTensorScaler: a tensor with an Inf/NaN gradient keeps its parameter and optimizer state; every
other tensor updates exactly as in an unscaled run (where the bad tensor simply had no gradient)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusedloss.amp import PerTensorScaler
from fusedloss.optim import StableAdamW

SHAPES = [(6, 4), (9,), (2, 3, 2)]


class NoSkipMasks(StableAdamW):
    """StableAdamW through the generic snapshot-and-restore path."""

    supports_skip_masks = False


OPTIMIZERS = {
    "StableAdamW": functools.partial(StableAdamW, lr=1e-2, weight_decay=0.1, track_rms=True),
    "StableAdamW-restore": functools.partial(NoSkipMasks, lr=1e-2, weight_decay=0.1),
    "AdamW": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True),
    "SGD-momentum": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9, weight_decay=0.1),
}


def make_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def grads_for(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def snapshot(opt, p):
    return {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad_step", [0, 2])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_only_the_nonfinite_tensor_is_skipped(name, bad_step, poison):
    make_opt = OPTIMIZERS[name]
    scale = 2.0**12
    scaled, plain = make_params(), make_params()
    opt, ref_opt = make_opt(scaled), make_opt(plain)
    scaler = PerTensorScaler(scale=scale)
    bad = 1
    for step in range(4):
        gs = grads_for(step)
        for i, (p, q, g) in enumerate(zip(scaled, plain, gs, strict=True)):
            p.grad = g * scale
            q.grad = g.clone()
            if step == bad_step and i == bad:
                p.grad[0] = poison
                q.grad = None  # the unscaled run: that tensor simply has no update
        if step == bad_step:
            before_param = scaled[bad].detach().clone()
            before_state = snapshot(opt, scaled[bad])
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        if step == bad_step:
            assert torch.equal(scaled[bad], before_param)
            after = snapshot(opt, scaled[bad])
            for k, v in before_state.items():
                assert torch.equal(after[k], v), k
            assert all(torch.count_nonzero(v) == 0 for k, v in after.items()
                       if k not in before_state and k != "rms")
            assert scaler.skipped_count().item() == 1
            assert [bool(f) for f in scaler.nonfinite.values()] == [False, True, False]
        else:
            assert scaler.skipped_count().item() == 0
        for p, q in zip(scaled, plain, strict=True):
            assert torch.equal(p, q)
    for p, q in zip(scaled, plain, strict=True):
        assert torch.equal(p, q)
        state, ref_state = snapshot(opt, p), snapshot(ref_opt, q)
        for k in ref_state:
            assert torch.equal(state[k].to(ref_state[k].dtype), ref_state[k]), k


@given(
    exponent=st.integers(-8, 24),
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=16),
)
def test_scale_and_unscale_are_exact_for_powers_of_two(exponent, values):
    scale = 2.0**exponent
    scaler = PerTensorScaler(scale=scale)
    x = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(scaler.scale(x), x * scale)
    a, b = scaler.scale([x, 2 * x])
    assert torch.equal(b, 2 * x * scale)
    p = torch.zeros_like(x, requires_grad=True)
    p.grad = scaler.scale(x)
    opt = torch.optim.SGD([p], lr=1.0)
    flags = scaler.unscale_(opt)
    assert torch.equal(p.grad, x)
    assert not flags[p]
    scaler.step(opt)
    assert torch.equal(p.detach(), -x)


def test_flags_each_tensor_and_unscale_once():
    params = [torch.zeros(3, requires_grad=True) for _ in range(4)]
    fills = [1.0, float("inf"), float("-inf"), float("nan")]
    for p, f in zip(params, fills, strict=True):
        p.grad = torch.tensor([1.0, f, 2.0])
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = PerTensorScaler(scale=4.0)
    flags = scaler.unscale_(opt)
    assert [bool(flags[p]) for p in params] == [False, True, True, True]
    with pytest.raises(RuntimeError):
        scaler.unscale_(opt)
    scaler.step(opt)  # uses the flags of the explicit unscale_, does not unscale again
    assert torch.equal(params[0].detach(), -torch.tensor([0.25, 0.25, 0.5]))
    assert all(torch.equal(p, torch.zeros(3)) for p in params[1:])


def test_float16_gradients_of_a_model():
    """A fp16 model: the overflowing tensor is skipped, the rest step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).half()
    opt = StableAdamW(model.parameters(), lr=1e-2, eps=1e-6)
    scaler = PerTensorScaler(scale=2.0**8)
    loss = model(torch.randn(5, 4).half()).float().square().sum()
    scaler.scale(loss).backward()
    model[1].bias.grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    after = list(model.parameters())
    assert torch.equal(after[3], before[3])
    assert all(not torch.equal(a, b) for a, b in zip(after[:3], before[:3], strict=True))
    assert all(torch.isfinite(p).all() for p in after)


def test_disabled_scaler_is_a_pass_through():
    p = torch.ones(2, requires_grad=True)
    p.grad = torch.ones(2)
    scaler = PerTensorScaler(enabled=False)
    x = torch.tensor([3.0])
    assert scaler.scale(x) is x and scaler.get_scale() == 1.0
    scaler.step(torch.optim.SGD([p], lr=1.0))
    assert torch.equal(p.detach(), torch.zeros(2))
    state = PerTensorScaler(scale=8.0).state_dict()
    scaler.load_state_dict(state)
    assert scaler.get_scale() == 8.0 and scaler.is_enabled()


@pytest.mark.parametrize("name", ["StableAdamW", "StableAdamW-restore", "SGD-momentum"])
def test_scaler_step_never_reads_a_tensor_on_the_host(name, monkeypatch):
    params = make_params()
    opt = OPTIMIZERS[name](params)
    scaler = PerTensorScaler()

    def refuse(self, *args, **kwargs):
        raise AssertionError("host synchronization: a tensor was read on the host")

    for attr in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)
    for step in range(3):
        for p, g in zip(params, grads_for(step), strict=True):
            p.grad = g * scaler.get_scale()
        params[0].grad[0] = float("nan")
        scaler.step(opt)
