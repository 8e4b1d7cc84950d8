"""SwitchBack int8 linear layers (PyTorch path) against float64 / exact-rational references.

References written from the paper's algorithm (Wortsman, Dettmers et al. 2023, SwitchBack):
quantizers against exact rational arithmetic (``fractions.Fraction``, Python's ``round`` is
half-to-even); forward and both gradients of each variant against a float64 emulation of the
quantized arithmetic (integer sums done in int64), to 1 ulp of the output dtype; and the error
against the unquantized layer within the int8 quantization bound (see ``quant_error_bound``).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fusedloss.nn import SwitchBackLinear as SwitchBackLinearFromNN
from fusedloss.switchback import (
    SwitchBackLinear,
    dequantize_rowwise,
    quantize_columnwise_transpose,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tensorwise_transpose,
    restore_linear_layers,
    swap_linear_layers,
    switchback_linear,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VARIANTS = [(me, wq) for me in (False, True) for wq in ("tensorwise", "rowwise")]
INF, NAN = float("inf"), float("nan")


# ------------------------------------------------------------------------------ references


def exact_quantize(values: list[float], absmax: float) -> list[int]:
    """round_half_even(v · 127 / absmax) in exact rational arithmetic."""
    if absmax == 0:
        return [0] * len(values)
    a = Fraction(absmax)
    return [round(Fraction(v) * 127 / a) for v in values]


def ref_quant64(x64: torch.Tensor, absmax64: torch.Tensor) -> torch.Tensor:
    """Float64 quantizer for the emulation (absmax broadcast; absmax 0 -> 0)."""
    safe = torch.where(absmax64 > 0, absmax64, torch.ones_like(absmax64))
    return torch.where(absmax64 > 0, torch.round(x64 * 127 / safe), torch.zeros_like(x64))


def ref_int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_k a[m,k]·b[n,k] with int64 accumulation (a, b hold integers)."""
    return (a.long()[:, None, :] * b.long()[None, :, :]).sum(-1).double()


def emulate(x, w, b, g, *, memory_efficient, weight_quantization):
    """Float64 emulation of one SwitchBack forward/backward. Returns unrounded float64
    (y, dx, dw, db) plus the quantization error bounds of y and dx."""
    dtype = x.dtype
    x64, w64, g64 = x.double(), w.double(), g.double()
    ax = x64.abs().amax(1, keepdim=True)
    qx = ref_quant64(x64, ax)
    if weight_quantization == "rowwise":
        aw = w64.abs().amax(1, keepdim=True)  # (N, 1)
    else:
        aw = w64.abs().amax().reshape(1, 1)
    qw = ref_quant64(w64, aw)
    y = ref_int_matmul(qx, qw) * ax * aw.t() / 127**2
    if b is not None:
        y = y + b.double()
    ag = g64.abs().amax(1, keepdim=True)
    qg = ref_quant64(g64, ag)
    if weight_quantization == "rowwise":
        awt = w64.abs().amax(0, keepdim=True).t()  # one scale per input feature (K, 1)
    else:
        awt = w64.abs().amax().reshape(1, 1)
    qwt = ref_quant64(w64.t(), awt)  # (K, N)
    dx = ref_int_matmul(qg, qwt) * ag * awt.t() / 127**2
    if memory_efficient:
        x_used = (qx * ax / 127).to(dtype).double()  # dequantized X, rounded to the dtype
    else:
        x_used = x64
    dw = g64.t() @ x_used
    db = g64.sum(0) if b is not None else None
    # Quantization error bounds (see quant_error_bound)
    wq_deq = qw * aw / 127
    y_bound = ax / 254 * wq_deq.abs().sum(1)[None, :] + aw.t() / 254 * x64.abs().sum(1, True)
    wt_deq = qwt * awt / 127
    dx_bound = ag / 254 * wt_deq.abs().sum(1)[None, :] + awt.t() / 254 * g64.abs().sum(1, True)
    return y, dx, dw, db, y_bound, dx_bound, x_used


