"""SwitchBack int8 linear layers (Wortsman, Dettmers et al. 2023), PyTorch path.

For Y = X Wᵀ (+ b), X of shape (*, in) flattened to (tokens, in):

- forward: X quantized to int8 row-wise (one absmax per token), W tensor-wise (one absmax for
  the tensor; ``weight_quantization="rowwise"``: one per output feature, the paper's
  SwitchBackQ), int8 matmul with integer accumulation, dequantized with both scales, bias added;
- input gradient: dY row-wise int8 times the int8 Wᵀ (tensor-wise: the same scale, quantized
  together with the transpose; rowwise variant: one scale per input feature, i.e. W quantized
  column-wise and transposed), dequantized;
- weight gradient: dYᵀ X in the 16-bit input dtype, unquantized (its inner dimension is the
  token count, where int8 noise would grow); ``memory_efficient=True`` (SwitchBackM) saves
  int8 X and its scales instead of X and dequantizes them for this product.

Quantization (every quantizer below; the numbers are defined here, a later Triton backend must
produce the same int8 values and scales):

    absmax = max |x| over the block (a row, a column, or the whole tensor), kept in float32
             (exact: it is one of the inputs);
    q      = round_half_to_even(x · 127 / absmax), exactly rounded (computed in float64 from
             the exact input; |q| <= 127);
    absmax = 0   -> q = 0 (the block is all zeros);
    a block holding a NaN or ±Inf -> q = 0 and absmax = NaN, so everything computed from that
             block dequantizes to NaN (never a finite wrong number).

Dequantized matmul: C = (Σ_k qa·qb) · absmax_a · absmax_b / 127² (+ bias), the integer sum
exact (here through float64, exact for k < 2⁵³ / 127²), the scaling and bias in float64, one
rounding to the output dtype at the end.

Backends: only ``backend="torch"`` (this emulation, any device) exists now. Triton int8 / fp8
kernels will slot in behind the same primitive functions (``_TorchOps``) in a later release.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = [
    "SwitchBackLinear",
    "dequantize_rowwise",
    "int8_matmul_dequantize",
    "quantize_columnwise_transpose",
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_tensorwise_transpose",
    "restore_linear_layers",
    "swap_linear_layers",
    "switchback_linear",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_QUANTIZATIONS = ("tensorwise", "rowwise")
BACKENDS = ("torch",)
Q_MAX = 127.0


# --------------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------------


def _check_float(name: str, t, dims: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16, float16 or float32, got {t.dtype}"
        )
    if dims is not None and t.dim() not in dims:
        want = " or ".join(str(d) for d in dims)
        raise ValueError(f"{name} must have {want} dimension(s), got shape {tuple(t.shape)}")


def _quantize(x: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q = rne(x·127/absmax) with absmax broadcast against x; non-finite blocks -> (0, NaN)."""
    absmax = absmax.float()
    finite = torch.isfinite(absmax)
    a64 = absmax.double()
    usable = finite & (a64 > 0)
    denom = torch.where(usable, a64, torch.ones_like(a64))
    q = torch.round(x.double() * Q_MAX / denom)  # torch.round: half to even
    q = torch.where(usable, q, torch.zeros_like(q)).clamp_(-Q_MAX, Q_MAX).to(torch.int8)
    state = torch.where(finite, absmax, torch.full_like(absmax, float("nan")))
    return q, state


def _nan_aware_absmax(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    # amax propagates NaN; Inf stays Inf; both end as NaN in _quantize.
    a = x.abs()
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=keepdim)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise int8: x (M, K) -> (q int8 (M, K), absmax float32 (M,)), one scale per row."""
    _check_float("x", x, (2,))
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one column, got shape {tuple(x.shape)}")
    q, state = _quantize(x, _nan_aware_absmax(x, dim=1, keepdim=True))
    return q, state.squeeze(1)


def quantize_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-wise int8: x (any shape, non-empty) -> (q int8, absmax float32 0-d)."""
    _check_float("x", x)
    if x.numel() == 0:
        raise ValueError("x must not be empty for tensor-wise quantization")
    return _quantize(x, _nan_aware_absmax(x))


