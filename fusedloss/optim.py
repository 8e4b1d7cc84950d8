"""StableAdamW: AdamW with AdaFactor's update clipping, per tensor, without host synchronization.

Wortsman, Dettmers et al. 2023, "Stable and low-precision training for large-scale
vision-language models", Algorithm 2. For each parameter tensor θ with gradient g_t at step t:

    β̂1 = β1 (1 - β1^(t-1)) / (1 - β1^t)          β̂2 = β2 (1 - β2^(t-1)) / (1 - β2^t)
    v_t = β̂1 v_{t-1} + (1 - β̂1) g_t               u_t = β̂2 u_{t-1} + (1 - β̂2) g_t²
    RMS_t = sqrt(mean(g_t² / max(u_t, ε²)))        (current u_t, mean over the tensor)
    η_t = α_t / max(1, RMS_t / d)                    (d = clip_threshold, 1 in the paper)
    θ_t = θ_{t-1} - α_t λ θ_{t-1} - η_t v_t / (sqrt(u_t) + ε)

The debiased β̂ recursion makes v_t and u_t equal Adam's bias-corrected m̂_t and v̂_t, so we keep
Adam's biased moments in state (`exp_avg`, `exp_avg_sq`, as torch.optim.AdamW) and divide by
1 - β^t on the fly: the same numbers, and a state layout AdamW users know. The weight decay is
decoupled and scaled by the unclipped α_t, as the authors' reference code does
(``theta.mul_(1 - lr * weight_decay)``); ``clip_weight_decay=True`` scales it by η_t instead.

On the foreach path, every operation is a ``torch._foreach_*`` multi-tensor op over the tensors of
one device and dtype; the step count, the bias corrections, RMS_t and the learning-rate factor
stay 0-d tensors on the parameters' device. Nothing is read back to the host, so a step never
synchronizes and can be captured in a CUDA graph (pass ``lr`` as a device tensor to change it
between replays).

The fused path (the default for float32 parameters on CUDA; ``fused=True`` also runs it on the CPU
under Triton's interpreter) does the same arithmetic,
equally without synchronizing, in one Triton launch per param group and device: two passes over
each tensor, no temporaries the size of the parameters (``fusedloss._optim_kernels`` explains
the passes and their memory traffic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from . import _optim_kernels as kernels

__all__ = ["StableAdamW"]


class StableAdamW(torch.optim.Optimizer):
    """AdamW with per-tensor update clipping (StableAdamW, Wortsman et al. 2023, Algorithm 2).

    Args:
        params: parameters or param-group dicts; every option below may be set per group.
        lr: α, the learning rate: a float or a 0-d tensor (kept on the device for graph capture).
        betas: (β1, β2). The paper recommends β2 = 0.99 for large CLIP models (the default).
        eps: ε, added to sqrt(û) in the denominator; ε² floors û inside RMS_t (the floor is at
            least the dtype's smallest normal number). With float16 parameters choose an ε that
            float16 can represent (e.g. 1e-6), as for torch.optim.AdamW.
        weight_decay: λ, decoupled weight decay, θ ← θ (1 - α λ).
        clip_threshold: d; η = α / max(1, RMS_t / d). The paper uses d = 1.
        clip_weight_decay: scale the weight decay by the clipped η_t instead of α_t.
        maximize: ascend instead of descend.
        track_rms: keep each tensor's last RMS_t in ``state[p]["rms"]`` (0-d float32 tensor on
            the parameter's device, never synchronized); the paper's loss-spike predictor
            (RMS_t well above 1, e.g. ≥ 2.3 in a ViT's patch embedding, precedes spikes).
        fused: run each step as Triton kernels, one launch per param group and device, instead of
            ``torch._foreach_*`` ops: the same results to float32 rounding, no parameter-sized
            temporaries, ~4× faster. None (default): the fused path for float32 parameters on
            CUDA, the foreach path for the rest. False: the foreach path. True requires float32
            parameters on CUDA (or on the CPU under ``TRITON_INTERPRET=1``). Tensors whose
            gradient or moments do not share the parameter's dense layout, and steps traced by
            ``torch.compile``, take the foreach path. Not part of ``state_dict()``: the state is
            the same on both paths.

    State per parameter: ``step`` (0-d float32, device), ``exp_avg`` and ``exp_avg_sq`` (Adam's
    biased moments, shaped and typed like the parameter), and ``rms`` with ``track_rms``.
    A fused step updates the same state in place, so either path continues the other's.

    ``step(closure=None, *, skip=None)``: ``skip`` maps parameters to 0-d bool device tensors;
    where True, that tensor's parameter, moments and step count stay exactly as they were (its
    gradient must be finite, e.g. zeroed). ``fusedloss.amp.PerTensorScaler`` uses this.

    Example::

        opt = StableAdamW(model.parameters(), lr=2e-3, weight_decay=0.2, track_rms=True)
        loss.backward(); opt.step(); opt.zero_grad()
        rms = torch.stack([opt.state[p]["rms"] for p in model.parameters()])  # no sync
    """

    supports_skip_masks = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        clip_threshold: float = 1.0,
        *,
        clip_weight_decay: bool = False,
        maximize: bool = False,
        track_rms: bool = False,
        fused: bool | None = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("a tensor lr must have one element")
        if not isinstance(lr, Tensor) and not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        if not clip_threshold > 0.0:
            raise ValueError(f"invalid clip_threshold {clip_threshold}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            clip_threshold=clip_threshold, clip_weight_decay=clip_weight_decay,
            maximize=maximize, track_rms=track_rms,
        )
        super().__init__(params, defaults)
        self.fused = fused
        self._fused_tables: dict[tuple[int, torch.device], kernels.FusedTables] = {}
        if fused:
            for group in self.param_groups:
                _check_fused(group["params"])
        self.register_load_state_dict_post_hook(_state_to_device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "fused", None):  # None while the constructor adds the first groups
            try:
                _check_fused(self.param_groups[-1]["params"])
            except RuntimeError:
                self.param_groups.pop()
                raise

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "fused": self.fused}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickling passes what __getstate__ saved; load_state_dict passes state and groups.
        state = dict(state)
        fused = state.pop("fused", getattr(self, "fused", None))
        super().__setstate__(state)
        self.fused = fused
        self.__dict__.setdefault("_fused_tables", {})

    def _fused_for(self, device: torch.device) -> bool:
        """Whether a bucket of tensors on ``device`` tries the fused step."""
        if torch.compiler.is_compiling():
            return False  # addresses are not traceable; Inductor fuses the foreach ops instead
        if self.fused is None:  # default: the fused kernels where they run natively
            return device.type == "cuda"
        return self.fused

    def _init_state(self, p: Tensor, track_rms: bool) -> dict[str, Tensor]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if track_rms and "rms" not in state:
            state["rms"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        skip: Mapping[Tensor, Tensor] | None = None,
    ) -> Any:
        """One StableAdamW step over every parameter that has a gradient (see the class doc)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StableAdamW does not support sparse gradients")
                self._init_state(p, group["track_rms"])
                buckets.setdefault((p.device, p.dtype), []).append(p)
            for (device, _), params in buckets.items():
                if self._fused_for(device):
                    params = self._fused_update(index, group, device, params, skip)
                    if not params:
                        continue
                keep = None
                if skip is not None:
                    keep = [
                        (~skip[p]).to(torch.float32) if p in skip
                        else torch.ones((), dtype=torch.float32, device=p.device)
                        for p in params
                    ]
                self._update(group, params, keep)
        return loss

    def _fused_update(
        self,
        index: int,
        group: dict[str, Any],
        device: torch.device,
        params: list[Tensor],
        skip: Mapping[Tensor, Tensor] | None,
    ) -> list[Tensor]:
        """The fused step of one bucket; returns the tensors it leaves to the foreach path (a
        gradient or moment laid out unlike its parameter)."""
        if not kernels.supports(params[0]):  # a parameter converted since the constructor
            if self.fused:
                _check_fused(params[:1])
            return params
        rows, fused, rest = [], [], []
        track_rms = group["track_rms"]
        for p in params:
            state, grad = self.state[p], p.grad
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if grad.dtype == p.dtype and (
                (p.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous()
                 and exp_avg_sq.is_contiguous() and grad.shape == p.shape == exp_avg.shape
                 == exp_avg_sq.shape)
                or kernels.flat_layout(p, grad, exp_avg, exp_avg_sq)
            ):
                rows.append((p, grad, exp_avg, exp_avg_sq, state["step"],
                             state["rms"] if track_rms else None))
                fused.append(p)
            else:
                rest.append(p)
        if not fused:
            return rest
        flags = None
        if skip is not None:
            false = None
            entries = []
            for p in fused:
                flag = skip.get(p)
                if flag is None:
                    if false is None:
                        false = torch.zeros((), dtype=torch.bool, device=device)
                    flag = false
                entries.append(flag.reshape(()))
            flags = torch.stack(entries)
        tables = self._fused_tables.setdefault((index, device), kernels.FusedTables())
        kernels.fused_step(
            tables, rows, flags, lr=group["lr"], betas=group["betas"], eps=group["eps"],
            weight_decay=group["weight_decay"], clip_threshold=group["clip_threshold"],
            clip_weight_decay=group["clip_weight_decay"], maximize=group["maximize"],
        )
        return rest

    def _update(self, group: dict[str, Any], params: list[Tensor], keep: list[Tensor] | None):
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]

        # t ← t + 1 (t + keep under a skip mask); bias corrections 1 - β1^t, sqrt(1 - β2^t).
        if keep is None:
            torch._foreach_add_(steps, 1.0)
            counted = steps
        else:
            torch._foreach_add_(steps, keep)
            counted = torch._foreach_clamp_min(steps, 1.0)  # a never-stepped, skipped tensor
        bias1 = torch._foreach_pow(beta1, counted)
        torch._foreach_neg_(bias1)
        torch._foreach_add_(bias1, 1.0)
        bias2 = torch._foreach_pow(beta2, counted)
        torch._foreach_neg_(bias2)
        torch._foreach_add_(bias2, 1.0)
        torch._foreach_sqrt_(bias2)

        # Biased moments m ← β1 m + (1-β1) g, u ← β2 u + (1-β2) g²; a skipped tensor (keep = 0,
        # zero gradient) keeps both exactly.
        if keep is None:
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
        else:
            torch._foreach_lerp_(exp_avgs, grads, torch._foreach_mul(keep, 1.0 - beta1))
            decay2 = torch._foreach_mul(keep, beta2 - 1.0)
            torch._foreach_add_(decay2, 1.0)
            torch._foreach_mul_(exp_avg_sqs, decay2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        # sqrt(û_t) with û_t = u_t / (1 - β2^t), Algorithm 2's u_t.
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2)
        # RMS_t = ‖g / sqrt(max(û_t, ε²))‖₂ / sqrt(n); sqrt(max(û, ε²)) = max(sqrt(û), ε).
        # The floor is at least the dtype's smallest normal number: ε = 1e-8 is 0 in float16.
        floor = max(eps, torch.finfo(params[0].dtype).tiny)
        ratio = torch._foreach_clamp_min(denom, floor)
        torch._foreach_reciprocal_(ratio)
        torch._foreach_mul_(ratio, grads)
        rms = torch._foreach_norm(ratio, 2, dtype=torch.float32)
        del ratio
        torch._foreach_mul_(rms, [1.0 / math.sqrt(max(p.numel(), 1)) for p in params])
        if group["track_rms"]:
            tracked = [s["rms"] for s in states]
            if keep is None:
                torch._foreach_copy_(tracked, rms)
            else:
                torch._foreach_lerp_(tracked, rms, keep)

        # Learning-rate factor η_t = α_t / max(1, RMS_t / d), a 0-d device tensor per parameter.
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.to(device=params[0].device, dtype=torch.float32)
        clipped = torch._foreach_div(rms, group["clip_threshold"])
        torch._foreach_clamp_min_(clipped, 1.0)
        torch._foreach_reciprocal_(clipped)
        torch._foreach_mul_(clipped, lr)
        if keep is not None:
            torch._foreach_mul_(clipped, keep)

        # Decoupled weight decay θ ← θ (1 - α λ), or (1 - η λ) with clip_weight_decay.
        if weight_decay != 0.0:
            if group["clip_weight_decay"] or keep is not None:
                rate = clipped if group["clip_weight_decay"] else torch._foreach_mul(keep, lr)
                shrink = torch._foreach_mul(rate, -weight_decay)
                torch._foreach_add_(shrink, 1.0)
                torch._foreach_mul_(params, shrink)
            else:
                torch._foreach_mul_(params, 1.0 - lr * weight_decay)

        # θ ← θ - η_t m̂ / (sqrt(û) + ε) with m̂ = m / (1 - β1^t): denominators divided by
        # -η_t / (1 - β1^t) so that one addcdiv applies it (a skipped tensor adds m / ∓inf = ∓0).
        torch._foreach_add_(denom, eps)
        step_size = torch._foreach_div(clipped, bias1)
        torch._foreach_neg_(step_size)
        torch._foreach_div_(denom, step_size)
        torch._foreach_addcdiv_(params, exp_avgs, denom)


def _check_fused(params: Iterable[Tensor]) -> None:
    for p in params:
        if not kernels.supports(p):
            raise RuntimeError(
                f"StableAdamW(fused=True) needs float32 parameters on a CUDA device (or on the CPU "
                f"under Triton's interpreter, TRITON_INTERPRET=1); got a {p.dtype} parameter on "
                f"{p.device}. Pass fused=False (or None, which picks the foreach path here)."
            )


def _state_to_device(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: ``step`` and ``rms`` back to float32 on the parameter's device
    (``Optimizer.load_state_dict`` leaves ``step`` where it was saved and casts other floating
    tensors to the parameter's dtype)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key in ("step", "rms"):
                if key in state:
                    state[key] = state[key].to(device=p.device, dtype=torch.float32)