def quant_error_bound():
    """Documentation only. With x̂ = q·a/127 and |x - x̂| <= a/254 (round to nearest, half a
    step), for Ŷ = X̂ Ŵᵀ against Y = X Wᵀ:

        |Ŷ_mn - Y_mn| = |Σ_k (x̂ - x) ŵ + x (ŵ - w)| <= a_x(m)/254 · ‖ŵ_n‖₁ + a_w(n)/254 · ‖x_m‖₁

    (a_w(n) = a_w for tensor-wise W). Since ‖ŵ_n‖₁ <= K a_w and ‖x_m‖₁ <= K a_x, this is at
    most K a_x a_w / 127: the error grows linearly in the inner dimension K, which is why
    SwitchBack keeps the weight gradient (inner dimension = the token count) in 16 bits. The
    same bound holds for dX with (G, Wᵀ) in place of (X, W). The output adds one rounding to
    the output dtype (<= 1 ulp)."""


def ulp_tol(ref64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    return fi.eps * ref64.abs() + fi.smallest_normal * fi.eps


def assert_within_ulp(actual: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype, what: str):
    assert actual.dtype == dtype, (what, actual.dtype)
    err = (actual.double() - ref64).abs()
    tol = ulp_tol(ref64, dtype)
    bad = ~(err <= tol)
    assert not bad.any(), f"{what}: max err {err.max().item()}, at {bad.nonzero()[:3].tolist()}"


def make_case(seed, m, k, n, dtype, scale, outlier, with_bias):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * scale
    if outlier and k > 1:
        x[:, 0] *= 40  # a large feature: the row-wise scales follow it
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)
    w[0] *= 3  # rows of different magnitude: row-wise and tensor-wise scales differ
    b = torch.randn(n, generator=gen, dtype=torch.float64) if with_bias else None
    g = torch.randn(m, n, generator=gen, dtype=torch.float64)
    cast = lambda t: None if t is None else t.to(dtype)
    return cast(x), cast(w), cast(b), cast(g)


def run(x, w, b, g, **opts):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    b = None if b is None else b.clone().requires_grad_(True)
    y = switchback_linear(x, w, b, **opts)
    y.backward(g)
    return y.detach(), x.grad, w.grad, (None if b is None else b.grad)


# ------------------------------------------------------------------------------ quantizers


finite32 = st.floats(-6e4, 6e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw):
    dtype = draw(st.sampled_from(DTYPES))
    m, k = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["floats", "ties", "zeros"]))
    if kind == "floats":
        vals = draw(st.lists(finite32, min_size=m * k, max_size=m * k))
    elif kind == "ties":
        # absmax 127·2^e and entries (j + 1/2)·2^e: exact ties, representable in every dtype
        e = draw(st.integers(-6, 6))
        js = draw(st.lists(st.integers(-127, 126), min_size=m * k, max_size=m * k))
        vals = [(j + 0.5) * 2.0**e for j in js]
        vals[0] = 127 * 2.0**e
    else:
        vals = [0.0] * (m * k)
    x = torch.tensor(vals, dtype=torch.float64).reshape(m, k).to(dtype)
    if kind != "zeros" and m > 1 and draw(st.booleans()):
        x[draw(st.integers(0, m - 1))] = 0  # an all-zero row
    return x


def check_block(q_row: torch.Tensor, absmax: float, x_row: torch.Tensor):
    vals = [float(v) for v in x_row.double()]
    ref_a = max(abs(v) for v in vals)
    assert absmax == ref_a
    assert q_row.tolist() == exact_quantize(vals, ref_a)


@given(matrices())
def test_quantize_rowwise_exact(x):
    q, a = quantize_rowwise(x)
    assert q.dtype == torch.int8 and a.dtype == torch.float32 and a.shape == (x.shape[0],)
    assert int(q.abs().max()) <= 127
    for r in range(x.shape[0]):
        check_block(q[r], float(a[r]), x[r])


@given(matrices())
def test_quantize_tensorwise_exact(x):
    q, a = quantize_tensorwise(x)
    assert a.shape == () and q.shape == x.shape
    check_block(q.flatten(), float(a), x.flatten())
    qt, at = quantize_tensorwise_transpose(x)
    assert qt.is_contiguous() and torch.equal(qt, q.t()) and torch.equal(at, a)
    qc, ac = quantize_columnwise_transpose(x)
    assert qc.shape == (x.shape[1], x.shape[0])
    for c in range(x.shape[1]):
        check_block(qc[c], float(ac[c]), x[:, c])


