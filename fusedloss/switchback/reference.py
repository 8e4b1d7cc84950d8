"""The SwitchBack primitives on the PyTorch path: the exact specification of every number.

Each function here defines what a backend must compute; the Triton kernels (``kernels.py``)
produce the same int8 / fp8 values and scales bit for bit, and the same dequantized products up
to their float32 epilogue (see the package docstring). Any device, any size; not fast.

Quantization of a block (a row, a column, or the whole tensor) to ``quant_dtype``:

    absmax = max |x| over the block, in float32 (exact: it is one of the inputs)
    int8:  q = round_half_to_even(x · 127 / absmax)          |q| <= 127
    fp8:   q = round_to_e4m3_nearest_even(x · 448 / absmax)   |q| <= 448 (float8_e4m3fn)

both exactly rounded (x · Q / absmax is computed in float64 from the exact input; no rational
x · Q / absmax lies within float64's rounding error of an int8 or e4m3 rounding boundary without
being on it, so the float64 value rounds like the exact one). The fp8 scale is absmax / 448 as a
real number; the state kept is absmax, as for int8. absmax = 0 -> q = 0; a block holding NaN or
±Inf -> q = 0 and absmax = NaN, so everything computed from it dequantizes to NaN.

Dequantized matmul: C = (Σ_k qa·qb) · absmax_a · absmax_b / Q² (+ bias), Q = 127 or 448. The
sum of products is exact in float64 (int8: for K < 2⁵³ / 127²; fp8: every product is a multiple
of 2⁻¹⁸ below 448², so for K < 2¹⁷), the scaling and bias are float64, and one conversion to
the output dtype ends it (PyTorch converts float64 through float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "dequantize_rowwise",
    "int8_matmul_dequantize",
    "matmul_dequantize",
    "quantize_columnwise_transpose",
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_tensorwise_transpose",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: quant_dtype -> (storage dtype, Q: the largest quantized magnitude)
QUANT_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_Q_OF_STORAGE = {storage: q for storage, q in QUANT_FORMATS.values()}


def check_float(name: str, t, dims: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        want = " or ".join(str(d) for d in dims)
        raise ValueError(f"{name} must have {want} dimension(s), got shape {tuple(t.shape)}")


def check_quant_dtype(quant_dtype) -> None:
    if quant_dtype not in QUANT_FORMATS:
        raise ValueError(f"quant_dtype must be 'int8' or 'fp8', got {quant_dtype!r}")


def q_max(storage: torch.dtype) -> float:
    """Q of a quantized tensor's dtype (127 for int8, 448 for float8_e4m3fn)."""
    if storage not in _Q_OF_STORAGE:
        raise TypeError(f"expected an int8 or float8_e4m3fn tensor, got {storage}")
    return _Q_OF_STORAGE[storage]


def round_to_e4m3(v: Tensor) -> Tensor:
    """float64 v (|v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in one
    rounding (PyTorch's float64 -> float8 conversion goes through float32: two roundings)."""
    # e4m3: 3 fraction bits; normal binades from 2⁻⁶, below that a fixed step of 2⁻⁹.
    _, exponent = torch.frexp(v)  # v = m · 2^exponent, 1/2 <= |m| < 1
    step = (exponent - 1).clamp(min=-6) - 3
    return torch.ldexp(torch.round(torch.ldexp(v, -step)), step)  # ldexp: exact scaling


def _quantize(x: Tensor, absmax: Tensor, quant_dtype: str) -> tuple[Tensor, Tensor]:
    """q of x with absmax broadcast against it; non-finite blocks -> (0, NaN)."""
    storage, q = QUANT_FORMATS[quant_dtype]
    absmax = absmax.float()
    finite = torch.isfinite(absmax)
    a64 = absmax.double()
    usable = finite & (a64 > 0)
    denom = torch.where(usable, a64, torch.ones_like(a64))
    v = torch.where(usable, x.double() * q / denom, torch.zeros((), dtype=torch.float64,
                                                                device=x.device))
    if quant_dtype == "int8":
        quantized = torch.round(v).clamp_(-q, q).to(storage)  # torch.round: half to even
    else:
        quantized = round_to_e4m3(v).to(storage)  # representable: the conversion is exact
    state = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
    return quantized, state


