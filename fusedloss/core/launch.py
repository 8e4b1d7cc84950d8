"""Triton launches without the JIT's per-launch cost.

Launching a kernel through Triton's JIT (``kernel[grid](...)``) binds and specializes every
argument, looks the kernel up in its cache, finds the device and the stream and builds launch
metadata, every time: 20–100 µs of host time per launch (docs/design.md, "Host cost per
call"), where a short call's kernels take less on the GPU, so the host sets the pace.

- :func:`launch` is ``kernel[grid](**arguments)`` for any launch: it computes the
  specialization Triton would (each tensor's dtype and 16-byte alignment, each integer's
  width and divisibility, the compile-time values and launch options) as a key, and launches
  through the compiled kernel's own launcher once this process has compiled that key, with the
  device's current stream.
- :class:`RepeatedLaunch` serves one kernel launched many times in a call with arguments that
  barely change (the backward's slabs): the arguments are bound once per call.

Under Triton's interpreter, with a launch hook registered (a profiler's), or for arguments the
key does not cover, launches go through the JIT.
"""

from __future__ import annotations

from typing import Any

import torch

from . import config

#: (kernel, device, specialization, options) → launcher of its compiled kernel (``_launcher``)
_LAUNCHERS: dict[tuple, Any] = {}

_UNKEYED = object()  # an argument the key does not cover: the launch goes through the JIT


def launch(kernel, grid: tuple[int, ...], *args, **arguments) -> None:
    """``kernel[grid](*args, **arguments)``: the kernel's parameters, every one given, in
    order and by name, then the launch options (``num_warps``, ``num_stages``, ...) by name."""
    if config.interpreting() or not hasattr(kernel, "params"):
        kernel[grid](*args, **arguments)
        return
    names, params = _parameters(kernel)[0], _parameters(kernel)[5]
    if len(args) > len(names) or any(name not in arguments for name in names[len(args):]):
        kernel[grid](*args, **arguments)  # (Triton's defaults, or its error naming the gap)
        return
    values = [*args, *(arguments[name] for name in names[len(args):])]
    options = {k: v for k, v in arguments.items() if k not in params}
    key, addresses = _specialization(kernel, names, values, options)
    launcher = _LAUNCHERS.get(key) if key is not None else None
    if launcher is None:
        _compile(kernel, grid, names, values, options, key)
        return
    launcher((*grid, 1, 1)[:3], values, addresses)


def _specialization(kernel, names, values, options) -> tuple[tuple | None, list]:
    """(the launch's key in ``_LAUNCHERS``, or None where it has none; what the launcher
    receives: the values with tensors as addresses)."""
    params = _parameters(kernel)[5]
    spec, addresses = [], []
    for name, value in zip(names, values, strict=True):
        if params[name].is_constexpr:
            spec.append((type(value), value))
            addresses.append(value)
            continue
        argument_key, address = _argument_key(value)
        if argument_key is _UNKEYED:
            return None, addresses
        spec.append(argument_key)
        addresses.append(address)
    key = (kernel, torch.cuda.current_device(), tuple(spec), tuple(sorted(options.items())))
    try:
        hash(key)
    except TypeError:  # an unhashable compile-time value
        return None, addresses
    return key, addresses


def _compile(kernel, grid, names, values, options, key) -> Any:
    """Launches through the JIT (compiling where it has not); with a key, keeps the compiled
    kernel's launcher under it, which is returned (None without)."""
    compiled = kernel[grid](**dict(zip(names, values, strict=True)), **options)
    if key is None or not callable(getattr(compiled, "__getitem__", None)):
        return None
    _LAUNCHERS[key] = _launcher(compiled)
    return _LAUNCHERS[key]


def _argument_key(value) -> tuple[Any, Any]:
    """(what Triton specializes a runtime argument on, or more; what its launcher receives).

    A key finer than Triton's own costs at most another pass through the JIT (which compiles
    nothing new); a coarser one would reuse a kernel compiled for other assumptions, so every
    property Triton specializes on is in it: a tensor's dtype and whether its address is a
    multiple of 16; an integer's width (32 bits, 64, unsigned 64), whether it is 1 and whether
    it is a multiple of 16; a float's type; None. A tensor descriptor adds the dtype, address
    alignment, shape and strides of its tensor, its block shape, padding and layout."""
    if isinstance(value, torch.Tensor):
        address = value.data_ptr()
        return (value.dtype, address % 16 == 0), address
    if isinstance(value, bool):
        return ("i1", value), value
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"
        return (width, value == 1, value % 16 == 0), value
    if isinstance(value, float):
        return ("fp",), value
    if value is None:
        return ("none",), value
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(value, "block_shape"):
        try:
            key = (type(value), base.dtype, base.data_ptr() % 16 == 0, tuple(value.shape),
                   tuple(value.strides), tuple(value.block_shape),
                   repr(getattr(value, "padding", None)), repr(getattr(value, "layout", None)))
        except (AttributeError, TypeError):
            return _UNKEYED, None
        return key, value
    return _UNKEYED, None