def test_quantize_round_half_even_and_zero():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5], [0.0] * 7])
    q, a = quantize_rowwise(x)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, 126]
    assert q[1].tolist() == [0] * 7 and a.tolist() == [127.0, 0.0]
    x = torch.tensor([[-3.0, 1.0]])  # a negative absmax element maps to -127
    assert quantize_rowwise(x)[0].tolist() == [[-127, 42]]
    # exact rounding: float32 arithmetic x·fl(127/a) gives 80 here; the exact value rounds to 79
    x = torch.tensor([[1.588769793510437, 0.9945448040962219]])
    assert quantize_rowwise(x)[0].tolist() == [[127, 79]]
    assert exact_quantize([float(v) for v in x[0]], float(x[0, 0])) == [127, 79]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_nonfinite(dtype):
    x = torch.tensor([[1.0, NAN, 2.0], [INF, 1.0, 0.0], [-INF, 0.0, 0.0], [4.0, -2.0, 1.0]],
                     dtype=dtype)
    q, a = quantize_rowwise(x)
    assert q[:3].eq(0).all() and a[:3].isnan().all()  # non-finite row: q = 0, absmax = NaN
    assert q[3].tolist() == [127, -64, 32] and a[3] == 4  # other rows unaffected (63.5 -> 64)
    deq = dequantize_rowwise(q, a, dtype)
    assert deq[:3].isnan().all() and deq[3].isfinite().all()
    q, a = quantize_tensorwise(x)
    assert q.eq(0).all() and a.isnan()
    q, a = quantize_tensorwise(x[3:])
    assert a == 4


# ------------------------------------------------------------------------------ emulation


cases = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 6), st.integers(1, 24), st.integers(1, 6),  # m, k, n
    st.sampled_from(DTYPES),
    st.sampled_from([1e-3, 1.0, 30.0]),  # scale of X
    st.booleans(), st.booleans(),  # outlier feature, bias
)


@given(cases, st.sampled_from(VARIANTS))
def test_variants_match_float64_emulation(case, variant):
    seed, m, k, n, dtype, scale, outlier, with_bias = case
    memory_efficient, wq = variant
    x, w, b, g = make_case(seed, m, k, n, dtype, scale, outlier, with_bias)
    y, dx, dw, db = run(x, w, b, g, memory_efficient=memory_efficient, weight_quantization=wq)
    ry, rdx, rdw, rdb, _, _, x_used = emulate(
        x, w, b, g, memory_efficient=memory_efficient, weight_quantization=wq
    )
    assert_within_ulp(y, ry, dtype, "y")
    assert_within_ulp(dx, rdx, dtype, "dx")
    # dW = dYᵀ X in the dtype (a CPU GEMM accumulating in float32): 1 ulp of the dtype plus the
    # float32 accumulation error m · 2⁻²⁴ · |G|ᵀ|X|.
    acc = m * 2.0**-24 * (g.double().abs().t() @ x_used.abs())
    err = (dw.double() - rdw).abs()
    assert dw.dtype == dtype and (err <= ulp_tol(rdw, dtype) + acc).all(), err.max()
    if with_bias:
        err = (db.double() - rdb).abs()
        assert (err <= ulp_tol(rdb, dtype) + m * 2.0**-24 * g.double().abs().sum(0)).all()


@given(cases, st.sampled_from(VARIANTS))
def test_error_against_unquantized_within_bound(case, variant):
    seed, m, k, n, dtype, scale, outlier, with_bias = case
    memory_efficient, wq = variant
    x, w, b, g = make_case(seed, m, k, n, dtype, scale, outlier, with_bias)
    y, dx, _, _ = run(x, w, b, g, memory_efficient=memory_efficient, weight_quantization=wq)
    _, _, _, _, y_bound, dx_bound, _ = emulate(
        x, w, b, g, memory_efficient=memory_efficient, weight_quantization=wq
    )
    exact_y = x.double() @ w.double().t() + (0 if b is None else b.double())
    exact_dx = g.double() @ w.double()
    eps = torch.finfo(dtype).eps
    for name, out, exact, bound, a_in in (
        ("y", y, exact_y, y_bound, x.double().abs().amax(1, keepdim=True)),
        ("dx", dx, exact_dx, dx_bound, g.double().abs().amax(1, keepdim=True)),
    ):
        tol = bound * (1 + eps) + ulp_tol(exact, dtype) + eps * bound
        assert ((out.double() - exact).abs() <= tol).all(), name
        # the corollary: K · a_in · a_w / 127 (+ output rounding)
        inner = k if name == "y" else n
        worst = inner * a_in * w.double().abs().max() / 127
        assert (bound <= worst * (1 + 1e-12)).all(), name


