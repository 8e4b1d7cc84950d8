"""SwitchBack linear layers against float64 / exact-rational references, and the Triton backend
against the PyTorch emulation.

References written from the paper's algorithm (Wortsman, Dettmers et al. 2023, SwitchBack) and
the module's definitions: int8 and fp8 (e4m3) quantizers against exact rational arithmetic
(``fractions.Fraction``; Python's ``round`` is half-to-even, e4m3 from its table of values);
forward and both gradients of each variant against a float64 emulation of the quantized
arithmetic (integer sums in int64; fp8 products as integer multiples of 2⁻¹⁸), to 1 ulp of the
output dtype; and the error against the unquantized layer within the quantization bound (see
``quant_error_bound``).

The Triton backend (a CUDA device, or Triton's interpreter under TRITON_INTERPRET=1, which runs
int8 and fp8 ``tl.dot``): every quantizer and the row-wise dequantization bit for bit equal to
the emulation, ties and signed zeros included, on the device itself; the matmul within the
float32-epilogue bound (``epilogue_tol``), its TMA and pointer-load variants bit for bit
alike; whole layers (forward, input gradient within that bound; weight and bias gradients bit
for bit).
"""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    DEVICE,
    requires_cuda,
    requires_triton,
    triton_interpreter_enabled,
)
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fusedloss.core import config
from fusedloss.nn import SwitchBackLinear as SwitchBackLinearFromNN
from fusedloss.switchback import (
    SwitchBackLinear,
    dequantize_rowwise,
    int8_matmul_dequantize,
    kernels,
    matmul_dequantize,
    quantize_columnwise_transpose,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tensorwise_transpose,
    reference,
    resolve_backend,
    restore_linear_layers,
    swap_linear_layers,
    switchback_linear,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VARIANTS = [(me, wq) for me in (False, True) for wq in ("tensorwise", "rowwise")]
QUANT_DTYPES = ["int8", "fp8"]
Q = {"int8": 127, "fp8": 448}
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
INF, NAN = float("inf"), float("nan")
QUANTIZERS = ["quantize_rowwise", "quantize_tensorwise", "quantize_tensorwise_transpose",
              "quantize_columnwise_transpose"]

BACKENDS = [pytest.param("torch", id="torch"),
            pytest.param("triton", id="triton", marks=requires_triton)]


def on_gpu_fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def skip_fp8_without_hardware(backend: str, quant_dtype: str) -> None:
    if backend == "triton" and quant_dtype == "fp8" and DEVICE == "cuda" and not on_gpu_fp8_ok():
        pytest.skip("fp8 kernels need compute capability 8.9+")


# ------------------------------------------------------------------------------ references

# e4m3 (float8_e4m3fn): every finite non-negative value, in code order (= value order)
E4M3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_FRACTIONS = [Fraction(float(v)) for v in E4M3]


def exact_quantize(values: list[float], absmax: float, quant_dtype: str = "int8") -> list:
    """q = round_half_even(v · Q / absmax) (int8) or the nearest e4m3 value, ties to the even
    code (fp8), in exact rational arithmetic."""
    if absmax == 0:
        return [0] * len(values)
    a = Fraction(absmax)
    if quant_dtype == "int8":
        return [round(Fraction(v) * 127 / a) for v in values]
    out = []
    for v in values:
        r = Fraction(v) * 448 / a
        best = min(range(len(E4M3_FRACTIONS)),
                   key=lambda i: (abs(abs(r) - E4M3_FRACTIONS[i]), i % 2))
        out.append(float(E4M3_FRACTIONS[best]) * (-1 if r < 0 else 1))
    return out


def ref_round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 v (|v| <= 448) to the nearest e4m3 value, ties to the even code (table lookup)."""
    a = v.abs()
    hi = torch.searchsorted(E4M3, a).clamp(max=len(E4M3) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return E4M3[pick] * torch.where(v < 0, -1.0, 1.0)


def ref_quant64(x64: torch.Tensor, absmax64: torch.Tensor, quant_dtype: str) -> torch.Tensor:
    """Float64 quantizer for the emulation (absmax broadcast; absmax 0 -> 0)."""
    safe = torch.where(absmax64 > 0, absmax64, torch.ones_like(absmax64))
    v = x64 * Q[quant_dtype] / safe
    q = torch.round(v) if quant_dtype == "int8" else ref_round_e4m3(v)
    return torch.where(absmax64 > 0, q, torch.zeros_like(x64))


def ref_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_k a[m,k]·b[n,k] exactly: int8 values are integers, e4m3 values integer multiples of
    2⁻⁹, so the sum runs in int64 on a·2⁹, b·2⁹."""
    ai, bi = (a * 512).long(), (b * 512).long()
    assert torch.equal(ai.double(), a * 512) and torch.equal(bi.double(), b * 512)
    return (ai[:, None, :] * bi[None, :, :]).sum(-1).double() / 2.0**18


def quant_error(x64: torch.Tensor, absmax64: torch.Tensor, quant_dtype: str) -> torch.Tensor:
    """Bound on |x − x̂| per element: half a step, a/254 (int8); 2⁻⁴|x| within e4m3's normal
    range, 2⁻¹⁰ of a/448 below it (fp8)."""
    if quant_dtype == "int8":
        return (absmax64 / 254).expand_as(x64)
    return x64.abs() / 16 + absmax64 / 448 / 1024


def emulate(x, w, b, g, *, memory_efficient, weight_quantization, quant_dtype="int8"):
    """Float64 emulation of one SwitchBack forward/backward (CPU). Returns the unrounded float64
    y, dx, dw, db; the sums of absolute products behind y and dx scaled like them (y_abs,
    dx_abs); the quantization error bounds of y and dx; the X the weight gradient uses."""
    dtype, q = x.dtype, Q[quant_dtype]
    x64, w64, g64 = x.double().cpu(), w.double().cpu(), g.double().cpu()
    ax = x64.abs().amax(1, keepdim=True)
    qx = ref_quant64(x64, ax, quant_dtype)
    if weight_quantization == "rowwise":
        aw = w64.abs().amax(1, keepdim=True)  # (N, 1)
    else:
        aw = w64.abs().amax().reshape(1, 1)
    qw = ref_quant64(w64, aw, quant_dtype)
    y_scale = ax * aw.t() / q**2
    y = ref_matmul(qx, qw) * y_scale
    y_abs = ref_matmul(qx.abs(), qw.abs()) * y_scale
    if b is not None:
        y = y + b.double().cpu()
    ag = g64.abs().amax(1, keepdim=True)
    qg = ref_quant64(g64, ag, quant_dtype)
    if weight_quantization == "rowwise":
        awt = w64.abs().amax(0, keepdim=True).t()  # one scale per input feature (K, 1)
    else:
        awt = w64.abs().amax().reshape(1, 1)
    qwt = ref_quant64(w64.t(), awt, quant_dtype)  # (K, N)
    dx_scale = ag * awt.t() / q**2
    dx = ref_matmul(qg, qwt) * dx_scale
    dx_abs = ref_matmul(qg.abs(), qwt.abs()) * dx_scale
    if memory_efficient:
        x_used = (qx * ax / q).to(dtype).double()  # dequantized X, rounded to the dtype
    else:
        x_used = x64
    dw = g64.t() @ x_used
    db = g64.sum(0) if b is not None else None
    # Quantization error bounds (see quant_error_bound)
    w_deq, wt_deq = qw * aw / q, qwt * awt / q
    y_bound = (quant_error(x64, ax, quant_dtype) @ w_deq.abs().t()
               + x64.abs() @ quant_error(w64, aw, quant_dtype).t())
    dx_bound = (quant_error(g64, ag, quant_dtype) @ wt_deq.abs().t()
                + g64.abs() @ quant_error(w64.t(), awt, quant_dtype).t())
    return SimpleNamespace(y=y, dx=dx, dw=dw, db=db, y_abs=y_abs, dx_abs=dx_abs,
                           y_bound=y_bound, dx_bound=dx_bound, x_used=x_used)


def quant_error_bound():
    """Documentation only. With x̂ the dequantized x and |x − x̂| <= e_x (``quant_error``: a/254
    for int8, half a step of e4m3 for fp8), for Ŷ = X̂ Ŵᵀ against Y = X Wᵀ:

        |Ŷ_mn − Y_mn| = |Σ_k (x̂ − x) ŵ + x (ŵ − w)| <= Σ_k e_x(m,k) |ŵ_nk| + |x_mk| e_w(n,k)

    For int8 that is a_x(m)/254 · ‖ŵ_n‖₁ + a_w(n)/254 · ‖x_m‖₁ <= K a_x a_w / 127: the error
    grows linearly in the inner dimension K, which is why SwitchBack keeps the weight gradient
    (inner dimension = the token count) in 16 bits. The same bound holds for dX with (G, Wᵀ) in
    place of (X, W). The output adds one rounding to the output dtype (<= 1 ulp)."""


def ulp_tol(ref64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fi = torch.finfo(dtype)
    return fi.eps * ref64.abs() + fi.smallest_normal * fi.eps


def epilogue_tol(ref64, abs64, bias, dtype, k: int, quant_dtype: str) -> torch.Tensor:
    """How far the Triton matmul may lie from the unrounded float64 value (docs/companions.md):
    the output rounding, 8 float32 roundings of the scaled sum and the bias in the epilogue,
    and for fp8 the float32 accumulation of K products (abs64: the scaled Σ|qa·qb|)."""
    magnitude = abs64 + (0 if bias is None else bias.double().cpu().abs())
    tol = ulp_tol(ref64, dtype) + 8 * 2.0**-24 * magnitude
    if quant_dtype == "fp8":
        tol = tol + k * fp8_accumulation_error() * abs64
    return tol


def fp8_accumulation_error() -> float:
    """Relative error per added fp8 product: float32 (the interpreter; tensor cores before
    Hopper). Hopper's fp8 tensor cores add within each K chunk in a narrower accumulator
    (reported at about 14 bits); the bound assumed there has not yet been checked on a GPU."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return 2.0**-13
    return 2.0**-24


def assert_within(actual: torch.Tensor, ref64: torch.Tensor, tol: torch.Tensor, dtype, what):
    assert actual.dtype == dtype, (what, actual.dtype)
    err = (actual.double().cpu() - ref64).abs()
    bad = ~(err <= tol)
    assert not bad.any(), f"{what}: max err {err.max().item()}, at {bad.nonzero()[:3].tolist()}"


def assert_within_ulp(actual: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype, what: str):
    assert_within(actual, ref64, ulp_tol(ref64, dtype), dtype, what)


def assert_same_quantization(got: tuple, want: tuple, what: str = ""):
    """The same quantized values (bit for bit) and the same absmax (NaN where NaN)."""
    (q, a), (q_ref, a_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and a.shape == a_ref.shape, what
    assert torch.equal(q.cpu().view(torch.int8), q_ref.cpu().view(torch.int8)), what
    assert a.dtype == torch.float32 and torch.equal(a.isnan(), a_ref.isnan()), what
    assert torch.equal(a.nan_to_num(), a_ref.nan_to_num()), what


def make_case(seed, m, k, n, dtype, scale, outlier, with_bias, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * scale
    if outlier and k > 1:
        x[:, 0] *= 40  # a large feature: the row-wise scales follow it
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)
    w[0] *= 3  # rows of different magnitude: row-wise and tensor-wise scales differ
    b = torch.randn(n, generator=gen, dtype=torch.float64) if with_bias else None
    g = torch.randn(m, n, generator=gen, dtype=torch.float64)
    cast = lambda t: None if t is None else t.to(dtype=dtype, device=device)
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
def matrices(draw, quant_dtype="int8"):
    dtype = draw(st.sampled_from(DTYPES))
    m, k = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["floats", "ties", "zeros"]))
    if kind == "floats":
        vals = draw(st.lists(finite32, min_size=m * k, max_size=m * k))
    elif kind == "ties" and quant_dtype == "int8":
        # absmax 127·2^e and entries (j + 1/2)·2^e: exact ties, representable in every dtype
        e = draw(st.integers(-6, 6))
        js = draw(st.lists(st.integers(-127, 126), min_size=m * k, max_size=m * k))
        vals = [(j + 0.5) * 2.0**e for j in js]
        vals[0] = 127 * 2.0**e
    elif kind == "ties":
        # absmax 448·2^e and entries halfway between neighbouring e4m3 values, times 2^e
        e = draw(st.integers(-6, 6))
        js = draw(st.lists(st.integers(0, len(E4M3) - 2), min_size=m * k, max_size=m * k))
        signs = draw(st.lists(st.sampled_from([-1, 1]), min_size=m * k, max_size=m * k))
        vals = [s * float(E4M3[j] + E4M3[j + 1]) / 2 * 2.0**e
                for j, s in zip(js, signs, strict=True)]
        vals[0] = 448 * 2.0**e
    else:
        vals = [0.0] * (m * k)
    x = torch.tensor(vals, dtype=torch.float64).reshape(m, k).to(dtype)
    if kind != "zeros" and m > 1 and draw(st.booleans()):
        x[draw(st.integers(0, m - 1))] = 0  # an all-zero row
    return x


def check_block(q_row: torch.Tensor, absmax: float, x_row: torch.Tensor, quant_dtype: str):
    vals = [float(v) for v in x_row.double()]
    ref_a = max(abs(v) for v in vals)
    assert absmax == ref_a
    q = q_row.double().tolist() if quant_dtype == "fp8" else q_row.tolist()
    assert q == exact_quantize(vals, ref_a, quant_dtype)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@given(data=st.data())
def test_quantize_rowwise_exact(quant_dtype, data):
    x = data.draw(matrices(quant_dtype))
    q, a = quantize_rowwise(x, quant_dtype)
    assert q.dtype == STORAGE[quant_dtype] and a.dtype == torch.float32
    assert a.shape == (x.shape[0],) and q.double().abs().max() <= Q[quant_dtype]
    for r in range(x.shape[0]):
        check_block(q[r], float(a[r]), x[r], quant_dtype)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@given(data=st.data())
def test_quantize_tensorwise_exact(quant_dtype, data):
    x = data.draw(matrices(quant_dtype))
    q, a = quantize_tensorwise(x, quant_dtype)
    assert a.shape == () and q.shape == x.shape
    check_block(q.flatten(), float(a), x.flatten(), quant_dtype)
    qt, at = quantize_tensorwise_transpose(x, quant_dtype)
    assert qt.is_contiguous() and torch.equal(qt.view(torch.int8), q.t().view(torch.int8))
    assert torch.equal(at, a)
    qc, ac = quantize_columnwise_transpose(x, quant_dtype)
    assert qc.shape == (x.shape[1], x.shape[0])
    for c in range(x.shape[1]):
        check_block(qc[c], float(ac[c]), x[:, c], quant_dtype)


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


def test_quantize_fp8_rounding():
    # 448 = 1.75·2⁸; ties between e4m3 neighbours go to the even code: 17 (between 16 and 18)
    # -> 16, 19 -> 20, 0.5·2⁻⁹ (between 0 and the smallest subnormal) -> 0; 240 -> 240
    x = torch.tensor([[448.0, 17.0, 19.0, 2.0**-10, -240.0, 3 * 2.0**-10]])
    assert quantize_rowwise(x, "fp8")[0].double().tolist() == [
        [448.0, 16.0, 20.0, 0.0, -240.0, 2 * 2.0**-9]]
    # one rounding from the exact value: a float64 value just above a tie rounds up, where
    # PyTorch's float64 -> float8 conversion (through float32) would round it to the tie first
    v = torch.tensor([17.0 + 2.0**-40], dtype=torch.float64)
    assert reference.round_to_e4m3(v).item() == 18.0 and v.to(torch.float8_e4m3fn).item() == 16
    assert torch.equal(reference.round_to_e4m3(E4M3), E4M3)  # every e4m3 value stays itself


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_nonfinite(dtype, quant_dtype):
    x = torch.tensor([[1.0, NAN, 2.0], [INF, 1.0, 0.0], [-INF, 0.0, 0.0], [4.0, -2.0, 1.0]],
                     dtype=dtype)
    q, a = quantize_rowwise(x, quant_dtype)
    assert q[:3].double().eq(0).all() and a[:3].isnan().all()  # non-finite row: q 0, absmax NaN
    want = {"int8": [127, -64, 32], "fp8": [448, -224, 112]}[quant_dtype]  # 63.5 -> 64
    assert q[3].double().tolist() == want and a[3] == 4  # other rows unaffected
    deq = dequantize_rowwise(q, a, dtype)
    assert deq[:3].isnan().all() and deq[3].isfinite().all()
    q, a = quantize_tensorwise(x, quant_dtype)
    assert q.double().eq(0).all() and a.isnan()
    q, a = quantize_tensorwise(x[3:], quant_dtype)
    assert a == 4


# ------------------------------------------------------------------------------ emulation


cases = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 6), st.integers(1, 24), st.integers(1, 6),  # m, k, n
    st.sampled_from(DTYPES),
    st.sampled_from([1e-3, 1.0, 30.0]),  # scale of X
    st.booleans(), st.booleans(),  # outlier feature, bias
)


@given(cases, st.sampled_from(VARIANTS), st.sampled_from(QUANT_DTYPES))
def test_variants_match_float64_emulation(case, variant, quant_dtype):
    seed, m, k, n, dtype, scale, outlier, with_bias = case
    memory_efficient, wq = variant
    x, w, b, g = make_case(seed, m, k, n, dtype, scale, outlier, with_bias)
    opts = dict(memory_efficient=memory_efficient, weight_quantization=wq,
                quant_dtype=quant_dtype)
    y, dx, dw, db = run(x, w, b, g, backend="torch", **opts)
    ref = emulate(x, w, b, g, **opts)
    assert_within_ulp(y, ref.y, dtype, "y")
    assert_within_ulp(dx, ref.dx, dtype, "dx")
    # dW = dYᵀ X in the dtype (a CPU GEMM accumulating in float32): 1 ulp of the dtype plus the
    # float32 accumulation error m · 2⁻²⁴ · |G|ᵀ|X|.
    acc = m * 2.0**-24 * (g.double().abs().t() @ ref.x_used.abs())
    err = (dw.double() - ref.dw).abs()
    assert dw.dtype == dtype and (err <= ulp_tol(ref.dw, dtype) + acc).all(), err.max()
    if with_bias:
        err = (db.double() - ref.db).abs()
        assert (err <= ulp_tol(ref.db, dtype) + m * 2.0**-24 * g.double().abs().sum(0)).all()


@given(cases, st.sampled_from(VARIANTS), st.sampled_from(QUANT_DTYPES))
def test_error_against_unquantized_within_bound(case, variant, quant_dtype):
    seed, m, k, n, dtype, scale, outlier, with_bias = case
    memory_efficient, wq = variant
    x, w, b, g = make_case(seed, m, k, n, dtype, scale, outlier, with_bias)
    opts = dict(memory_efficient=memory_efficient, weight_quantization=wq,
                quant_dtype=quant_dtype)
    y, dx, _, _ = run(x, w, b, g, backend="torch", **opts)
    ref = emulate(x, w, b, g, **opts)
    exact_y = x.double() @ w.double().t() + (0 if b is None else b.double())
    exact_dx = g.double() @ w.double()
    eps = torch.finfo(dtype).eps
    for name, out, exact, bound, a_in in (
        ("y", y, exact_y, ref.y_bound, x.double().abs().amax(1, keepdim=True)),
        ("dx", dx, exact_dx, ref.dx_bound, g.double().abs().amax(1, keepdim=True)),
    ):
        tol = bound * (1 + eps) + ulp_tol(exact, dtype) + eps * bound
        assert ((out.double() - exact).abs() <= tol).all(), name
        if quant_dtype == "int8":  # the corollary: K · a_in · a_w / 127 (+ output rounding)
            inner = k if name == "y" else n
            worst = inner * a_in * w.double().abs().max() / 127
            assert (bound <= worst * (1 + 1e-12)).all(), name


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_different_magnitudes_keep_their_own_scales(backend, quant_dtype):
    """X and dY are quantized row by row: rows five orders of magnitude apart each keep their
    own absmax, so every row of Y and dX lies within the quantization bound that its own row's
    scale gives (``quant_error_bound``; the Triton matmul adds its epilogue rounding). A tensor-wise
    quantizer, one step a_max / 127 for the whole tensor, rounds the small rows to zero (int8)
    or to a few subnormal steps (fp8): errors the size of those rows, far above their bound.
    With weight_quantization="rowwise" W's rows (forward) and columns (dX) vary the same way."""
    skip_fp8_without_hardware(backend, quant_dtype)
    m, k, n, dtype = 6, 32, 5, torch.float32
    gen = torch.Generator().manual_seed(0)
    rows = 10.0 ** torch.arange(-3.0, 3.0, dtype=torch.float64)  # 1e-3 ... 1e2
    x = torch.randn(m, k, generator=gen, dtype=torch.float64) * rows[:, None]
    g = torch.randn(m, n, generator=gen, dtype=torch.float64) * rows[:, None]
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)
    w = w * (10.0 ** torch.arange(-2.0, 3.0, dtype=torch.float64))[:, None]
    w[:, ::2] *= 1e-3  # every other input feature (a column of W) a thousand times smaller
    b = torch.randn(n, generator=gen, dtype=torch.float64)
    x, w, b, g = (t.to(dtype=dtype, device=DEVICE) for t in (x, w, b, g))
    eps = torch.finfo(dtype).eps
    for wq in ("tensorwise", "rowwise"):
        opts = dict(weight_quantization=wq, quant_dtype=quant_dtype)
        y, dx, _, _ = run(x, w, b, g, backend=backend, **opts)
        ref = emulate(x, w, b, g, memory_efficient=False, **opts)
        exact_y = x.double().cpu() @ w.double().cpu().t() + b.double().cpu()
        exact_dx = g.double().cpu() @ w.double().cpu()
        for name, out, exact, bound, emulated, sum_abs, bias, inner in (
            ("y", y, exact_y, ref.y_bound, ref.y, ref.y_abs, b, k),
            ("dx", dx, exact_dx, ref.dx_bound, ref.dx, ref.dx_abs, None, n),
        ):
            # |out - exact| <= |out - emulated| + |emulated - exact|: the output (and, on Triton,
            # the epilogue's) rounding plus the quantization bound of each entry's own scales.
            tol = bound * (1 + eps) + epilogue_tol(emulated, sum_abs, bias, dtype, inner,
                                                   quant_dtype)
            assert_within(out, exact, tol, dtype, f"{wq} {name}")


def test_matmul_dequantize_reference():
    a = torch.tensor([[127, -3]], dtype=torch.int8)
    b = torch.tensor([[1, 2], [-127, 0]], dtype=torch.int8)
    c = matmul_dequantize(a, b, torch.tensor([127.0]), torch.tensor(254.0), None, torch.float32)
    assert c.tolist() == [[242.0, -32258.0]]  # (127 − 6)·2, −127·127·2
    assert torch.equal(int8_matmul_dequantize(a, b, torch.tensor([127.0]), torch.tensor(254.0),
                                              None, torch.float32), c)
    a8, b8 = a.double().div(127).to(torch.float8_e4m3fn), b.double().to(torch.float8_e4m3fn)
    c8 = matmul_dequantize(a8, b8, torch.tensor([448.0]), torch.tensor([448.0, 896.0]),
                           torch.tensor([0.5, 0.0]), torch.float32)
    exact = (a8.double() @ b8.double().t()) * torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert torch.equal(c8, (exact + torch.tensor([0.5, 0.0], dtype=torch.float64)).float())


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_options_change_the_result(dtype, backend):
    x, w, b, g = make_case(11, 6, 32, 5, dtype, 1.0, True, True, device=DEVICE)
    out = {v: run(x, w, b, g, memory_efficient=v[0], weight_quantization=v[1], backend=backend)
           for v in VARIANTS}
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
    # fp8: another forward and input gradient (and each matches its own emulation elsewhere)
    if not (backend == "triton" and DEVICE == "cuda" and not on_gpu_fp8_ok()):
        fp8 = run(x, w, b, g, quant_dtype="fp8", backend=backend)
        assert not torch.equal(fp8[0], base[0]) and not torch.equal(fp8[1], base[1])
        assert torch.equal(fp8[2], base[2])


def test_backend_option_is_used(monkeypatch):
    """'triton' runs the kernels (here: refuses a device they cannot run on), 'torch' never,
    'auto' picks torch off CUDA."""
    x, w = torch.randn(3, 4, device="meta"), torch.randn(5, 4, device="meta")
    assert switchback_linear(x, w, backend="torch").shape == (3, 5)
    assert switchback_linear(x, w, backend="auto").shape == (3, 5)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, but x is on meta"):
        switchback_linear(x, w, backend="triton")
    assert resolve_backend("auto", torch.zeros(1)) == "torch"
    layer = SwitchBackLinear(4, 5, device="meta", backend="triton")  # the module passes it on
    with pytest.raises(RuntimeError, match="needs CUDA tensors, but x is on meta"):
        layer(x)
    layer.backend = "torch"
    assert layer(x).shape == (3, 5)
    monkeypatch.setattr(config, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, but x is on cpu"):
        switchback_linear(torch.randn(3, 4), torch.randn(5, 4), backend="triton")
    switchback_linear(torch.randn(3, 4), torch.randn(5, 4), backend="torch")


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inf_propagate_as_nan(backend, quant_dtype):
    skip_fp8_without_hardware(backend, quant_dtype)
    x, w, b, g = make_case(5, 4, 8, 3, torch.bfloat16, 1.0, False, True, device=DEVICE)
    opts = dict(backend=backend, quant_dtype=quant_dtype)
    x[1, 2] = INF
    x[2, 0] = NAN
    for me, wq in VARIANTS:
        y, dx, dw, _ = run(x, w, b, g, memory_efficient=me, weight_quantization=wq, **opts)
        assert y[1:3].isnan().all() and y[[0, 3]].isfinite().all()
        assert dx.isfinite().all()  # dX depends on dY and W only
    g2 = g.clone()
    g2[3, 1] = -INF
    y, dx, _, _ = run(x, w, b, g2, **opts)
    assert dx[3].isnan().all() and dx[:3].isfinite().all()
    w2 = w.clone()
    w2[0, 0] = INF
    y, dx, _, _ = run(x.nan_to_num(), w2, b, g, **opts)
    assert y.isnan().all() and dx.isnan().all()  # tensor-wise W: one Inf poisons every output
    y, _, _, _ = run(x.nan_to_num(), w2, b, g, weight_quantization="rowwise", **opts)
    assert y[:, 0].isnan().all() and y[:, 1:].isfinite().all()  # row-wise: only that row


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_inputs_and_empty_batch(backend):
    w = torch.randn(3, 4, device=DEVICE)
    ones = torch.ones(2, 3, device=DEVICE)
    y, dx, dw, _ = run(torch.zeros(2, 4, device=DEVICE), w, None, ones, backend=backend)
    assert y.eq(0).all() and dw.eq(0).all() and dx.isfinite().all()
    y, dx, dw, _ = run(torch.zeros(0, 4, device=DEVICE), w, None, ones[:0], backend=backend,
                       memory_efficient=True)
    assert y.shape == (0, 3) and dx.shape == (0, 4) and dw.eq(0).all()


# ------------------------------------------------------------------------------ Triton backend
# Triton's interpreter runs int8 x int8 -> int32 and fp8 e4m3 x e4m3 -> float32 ``tl.dot``, so
# both formats are checked here at tiny sizes (tiles of 16; shapes past one tile and one K step).

# (rows, columns, with NaN and -Inf in two rows); every matrix past r > 2 has an all-zero row.
# Under the interpreter rows of up to 64 columns are read once (tiles side by side), longer ones
# in two sweeps (150).
ODD_MATRICES = [(1, 1, False), (5, 3, True), (19, 37, False), (37, 19, True), (6, 150, True)]


def odd_matrix(r, c, dtype, seed, nonfinite: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(
        -8, 8, (r, 1), generator=gen)
    if r > 2:
        x[1] = 0  # an all-zero row
    if nonfinite and r > 3 and c > 2:
        x[2, c - 1], x[3, 0] = NAN, -INF
    return x.to(dtype=dtype, device=DEVICE)


@requires_triton
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_quantizers_equal_reference(dtype, quant_dtype):
    skip_fp8_without_hardware("triton", quant_dtype)
    for seed, (r, c, nonfinite) in enumerate(ODD_MATRICES):
        x = odd_matrix(r, c, dtype, seed, nonfinite)
        for name in QUANTIZERS:
            what = f"{name} {tuple(x.shape)} nonfinite={nonfinite}"
            assert_same_quantization(getattr(kernels, name)(x, quant_dtype),
                                     getattr(reference, name)(x, quant_dtype), what)
        q, a = reference.quantize_rowwise(x, quant_dtype)
        torch.testing.assert_close(kernels.dequantize_rowwise(q, a, dtype),
                                   reference.dequantize_rowwise(q, a, dtype),
                                   rtol=0, atol=0, equal_nan=True)
    # a strided input, and a tensor-wise quantization of a 3-d tensor
    x = odd_matrix(19, 37, dtype, 9, False)
    assert_same_quantization(kernels.quantize_rowwise(x.t(), quant_dtype),
                             reference.quantize_rowwise(x.t(), quant_dtype))
    x3 = x[:18].reshape(2, 9, 37)
    assert_same_quantization(kernels.quantize_tensorwise(x3, quant_dtype),
                             reference.quantize_tensorwise(x3, quant_dtype))


@requires_triton
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@given(data=st.data())
def test_triton_quantizers_equal_reference_hypothesis(quant_dtype, data):
    skip_fp8_without_hardware("triton", quant_dtype)
    x = data.draw(matrices(quant_dtype)).to(DEVICE)
    for name in QUANTIZERS:
        assert_same_quantization(getattr(kernels, name)(x, quant_dtype),
                                 getattr(reference, name)(x, quant_dtype), name)


@requires_triton
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (7, 37, 19), (33, 70, 17), (33, 64, 24)],
                         ids=["M1-K1-N1", "M7-K37-N19", "M33-K70-N17", "M33-K64-N24"])
def test_triton_matmul_within_epilogue_bound(m, k, n, quant_dtype):
    """Pointer loads at the odd shapes; TMA tiles (Hopper, the interpreter) where K and N are
    16-byte aligned (M33-K64-N24)."""
    skip_fp8_without_hardware("triton", quant_dtype)
    gen = torch.Generator().manual_seed(m * k * n)
    for dtype in DTYPES:
        for rowwise_b in (False, True):
            for bias_dtype in (None, torch.float32, dtype):
                x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=DEVICE) * 5
                w = torch.randn(n, k, generator=gen).to(dtype=dtype, device=DEVICE)
                bias = (None if bias_dtype is None
                        else torch.randn(n, generator=gen).to(dtype=bias_dtype, device=DEVICE))
                a, sa = reference.quantize_rowwise(x, quant_dtype)
                quantize_b = reference.quantize_rowwise if rowwise_b else \
                    reference.quantize_tensorwise
                b, sb = quantize_b(w, quant_dtype)
                c = kernels.matmul_dequantize(a, b, sa, sb, bias, dtype)
                scale = sa.double().cpu()[:, None] * sb.double().cpu() / Q[quant_dtype] ** 2
                qa, qb = a.double().cpu(), b.double().cpu()
                ref = ref_matmul(qa, qb) * scale + (0 if bias is None else bias.double().cpu())
                abs64 = ref_matmul(qa.abs(), qb.abs()) * scale
                tol = epilogue_tol(ref, abs64, bias, dtype, k, quant_dtype)
                assert_within(c, ref, tol, dtype, f"{dtype} rowwise_b={rowwise_b} {bias_dtype}")


