"""Every option of ``linear_cross_entropy`` and ``LinearCrossEntropyLoss`` has a test that fails
if the option is ignored: it changes the result where it should, and matches the float64
reference (with the accuracy bar of test_linear_cross_entropy.py) when it does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
from helpers import can_run_triton, rel_err
from test_linear_cross_entropy import (
    BACKENDS,
    DEVICE,
    ON_GPU,
    Case,
    Result,
    check_case,
    make_problem,
    requires_triton,
    run_ours,
)

import fusedloss
import fusedloss.nn
from fusedloss import LinearCrossEntropyLoss, linear_cross_entropy
from fusedloss.core import config

# One moderate problem: several 16×16 tiles with ragged edges on the interpreter.
BASE = Case(lead=(37,), v=123, d=16, dtype=torch.float32, regime="peaked")
BF16 = replace(BASE, dtype=torch.bfloat16)


def assert_changes(on: Result, off: Result, *, what: str, at_least: float = 1e-3,
                   grads: bool = True) -> None:
    """The option moved the loss (and the gradients) far beyond rounding."""
    assert rel_err(on.loss, off.loss) > at_least, f"{what} does not change the loss"
    if grads:
        for name in off.grads:
            assert rel_err(on.grads[name], off.grads[name]) > at_least, (
                f"{what} does not change grad {name}")


def with_option(backend: str, base: Case, **option):
    """(ours with the option, checked against the reference; ours without it)."""
    on_case = replace(base, **option)
    on = check_case(on_case, backend)
    problem = make_problem(on_case)  # same data: bias and class weights are drawn last
    if not base.class_weight:
        problem.weight = None
    if not base.bias:
        problem.linear_bias = None
    off = run_ours(base, problem, backend)
    return on, off


# ---------------------------------------------------------------------------------------------
# loss options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alpha", [0.1, pytest.param(1.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("class_weight", [False, True], ids=["no-class-weight", "class-weight"])
def test_label_smoothing(backend, alpha, class_weight):
    on, off = with_option(backend, replace(BASE, class_weight=class_weight),
                          label_smoothing=alpha)
    assert_changes(on, off, what="label_smoothing")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", [pytest.param(5.0, marks=pytest.mark.slow), 30.0])
def test_softcap(backend, cap):
    on, off = with_option(backend, replace(BASE, bias=True), softcap=cap)
    # peaked logits reach ~15: c = 30 bends them by a few percent, c = 5 by a lot
    assert_changes(on, off, what="softcap")


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_bounds_the_lse(backend):
    """Every capped logit is below c, so lse < c + log V, whatever the input scale."""
    case = replace(BASE, regime="sharp", softcap=2.0, return_lse=True, reduction="none")
    ours = check_case(case, backend)
    assert (ours.lse <= 2.0 + torch.log(torch.tensor(123.0))).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_z_loss(backend, reduction):
    base = replace(BASE, reduction=reduction, ignore="some")
    on, off = with_option(backend, base, z_loss=1e-2)
    assert_changes(on, off, what="z_loss")
    # The difference is λ·lse² per token, exactly what return_lse reports.
    with_lse = run_ours(replace(base, return_lse=True), make_problem(base), backend)
    extra = 1e-2 * with_lse.lse**2
    if reduction == "mean":
        valid = make_problem(base).target != base.ignore_index
        extra = extra.sum() / valid.sum()
    torch.testing.assert_close(on.loss - off.loss, extra, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weight(backend):
    on, off = with_option(backend, replace(BASE, ignore="some"), class_weight=True)
    assert_changes(on, off, what="weight")
    # "mean" divides by the summed weights of the non-ignored targets (PyTorch's semantics).
    case = replace(BASE, ignore="some", class_weight=True)
    problem = make_problem(case)
    total = run_ours(replace(case, reduction="sum"), problem, backend).loss
    valid = problem.target != case.ignore_index
    denominator = problem.weight[problem.target[valid]].sum()
    torch.testing.assert_close(on.loss, total / denominator, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", pytest.param("sum", marks=pytest.mark.slow), "none"])
def test_shift_equals_slicing(backend, reduction):
    """shift=True on (B, T, D) equals the unshifted call on input[:, :-1] and target[:, 1:]."""
    case = replace(BASE, lead=(3, 13), shift=True, ignore="some", reduction=reduction)
    problem = make_problem(case)
    shifted = check_case(case, backend)
    x = problem.input[:, :-1].detach().clone().requires_grad_()
    w = problem.linear_weight.detach().clone().requires_grad_()
    sliced = linear_cross_entropy(x, w, problem.target[:, 1:], reduction=reduction,
                                  backend=backend)
    torch.testing.assert_close(shifted.loss, sliced.detach(), rtol=1e-5, atol=1e-6)
    unshifted = run_ours(replace(case, shift=False), problem, backend)
    if reduction == "none":
        assert shifted.loss.shape == (3, 12) and unshifted.loss.shape == (3, 13)
    else:
        assert_changes(shifted, unshifted, what="shift", grads=False)
    assert (shifted.grads["input"][:, -1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ignore_index", [-100, -1, 3], ids=["-100", "-1", "class3"])
def test_ignore_index_equals_dropping_the_tokens(backend, ignore_index):
    """Ignored tokens count for nothing: the mean over all tokens equals the mean over the
    kept ones, and an in-range ignore_index (a real class id) works too."""
    case = replace(BASE, ignore="some", ignore_index=ignore_index, bias=True)
    problem = make_problem(case)
    if ignore_index == 3:
        problem.target[:5] = 3  # make sure the class is present
    keep = problem.target != ignore_index
    assert keep.any() and not keep.all()
    ours = run_ours(case, problem, backend)
    kept = fusedloss.linear_cross_entropy(
        problem.input[keep], problem.linear_weight, problem.target[keep],
        linear_bias=problem.linear_bias, backend=backend)
    torch.testing.assert_close(ours.loss, kept, rtol=1e-5, atol=1e-6)
    assert (ours.grads["input"][~keep] == 0).all()
    check_case(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shift", [False, True], ids=["no-shift", "shift"])
def test_return_lse(backend, shift):
    """lse equals logsumexp of the float64 logits (0 at ignored tokens) and its gradient
    flows: a loss built from the lse alone matches the reference's."""
    lead = (3, 13) if shift else (37,)
    case = replace(BASE, lead=lead, bias=True, shift=shift, ignore="some", return_lse=True,
                   reduction="none")
    problem = make_problem(case)
    ours = check_case(case, backend)
    x = problem.input[..., :-1, :] if shift else problem.input
    target = problem.target[..., 1:] if shift else problem.target
    logits = x.double() @ problem.linear_weight.double().T + problem.linear_bias.double()
    expected = torch.where(target != -100, torch.logsumexp(logits, dim=-1), 0.0)
    torch.testing.assert_close(ours.lse.double(), expected, rtol=1e-6, atol=1e-5)

    # The lse alone as the objective: d/dX Σ lse = softmax, nothing from the target.
    leaves = [t.detach().clone().requires_grad_() for t in (problem.input, problem.linear_weight)]
    _, lse = linear_cross_entropy(*leaves, problem.target, linear_bias=problem.linear_bias,
                                  shift=shift, return_lse=True, reduction="none",
                                  backend=backend)
    lse.sum().backward()
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    _, ref_lse = fusedloss.reference.linear_cross_entropy_ref(
        *ref_leaves, problem.target, linear_bias=problem.linear_bias.double(), shift=shift,
        return_lse=True, reduction="none")
    ref_lse.sum().backward()
    for ours_leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert rel_err(ours_leaf.grad, ref_leaf.grad) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions_are_consistent(backend):
    """sum = Σ none, mean = sum / Σ w_y, and the gradients scale the same way."""
    case = replace(BASE, class_weight=True, ignore="some", label_smoothing=0.1, z_loss=1e-3)
    problem = make_problem(case)
    results = {r: run_ours(replace(case, reduction=r), problem, backend)
               for r in ("none", "sum", "mean")}
    valid = problem.target != case.ignore_index
    denominator = problem.weight[problem.target[valid]].sum()
    assert results["none"].loss.shape == (37,)
    assert results["sum"].loss.shape == results["mean"].loss.shape == ()
    torch.testing.assert_close(results["sum"].loss, results["none"].loss.sum())
    torch.testing.assert_close(results["mean"].loss, results["sum"].loss / denominator)
    for name, grad in results["sum"].grads.items():
        torch.testing.assert_close(results["mean"].grads[name] * denominator, grad,
                                   rtol=1e-5, atol=1e-6)
    assert rel_err(results["none"].loss, results["mean"].loss.expand(37)) > 0.1


