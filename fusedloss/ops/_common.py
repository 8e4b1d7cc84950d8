"""What the ops share: their tags, the conventions of their outputs, autocast, the backward's
scratch."""

import contextlib
import functools

import torch
from torch import Tensor

from ..core import config, engine, replay
from ..core.engine import Rows


def replays(a: Tensor, columns: int, backend: str) -> bool:
    """Whether a call over the rows of ``a`` against ``columns`` columns replays its launches
    as a CUDA graph (``core/replay.py``): the Triton backend, products of at most
    ``Tuning.replay_work`` multiply-adds, and no backward-tile recording open (a replay runs
    none of the call's Python)."""
    return (backend == "triton" and not engine.recording_tiles()
            and replay.applies(a.device, a.shape[0] * columns * a.shape[1]))


def row_major(t: Tensor) -> Tensor:
    """t itself when its rows are contiguous (what the kernels address), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def nothing(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """An empty fp32 stand-in, on ``like``'s device, for an output that was not asked for (an op
    returns tensors only; each stand-in is a tensor of its own, as outputs may not alias)."""
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def grad_or_none(grad: Tensor, needed: bool) -> Tensor | None:
    return grad if needed else None


# Autocast (torch.autocast): the matrix operands of every loss are cast to the autocast dtype, as
# PyTorch's own matmuls would be, and the statistics and the loss stay fp32, as PyTorch's own
# losses (autocast's fp32 list) compute them. The functional API casts (``autocast_operands``,
# traceable, so the cast lands in a compiled graph too); the ops' bodies then run with autocast
# off (``op_body``), so that no fp32 product inside them is silently rounded to bf16.
_AUTOCAST_DEVICES = ("cuda", "cpu")
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves float64


def autocast_operands(device: torch.device, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors`` (the matrix operands of a loss: features, classifier, bias) cast to the
    autocast dtype of ``device``'s type while autocast is on there; unchanged otherwise (a
    dtype mismatch then stays the caller's error). float64, non-floating and None entries pass,
    as autocast passes them."""
    if device.type not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device.type):
        return tensors
    dtype = torch.get_autocast_dtype(device.type)
    return tuple(t.to(dtype) if t is not None and t.dtype in _AUTOCAST_ELIGIBLE else t
                 for t in tensors)


def op_body(fn):
    """``fn`` run as an op's body: autocast off on every device (its products and statistics
    choose their own precision), and the device of its first CUDA tensor argument current
    (``on_device``: Triton and cuBLAS launch on the current device)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with on_device(args):
            if not any(torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES):
                return fn(*args, **kwargs)
            with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                return fn(*args, **kwargs)

    return run


def on_device(args: tuple):
    """The device of the first CUDA tensor among ``args`` made current for the block: Triton
    launches its kernels on the current device (a tensor on another one would be read from the
    wrong GPU), as do cuBLAS's handles; nothing to do where it already is current."""
    for t in args:
        if isinstance(t, Tensor) and t.is_cuda:
            if t.device.index != torch.cuda.current_device():
                return torch.cuda.device(t.device)
            break
    return contextlib.nullcontext()


def run_op(op, eager: type[torch.autograd.Function], *args):
    """``op(*args)`` through the dispatcher while ``torch.compile`` traces; in eager mode the
    same host functions through ``eager`` (``eager_function``), without the dispatcher's Python
    layers (~0.3 ms per call)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return eager.apply(*args)


def eager_function(name: str, forward, setup_context, autograd_backward,
                   backward) -> type[torch.autograd.Function]:
    """An autograd Function with the op's forward, setup and backward, called without the
    dispatcher (eager mode). Its forward takes ``ctx`` itself: a Function that defines
    ``setup_context`` instead binds its arguments through ``inspect.signature`` on every call.
    The backward runs without gradient tracking, as the op's body runs below autograd through
    the dispatcher: ``create_graph=True`` gives first-order gradients (the ops have no second
    derivative) instead of failing on the bodies' ``out=`` products."""

    def function_forward(ctx, *args):
        outputs = forward(*args)
        setup_context(ctx, args, outputs)
        return outputs

    def function_backward(ctx, *grads):
        with torch.no_grad():
            return autograd_backward(ctx, *grads, backward_fn=backward)

    return type(name, (torch.autograd.Function,), {
        "__doc__": eager_function.__doc__,
        "forward": staticmethod(function_forward),
        "backward": staticmethod(function_backward),
    })