def hard_rows(dtype: torch.dtype, quant_dtype: str) -> torch.Tensor:
    """Rows that each hold their absmax Q·2^e and, times 2^e, every tie between neighbouring
    grid values (e4m3 midpoints, or half-integers), every grid value, +0, -0 and values below
    the smallest step (which round to ±0), both signs; float32 adds subnormal inputs."""
    rows = []
    for e in (-6, 0, 5):
        if quant_dtype == "fp8":
            grid = E4M3
            ties = (E4M3[:-1] + E4M3[1:]) / 2
            tiny = [2.0**-12, 2.0**-11, 3 * 2.0**-11]
        else:
            grid = torch.arange(0, 128, dtype=torch.float64)
            ties = grid[:-1] + 0.5
            tiny = [2.0**-3, 0.25, 0.375]
        body = torch.cat([ties, grid, torch.tensor(tiny, dtype=torch.float64), torch.zeros(1)])
        vals = torch.cat([torch.tensor([Q[quant_dtype]], dtype=torch.float64), body, -body])
        rows.append(vals * 2.0**e)
    x = torch.stack(rows).to(dtype)
    if dtype == torch.float32:
        sub = torch.tensor([2.0**-140, -(2.0**-149), 3 * 2.0**-149, 2.0**-126, -(2.0**-130)])
        x = torch.cat([x, torch.cat([sub, torch.zeros(x.shape[1] - 5)])[None].float()])
    return x


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=requires_cuda, id="gpu"),
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        not triton_interpreter_enabled(), reason="needs TRITON_INTERPRET=1")),
])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_triton_signed_zeros_and_ties(device, quant_dtype):
    """Every tie rounds to even and -0 stays -0, on the device itself: bit for bit the
    emulation's values for each quantizer and input dtype, and the tests' own table-lookup
    rounding (Triton 3.6 compiles -x as 0 - x, and a float32 -> float8 conversion could round
    a tie or a signed zero its own way; the kernels rely on neither)."""
    skip_fp8_without_hardware("triton", quant_dtype)
    for dtype in DTYPES:
        x = hard_rows(dtype, quant_dtype).to(device)
        for name in QUANTIZERS:
            assert_same_quantization(getattr(kernels, name)(x, quant_dtype),
                                     getattr(reference, name)(x, quant_dtype), f"{name} {dtype}")
        q, a = kernels.quantize_rowwise(x, quant_dtype)  # and against the table-lookup rounding
        x64, a64 = x.double().cpu(), x.double().abs().amax(1, keepdim=True).cpu()
        assert torch.equal(a.cpu(), a64[:, 0].float())
        assert torch.equal(q.double().cpu(), ref_quant64(x64, a64, quant_dtype))
        if quant_dtype == "fp8":  # -0 and the negative values below the smallest step: -0
            neg_zero = (x < 0) & (x.double().abs() * 448 < a.double()[:, None] * 2.0**-10)
            neg_zero |= (x == 0) & torch.signbit(x)
            assert neg_zero.sum(1).ge(1).all()
            assert q.view(torch.int8)[neg_zero].eq(-128).all()
            assert q.view(torch.int8)[(x == 0) & ~torch.signbit(x)].eq(0).all()


