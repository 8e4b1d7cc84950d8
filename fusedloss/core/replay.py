"""Replaying a call's kernel launches as a CUDA graph, where the host would set the pace.

At small sizes the GPU finishes a loss's kernels sooner than the host can issue them: a CLIP
step at b = 16384 (c = 512, bf16) holds ~3 ms of kernels on an H200 but ~30 Triton launches,
~80 torch calls and their Python, which cost the host 4–6 ms (docs/design.md, "Host cost per
call"). :func:`call` runs ``fn(*args)`` eagerly the first time a signature is met (compiling
the kernels), captures its launches into a CUDA graph the second time, and from then on
replays that graph: the arguments' tensors are copied into the graph's own input buffers, the
graph is launched, and its outputs are copied out: whatever ``fn`` launches, the host issues
three calls (a CLIP step's host time measured 4.4–6.2 ms before, 2.0–2.5 ms after, the rest
being autograd and the ops' glue; docs/design.md).

The signature is everything ``fn``'s launches depend on: the structure of the arguments (tuples,
the engine's dataclasses) with their non-tensor values, each tensor's shape, strides, dtype and
device (and which arguments are the same tensor), the tuning in force (``config.tuning()``),
PyTorch's matmul precision settings and the current stream. ``fn`` must be a pure function of
its arguments that reads nothing back to the host (the engine's default paths: docs/design.md,
"Host synchronization"), called with its tensors' device current (as the ops' bodies run:
``ops._common.op_body``), where the graph is captured and replayed.

``reuse`` names tensors whose buffer may still hold them: autograd's saved tensors, which a
backward receives unchanged since the forward copied them (autograd checks their version
counters, ``Tensor._version``, which every in-place write bumps). Such a tensor is not copied
again where its buffer's last copy came from it at its present version: a replayed step copies
its features once.

What a signature holds on the GPU while it stays cached (at most ``CAPACITY`` signatures, the
least recently used dropped first): buffers for its input tensors (shared with the other
graphs replayed on the stream: the forward's A and B are the backward's), the graph's outputs,
and the memory ``fn`` used while it ran (its scratch), reserved for the graph rather than
returned to PyTorch's allocator. ``Tuning.replay_work`` bounds the calls that replay (and so
this memory); ``Tuning.replay_work = 0`` turns replay off. :func:`clear` drops every graph.

Host steps: what ``fn`` must do on the host between its launches, such as posting a transfer to
another process and making the stream wait for it, goes through :func:`host`. Called directly,
``host(action)`` runs ``action()`` then and there; while a call is captured, it ends the graph
captured so far and notes ``action``, and the capture goes on in a new graph (the graphs share
one memory pool): a replay launches the graphs in order and runs each noted action between
them. So a replayed call makes the same host steps, in the same order, as a direct one, and
no transfer is ever captured in a graph: a process may replay while its peer runs directly,
and ``torch.distributed.destroy_process_group`` does not wait for graphs that hold transfers
(NCCL keeps a communicator alive while a graph holds one of its operations). A capture runs no
action: the replay that follows it does.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch

from . import config

CAPACITY = 16  # signatures kept (a graph and its buffers, or a first sight)

_SEEN = object()  # a signature met once: run eagerly, captured at its next call
_DIRECT = object()  # a signature whose capture failed: always run eagerly


def applies(device: torch.device, work: int) -> bool:
    """Whether a call on ``device`` whose products take ``work`` multiply-adds replays: on CUDA,
    up to ``Tuning.replay_work``, with nothing read back by the tuning (``check_values``,
    ``sparse_slabs``), and not while a CUDA graph is being captured (the caller's own graph
    then holds the launches)."""
    tuning = config.tuning()
    return (device.type == "cuda" and 0 < work <= tuning.replay_work
            and not tuning.check_values and not tuning.sparse_slabs
            and not torch.cuda.is_current_stream_capturing())


def call(fn: Callable[..., Any], *args, reuse: tuple[torch.Tensor, ...] = (), **kwargs) -> Any:
    """``fn(*args, **kwargs)``, its launches replayed from a CUDA graph from the second call with
    the same signature on (see the module's doc). The result equals ``fn``'s (the same kernels
    on the same values); its tensors are new, as ``fn``'s would be. ``reuse``: tensors of
    ``args`` that an earlier replay may have left in their buffers (autograd's saved tensors)."""
    tensors: list[torch.Tensor] = []  # each distinct tensor once
    spec = _flatten((args, tuple(sorted(kwargs.items()))), tensors, {})
    key = (fn, spec, tuple(_metadata(t) for t in tensors), config.tuning(), _precision(),
           _stream(tensors[0].device))
    entry = _CACHE.get(key)
    if entry is None:
        result = fn(*args, **kwargs)
        _remember(key, _SEEN)
        return result
    if entry is _SEEN:
        try:
            entry = _capture(fn, spec, tensors)
        except RuntimeError:  # something fn does may not be captured: it runs as it is
            entry = _DIRECT
        _remember(key, entry)
    _CACHE.move_to_end(key)
    if entry is _DIRECT:
        return fn(*args, **kwargs)
    return entry.run(tensors, {id(t) for t in reuse})


def clear() -> None:
    """Drops every cached graph and its buffers."""
    _CACHE.clear()


def host(action: Callable[[], Any]) -> None:
    """``action()``: host work between launches (see the module's doc, "Host steps"), run now,
    or, while :func:`call` captures, at this place in every replay of the captured call."""
    if _TAPES:
        _TAPES[-1].cut(action)
    else:
        action()


class _Tape:
    """A capture in progress, cut into graphs at its host steps: (graph or None where nothing
    was launched, the host step after it or None) in order."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.segments: list[tuple[Any, Callable[[], Any] | None]] = []
        self.graph = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a communication library's) may keep working meanwhile
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def cut(self, action: Callable[[], Any] | None) -> None:
        """Ends the graph being captured, notes ``action`` after it, and (for an action) begins
        the next graph."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.graph.capture_end()
        empty = any("graph is empty" in str(w.message).lower() for w in caught)
        self.segments.append((None if empty else self.graph, action))
        self.graph = None
        if action is not None:
            self.begin()

    def run(self) -> None:
        for graph, action in self.segments:
            if graph is not None:
                graph.replay()
            if action is not None:
                action()


class _Graph:
    """One signature's graph (a ``_Tape``: one or more CUDA graphs between host steps): its
    input buffers, its outputs (structure and tensors)."""

    def __init__(self, tape, inputs: list[torch.Tensor], out_spec, outputs: list[torch.Tensor]):
        self.tape, self.inputs, self.out_spec, self.outputs = tape, inputs, out_spec, outputs

    def run(self, tensors: list[torch.Tensor], reuse: Collection[int] = ()) -> Any:
        """The graph on ``tensors`` (the call's distinct tensors, as ``_flatten`` lists them);
        ``reuse``: the ids of those that need no copy where their buffer holds them."""
        buffers, sources = [], []
        for buffer, t in zip(self.inputs, tensors, strict=True):
            if id(t) in reuse and _holds(buffer, t):
                continue
            buffer.held = (weakref.ref(t), _version(t))  # what it holds once copied
            buffers.append(buffer)
            sources.append(t)
        # One call for all the copies in (and one for all the copies out): each PyTorch call
        # costs the host ~10 µs, and a backward has ~20 tensors.
        if buffers:
            torch._foreach_copy_(buffers, sources)
        self.tape.run()
        copies = [torch.empty_like(t) for t in self.outputs]
        if copies:
            torch._foreach_copy_(copies, self.outputs)
        return _unflatten(self.out_spec, copies)


def _capture(fn, spec, tensors: list[torch.Tensor]) -> _Graph:
    """Captures ``fn`` on buffers shaped as the call's distinct ``tensors`` (the graph's inputs,
    filled at each replay)."""
    inputs = _input_buffers(tensors)
    device = tensors[0].device
    tape = _Tape()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        tape.begin()
        _TAPES.append(tape)
        try:
            args, kwargs = _unflatten(spec, inputs)
            result = fn(*args, **dict(kwargs))
        finally:
            _TAPES.pop()
            tape.cut(None)
    torch.cuda.current_stream(device).wait_stream(stream)
    outputs: list[torch.Tensor] = []
    out_spec = _flatten(result, outputs, None)  # RuntimeError for a result it cannot rebuild
    return _Graph(tape, inputs, out_spec, outputs)


_CACHE: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_TAPES: list[_Tape] = []  # the capture in progress (nested calls run directly inside one)


def _remember(key: tuple, value):
    _CACHE[key] = value
    _CACHE.move_to_end(key)
    while len(_CACHE) > CAPACITY:
        _CACHE.popitem(last=False)
    return value


# ---------------------------------------------------------------------------------------------
# arguments and results as (structure, tensors)


def _flatten(x, leaves: list[torch.Tensor], seen: dict[int, int] | None):
    """A hashable structure of ``x`` (tuples, lists, dataclasses, values) whose tensors stand in
    it as ("tensor", position in ``leaves``). ``seen`` (tensor id → position): a tensor met
    before is not appended again, so ``leaves`` lists the distinct tensors; None, for a
    result: every tensor a leaf of its own, and RuntimeError for an object that is none of
    these."""
    if x is None or type(x) in _PLAIN:
        return ("value", x)
    if isinstance(x, torch.Tensor):
        if seen is None:
            leaves.append(x)
            return ("tensor", len(leaves) - 1)
        if id(x) not in seen:
            seen[id(x)] = len(leaves)
            leaves.append(x)
        return ("tensor", seen[id(x)])
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_flatten(v, leaves, seen) for v in x))
    names = _field_names(type(x))
    if names is not None:
        return (type(x), tuple((name, _flatten(getattr(x, name), leaves, seen))
                               for name in names))
    if seen is None:  # a result: its objects must be rebuilt from tensors, not shared
        raise RuntimeError(f"cannot replay a call that returns a {type(x).__name__}")
    hash(x)  # a value that is part of the signature
    return ("value", x)


