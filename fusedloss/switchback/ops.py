"""The Triton primitives as ``torch.library`` custom ops, so that ``torch.compile`` sees each
launch as one opaque node with a fake (shape-only) implementation; in eager mode the host
functions are called directly (the dispatcher's Python layers cost more than a small kernel).

    fusedloss::switchback_quantize            (x, layout, quant_dtype) -> (q, absmax)
    fusedloss::switchback_dequantize_rowwise  (q, absmax, dtype) -> x̂
    fusedloss::switchback_matmul_dequantize   (a, b, absmax_a, absmax_b, bias, out_dtype) -> c
"""

import torch
from torch import Tensor

from . import kernels
from .reference import QUANT_FORMATS

_QUANTIZERS = {
    "rowwise": kernels.quantize_rowwise,
    "tensorwise": kernels.quantize_tensorwise,
    "tensorwise_transpose": kernels.quantize_tensorwise_transpose,
    "columnwise_transpose": kernels.quantize_columnwise_transpose,
}


def _quantize(x: Tensor, layout: str, quant_dtype: str) -> tuple[Tensor, Tensor]:
    return _QUANTIZERS[layout](x, quant_dtype)


quantize_op = torch.library.custom_op("fusedloss::switchback_quantize", _quantize,
                                      mutates_args=())


@quantize_op.register_fake
def _(x, layout, quant_dtype):
    storage = QUANT_FORMATS[quant_dtype][0]
    if layout == "rowwise":
        return x.new_empty(x.shape, dtype=storage), x.new_empty(x.shape[0], dtype=torch.float32)
    if layout == "tensorwise":
        return x.new_empty(x.shape, dtype=storage), x.new_empty((), dtype=torch.float32)
    transposed = x.new_empty((x.shape[1], x.shape[0]), dtype=storage)
    if layout == "tensorwise_transpose":
        return transposed, x.new_empty((), dtype=torch.float32)
    return transposed, x.new_empty(x.shape[1], dtype=torch.float32)


def _dequantize_rowwise(q: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
    return kernels.dequantize_rowwise(q, absmax, dtype)


dequantize_rowwise_op = torch.library.custom_op("fusedloss::switchback_dequantize_rowwise",
                                                _dequantize_rowwise, mutates_args=())


@dequantize_rowwise_op.register_fake
def _(q, absmax, dtype):
    return q.new_empty(q.shape, dtype=dtype)


def _matmul_dequantize(a: Tensor, b: Tensor, absmax_a: Tensor, absmax_b: Tensor,
                       bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    return kernels.matmul_dequantize(a, b, absmax_a, absmax_b, bias, out_dtype)


matmul_dequantize_op = torch.library.custom_op("fusedloss::switchback_matmul_dequantize",
                                               _matmul_dequantize, mutates_args=())


@matmul_dequantize_op.register_fake
def _(a, b, absmax_a, absmax_b, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _quantizer(layout: str):
    host = _QUANTIZERS[layout]

    def quantize(x: Tensor, quant_dtype: str = "int8") -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return quantize_op(x, layout, quant_dtype)
        return host(x, quant_dtype)

    quantize.__doc__ = host.__doc__
    return staticmethod(quantize)


class TritonOps:
    """The primitive operations of SwitchBack as Triton kernels (``reference.TorchOps``' API):
    through the custom ops while ``torch.compile`` traces, straight to the kernels otherwise."""

    quantize_rowwise = _quantizer("rowwise")
    quantize_tensorwise = _quantizer("tensorwise")
    quantize_tensorwise_transpose = _quantizer("tensorwise_transpose")
    quantize_columnwise_transpose = _quantizer("columnwise_transpose")

    @staticmethod
    def dequantize_rowwise(q: Tensor, absmax: Tensor, dtype: torch.dtype) -> Tensor:
        if torch.compiler.is_compiling():
            return dequantize_rowwise_op(q, absmax, dtype)
        return kernels.dequantize_rowwise(q, absmax, dtype)

    @staticmethod
    def matmul_dequantize(a: Tensor, b: Tensor, absmax_a: Tensor, absmax_b: Tensor,
                          bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
        if torch.compiler.is_compiling():
            return matmul_dequantize_op(a, b, absmax_a, absmax_b, bias, out_dtype)
        return kernels.matmul_dequantize(a, b, absmax_a, absmax_b, bias, out_dtype)
