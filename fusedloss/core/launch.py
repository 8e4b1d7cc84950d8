"""Repeated launches of one Triton kernel whose arguments barely change between launches.

The backward launches its recompute kernel once per column slab with the same arguments but
for the slab's first tile, its width and its scratch view. Going through Triton's JIT each time
binds and specializes every argument again and looks the kernel up in its cache: measured on
an H100 host (Triton 3.6, 2026-11-22) ≈ 90 µs of host time per launch of that kernel, where a
CLIP step at b = 16384 has eight of them and the host, not the GPU, sets its pace.
:class:`RepeatedLaunch` compiles through the JIT once per set of compile-time arguments and then
calls the compiled kernel directly.
"""

from __future__ import annotations

from typing import Any

from . import config


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
        params = {p.name: p for p in kernel.params}
        missing = set(params) - set(arguments)
        if missing:
            raise TypeError(f"RepeatedLaunch of {kernel.fn.__name__}: missing {sorted(missing)}")
        self.names = list(params)
        self.constexprs = sorted(name for name, p in params.items() if p.is_constexpr)
        self.unspecialized = {name for name, p in params.items() if p.do_not_specialize}

    def __call__(self, grid: tuple[int, ...], **changes) -> None:
        if not self.direct:
            self.kernel[grid](**{**self.arguments, **changes}, **self.options)
            return
        for name, value in changes.items():
            if (name not in self.constexprs and name not in self.unspecialized
                    and not hasattr(value, "data_ptr")):
                raise ValueError(f"{self.kernel.fn.__name__}: {name} is specialized on; "
                                 "it may not change between repeated launches")
        arguments = {**self.arguments, **changes}
        key = tuple(arguments[name] for name in self.constexprs)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](**arguments, **self.options)
            if callable(getattr(compiled, "__getitem__", None)):
                self.compiled[key] = compiled
            return
        grid = (*grid, 1, 1)[:3]  # the compiled kernel's launcher takes all three dimensions
        compiled[grid](*(arguments[name] for name in self.names))