# Beyond 16384 rows the backward's column slabs are this many columns wide, in a scratch of at
# most this many bytes (``scratch_bytes``); ``backward_row_chunk`` keeps the LM heads' within both.
WIDE_SLAB_COLUMNS = 4096
SCRATCH_CAP_BYTES = 2**30


def scratch_bytes(a: Tensor, split: bool = False, wide: bool = False) -> int | None:
    """The backward's dX scratch per column slab for the rows ``a`` (``engine.grads``'
    ``scratch_bytes``): 64 MiB up to N = 16384 rows (44 MiB with the split accumulator), 4096
    columns wide beyond, up to 1 GiB. ``wide``: slabs of 4096 columns (up to 1 GiB) whatever N,
    but never a smaller scratch than the default — the ring's choice, whose blocks of one
    rank's rows are often 16384 or fewer, each block paying the host's per-slab launches, and
    a replayed contrastive backward's, which holds an fp32 dA beside it anyway.
    ``Tuning.scratch_mb`` overrides. The LM heads and the
    contrastive losses share it: beyond 16384 rows a fixed 64 MiB would leave slabs of
    32 Mi / N columns (256 at N = 131072), each paying the read-modify-write of the fp32 dA.

    Each slab costs the host a launch of the recompute kernel and two cuBLAS calls, so narrower
    slabs let the host set the pace; the split accumulator's 44 MiB keeps a step at b = 16384
    within 64 MiB in all. Beyond 16384 rows 4096 columns amortize each slab's read-modify-write
    of the fp32 dA and give its dB matmul the width to fill the GPU (docs/design.md, "Memory").
    """
    if config.tuning().scratch_mb is not None:
        return None
    n = a.shape[0]
    wide_bytes = int(min(SCRATCH_CAP_BYTES, n * WIDE_SLAB_COLUMNS * a.element_size()))
    if n <= 16384:
        default = 44 * 2**20 if split else 2**26
        return max(default, wide_bytes) if wide else default
    return wide_bytes


def backward_row_chunk(a: Tensor) -> int | None:
    """Compact rows per block of the LM heads' engine backward (``engine.grads``' ``row_chunk``;
    per-token losses, ``return_lse`` and filtering take it, a reduced loss the training path):
    as many as a 1 GiB dX scratch of 4096-column slabs holds (131072 bf16 rows); None when
    ``Tuning.scratch_mb`` sets the scratch. In one block, more rows would narrow the slabs
    (``scratch_bytes`` caps the scratch at 1 GiB), and every slab reads and writes the fp32 dA
    accumulator of all rows, 8·N·D bytes: at N = 581632 (a training step of 142 × 4096 tokens),
    D = 2048 and V = 128256, 144 slabs of 896 columns move ~1.4 TB, in blocks of 131072 rows
    with 32 slabs each ~0.3 TB (arithmetic; not yet timed), and the accumulator shrinks from
    4.8 to 1.1 GB. dB then adds the blocks' parts in an fp32 (V, D) buffer."""
    if config.tuning().scratch_mb is not None:
        return None
    return SCRATCH_CAP_BYTES // (WIDE_SLAB_COLUMNS * a.element_size())


def check_targets(target: Tensor, ignore_index: int, v: int) -> None:
    """ValueError for a target outside [0, V) other than ``ignore_index`` (a read-back)."""
    out_of_range = (target != ignore_index) & ((target < 0) | (target >= v))
    if out_of_range.any():
        bad = int(target[out_of_range][0])
        raise ValueError(f"target holds {bad}, outside [0, {v}) and not "
                         f"ignore_index={ignore_index}")


def all_rows(row_target: Tensor) -> Rows:
    """Every row, in order (the LM heads' kernels compute ignored tokens too)."""
    n = row_target.shape[0]
    return Rows(index=torch.arange(n, device=row_target.device),
                n_valid=torch.full((), n, dtype=torch.int64, device=row_target.device),
                target=row_target, identity=True, all_valid=True)