def test_outlier_feature_hurts_rowwise_x_less_than_tensorwise():
    # Sanity of the analysis: the bound scales with each row's absmax.
    x, w, b, g = make_case(3, 8, 64, 8, torch.float32, 1.0, True, False)
    *_, y_bound, _, _ = emulate(x, w, b, g, memory_efficient=False,
                                weight_quantization="tensorwise")
    assert y_bound.max() < 64 * x.abs().max() * w.abs().max() / 127


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize("dtype", DTYPES)
def test_options_change_the_result(dtype):
    x, w, b, g = make_case(11, 6, 32, 5, dtype, 1.0, True, True)
    out = {v: run(x, w, b, g, memory_efficient=v[0], weight_quantization=v[1]) for v in VARIANTS}
    base = out[(False, "tensorwise")]
    # memory_efficient: same forward and input gradient, a different weight gradient (it uses
    # the dequantized int8 X)
    me = out[(True, "tensorwise")]
    assert torch.equal(me[0], base[0]) and torch.equal(me[1], base[1])
    assert not torch.equal(me[2], base[2])
    assert torch.equal(me[3], base[3])
    # rowwise weights: different forward and input gradient, same (unquantized) weight gradient
    rw = out[(False, "rowwise")]
    assert not torch.equal(rw[0], base[0]) and not torch.equal(rw[1], base[1])
    assert torch.equal(rw[2], base[2])
    assert not torch.equal(out[(True, "rowwise")][2], rw[2])
    # the unquantized weight gradient is exactly dYᵀ X in the dtype
    assert torch.equal(base[2], g.t() @ x)


def test_nan_inf_propagate_as_nan():
    x, w, b, g = make_case(5, 4, 8, 3, torch.bfloat16, 1.0, False, True)
    x[1, 2] = INF
    x[2, 0] = NAN
    for me, wq in VARIANTS:
        y, dx, dw, _ = run(x, w, b, g, memory_efficient=me, weight_quantization=wq)
        assert y[1:3].isnan().all() and y[[0, 3]].isfinite().all()
        assert dx.isfinite().all()  # dX depends on dY and W only
    g2 = g.clone()
    g2[3, 1] = -INF
    y, dx, _, _ = run(x, w, b, g2)
    assert dx[3].isnan().all() and dx[:3].isfinite().all()
    w2 = w.clone()
    w2[0, 0] = INF
    y, dx, _, _ = run(x.nan_to_num(), w2, b, g)
    assert y.isnan().all() and dx.isnan().all()  # tensor-wise W: one Inf poisons every output
    y, _, _, _ = run(x.nan_to_num(), w2, b, g, weight_quantization="rowwise")
    assert y[:, 0].isnan().all() and y[:, 1:].isfinite().all()  # row-wise: only that row


def test_zero_inputs_and_empty_batch():
    w = torch.randn(3, 4)
    y, dx, dw, _ = run(torch.zeros(2, 4), w, None, torch.ones(2, 3))
    assert y.eq(0).all() and dw.eq(0).all() and dx.isfinite().all()
    y, dx, dw, _ = run(torch.zeros(0, 4), w, None, torch.zeros(0, 3))
    assert y.shape == (0, 3) and dx.shape == (0, 4) and dw.eq(0).all()


# ------------------------------------------------------------------------------ module, swap


def test_module_matches_functional_and_shapes():
    torch.manual_seed(0)
    layer = SwitchBackLinearFromNN(12, 7, memory_efficient=True, weight_quantization="rowwise")
    assert SwitchBackLinearFromNN is SwitchBackLinear and isinstance(layer, nn.Linear)
    x = torch.randn(2, 3, 12)
    y = layer(x)
    ref = switchback_linear(x, layer.weight, layer.bias, memory_efficient=True,
                            weight_quantization="rowwise")
    assert y.shape == (2, 3, 7) and torch.equal(y, ref)
    assert layer(torch.randn(12)).shape == (7,)
    assert "memory_efficient=True" in repr(layer) and "rowwise" in repr(layer)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_module_under_autocast_keeps_float32_weights():
    torch.manual_seed(0)
    layer = SwitchBackLinear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    ref = switchback_linear(x.detach().bfloat16(), layer.weight, layer.bias)
    assert torch.equal(y, ref)