@requires_triton
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
def test_triton_matmul_tma_and_pointer_paths_agree(quant_dtype):
    """The TMA tiles and the pointer loads give the same C, bit for bit (one epilogue): a few
    tiles under the interpreter, past the Hopper tiles on a GPU (both 128 × 256 and 256 × 128
    tiles); K padded to 16 bytes where it is not (37, 1000), C stored by TMA where its rows are
    16-byte aligned and by pointers where not (N = 19)."""
    skip_fp8_without_hardware("triton", quant_dtype)
    on_gpu = DEVICE == "cuda"
    if on_gpu and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    shapes = [(300, 1000, 520), (600, 640, 1664), (70, 37, 19)] if on_gpu else \
        [(33, 64, 48), (20, 37, 19)]
    gen = torch.Generator().manual_seed(5)
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen).to(DEVICE)
        w = torch.randn(n, k, generator=gen).to(DEVICE)
        a, sa = reference.quantize_rowwise(x, quant_dtype)
        for b, sb in (reference.quantize_tensorwise(w, quant_dtype),
                      reference.quantize_rowwise(w, quant_dtype)):
            for dtype in DTYPES:
                bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE)
                tma = kernels.matmul_dequantize(a, b, sa, sb, bias, dtype, tma=True)
                pointers = kernels.matmul_dequantize(a, b, sa, sb, bias, dtype, tma=False)
                assert torch.equal(tma, pointers), (m, k, n, dtype)


