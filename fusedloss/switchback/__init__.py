"""SwitchBack linear layers (Wortsman, Dettmers et al. 2023): int8 (or fp8) forward and
input-gradient matmuls, a 16-bit weight gradient.

For Y = X Wᵀ (+ b), X of shape (*, in) flattened to (tokens, in):

- forward: X quantized row-wise (one absmax per token), W tensor-wise (one absmax for the
  tensor; ``weight_quantization="rowwise"``: one per output feature, the paper's SwitchBackQ),
  a quantized matmul dequantized with both scales, bias added;
- input gradient: dY row-wise times the quantized Wᵀ (tensor-wise: the same scale, quantized
  together with the transpose; rowwise variant: one scale per input feature, i.e. W quantized
  column-wise and transposed), dequantized;
- weight gradient: dYᵀ X in the 16-bit input dtype, unquantized (its inner dimension is the
  token count, where quantization noise would grow); ``memory_efficient=True`` (SwitchBackM)
  saves the quantized X and its scales instead of X and dequantizes them for this product.

``quant_dtype="int8"``: q = round_half_to_even(x · 127 / absmax); ``"fp8"``: q = x · 448 / absmax
rounded to float8 e4m3 (scale absmax / 448), both exactly rounded; ``reference.py`` defines
every number (absmax 0 -> q 0; a block with NaN/Inf -> q 0, absmax NaN).

Backends (``backend=``): ``"torch"`` is the exact emulation in ``reference.py`` (any device);
``"triton"`` runs the kernels of ``kernels.py`` on CUDA tensors (or the CPU under
TRITON_INTERPRET=1): the same quantized values and scales bit for bit, the matmul's
dequantization in a float32 epilogue (a few float32 roundings before the output rounding, where
the emulation scales in float64); ``"auto"`` (default): the Triton kernels on CUDA tensors (fp8: on
GPUs with fp8 tensor cores), the emulation elsewhere.

This file holds the public API and the autograd Function; ``reference.py`` the specification
and PyTorch path, ``kernels.py`` the Triton kernels, ``ops.py`` their ``torch.library`` ops.
docs/companions.md has the error bounds and the numerics of each backend.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from . import kernels
from .ops import TritonOps
from .reference import (
    QUANT_FORMATS,
    TorchOps,
    check_float,
    check_quant_dtype,
    dequantize_rowwise,
    int8_matmul_dequantize,
    matmul_dequantize,
    quantize_columnwise_transpose,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tensorwise_transpose,
)

__all__ = [
    "SwitchBackLinear",
    "dequantize_rowwise",
    "int8_matmul_dequantize",
    "matmul_dequantize",
    "quantize_columnwise_transpose",
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_tensorwise_transpose",
    "restore_linear_layers",
    "swap_linear_layers",
    "switchback_linear",
]

WEIGHT_QUANTIZATIONS = ("tensorwise", "rowwise")
QUANT_DTYPES = tuple(QUANT_FORMATS)
BACKENDS = ("auto", "triton", "torch")
_OPS = {"torch": TorchOps, "triton": TritonOps}
_OPTION_NAMES = ("memory_efficient", "weight_quantization", "quant_dtype", "backend")


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def _check_options(memory_efficient, weight_quantization, quant_dtype, backend) -> None:
    if not isinstance(memory_efficient, bool):
        raise TypeError(f"memory_efficient must be a bool, got {memory_efficient!r}")
    if weight_quantization not in WEIGHT_QUANTIZATIONS:
        raise ValueError(
            f"weight_quantization must be 'tensorwise' or 'rowwise', got {weight_quantization!r}"
        )
    check_quant_dtype(quant_dtype)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def resolve_backend(backend: str, x: torch.Tensor, quant_dtype: str = "int8") -> str:
    """'auto' -> 'triton' where x is on a CUDA device whose tensor cores take the format (int8:
    any; fp8: capability 8.9+), else 'torch'; 'triton' checks that x's device can run the
    kernels (CUDA, fp8: capability 8.9+; the CPU only under TRITON_INTERPRET=1)."""
    if backend == "auto":
        backend = "triton" if kernels.runs_natively(x.device, quant_dtype) else "torch"
    if backend == "triton" and not torch.compiler.is_compiling():
        # While torch.compile traces, the kernels' host functions check at run time instead.
        kernels.check_device("x", x, quant_dtype)
    return backend


@dataclass(frozen=True)
class SwitchBackParams:
    """The options of one SwitchBack call, the backend resolved ("torch" or "triton")."""

    memory_efficient: bool
    rowwise_weight: bool
    quant_dtype: str
    backend: str


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


class SwitchBackFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, params: SwitchBackParams):
        # x2 (tokens, in) contiguous; weight (out, in); bias (out,) or None
        ops, qd = _OPS[params.backend], params.quant_dtype
        dtype = x2.dtype
        xq, xs = ops.quantize_rowwise(x2, qd)
        if params.rowwise_weight:
            wq, ws = ops.quantize_rowwise(weight, qd)
        else:
            wq, ws = ops.quantize_tensorwise(weight, qd)
        y = ops.matmul_dequantize(xq, wq, xs, ws, bias, dtype)
        if params.memory_efficient:
            ctx.save_for_backward(xq, xs, weight)
        else:
            ctx.save_for_backward(x2, weight)
        ctx.params, ctx.dtype = params, dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, g):
        params = ctx.params
        ops, qd = _OPS[params.backend], params.quant_dtype
        if params.memory_efficient:
            xq, xs, weight = ctx.saved_tensors
        else:
            x2, weight = ctx.saved_tensors
        g = g.to(ctx.dtype).contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gq, gs = ops.quantize_rowwise(g, qd)
            if params.rowwise_weight:
                wtq, wts = ops.quantize_columnwise_transpose(weight, qd)
            else:
                wtq, wts = ops.quantize_tensorwise_transpose(weight, qd)
            dx = ops.matmul_dequantize(gq, wtq, gs, wts, None, ctx.dtype)
        if ctx.needs_input_grad[1]:
            if params.memory_efficient:
                x2 = ops.dequantize_rowwise(xq, xs, ctx.dtype)
            dw = (g.t() @ x2).to(weight.dtype)  # 16 bits: the input dtype
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            # float32 sums read dY once (g.float() would first write a float32 copy of it)
            db = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


def switchback_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    memory_efficient: bool = False,
    weight_quantization: str = "tensorwise",
    quant_dtype: str = "int8",
    backend: str = "auto",
) -> torch.Tensor:
    """SwitchBack Y = X Wᵀ (+ b) with quantized forward and input-gradient matmuls.

    x (*, in), weight (out, in), bias (out,) or None; bfloat16, float16 or float32 each (the
    weight and bias may differ from x, e.g. float32 master weights: the output and the
    matmuls use x's dtype, the gradients come back in each tensor's own dtype). Approximates
    ``F.linear(x, weight, bias)`` (the error bound is in docs/companions.md).

    ``memory_efficient``: SwitchBackM (save the quantized X for the weight gradient);
    ``weight_quantization="rowwise"``: SwitchBackQ (one weight scale per output feature);
    ``quant_dtype``: "int8" or "fp8" (e4m3; the Triton backend needs compute capability 8.9+);
    ``backend``: "auto" (for now the PyTorch emulation), "triton" or "torch".

        y = switchback_linear(x, layer.weight, layer.bias, quant_dtype="fp8")
    """
    _check_options(memory_efficient, weight_quantization, quant_dtype, backend)
    check_float("x", x)
    check_float("weight", weight, (2,))
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
        check_float("bias", bias, (1,))
        if bias.shape[0] != out_features:
            raise ValueError(
                f"bias must have shape ({out_features},) to match weight, got {tuple(bias.shape)}"
            )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    params = SwitchBackParams(
        memory_efficient=memory_efficient, rowwise_weight=weight_quantization == "rowwise",
        quant_dtype=quant_dtype, backend=resolve_backend(backend, x, quant_dtype),
    )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    y = SwitchBackFunction.apply(x2, weight, bias, params)
    return y.reshape(*lead, out_features)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class SwitchBackLinear(nn.Linear):
    """Drop-in ``nn.Linear`` computing :func:`switchback_linear` (same parameters, same
    state_dict, same options). Under ``torch.autocast`` the input is cast to the autocast dtype
    as ``F.linear`` would; the weight may stay float32 (it is quantized from float32)."""

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
        quant_dtype: str = "int8",
        backend: str = "auto",
    ) -> None:
        _check_options(memory_efficient, weight_quantization, quant_dtype, backend)
        super().__init__(in_features, out_features, bias, device, dtype)
        self.memory_efficient = memory_efficient
        self.weight_quantization = weight_quantization
        self.quant_dtype = quant_dtype
        self.backend = backend

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> SwitchBackLinear:
        """A SwitchBackLinear sharing ``linear``'s parameters (the same Parameter objects);
        ``options``: those of the constructor after ``*``."""
        unknown = set(options) - set(_OPTION_NAMES)
        if unknown:
            raise TypeError(f"unknown SwitchBackLinear option(s): {sorted(unknown)}")
        defaults = dict(memory_efficient=False, weight_quantization="tensorwise",
                        quant_dtype="int8", backend="auto")
        options = {**defaults, **options}
        _check_options(**options)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        for name, value in options.items():
            setattr(new, name, value)
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
        device_type = x.device.type if isinstance(x, torch.Tensor) else None
        if (device_type and torch.amp.is_autocast_available(device_type)
                and torch.is_autocast_enabled(device_type)):
            x = x.to(torch.get_autocast_dtype(device_type))
        return switchback_linear(
            x, self.weight, self.bias, memory_efficient=self.memory_efficient,
            weight_quantization=self.weight_quantization, quant_dtype=self.quant_dtype,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, memory_efficient={self.memory_efficient}, "
            f"weight_quantization={self.weight_quantization!r}, "
            f"quant_dtype={self.quant_dtype!r}, backend={self.backend!r}"
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
    quant_dtype: str = "int8",
    backend: str = "auto",
) -> list[str]:
    """Replace ``nn.Linear`` layers of ``model`` (in place) by :class:`SwitchBackLinear` with
    the given options.

    ``include`` / ``exclude``: None, a callable ``(name, module) -> bool``, or fnmatch
    pattern(s) on the qualified module name (e.g. ``include="blocks.*"`` for a ViT's
    transformer blocks, leaving the patch embedding and the head alone). A layer is swapped
    when it is included and not excluded. The new layers share the old layers' Parameters (so
    an optimizer built before keeps working). Returns the swapped names."""
    options = dict(memory_efficient=memory_efficient, weight_quantization=weight_quantization,
                   quant_dtype=quant_dtype, backend=backend)
    _check_options(**options)
    inc, exc = _make_filter(include), _make_filter(exclude) if exclude is not None else None
    targets = [
        name for name, m in model.named_modules()
        if type(m) is nn.Linear and name and inc(name, m) and not (exc and exc(name, m))
    ]
    if type(model) is nn.Linear:
        raise TypeError("model is itself an nn.Linear: use SwitchBackLinear.from_linear(model)")
    for name in targets:
        _set_child(model, name, SwitchBackLinear.from_linear(model.get_submodule(name), **options))
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
