"""Per-tensor loss scaling for fp16 training (Wortsman, Dettmers et al. 2023).

``torch.amp.GradScaler`` halves a global loss scale and skips the whole optimizer step when any
gradient overflows. The paper instead keeps a fixed loss scale and skips only the tensors whose
gradient has an Inf or NaN: every other tensor updates as usual. ``PerTensorScaler`` does that
without reading anything back to the host:

1. ``unscale_``: the gradients are multiplied by 1/scale (foreach; exact for a power-of-two scale
   unless a value is subnormal), the per-tensor max-norm ``_foreach_norm(grads, inf)`` is Inf or
   NaN exactly when the tensor has one, and the flags stay 0-d bool tensors on the device.
2. ``step``: the flagged gradients are zeroed (``masked_fill_``, one small kernel per tensor), then
   - an optimizer with ``supports_skip_masks`` (``fusedloss.optim.StableAdamW``) receives the flags
     and leaves those tensors, their moments and step counts untouched at no extra cost;
   - any other ``torch.optim`` optimizer steps normally, and the flagged parameters and their
     state tensors are restored afterwards with ``torch.where`` from a copy taken before the step.
     Cost: a transient copy of every parameter with a gradient and of its tensor state (for Adam,
     3× the parameter memory), two extra reads and one write of each per step. State created by
     this very step (the first step) is reset to zeros for flagged tensors, which is the fresh
     state of the Adam family and of SGD with momentum and dampening 0. Python numbers in state
     cannot be restored without a sync and are left as the optimizer set them; state tensors kept
     on the CPU while the flags are on an accelerator (torch.optim's default non-capturable
     ``step``) are restored after one device-to-host copy of all the flags per step: pass
     ``capturable=True`` or ``fused=True`` to torch.optim optimizers to avoid it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["PerTensorScaler"]


class PerTensorScaler:
    """Fixed loss scale, Inf/NaN checked per tensor, only the affected tensors' updates skipped.

    Like ``torch.amp.GradScaler``, it belongs to the training loop outside a compiled region:
    ``scaler.step`` is not traced by ``torch.compile`` (compile the model, or the optimizer's
    step alone, which :class:`fusedloss.optim.StableAdamW` allows with ``fullgraph=True``).

    Args:
        scale: the fixed loss scale (a power of two keeps scaling and unscaling exact).
        enabled: when False, ``scale`` returns its input and ``step`` calls ``optimizer.step()``.

    Usage (the same calls as ``torch.amp.GradScaler``)::

        scaler = PerTensorScaler(scale=2.0**16)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                 # optional: to clip or inspect true gradients
        scaler.step(opt)                     # skips exactly the tensors with Inf/NaN gradients
        scaler.update()                      # no-op: the scale is fixed
        opt.zero_grad()

    After ``step``, ``scaler.nonfinite`` maps each parameter that had a gradient to a 0-d bool
    tensor on its device (True: skipped), and ``scaler.skipped_count()`` sums them on the device.
    """

    def __init__(self, scale: float = 2.0**16, *, enabled: bool = True) -> None:
        if not scale > 0.0:
            raise ValueError(f"the loss scale must be positive, got {scale}")
        self._scale = float(scale)
        self._enabled = enabled
        self._unscaled: dict[int, dict[Tensor, Tensor]] = {}
        self.nonfinite: dict[Tensor, Tensor] = {}

    def get_scale(self) -> float:
        """The fixed loss scale (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Tensor | list[Tensor]:
        """``outputs * scale``: a tensor, or each tensor of an iterable (returned as a list)."""
        if not self._enabled:
            return outputs if isinstance(outputs, Tensor) else list(outputs)
        if isinstance(outputs, Tensor):
            return outputs * self._scale
        return [o * self._scale for o in outputs]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> dict[Tensor, Tensor]:
        """Divide the optimizer's gradients by the scale in place and flag, per tensor, those with
        an Inf or NaN. Returns {parameter: 0-d bool device tensor}; called once per step."""
        key = id(optimizer)
        if key in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since its step")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        flags: dict[Tensor, Tensor] = {}
        buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("PerTensorScaler does not support sparse gradients")
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p)
        for bucket in buckets.values():
            grads = [p.grad for p in bucket]
            if self._enabled:
                torch._foreach_mul_(grads, 1.0 / self._scale)
            peaks = torch.stack(torch._foreach_norm(grads, float("inf")))
            for p, bad in zip(bucket, (~torch.isfinite(peaks)).unbind(0), strict=True):
                flags[p] = bad
        self._unscaled[key] = flags
        return flags

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` was called), then ``optimizer.step(*args, **kwargs)`` with
        every tensor whose gradient had an Inf/NaN left unchanged: parameter and state."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        flags = self._unscaled.pop(id(optimizer), None)
        if flags is None:
            flags = self.unscale_(optimizer)
            self._unscaled.pop(id(optimizer))
        self.nonfinite = flags
        for p, bad in flags.items():
            p.grad.masked_fill_(bad, 0)
        if getattr(optimizer, "supports_skip_masks", False):
            return optimizer.step(*args, skip=flags, **kwargs)
        return _step_and_restore(optimizer, flags, args, kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """Kept for ``GradScaler`` compatibility: the scale is fixed; ``new_scale`` replaces it."""
        if new_scale is not None:
            if not new_scale > 0.0:
                raise ValueError(f"the loss scale must be positive, got {new_scale}")
            self._scale = float(new_scale)

    def skipped_count(self) -> Tensor | None:
        """How many tensors the last ``step`` skipped: an int64 tensor on the first parameter's
        device (None before any step). Reading it synchronizes; the scaler never does."""
        if not self.nonfinite:
            return None
        flags = list(self.nonfinite.values())
        device = flags[0].device
        return torch.stack([f.to(device) for f in flags]).sum()

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale, "enabled": self._enabled}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = float(state_dict["scale"])
        self._enabled = bool(state_dict["enabled"])


def _step_and_restore(
    optimizer: torch.optim.Optimizer,
    flags: dict[Tensor, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Step a generic optimizer, then put back the flagged parameters and their state tensors."""
    with torch.no_grad():
        saved_params = {p: p.detach().clone() for p in flags}
        saved_state = {
            p: {k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, Tensor)}
            for p in flags
            if p in optimizer.state
        }
        result = optimizer.step(*args, **kwargs)
        host_flags: dict[Tensor, Tensor] = {}
        for p, bad in flags.items():
            p.copy_(torch.where(bad, saved_params[p], p))
            old = saved_state.get(p, {})
            for k, v in optimizer.state[p].items():
                if not isinstance(v, Tensor):
                    continue
                flag = bad
                if v.device != bad.device:
                    if not host_flags:  # one transfer of every flag, at most once per step
                        stacked = torch.stack([f.to(bad.device) for f in flags.values()])
                        stacked = stacked.to(v.device)
                        host_flags = dict(zip(flags, stacked.unbind(0), strict=True))
                    flag = host_flags[p]
                before = old[k] if k in old else torch.zeros_like(v)
                v.copy_(torch.where(flag, before, v))
    return result