@requires_triton
def test_triton_matmul_falls_back_to_pointer_loads(monkeypatch):
    """Where the TMA variant fails to build, a warning, the pointer loads' result, and no
    second attempt for that configuration."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    launches = []
    launch = kernels._launch_matmul

    def failing_tma(*args, tma):
        launches.append(tma)
        if tma:
            raise RuntimeError("PassManager::run failed")
        launch(*args, tma=tma)

    monkeypatch.setattr(kernels, "_launch_matmul", failing_tma)
    monkeypatch.setattr(kernels, "_TMA_FAILED", set())
    monkeypatch.setattr(config, "tma_enabled", lambda: True)
    a, sa = reference.quantize_rowwise(torch.randn(20, 32, device=DEVICE))
    b, sb = reference.quantize_tensorwise(torch.randn(16, 32, device=DEVICE))
    with pytest.warns(RuntimeWarning, match="TMA matmul failed to build"):
        c = kernels.matmul_dequantize(a, b, sa, sb, None, torch.float32)
    assert launches == [True, False]
    assert torch.equal(c, kernels.matmul_dequantize(a, b, sa, sb, None, torch.float32, tma=False))
    assert launches == [True, False, False]  # remembered: no second attempt
    kernels.matmul_dequantize(a, b, sa, sb, None, torch.float32)
    assert launches == [True, False, False, False]


@requires_triton
@given(cases, st.sampled_from(VARIANTS), st.sampled_from(QUANT_DTYPES))
def test_triton_layer_matches_emulation(case, variant, quant_dtype):
    skip_fp8_without_hardware("triton", quant_dtype)
    seed, m, k, n, dtype, scale, outlier, with_bias = case
    memory_efficient, wq = variant
    x, w, b, g = make_case(seed, m, k, n, dtype, scale, outlier, with_bias, device=DEVICE)
    opts = dict(memory_efficient=memory_efficient, weight_quantization=wq,
                quant_dtype=quant_dtype)
    y, dx, dw, db = run(x, w, b, g, backend="triton", **opts)
    ref = emulate(x, w, b, g, **opts)
    assert_within(y, ref.y, epilogue_tol(ref.y, ref.y_abs, b, dtype, k, quant_dtype), dtype, "y")
    assert_within(dx, ref.dx, epilogue_tol(ref.dx, ref.dx_abs, None, dtype, n, quant_dtype),
                  dtype, "dx")
    # the weight and bias gradients are the PyTorch path's, bit for bit (the same dequantized X)
    _, _, dw_torch, db_torch = run(x, w, b, g, backend="torch", **opts)
    assert torch.equal(dw, dw_torch)
    assert (db is None and db_torch is None) or torch.equal(db, db_torch)


@requires_cuda
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(300, 1000, 520), (1000, 1664, 1280)],
                         ids=["M300-K1000-N520", "M1000-K1664-N1280"])
def test_gpu_layer_at_hopper_tile_sizes(m, k, n, quant_dtype):
    """Shapes past the GPU tiles (128 × 256 × 128, 256 × 128 × 128): several tiles per program
    of the persistent grid, K tails (pointer loads: K = 1000) and TMA tiles (the rest)."""
    skip_fp8_without_hardware("triton", quant_dtype)
    x, w, b, g = make_case(1, m, k, n, torch.bfloat16, 1.0, True, True, device="cuda")
    for wq in ("tensorwise", "rowwise"):
        opts = dict(weight_quantization=wq, quant_dtype=quant_dtype)
        y, dx, dw, _ = run(x, w, b, g, backend="triton", **opts)
        y_t, dx_t, dw_t, _ = run(x, w, b, g, backend="torch", **opts)
        assert resolve_backend("auto", x, quant_dtype) == "triton"
        for name, got, want, inner in (("y", y, y_t, k), ("dx", dx, dx_t, n)):
            err = (got.double() - want.double()).norm() / want.double().norm()
            # within bf16 rounding of the emulation; fp8 adds its accumulation per step of 32
            # products (Hopper: a narrower accumulator than float32, see fp8_accumulation_error)
            tol = 2.0**-8 + (math.ceil(inner / 32) * fp8_accumulation_error()
                             if quant_dtype == "fp8" else 0.0)
            assert err < tol, (name, err.item())
        assert torch.equal(dw, dw_t)


@requires_cuda
def test_gpu_fp8_refused_without_fp8_tensor_cores():
    x, w = torch.randn(4, 8, device="cuda"), torch.randn(3, 8, device="cuda")
    if on_gpu_fp8_ok():
        assert switchback_linear(x, w, quant_dtype="fp8").shape == (4, 3)
    else:
        with pytest.raises(RuntimeError, match="capability 8.9"):
            switchback_linear(x, w, quant_dtype="fp8")


def test_fp8_needs_capability_8_9(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(config, "capability", lambda device: (8, 0))
    with pytest.raises(RuntimeError, match="quant_dtype='fp8' .* capability 8.9 .* 8.0"):
        kernels.check_device("x", cuda, "fp8")
    kernels.check_device("x", cuda, "int8")  # int8 runs on Ampere
    monkeypatch.setattr(config, "capability", lambda device: (9, 0))
    kernels.check_device("x", cuda, "fp8")


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
    fp8 = SwitchBackLinear(12, 7, quant_dtype="fp8", backend="torch")
    fp8.load_state_dict(layer.state_dict())
    assert torch.equal(fp8(x), switchback_linear(x, layer.weight, layer.bias, quant_dtype="fp8"))
    assert not torch.equal(fp8(x), switchback_linear(x, layer.weight, layer.bias))
    assert "quant_dtype='fp8'" in repr(fp8) and "backend='torch'" in repr(fp8)
    assert SwitchBackLinear(2, 2).backend == "auto" and SwitchBackLinear(2, 2).quant_dtype == "int8"


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


def test_swap_filters_and_options():
    model = TinyViT()
    assert swap_linear_layers(model, include=lambda name, m: m.out_features == 32) == [
        "blocks.0.1", "blocks.1.1"
    ]
    restore_linear_layers(model)
    got = swap_linear_layers(model, exclude=["patch_embed", "head"], weight_quantization="rowwise")
    assert got == ["blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3"]
    assert model.blocks[0][3].weight_quantization == "rowwise"
    restore_linear_layers(model)
    assert swap_linear_layers(model, quant_dtype="fp8", backend="torch") == [
        "patch_embed", "blocks.0.1", "blocks.0.3", "blocks.1.1", "blocks.1.3", "head"
    ]
    layer = model.blocks[1][1]
    assert (layer.quant_dtype, layer.backend, layer.memory_efficient) == ("fp8", "torch", False)
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), switchback_linear(x, layer.weight, layer.bias,
                                                   quant_dtype="fp8"))
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
        (dict(quant_dtype="int4"), ValueError, "quant_dtype must be 'int8' or 'fp8'"),
        (dict(quant_dtype=torch.int8), ValueError, "quant_dtype must be"),
        (dict(backend="cuda"), ValueError, "backend must be 'auto', 'triton' or 'torch'"),
        (dict(weight=w.to("meta")), ValueError, "weight is on meta but x is on cpu"),
    ]
    for override, exc, msg in cases:
        kw = dict(x=x, weight=w, bias=b)
        kw.update(override)
        with pytest.raises(exc, match=msg):
            switchback_linear(**kw)
    with pytest.raises(ValueError, match="weight_quantization"):
        SwitchBackLinear(4, 5, weight_quantization="vector")
    with pytest.raises(ValueError, match="quant_dtype"):
        SwitchBackLinear(4, 5, quant_dtype="e5m2")
    with pytest.raises(ValueError, match="backend"):
        swap_linear_layers(TinyViT(), backend="cutlass")
    with pytest.raises(ValueError, match="quant_dtype"):
        swap_linear_layers(TinyViT(), quant_dtype="fp4")
    with pytest.raises(TypeError, match="include"):
        swap_linear_layers(TinyViT(), include=3)
    with pytest.raises(TypeError, match="unknown SwitchBackLinear option"):
        SwitchBackLinear.from_linear(nn.Linear(2, 2), memory_eficient=True)
    with pytest.raises(ValueError, match="backend"):
        SwitchBackLinear.from_linear(nn.Linear(2, 2), backend="tritn")
    with pytest.raises(TypeError, match="x must be bfloat16"):
        quantize_rowwise(torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have 2 dimension"):
        quantize_rowwise(torch.zeros(2))
    with pytest.raises(TypeError, match="a and b must share"):
        matmul_dequantize(torch.zeros(1, 1, dtype=torch.int8),
                          torch.zeros(1, 1).to(torch.float8_e4m3fn), torch.ones(1),
                          torch.ones(()), None, torch.float32)


def test_kernel_errors(monkeypatch):
    x = torch.randn(3, 4)
    monkeypatch.setattr(config, "interpreting", lambda: False)
    for name in QUANTIZERS:
        with pytest.raises(RuntimeError, match="needs CUDA tensors, but x is on cpu"):
            getattr(kernels, name)(x)
    q = torch.zeros(3, 4, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="q is on cpu"):
        kernels.dequantize_rowwise(q, torch.ones(3), torch.float32)
    with pytest.raises(RuntimeError, match="a is on cpu"):
        kernels.matmul_dequantize(q, q, torch.ones(3), torch.ones(()), None, torch.float32)
    monkeypatch.setattr(config, "interpreting", lambda: True)
    big = torch.zeros(1, kernels.INT8_MAX_K + 1, dtype=torch.int8)
    with pytest.raises(ValueError, match="int32 accumulator"):
        kernels.matmul_dequantize(big, big, torch.ones(1), torch.ones(()), None, torch.float32)
    with pytest.raises(ValueError, match="must share K"):
        kernels.matmul_dequantize(q, q[:, :3], torch.ones(3), torch.ones(()), None,
                                  torch.float32)
    monkeypatch.setattr(kernels, "_tma_ready", lambda t: False)  # a GPU without TMA
    with pytest.raises(ValueError, match="tma=True needs TMA"):
        kernels.matmul_dequantize(q, q, torch.ones(3), torch.ones(()), None, torch.float32,
                                  tma=True)


# ------------------------------------------------------------------------------ compile


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"memory_efficient": True},
                                     {"weight_quantization": "rowwise"},
                                     {"quant_dtype": "fp8", "memory_efficient": True}],
                         ids=["switchback", "memory-efficient", "rowwise-weight", "fp8"])
def test_compiles_fullgraph_like_eager(options, backend):
    """Under torch.compile(fullgraph=True) the same output and gradients, bit for bit (the
    Triton kernels are custom ops there: one opaque node each)."""
    skip_fp8_without_hardware(backend, options.get("quant_dtype", "int8"))
    torch.manual_seed(0)
    x = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(5, 8, device=DEVICE, requires_grad=True)
    b = torch.randn(5, device=DEVICE, requires_grad=True)

    def f(x, w, b):
        return switchback_linear(x, w, b, backend=backend, **options)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    y = f(x, w, b)
    grads = torch.autograd.grad((y * y).sum(), (x, w, b))
    cy = compiled(x, w, b)
    cgrads = torch.autograd.grad((cy * cy).sum(), (x, w, b))
    assert torch.equal(cy, y)
    for g, cg in zip(grads, cgrads, strict=True):
        assert torch.equal(cg, g)


def test_import_fusedloss_leaves_the_companions_unloaded():
    """The losses do not pay for the companions' kernels at import; fusedloss.nn still hands
    out SwitchBackLinear on demand."""
    code = ("import sys, fusedloss, fusedloss.nn\n"
            "loaded = sorted(m for m in sys.modules if m.startswith(('fusedloss.switchback', "
            "'fusedloss.optim', 'fusedloss._optim_kernels', 'fusedloss.amp')))\n"
            "assert not loaded, loaded\n"
            "from fusedloss.nn import SwitchBackLinear\n"
            "assert 'fusedloss.switchback' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