class TinyViT(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.patch_embed = nn.Linear(12, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(2)
        )
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        x = self.patch_embed(x)
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


def test_swap_and_restore_keep_weights():
    torch.manual_seed(0)
    model = TinyViT()
    params = dict(model.named_parameters())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4, 12)
    y0 = model(x)
    swapped = swap_linear_layers(model, include="blocks.*", memory_efficient=True)
    assert swapped == ["blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"]
    assert type(model.patch_embed) is nn.Linear and type(model.head) is nn.Linear
    assert isinstance(model.blocks[0][1], SwitchBackLinear) and model.blocks[1][3].memory_efficient
    for name, p in model.named_parameters():
        assert p is params[name]  # the same Parameter objects: an optimizer keeps working
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    y1 = model(x)
    assert not torch.equal(y1, y0) and torch.allclose(y1, y0, atol=0.1, rtol=0.05)
    y1.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert restore_linear_layers(model) == swapped
    assert not any(isinstance(m, SwitchBackLinear) for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert torch.equal(model(x), y0)


def test_swap_filters():
    model = TinyViT()
    assert swap_linear_layers(model, include=lambda name, m: m.out_features == 32) == [
        "blocks.0.1", "blocks.1.1"
    ]
    restore_linear_layers(model)
    got = swap_linear_layers(model, exclude=["patch_embed", "head"], weight_quantization="rowwise")
    assert got == ["blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"]
    assert model.blocks[0][3].weight_quantization == "rowwise"
    restore_linear_layers(model)
    assert swap_linear_layers(model) == [
        "patch_embed", "blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3", "head"
    ]
    assert swap_linear_layers(model) == []  # already swapped: nothing left to swap


# ------------------------------------------------------------------------------ errors


def test_errors_name_the_argument():
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    cases = [
        (dict(x=x.double()), TypeError, "x must be bfloat16"),
        (dict(x=x.long()), TypeError, "x must be bfloat16"),
        (dict(weight=w.double()), TypeError, "weight must be bfloat16"),
        (dict(bias=b.half().double()), TypeError, "bias must be bfloat16"),
        (dict(weight=torch.randn(20)), ValueError, "weight must have 2 dimension"),
        (dict(weight=torch.randn(5, 4, 1)), ValueError, "weight must have 2 dimension"),
        (dict(x=torch.randn(3, 6)), ValueError, "x's last dimension \\(6\\)"),
        (dict(x=torch.tensor(1.0)), ValueError, "x must have at least one dimension"),
        (dict(bias=torch.randn(4)), ValueError, "bias must have shape \\(5,\\)"),
        (dict(bias=torch.randn(5, 1)), ValueError, "bias must have 1 dimension"),
        (dict(weight=torch.randn(0, 4)), ValueError, "weight must be non-empty"),
        (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
        (dict(memory_efficient=1), TypeError, "memory_efficient must be a bool"),
        (dict(weight_quantization="columnwise"), ValueError, "weight_quantization must be"),
        (dict(backend="triton"), ValueError, "not yet available"),
    ]
    for override, exc, msg in cases:
        kw = dict(x=x, weight=w, bias=b)
        kw.update(override)
        with pytest.raises(exc, match=msg):
            switchback_linear(**kw)
    with pytest.raises(ValueError, match="weight_quantization"):
        SwitchBackLinear(4, 5, weight_quantization="vector")
    with pytest.raises(ValueError, match="backend"):
        swap_linear_layers(TinyViT(), backend="triton")
    with pytest.raises(TypeError, match="include"):
        swap_linear_layers(TinyViT(), include=3)
    with pytest.raises(TypeError, match="unknown SwitchBackLinear option"):
        SwitchBackLinear.from_linear(nn.Linear(2, 2), memory_eficient=True)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        quantize_rowwise(torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have 2 dimension"):
        quantize_rowwise(torch.zeros(2))


@pytest.mark.parametrize("options", [{}, {"memory_efficient": True},
                                     {"weight_quantization": "rowwise"}],
                         ids=["switchback", "memory-efficient", "rowwise-weight"])
def test_compiles_fullgraph_like_eager(options):
    """Under torch.compile(fullgraph=True) the same output and gradients, bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    b = torch.randn(5, requires_grad=True)

    def f(x, w, b):
        return switchback_linear(x, w, b, **options)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y = f(x, w, b)
    grads = torch.autograd.grad((y * y).sum(), (x, w, b))
    cy = compiled(x, w, b)
    cgrads = torch.autograd.grad((cy * cy).sum(), (x, w, b))
    assert torch.equal(cy, y)
    for g, cg in zip(grads, cgrads, strict=True):
        assert torch.equal(cg, g)
