"""Repeated launches of one Triton kernel whose arguments barely change between launches.

The backward launches its recompute kernel (and, with the split accumulator, its dA kernel)
once per column slab with the same arguments but for the slab's first tile, its width and the
dense flag. Going through Triton's JIT each time
binds and specializes every argument again and looks the kernel up in its cache, and on short
calls the host's time for that, not the GPU, sets the pace (docs/design.md, "Host cost per call").
:class:`RepeatedLaunch` compiles through the JIT once per set of compile-time arguments and then
hands the compiled kernel's launcher the arguments in order, with the stream looked up once.
"""

from __future__ import annotations

from typing import Any

import torch

from . import config


class RepeatedLaunch:
    """``kernel[grid](**arguments, **changes)``, with the JIT's binding done once.

    ``arguments`` name every parameter of the kernel (and ``options``, e.g. ``num_warps``, the
    launch options). Each call may change some of them: a changed compile-time (``tl.constexpr``)
    argument selects another compiled kernel; a changed runtime scalar must be one that the
    kernel does not specialize on (``do_not_specialize``), since the compiled kernel keeps the
    first launch's assumptions about it (e.g. divisibility by 16); a changed tensor must share
    the first one's alignment (a view at the same address, as the scratch slabs are).
    Every launch goes to the stream that was current at the first one.
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
         self.unspecialized) = _parameters(kernel)
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
        launch = self.compiled.get(key)
        if launch is None:
            compiled = self.kernel[grid](**dict(zip(self.names, values, strict=True)),
                                         **self.options)
            if callable(getattr(compiled, "__getitem__", None)):
                self.compiled[key] = _launcher(compiled)
            return
        launch((*grid, 1, 1)[:3], values, addresses)


_PARAMETERS: dict[Any, tuple] = {}


def _parameters(kernel) -> tuple:
    """The kernel's parameter names in order, their positions, its compile-time parameters
    (sorted) and their slots in the key, and the runtime ones it never specializes on: the
    same for every launcher of the kernel, so read once per process."""
    if kernel not in _PARAMETERS:
        params = {p.name: p for p in kernel.params}
        names = list(params)
        constexprs = sorted(name for name, p in params.items() if p.is_constexpr)
        _PARAMETERS[kernel] = (
            names, {name: i for i, name in enumerate(names)}, constexprs,
            {name: i for i, name in enumerate(constexprs)},
            {name for name, p in params.items() if p.do_not_specialize},
        )
    return _PARAMETERS[kernel]


def _address(value):
    """A tensor's address (what a kernel's pointer argument receives); anything else as is."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _launcher(compiled):
    """A function (grid of three, argument values, the same with tensors as addresses) →
    launch of ``compiled``.

    Triton's ``compiled[grid](*values)`` looks up the device and the stream, and builds launch
    metadata for its hooks, at every launch; its launcher then reads each tensor's address.
    Without per-launch scratch, this calls that launcher directly, with the stream found once
    and the addresses read once per tensor, whenever no launch hook (a profiler's) is
    registered at the time. Anything else (another Triton, hooks, scratch) goes through
    ``compiled[grid]``.
    """
    def through_triton(grid, values, addresses):
        compiled[grid](*values)

    try:
        run = compiled.run
        if run.global_scratch_size or run.profile_scratch_size or not callable(run.launch):
            return through_triton
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None)
        launch, stream = run.launch, torch.cuda.current_stream().cuda_stream
        _no_hooks()  # a Triton without launch-hook knobs raises here: Triton's own path then
    except (AttributeError, ImportError):
        return through_triton

    def direct(grid, values, addresses):
        if _no_hooks():
            launch(*grid, stream, *head, *addresses)
        else:
            through_triton(grid, values, addresses)
    return direct


def _no_hooks() -> bool:
    """Whether no launch hook is registered (Triton 3.6 keeps them in chains; older ones None)."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return all(h is None or getattr(h, "calls", None) == [] for h in hooks)