# ---------------------------------------------------------------------------------------------
# vocab_order and filter_eps (Triton only: the torch backend ignores both)


@requires_triton
@pytest.mark.parametrize("case", [
    pytest.param(replace(BASE, filter_eps=None), id="fp32-exact"),
    pytest.param(replace(BF16, filter_eps=None, bias=True), id="bf16-exact"),
])
def test_vocab_order_does_not_change_the_result(case):
    """Any column order gives the natural order's result up to the summation order (per-token
    losses: the engine, where the order applies; a reduced loss without it would take the
    training path, whose logits are rounded to the input dtype)."""
    case = replace(case, reduction="none")
    problem = make_problem(case)
    natural = run_ours(case, problem, "triton", vocab_order=None)
    g = torch.Generator().manual_seed(5)
    for order in (torch.randperm(case.v, generator=g), torch.arange(case.v).flip(0), "auto"):
        if isinstance(order, torch.Tensor):
            order = order.to(DEVICE)
        permuted = run_ours(case, problem, "triton", vocab_order=order)
        torch.testing.assert_close(permuted.loss, natural.loss, rtol=1e-6, atol=1e-6)
        for name, grad in natural.grads.items():
            tol = max(2 * torch.finfo(case.dtype).eps, 1e-5)  # summation order, one rounding
            assert rel_err(permuted.grads[name], grad) <= tol, name