def quantize_tensorwise_transpose(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-wise int8 of x (M, N), returned transposed and contiguous: (q (N, M), absmax 0-d).

    The same numbers as ``quantize_tensorwise(x)[0].t()``: a kernel fuses the transpose."""
    _check_float("x", x, (2,))
    q, state = quantize_tensorwise(x)
    return q.t().contiguous(), state


def quantize_columnwise_transpose(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise int8 of x (M, N), transposed: (q (N, M), absmax (N,)), one scale per column.

    Equal to ``quantize_rowwise(x.t())``; used for Wᵀ in SwitchBackQ's input gradient."""
    _check_float("x", x, (2,))
    return quantize_rowwise(x.t())


def dequantize_rowwise(q: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (M, K) int8 · absmax (M,) / 127, rounded once to ``dtype``."""
    return (q.double() * (absmax.double()[:, None] / Q_MAX)).to(dtype)


def int8_matmul_dequantize(
    a: torch.Tensor,
    b: torch.Tensor,
    absmax_a: torch.Tensor,
    absmax_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """C = (a @ bᵀ) · absmax_a[:, None] · absmax_b / 127² (+ bias), rounded once to out_dtype.

    a: int8 (M, K) with absmax_a (M,); b: int8 (N, K) with absmax_b 0-d or (N,).
    The integer products are summed exactly (float64 holds every partial sum: |Σ| < 2⁵³)."""
    acc = a.double() @ b.double().t()
    scale = absmax_a.double()[:, None] * absmax_b.double()  # exact: 24 + 24 bits
    c = acc * scale / (Q_MAX * Q_MAX)
    if bias is not None:
        c = c + bias.double()
    return c.to(out_dtype)


class _TorchOps:
    """The primitive operations of SwitchBack on the PyTorch path (a Triton backend provides
    the same five functions with the same numbers)."""

    quantize_rowwise = staticmethod(quantize_rowwise)
    quantize_tensorwise = staticmethod(quantize_tensorwise)
    quantize_tensorwise_transpose = staticmethod(quantize_tensorwise_transpose)
    quantize_columnwise_transpose = staticmethod(quantize_columnwise_transpose)
    dequantize_rowwise = staticmethod(dequantize_rowwise)
    int8_matmul_dequantize = staticmethod(int8_matmul_dequantize)


_BACKEND_OPS = {"torch": _TorchOps}


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


class _SwitchBackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, memory_efficient, rowwise, ops):
        dtype = x2.dtype
        xq, xs = ops.quantize_rowwise(x2)
        if rowwise:
            wq, ws = ops.quantize_rowwise(weight)
        else:
            wq, ws = ops.quantize_tensorwise(weight)
        y = ops.int8_matmul_dequantize(xq, wq, xs, ws, bias, dtype)
        if memory_efficient:
            ctx.save_for_backward(xq, xs, weight)
        else:
            ctx.save_for_backward(x2, weight)
        ctx.memory_efficient, ctx.rowwise, ctx.ops = memory_efficient, rowwise, ops
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, g):
        ops = ctx.ops
        if ctx.memory_efficient:
            xq, xs, weight = ctx.saved_tensors
        else:
            x2, weight = ctx.saved_tensors
        g = g.to(ctx.dtype).contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gq, gs = ops.quantize_rowwise(g)
            if ctx.rowwise:
                wtq, wts = ops.quantize_columnwise_transpose(weight)
            else:
                wtq, wts = ops.quantize_tensorwise_transpose(weight)
            dx = ops.int8_matmul_dequantize(gq, wtq, gs, wts, None, ctx.dtype)
        if ctx.needs_input_grad[1]:
            if ctx.memory_efficient:
                x2 = ops.dequantize_rowwise(xq, xs, ctx.dtype)
            dw = (g.t() @ x2).to(weight.dtype)  # 16 bits: the input dtype
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def _check_options(memory_efficient, weight_quantization, backend) -> None:
    if not isinstance(memory_efficient, bool):
        raise TypeError(f"memory_efficient must be a bool, got {memory_efficient!r}")
    if weight_quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(
            f"weight_quantization must be 'tensorwise' or 'rowwise', got {weight_quantization!r}"
        )
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be 'torch' (the only SwitchBack backend so far; Triton int8/fp8 "
            f"kernels are not yet available), got {backend!r}"
        )


def switchback_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    memory_efficient: bool = False,
    weight_quantization: str = "tensorwise",
    backend: str = "torch",
) -> torch.Tensor:
    """SwitchBack Y = X Wᵀ (+ b) with int8 forward and input-gradient matmuls.

    x (*, in), weight (out, in), bias (out,) or None; bfloat16, float16 or float32 each (the
    weight and bias may differ from x, e.g. float32 master weights: the output and the
    matmuls use x's dtype, the gradients come back in each tensor's own dtype).
    ``memory_efficient``: SwitchBackM; ``weight_quantization="rowwise"``: SwitchBackQ.
    """
    _check_options(memory_efficient, weight_quantization, backend)
    _check_float("x", x)
    _check_float("weight", weight, (2,))
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (*, in_features), got a 0-d tensor")
    out_features, in_features = weight.shape
    if in_features == 0 or out_features == 0:
        raise ValueError(f"weight must be non-empty (out, in), got shape {tuple(weight.shape)}")
    if x.shape[-1] != in_features:
        raise ValueError(
            f"x's last dimension ({x.shape[-1]}) must equal weight's in_features "
            f"({in_features}); x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if bias is not None:
        _check_float("bias", bias, (1,))
        if bias.shape[0] != out_features:
            raise ValueError(
                f"bias must have shape ({out_features},) to match weight, got {tuple(bias.shape)}"
            )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    y = _SwitchBackFunction.apply(
        x2, weight, bias, memory_efficient, weight_quantization == "rowwise",
        _BACKEND_OPS[backend],
    )
    return y.reshape(*lead, out_features)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class SwitchBackLinear(nn.Linear):
    """Drop-in ``nn.Linear`` computing :func:`switchback_linear` (same parameters, same
    state_dict). Under ``torch.autocast`` the input is cast to the autocast dtype as
    ``F.linear`` would; the weight may stay float32 (it is quantized from float32)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        memory_efficient: bool = False,
        weight_quantization: str = "tensorwise",
        backend: str = "torch",
    ) -> None:
        _check_options(memory_efficient, weight_quantization, backend)
        super().__init__(in_features, out_features, bias, device, dtype)
        self.memory_efficient = memory_efficient
        self.weight_quantization = weight_quantization
        self.backend = backend

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> SwitchBackLinear:
        """A SwitchBackLinear sharing ``linear``'s parameters (the same Parameter objects)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        _check_options(
            options.get("memory_efficient", False),
            options.get("weight_quantization", "tensorwise"),
            options.get("backend", "torch"),
        )
        unknown = set(options) - {"memory_efficient", "weight_quantization", "backend"}
        if unknown:
            raise TypeError(f"unknown SwitchBackLinear option(s): {sorted(unknown)}")
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.memory_efficient = options.get("memory_efficient", False)
        new.weight_quantization = options.get("weight_quantization", "tensorwise")
        new.backend = options.get("backend", "torch")
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's parameters."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        lin.train(self.training)
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return switchback_linear(
            x, self.weight, self.bias, memory_efficient=self.memory_efficient,
            weight_quantization=self.weight_quantization, backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, memory_efficient={self.memory_efficient}, "
            f"weight_quantization={self.weight_quantization!r}, backend={self.backend!r}"
        )


def _make_filter(include) -> Callable[[str, nn.Module], bool]:
    if include is None:
        return lambda name, module: True
    if callable(include):
        return include
    if isinstance(include, str):
        include = [include]
    if isinstance(include, Iterable):
        patterns = list(include)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError("include patterns must be strings (fnmatch patterns on module names)")
        return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)
    raise TypeError(
        "include must be None, a callable (name, module) -> bool, or fnmatch pattern(s), "
        f"got {type(include).__name__}"
    )


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def swap_linear_layers(
    model: nn.Module,
    *,
    include=None,
    exclude=None,
    memory_efficient: bool = False,
    weight_quantization: str = "tensorwise",
    backend: str = "torch",
) -> list[str]:
    """Replace ``nn.Linear`` layers of ``model`` (in place) by :class:`SwitchBackLinear`.

    ``include`` / ``exclude``: None, a callable ``(name, module) -> bool``, or fnmatch
    pattern(s) on the qualified module name (e.g. ``include="blocks.*"`` for a ViT's
    transformer blocks, leaving the patch embedding and the head alone). A layer is swapped
    when it is included and not excluded. The new layers share the old layers' Parameters (so
    an optimizer built before keeps working). Returns the swapped names."""
    _check_options(memory_efficient, weight_quantization, backend)
    inc, exc = _make_filter(include), _make_filter(exclude) if exclude is not None else None
    targets = [
        name for name, m in model.named_modules()
        if type(m) is nn.Linear and name and inc(name, m) and not (exc and exc(name, m))
    ]
    if type(model) is nn.Linear:
        raise TypeError("model is itself an nn.Linear: use SwitchBackLinear.from_linear(model)")
    for name in targets:
        old = model.get_submodule(name)
        _set_child(model, name, SwitchBackLinear.from_linear(
            old, memory_efficient=memory_efficient, weight_quantization=weight_quantization,
            backend=backend,
        ))
    return targets


def restore_linear_layers(model: nn.Module) -> list[str]:
    """Replace every :class:`SwitchBackLinear` in ``model`` by a plain ``nn.Linear`` sharing its
    Parameters (undoes :func:`swap_linear_layers`). Returns the restored names."""
    targets = [
        name for name, m in model.named_modules() if isinstance(m, SwitchBackLinear) and name
    ]
    for name in targets:
        _set_child(model, name, model.get_submodule(name).to_linear())
    return targets
