"""What the ops share: their tags and the conventions of their outputs."""

import torch
from torch import Tensor

# The ops may wait for the GPU (a read-back), which a CUDA graph cannot capture: Inductor's
# CUDA graphs ("reduce-overhead") leave ops with this tag outside the graph.
CUDAGRAPH_UNSAFE = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),)
                         if tag is not None)


def row_major(t: Tensor) -> Tensor:
    """t itself when its rows are contiguous (what the kernels address), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def nothing(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """An empty fp32 stand-in, on ``like``'s device, for an output that was not asked for (an op
    returns tensors only; each stand-in is a tensor of its own, as outputs may not alias)."""
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def grad_or_none(grad: Tensor, needed: bool) -> Tensor | None:
    return grad if needed else None


def eager_function(name: str, forward, setup_context, autograd_backward,
                   backward) -> type[torch.autograd.Function]:
    """An autograd Function with the op's forward, setup and backward, called without the
    dispatcher (eager mode). Its forward takes ``ctx`` itself: a Function that defines
    ``setup_context`` instead binds its arguments through ``inspect.signature`` on every call."""

    def function_forward(ctx, *args):
        outputs = forward(*args)
        setup_context(ctx, args, outputs)
        return outputs

    def function_backward(ctx, *grads):
        return autograd_backward(ctx, *grads, backward_fn=backward)

    return type(name, (torch.autograd.Function,), {
        "__doc__": eager_function.__doc__,
        "forward": staticmethod(function_forward),
        "backward": staticmethod(function_backward),
    })