@requires_triton
@pytest.mark.parametrize("order", ["auto", None, "permutation"])
def test_vocab_order_with_filtering_meets_the_bar(order):
    """With filtering on, the order changes which tiles are skipped, never the bar."""
    case = replace(BF16, regime="sharp", ignore="some")
    if order == "permutation":
        order = torch.randperm(case.v, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    check_case(case, "triton", vocab_order=order)


@requires_triton
@pytest.mark.parametrize("order", ["repeats", "out-of-range"])
def test_invalid_vocab_order_gives_nan(order):
    """Found on the device, without a wait: a vocab_order that is not a permutation runs the
    tiles in plain order (no read outside the head) and makes the loss and every gradient
    NaN."""
    case = BASE
    problem = make_problem(case)
    bad = (torch.zeros(case.v, dtype=torch.long) if order == "repeats"
           else torch.arange(case.v) + 7).to(DEVICE)
    got = run_ours(case, problem, "triton", vocab_order=bad)
    assert torch.isnan(got.loss).all()
    assert all(torch.isnan(g).any() for g in got.grads.values())


@requires_triton
def test_invalid_vocab_order_raises_when_checked(tune):
    tune(check_values=True)
    case = BASE
    problem = make_problem(case)
    with pytest.raises(ValueError, match="permutation"):
        run_ours(case, problem, "triton",
                 vocab_order=torch.zeros(case.v, dtype=torch.long, device=DEVICE))


SPARSE = {"dense_slab_fraction": 2.0}  # every slab through the block-sparse path
# Several column tiles per row block: the interpreter's tiles are 16 wide, a GPU's 128-256.
FILTER_SHAPE = dict(lead=(512,), v=5003) if ON_GPU else dict(lead=(64,), v=300)


def use_small_tiles(tune) -> None:
    """On a GPU, tiles of 32 × 32 as the interpreter's 16 × 16: the filter's bound takes each
    row block's most confident row, and a block of 128 peaked rows always holds one whose
    gradient mass (1 − P_y) is below fp32's resolution, which keeps every tile of the block."""
    tune(forward_tile=config.TileConfig(32, 32, 32, 0, num_warps=4, num_stages=2),
         backward_tile=config.TileConfig(32, 32, 32, 32, num_warps=4, num_stages=2))


@requires_triton
@pytest.mark.parametrize("regime", ["peaked", "flat"])
def test_filter_eps_filters(tune, regime):
    """A huge eps skips tiles (the gradients move), "auto" keeps them within the bar.

    Through the block-sparse path: the default engine sends a slab with ≥ 25% live tiles
    through the dense path, which computes whole row blocks, and on interpreter-sized problems
    even a relative bound of 1 leaves that many (the bound takes each block's largest tile mass
    over its smallest lse, and each block's most confident row). eps = 1000 does skip; on sharp
    logits it would change nothing measurable: no mass to drop.
    """
    tune(**SPARSE)
    use_small_tiles(tune)
    case = replace(BF16, regime=regime, classes=16, **FILTER_SHAPE)
    problem = make_problem(case)
    # per-token losses: the engine with and without filtering (a reduced loss without it
    # would take the training path)
    exact = run_ours(replace(case, filter_eps=None, reduction="none"), problem, "triton")
    huge = run_ours(replace(case, filter_eps=1000.0, reduction="none"), problem, "triton")
    for name in exact.grads:  # same path, same rounding: any change is a skipped tile
        assert rel_err(huge.grads[name], exact.grads[name]) > 1e-3, (
            f"filter_eps=1000 left grad {name} unchanged: no tile was skipped")
    torch.testing.assert_close(huge.loss, exact.loss)  # the forward never filters
    check_case(case, "triton")  # "auto" meets the bar on the same problem


@requires_triton
@pytest.mark.slow  # ~25 s a case on the interpreter: make test-slow
@pytest.mark.parametrize("order", ["auto", None, "permutation"])
def test_filtering_keeps_unlikely_targets(tune, order):
    """A target the model finds unlikely sits in a tile with no mass: only its one-hot term
    keeps that tile live (mark_targets_live, through the column order). Dropping it would lose
    the −1 of dX_{i,y}: the largest gradient entry of the row."""
    tune(**SPARSE)
    case = replace(BF16, regime="sharp", filter_eps=0.5, **FILTER_SHAPE)
    problem = make_problem(case)
    # Targets other than the labels the hidden states point at: unlikely classes.
    g = torch.Generator().manual_seed(1)
    problem.target = torch.randint(0, case.v, problem.target.shape, generator=g).to(DEVICE)
    if order == "permutation":
        order = torch.randperm(case.v, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ours = run_ours(case, problem, "triton", vocab_order=order)
    exact = run_ours(replace(case, filter_eps=None), problem, "triton")
    # Whatever is skipped holds ≤ eps of the mass, and here almost none: the gradients match
    # the unfiltered ones to rounding, which they would miss by ~100% without the targets.
    for name, grad in exact.grads.items():
        assert rel_err(ours.grads[name], grad) < 1e-2, name


@requires_triton
@pytest.mark.slow  # ~20 s a case on the interpreter: make test-slow
@pytest.mark.parametrize("eps", [2.0**-10, 2.0**-6, 0.25])
@pytest.mark.parametrize("tuning", [pytest.param({}, id="defaults"),
                                    pytest.param(SPARSE, id="sparse")])
def test_filter_eps_bounds_the_gradient_change(tune, tuning, eps):
    """filter_eps is a proven bound: each row loses ≤ eps of its softmax mass, so with unit
    coefficients (reduction="sum", no options) ‖ΔdA_i‖ ≤ eps · max_j ‖B_j‖ and
    ‖ΔdB‖ ≤ eps · Σ_i ‖A_i‖ against the unfiltered gradients."""
    tune(**tuning)
    case = replace(BASE, regime="sharp", reduction="sum", bias=True, **FILTER_SHAPE)
    problem = make_problem(case)
    exact = run_ours(replace(case, filter_eps=None), problem, "triton")
    filtered = run_ours(replace(case, filter_eps=eps), problem, "triton")
    a, b = problem.input.double().cpu(), problem.linear_weight.double().cpu()
    d_a = (filtered.grads["input"] - exact.grads["input"]).double().cpu().norm(dim=1)
    rounding = 1e-5 * exact.grads["input"].double().cpu().norm(dim=1) + 1e-6
    assert (d_a <= eps * b.norm(dim=1).max() + rounding).all()
    d_b = (filtered.grads["linear_weight"] - exact.grads["linear_weight"]).double().norm()
    assert d_b <= eps * a.norm(dim=1).sum() + 1e-5 * exact.grads["linear_weight"].norm()
    d_bias = (filtered.grads["linear_bias"] - exact.grads["linear_bias"]).double().norm()
    assert d_bias <= eps * a.shape[0] + 1e-5


# ---------------------------------------------------------------------------------------------
# the module


MODULE_OPTIONS = [
    pytest.param(dict(reduction="sum"), id="reduction"),
    pytest.param(dict(ignore_index=3), id="ignore_index"),
    pytest.param(dict(label_smoothing=0.2), id="label_smoothing"),
    pytest.param(dict(softcap=5.0), id="softcap"),
    pytest.param(dict(z_loss=1e-2), id="z_loss"),
    pytest.param(dict(shift=True), id="shift"),
    pytest.param(dict(return_lse=True), id="return_lse"),
    pytest.param(dict(weight="class-weight"), id="weight"),
    pytest.param(dict(filter_eps=1000.0), id="filter_eps", marks=pytest.mark.slow),
    pytest.param(dict(backend="torch"), id="backend-torch"),
    pytest.param(dict(backend="triton"), id="backend-triton",
                 marks=[requires_triton, pytest.mark.slow]),
]


def _module_inputs(case: Case):
    problem = make_problem(case)
    problem.target[:4] = 3  # ignore_index=3 must have something to ignore
    return problem


def _forward_backward(fn, problem):
    x = problem.input.detach().clone().requires_grad_()
    w = problem.linear_weight.detach().clone().requires_grad_()
    b = problem.linear_bias
    b = b.detach().clone().requires_grad_() if b is not None else None
    out = fn(x, w, problem.target, b)
    loss = out[0] if isinstance(out, tuple) else out
    lse = out[1] if isinstance(out, tuple) else None
    total = loss.sum() + (lse.sum() if lse is not None else 0)
    total.backward()
    return out, tuple(t.grad for t in (x, w, b) if t is not None)


@pytest.mark.parametrize("option", MODULE_OPTIONS)
def test_module_forwards_every_option(tune, option):
    """Module(option) equals the functional call with that option, bit for bit, and differs
    from the call without it."""
    tune(**SPARSE)
    case = replace(BF16, lead=(2, 32), bias=True, v=300, classes=16)
    if "filter_eps" in option:
        # Flat logits: every row's gradient mass is ~1, so a huge eps skips tiles that "auto"
        # keeps, whatever the block size (a confident row would keep its whole block).
        case = replace(case, regime="flat")
        use_small_tiles(tune)
    problem = _module_inputs(case)
    option = dict(option)
    if option.get("weight") == "class-weight":
        option["weight"] = torch.rand(case.v, generator=torch.Generator().manual_seed(1)) + 0.5
        option["weight"] = option["weight"].to(DEVICE)
    needs_triton = "filter_eps" in option
    backend = option.pop("backend", "triton" if needs_triton else "torch")
    if backend == "triton" and not can_run_triton():
        pytest.skip("backend='triton' needs a CUDA device or TRITON_INTERPRET=1")

    module = LinearCrossEntropyLoss(**option, backend=backend)
    if "shift" not in option:  # without a time dimension
        problem.input, problem.target = problem.input.flatten(0, 1), problem.target.flatten()

    def functional(opts):
        return lambda x, w, y, b: linear_cross_entropy(x, w, y, linear_bias=b, backend=backend,
                                                       **opts)

    out_module, grads_module = _forward_backward(
        lambda x, w, y, b: module(x, w, y, linear_bias=b), problem)
    out_functional, grads_functional = _forward_backward(functional(option), problem)
    out_default, grads_default = _forward_backward(functional({}), problem)
    for ours, theirs in zip(grads_module, grads_functional, strict=True):
        assert torch.equal(ours, theirs)
    if isinstance(out_functional, tuple):
        assert isinstance(out_module, tuple)
        for ours, theirs in zip(out_module, out_functional, strict=True):
            assert torch.equal(ours, theirs)
        return  # return_lse: the tuple is the difference
    assert torch.equal(out_module, out_functional)
    if option:
        changed = out_module.shape != out_default.shape or not torch.equal(out_module,
                                                                           out_default)
        changed = changed or any(not torch.equal(g, h)
                                 for g, h in zip(grads_module, grads_default, strict=True))
        assert changed, f"{option} changes nothing: the module may be dropping it"


@requires_triton
@pytest.mark.parametrize("every", [pytest.param(None, marks=pytest.mark.slow),
                                   pytest.param(1, marks=pytest.mark.slow), 3])
def test_module_vocab_order_every(monkeypatch, every):
    """vocab_order_every=None keeps the natural order, 1 sorts on every call (the functional
    "auto"), k sorts on calls 0, k, 2k, … and passes that order in between. The results equal
    the functional call with that order, bit for bit, and meet the bar."""
    computed = []
    sort = fusedloss.nn.order_by_mean_logit

    def spy(*args, **kwargs):
        computed.append(sort(*args, **kwargs))
        return computed[-1]

    monkeypatch.setattr(fusedloss.nn, "order_by_mean_logit", spy)
    module = LinearCrossEntropyLoss(backend="triton", vocab_order_every=every)
    case = replace(BF16, regime="sharp")
    orders_used = []
    for step in range(4):
        problem = make_problem(replace(case, seed=step))  # the model moves between steps
        ours = _forward_backward(lambda x, w, y, b: module(x, w, y), problem)
        order = {None: None, 1: "auto"}.get(every, computed[-1] if computed else None)
        orders_used.append(order)
        functional = _forward_backward(
            lambda x, w, y, b, order=order: linear_cross_entropy(x, w, y, backend="triton",
                                                                 vocab_order=order), problem)
        assert torch.equal(ours[0], functional[0])
        for g, h in zip(ours[1], functional[1], strict=True):
            assert torch.equal(g, h)
    if every in (None, 1):
        assert computed == []  # the functional API sorts ("auto") or not (None) on its own
    else:
        assert len(computed) == 2  # calls 0 and 3
        assert orders_used[0] is orders_used[1] is orders_used[2]
        assert orders_used[3] is not orders_used[0]
        # A reused (stale) order still meets the bar on the last step's data.
        check_case(replace(case, seed=3), "triton", vocab_order=computed[0])


def test_backward_scratch_rule(tune, monkeypatch):
    """The dX scratch per slab: 64 MiB up to 16384 rows (44 MiB with the split accumulator),
    4096 columns beyond, capped at 1 GiB; ``Tuning.scratch_mb`` hands the choice to the engine.
    The LM head passes it to the engine (a fixed 64 MiB made slabs 32 Mi / N columns wide)."""
    from fusedloss.core import engine
    from fusedloss.ops._common import scratch_bytes

    tune(scratch_mb=None)

    def rows(n):
        return torch.empty((n, 8), dtype=torch.bfloat16, device="meta")

    assert scratch_bytes(rows(16384)) == 2**26
    assert scratch_bytes(rows(16384), split=True) == 44 * 2**20
    assert scratch_bytes(rows(40000)) == 40000 * 4096 * 2
    assert scratch_bytes(rows(1 << 20)) == 2**30
    # wide (the ring's blocks): 4096-column slabs at any row count, never below the default
    assert scratch_bytes(rows(16384), wide=True) == 16384 * 4096 * 2
    assert scratch_bytes(rows(4096), wide=True) == 2**26
    assert scratch_bytes(rows(1 << 20), wide=True) == 2**30
    tune(scratch_mb=32.0)
    assert scratch_bytes(rows(40000)) is None  # the engine reads the tuning itself
    tune(scratch_mb=None)

    seen = []
    real = engine.grads

    def spy(*args, **kwargs):
        seen.append(kwargs["plan"].scratch_bytes)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "grads", spy)
    e = torch.randn(20000, 4, requires_grad=True)
    c = torch.randn(7, 4, requires_grad=True)
    linear_cross_entropy(e, c, torch.randint(0, 7, (20000,)), backend="torch").backward()
    assert seen == [20000 * 4096 * 4]


def test_tuning_reads_the_environment_and_tuned_restores():
    """``config.Tuning.from_environment`` reads each FUSEDLOSS_<FIELD> variable as its field's
    type (unset and empty: the default) and names the variable it cannot read; ``tuned``
    changes fields within its block only."""
    tuning = config.Tuning.from_environment({
        "FUSEDLOSS_TMA": "0", "FUSEDLOSS_SPLIT_ACCUMULATOR": "1", "FUSEDLOSS_SCRATCH_MB": "0.5",
        "FUSEDLOSS_FORWARD_TILE": "32,32,32,0,4,2", "FUSEDLOSS_LM_HEAD_CHUNK_BYTES": "4096",
        "FUSEDLOSS_MATERIALIZED_BYTES": "1024", "FUSEDLOSS_GLUON": "", "FUSEDLOSS_OTHER": "x"})
    assert tuning == config.Tuning(
        tma=False, split_accumulator=True, scratch_mb=0.5, lm_head_chunk_bytes=4096,
        forward_tile=config.TileConfig(32, 32, 32, 0, num_warps=4, num_stages=2),
        materialized_bytes=1024)
    for name, bad in [("FUSEDLOSS_TMA", "yes"), ("FUSEDLOSS_SCRATCH_MB", "lots"),
                      ("FUSEDLOSS_BACKWARD_TILE", "32,x"), ("FUSEDLOSS_LM_HEAD_DEFERRED_ROWS",
                                                             "many")]:
        with pytest.raises(ValueError, match=name):
            config.Tuning.from_environment({name: bad})
    for field in dataclasses.fields(config.Tuning):  # every number field reads as its type
        default = field.default
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            name = f"FUSEDLOSS_{field.name.upper()}"
            value = getattr(config.Tuning.from_environment({name: "7"}), field.name)
            assert value == 7 and type(value) is type(default), (name, value)
    before = config.tuning()
    with config.tuned(scratch_mb=1.0, tma=False) as inside:
        assert config.tuning() is inside and inside.scratch_mb == 1.0 and not inside.tma
        assert config.tma_enabled() is False
    assert config.tuning() is before