class RepeatedLaunch:
    """``kernel[grid](**arguments, **changes)``, with the JIT's binding done once.

    ``arguments`` name every parameter of the kernel (and ``options``, e.g. ``num_warps``, the
    launch options). Each call may change some of them: a changed compile-time (``tl.constexpr``)
    argument selects another compiled kernel; a changed runtime scalar must be one that the
    kernel does not specialize on (``do_not_specialize``), since the compiled kernel keeps the
    first launch's assumptions about it (e.g. divisibility by 16); a changed tensor must share
    the first one's alignment (a view at the same address, as the scratch slabs are).
    Under Triton's interpreter, or where the JIT does not hand back a compiled kernel, every
    call goes through the JIT.
    """

    def __init__(self, kernel, options: dict[str, Any], **arguments):
        self.kernel = kernel
        self.options = options
        self.arguments = arguments
        self.compiled: dict[tuple, Any] = {}
        # The interpreter's kernels (no compiled form, no parameter records) go through the JIT.
        self.direct = not config.interpreting() and hasattr(kernel, "params")
        if not self.direct:
            return
        (self.names, self.position, constexprs, self.constexpr_slot,
         self.unspecialized, _) = _parameters(kernel)
        missing = set(self.names) - set(arguments)
        if missing:
            raise TypeError(f"RepeatedLaunch of {kernel.fn.__name__}: missing {sorted(missing)}")
        self.values = [arguments[name] for name in self.names]
        self.addresses = [_address(value) for value in self.values]
        self.key = tuple(arguments[name] for name in constexprs)

    def __call__(self, grid: tuple[int, ...], **changes) -> None:
        if not self.direct:
            self.kernel[grid](**{**self.arguments, **changes}, **self.options)
            return
        values, addresses, key = self.values.copy(), self.addresses.copy(), list(self.key)
        for name, value in changes.items():
            i = self.position[name]
            if name in self.constexpr_slot:
                key[self.constexpr_slot[name]] = value
            elif name not in self.unspecialized and not hasattr(value, "data_ptr"):
                raise ValueError(f"{self.kernel.fn.__name__}: {name} is specialized on; "
                                 "it may not change between repeated launches")
            values[i] = value
            addresses[i] = _address(value)
        key = tuple(key)
        launcher = self.compiled.get(key)
        if launcher is None:
            # this call's first launch with these compile-time values: the process's launcher
            # where an earlier call compiled the same specialization
            specialization, _ = _specialization(self.kernel, self.names, values, self.options)
            launcher = _LAUNCHERS.get(specialization) if specialization is not None else None
            if launcher is None:
                self.compiled[key] = _compile(self.kernel, grid, self.names, values,
                                              self.options, specialization)
                if self.compiled[key] is None:
                    del self.compiled[key]
                return
            self.compiled[key] = launcher
        launcher((*grid, 1, 1)[:3], values, addresses)


_PARAMETERS: dict[Any, tuple] = {}


def _parameters(kernel) -> tuple:
    """The kernel's parameter names in order, their positions, its compile-time parameters
    (sorted) and their slots in the key, the runtime ones it never specializes on, and the
    parameter records by name: the same for every launch of the kernel, so read once per
    process."""
    if kernel not in _PARAMETERS:
        params = {p.name: p for p in kernel.params}
        names = list(params)
        constexprs = sorted(name for name, p in params.items() if p.is_constexpr)
        _PARAMETERS[kernel] = (
            names, {name: i for i, name in enumerate(names)}, constexprs,
            {name: i for i, name in enumerate(constexprs)},
            {name for name, p in params.items() if p.do_not_specialize},
            params,
        )
    return _PARAMETERS[kernel]


def _address(value):
    """A tensor's address (what a kernel's pointer argument receives); anything else as is."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _launcher(compiled):
    """A function (grid of three, argument values, the same with tensors as addresses) →
    launch of ``compiled`` on the current device's current stream.

    Triton's ``compiled[grid](*values)`` looks up the device and the stream, and builds launch
    metadata for its hooks, at every launch; its launcher then reads each tensor's address.
    Without per-launch scratch, this calls that launcher directly with the addresses read once
    per tensor, whenever no launch hook (a profiler's) is registered at the time. Anything else
    (another Triton, hooks, scratch) goes through ``compiled[grid]``.
    """
    def through_triton(grid, values, addresses):
        compiled[grid](*values)

    try:
        run = compiled.run
        if run.global_scratch_size or run.profile_scratch_size or not callable(run.launch):
            return through_triton
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None)
        launch, current_stream = run.launch, torch._C._cuda_getCurrentRawStream
        _no_hooks()  # a Triton without launch-hook knobs raises here: Triton's own path then
    except (AttributeError, ImportError):
        return through_triton

    def direct(grid, values, addresses):
        if _no_hooks():
            launch(*grid, current_stream(torch.cuda.current_device()), *head, *addresses)
        else:
            through_triton(grid, values, addresses)
    return direct


def _no_hooks() -> bool:
    """Whether no launch hook is registered (Triton 3.6 keeps them in chains; older ones None)."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return all(h is None or getattr(h, "calls", None) == [] for h in hooks)