_PLAIN = frozenset({bool, int, float, str, torch.dtype, torch.device})  # values as they are
_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _field_names(cls: type) -> tuple[str, ...] | None:
    """A dataclass's field names (None for any other type), looked up once per type: the
    flattening runs at every call."""
    if cls not in _FIELDS:
        _FIELDS[cls] = (tuple(f.name for f in dataclasses.fields(cls))
                        if dataclasses.is_dataclass(cls) else None)
    return _FIELDS[cls]


def _unflatten(spec, leaves: list[torch.Tensor]):
    """``_flatten``'s inverse: ``spec`` with its tensors taken from ``leaves`` by position."""
    kind, body = spec
    if kind == "tensor":
        return leaves[body]
    if kind == "value":
        return body
    if kind in (tuple, list):
        return kind(_unflatten(s, leaves) for s in body)
    obj = object.__new__(kind)  # a dataclass, frozen or not, without running __init__
    for name, s in body:
        object.__setattr__(obj, name, _unflatten(s, leaves))
    return obj


# Input buffers, shared by every graph that replays on one stream: a buffer is filled right
# before each replay that reads it, and the replays on a stream run one after another, so the
# k-th argument of a given shape, strides and dtype in any call can use the same buffer (the
# forward's A and B are the backward's). Held by the graphs; dropped with the last of them.
_BUFFERS: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def _input_buffers(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A buffer for each of ``tensors`` (distinct tensors of one call): the shared one for its
    metadata and its rank among the call's tensors of that metadata."""
    seen: collections.Counter = collections.Counter()
    buffers = []
    for t in tensors:
        meta = (*_metadata(t), _stream(t.device))
        key = (meta, seen[meta])
        seen[meta] += 1
        buffer = _BUFFERS.get(key)
        if buffer is None:
            buffer = _BUFFERS[key] = _buffer(t)
        buffers.append(buffer)
    return buffers


def _holds(buffer: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``buffer``'s last copy came from ``t``, unchanged since (its version). Each
    buffer keeps its last copy's source as ``held``: (a weak reference to the tensor, whose
    id a new tensor may take once it is gone, and its version then)."""
    source, version = buffer.held
    return source() is t and version is not None and version == _version(t)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor (``torch.inference_mode``), which
    keeps none: its buffer is always filled again."""
    return None if t.is_inference() else t._version


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """A tensor to copy ``t``'s values into: ``t``'s strides, or contiguous where ``t`` repeats
    elements (an expand's stride 0), which a copy cannot write."""
    if any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True)):
        buffer = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    else:
        buffer = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    buffer.held = (lambda: None, -1)  # nothing yet (see _holds)
    return buffer


def _metadata(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _stream(device: torch.device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def _precision() -> tuple:
    """PyTorch's settings that select the cuBLAS kernels a graph bakes in."""
    matmul = torch.backends.cuda.matmul
    return (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction,
            torch.are_deterministic_algorithms_enabled())