def _absmax(x: Tensor, dim=None) -> Tensor:
    # amax propagates NaN; Inf stays Inf; both end as NaN in _quantize.
    a = x.abs()
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=True)


def quantize_rowwise(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Row-wise: x (M, K) -> (q (M, K) int8 or float8_e4m3fn, absmax (M,) float32)."""
    check_float("x", x, (2,))
    check_quant_dtype(quant_dtype)
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one column, got shape {tuple(x.shape)}")
    q, state = _quantize(x, _absmax(x, dim=1), quant_dtype)
    return q, state.squeeze(1)


def quantize_tensorwise(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Tensor-wise: x (any shape, non-empty) -> (q, absmax float32 0-d)."""
    check_float("x", x)
    check_quant_dtype(quant_dtype)
    if x.numel() == 0:
        raise ValueError("x must not be empty for tensor-wise quantization")
    return _quantize(x, _absmax(x), quant_dtype)


def quantize_tensorwise_transpose(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Tensor-wise of x (M, N), returned transposed and contiguous: (q (N, M), absmax 0-d).

    The same numbers as ``quantize_tensorwise(x)[0].t()``: a kernel fuses the transpose."""
    check_float("x", x, (2,))
    q, state = quantize_tensorwise(x, quant_dtype)
    return q.t().contiguous(), state


def quantize_columnwise_transpose(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
    """Column-wise of x (M, N), transposed: (q (N, M), absmax (N,)), one scale per column.

    Equal to ``quantize_rowwise(x.t())``; used for Wᵀ in SwitchBackQ's input gradient."""
    check_float("x", x, (2,))
    return quantize_rowwise(x.t(), quant_dtype)


def dequantize_rowwise(q: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    """q (M, K) int8 or float8_e4m3fn · absmax (M,) / Q, converted once to ``dtype``."""
    return (q.double() * (absmax.double()[:, None] / q_max(q.dtype))).to(dtype)


def matmul_dequantize(
    a: Tensor,  # (M, K) int8 or float8_e4m3fn
    b: Tensor,  # (N, K), a's dtype
    absmax_a: Tensor,  # (M,) float32
    absmax_b: Tensor,  # () or (N,) float32
    bias: Tensor | None,  # (N,)
    out_dtype: torch.dtype,
) -> Tensor:
    """C = (a @ bᵀ) · absmax_a[:, None] · absmax_b / Q² (+ bias), converted once to out_dtype.

    The products are summed exactly in float64 (see the module docstring for the bounds on K)."""
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a quantized dtype, got {a.dtype} and {b.dtype}")
    q = q_max(a.dtype)
    acc = a.double() @ b.double().t()
    scale = absmax_a.double()[:, None] * absmax_b.double()  # exact: 24 + 24 bits
    c = acc * scale / (q * q)
    if bias is not None:
        c = c + bias.double()
    return c.to(out_dtype)


def int8_matmul_dequantize(a, b, absmax_a, absmax_b, bias, out_dtype) -> Tensor:
    """:func:`matmul_dequantize` (the name from before the fp8 format; it takes both)."""
    return matmul_dequantize(a, b, absmax_a, absmax_b, bias, out_dtype)


class TorchOps:
    """The primitive operations of SwitchBack on the PyTorch path; ``kernels.TritonOps`` has the
    same functions with the same signatures."""

    quantize_rowwise = staticmethod(quantize_rowwise)
    quantize_tensorwise = staticmethod(quantize_tensorwise)
    quantize_tensorwise_transpose = staticmethod(quantize_tensorwise_transpose)
    quantize_columnwise_transpose = staticmethod(quantize_columnwise_transpose)
    dequantize_rowwise = staticmethod(dequantize_rowwise)
    matmul_dequantize = staticmethod(matmul_dequantize)
