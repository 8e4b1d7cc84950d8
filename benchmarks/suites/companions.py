"""Suite ``companions``: the low-precision training companions of docs/companions.md.

Parts (``--parts``): ``linear``: ``y = layer(x); y.backward(dy)`` of ``nn.Linear`` against the
SwitchBack variants at CLIP ViT widths (d → d, d → 4d, 4d → d), eager and CUDA-graphed;
``optimizer``: one StableAdamW step against torch AdamW over a ViT-B/16 tower's parameters;
``e2e``: a ViT-B/16 CLIP model (benchmarks/vit.py) trained on synthetic pairs with
``fusedloss.ClipLoss``, with ``nn.Linear`` and each SwitchBack variant in the blocks. A provider
whose options this SwitchBack rejects (TypeError, ValueError, NotImplementedError) is recorded
``unavailable``. Figures are defined in benchmarks/README.md and the report's Definitions.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import common, vit
from benchmarks.common import (
    UNAVAILABLE,
    TimingSettings,
    count_text,
    gib_text,
    loss_text,
    save_plot,
    table,
    timed,
)
from benchmarks.suites import Suite
from benchmarks.trained_lm import cosine_decay

NAME = RESULTS_PREFIX = "companions"
MIB, GIB = common.MIB, float(1 << 30)
DTYPE = "bf16"  # inputs and layers (linear), autocast (e2e)
LINEAR, OPTIMIZER, E2E = "linear", "optimizer", "e2e"
PARTS = (LINEAR, OPTIMIZER, E2E)
UNAVAILABLE_ERRORS = (TypeError, ValueError, NotImplementedError)  # an option this build lacks
DEFAULT_TIMING = TimingSettings(warmup_ms=25.0, rep_ms=100.0)  # Triton's do_bench defaults
fmt_ms, ratio = common.format_ms, common.format_ratio

# ----------------------------------------------------------------------------- linear

TORCH, SWITCHBACK, SWITCHBACK_M, SWITCHBACK_Q, FP8 = (
    "torch", "switchback", "switchback-m", "switchback-q", "fp8")
# SwitchBackLinear options beside ``backend`` (only non-defaults, for older SwitchBacks).
SWITCHBACK_OPTIONS: dict[str, dict[str, Any]] = {
    SWITCHBACK: {},
    SWITCHBACK_M: {"memory_efficient": True},
    SWITCHBACK_Q: {"weight_quantization": "rowwise"},
    FP8: {"quant_dtype": "fp8"},
}
LINEAR_PROVIDERS = (TORCH, *SWITCHBACK_OPTIONS)
LINEAR_LABELS = {TORCH: "nn.Linear", SWITCHBACK: "SwitchBack", SWITCHBACK_M: "SwitchBackM",
                 SWITCHBACK_Q: "SwitchBackQ", FP8: "SwitchBack fp8"}
WIDTHS = (768, 1024, 1280, 1664)  # CLIP ViT-B, -L, -H, -G widths
TOKENS = (8192, 16384, 32768, 65536)
SHAPES = {"d-d": (1, 1), "d-4d": (1, 4), "4d-d": (4, 1)}  # (in, out) as multiples of d
QUICK_WIDTHS, QUICK_TOKENS = (32,), (64, 128)
GRAPH_WARMUP_STEPS = 3  # eager steps on a side stream before the capture
GRAPH_FAILED = "not graphed"  # a row's note where the CUDA graph capture or replay failed


@dataclass(frozen=True)
class LinearCase:
    width: int  # d
    shape: str  # key of SHAPES
    in_features: int
    out_features: int
    tokens: int

    @property
    def key(self) -> str:
        return f"{self.in_features}x{self.out_features} N{self.tokens}"

    @property
    def flops(self) -> float:
        """Forward 2·N·in·out, input and weight gradients as much again each."""
        return 6.0 * self.tokens * self.in_features * self.out_features


def linear_cases(widths: Sequence[int], shapes: Sequence[str],
                 tokens: Sequence[int]) -> list[LinearCase]:
    """Every width × shape × token count, widths outermost."""
    return [LinearCase(w, s, SHAPES[s][0] * w, SHAPES[s][1] * w, n)
            for w in widths for s in shapes for n in tokens]


@dataclass
class LinearInputs:
    x: Tensor  # (N, in), requires grad
    dy: Tensor  # (N, out)
    weight: Tensor  # (out, in)
    bias: Tensor  # (out,)


def make_linear_inputs(case: LinearCase, dtype: torch.dtype, seed: int,
                       device: torch.device) -> LinearInputs:
    """x, dy ~ N(0, 1); weight, bias ~ U(±1/sqrt(in)) (nn.Linear's); float32 from one seeded
    generator, rounded to dtype."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, uniform: bool = False) -> Tensor:
        if uniform:
            bound = case.in_features**-0.5
            values = (2 * torch.rand(shape, generator=generator, device=device) - 1) * bound
        else:
            values = torch.randn(shape, generator=generator, device=device)
        return values.to(dtype)

    return LinearInputs(x=draw(case.tokens, case.in_features).requires_grad_(),
                        dy=draw(case.tokens, case.out_features),
                        weight=draw(case.out_features, case.in_features, uniform=True),
                        bias=draw(case.out_features, uniform=True))


def float32_reference(inputs: LinearInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(y, dx, dw) of a float32 nn.Linear (TF32 off) on the same dtype-rounded inputs."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x = inputs.x.detach().float().requires_grad_()
        weight = inputs.weight.float().requires_grad_()
        y = F.linear(x, weight, inputs.bias.float())
        y.backward(inputs.dy.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return y.detach(), x.grad, weight.grad


def build_layer(provider: str, case: LinearCase, inputs: LinearInputs, backend: str) -> nn.Linear:
    """The provider's layer holding the case's weight and bias."""
    dtype, device = inputs.x.dtype, inputs.x.device
    if provider == TORCH:
        layer = nn.Linear(case.in_features, case.out_features, device=device, dtype=dtype)
    else:
        from fusedloss.nn import SwitchBackLinear

        layer = SwitchBackLinear(case.in_features, case.out_features, True, device=device,
                                 dtype=dtype, **SWITCHBACK_OPTIONS[provider], backend=backend)
    with torch.no_grad():
        layer.weight.copy_(inputs.weight)
        layer.bias.copy_(inputs.bias)
    return layer


def switchback_backend(device: torch.device) -> str:
    """The ``backend`` of every SwitchBack layer: triton on CUDA, torch elsewhere."""
    return "triton" if common.uses_cuda(device) else "torch"


def layer_call_text(provider: str, backend: str, dtype: torch.dtype) -> str:
    if provider == TORCH:
        layer = f"nn.Linear(in, out, dtype={dtype})"
    else:
        options = {**SWITCHBACK_OPTIONS[provider], "backend": backend}
        text = ", ".join(f"{k}={v!r}" for k, v in options.items())
        layer = f"fusedloss.nn.SwitchBackLinear(in, out, dtype={dtype}, {text})"
    return f"layer = {layer}; y = layer(x); y.backward(dy)"


def clear_grads(layer: nn.Linear, inputs: LinearInputs) -> None:
    inputs.x.grad = layer.weight.grad = layer.bias.grad = None


def forward_backward(layer: nn.Linear, inputs: LinearInputs) -> Callable[[], None]:
    """One step of the layer, gradients from None (as after ``zero_grad(set_to_none=True)``)."""
    def step() -> None:
        clear_grads(layer, inputs)
        layer(inputs.x).backward(inputs.dy)

    return step


def graphed_ms(layer: nn.Linear, inputs: LinearInputs, device: torch.device,
               timing: TimingSettings) -> float | None:
    """Median replay time of one forward+backward captured in a CUDA graph; None without CUDA.
    Gradients are set to None once before the capture; replays rewrite them in place."""
    if not common.uses_cuda(device):
        return None
    graph, _ = common.capture_graph(
        forward_backward(layer, inputs), lambda: layer(inputs.x).backward(inputs.dy), device,
        GRAPH_WARMUP_STEPS, before_capture=lambda: clear_grads(layer, inputs))
    return common.median_ms(graph.replay, device, timing)


def saved_mib(layer: nn.Linear, x: Tensor) -> float:
    """MiB the forward saves for the backward (each storage once, parameters left out, x in)."""
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = layer(x)
    del y
    return sum(saved.values()) / MIB


@dataclass
class LinearResult(common.ProviderResultBase):
    case: str = ""
    first_call_ms: float | None = None  # the untimed first call: compilation, autotuning
    speedup: float | None = None  # nn.Linear's ms ÷ this ms
    graphed_ms: float | None = None  # the step replayed from a CUDA graph; None without CUDA
    graphed_speedup: float | None = None  # nn.Linear's graphed ms ÷ this graphed ms
    tflops: float | None = None
    peak_extra_mib: float | None = None
    saved_mib: float | None = None
    y_error: float | None = None
    dx_error: float | None = None
    dw_error: float | None = None


def measure_linear(provider: str, case: LinearCase, inputs: LinearInputs,
                   reference: tuple[Tensor, Tensor, Tensor], backend: str,
                   device: torch.device, timing: TimingSettings,
                   notes: list[str] | None = None) -> LinearResult:
    """The provider's row. A failed CUDA-graph capture keeps the eager figures (graphed_ms
    None; the error goes to the note and ``notes``)."""
    result = LinearResult(provider=provider, label=LINEAR_LABELS[provider], case=case.key,
                          call=layer_call_text(provider, backend, inputs.x.dtype))
    with common.failures_recorded(result, device):
        try:
            layer = build_layer(provider, case, inputs, backend)
            clear_grads(layer, inputs)
            common.synchronize(device)
            begin = time.perf_counter()
            y = layer(inputs.x)
            y.backward(inputs.dy)
            common.synchronize(device)
            result.first_call_ms = (time.perf_counter() - begin) * 1e3
        except UNAVAILABLE_ERRORS as error:
            result.status, result.note = UNAVAILABLE, common.describe_error(error)
            return result
        y_ref, dx_ref, dw_ref = reference
        result.y_error = common.relative_l2_error(y.detach(), y_ref)
        result.dx_error = common.relative_l2_error(inputs.x.grad, dx_ref)
        result.dw_error = common.relative_l2_error(layer.weight.grad, dw_ref)
        del y
        clear_grads(layer, inputs)
        result.saved_mib = saved_mib(layer, inputs.x)
        gradient_bytes = sum(t.numel() * t.element_size()
                             for t in (inputs.x, layer.weight, layer.bias))
        step = forward_backward(layer, inputs)
        result.peak_extra_mib = common.peak_extra_mib(step, device, gradient_bytes)
        result.ms = common.median_ms(step, device, timing)
        result.tflops = case.flops / (result.ms * 1e-3) / 1e12
        common.mark_wrong(result, [f"{name} not finite" for name, value in
                                   (("y", result.y_error), ("dx", result.dx_error),
                                    ("dw", result.dw_error)) if not math.isfinite(value)])
        try:
            result.graphed_ms = graphed_ms(layer, inputs, device, timing)
        except Exception as error:  # the eager figures stand; the run goes on
            problem = f"{GRAPH_FAILED}: {common.describe_error(error)}"
            result.note = "; ".join(filter(None, (result.note, problem)))
            if notes is not None:
                notes.append(f"{case.key}: {result.label} {problem}")
        clear_grads(layer, inputs)
    return result


def run_linear(cases: Sequence[LinearCase], providers: Sequence[str], backend: str,
               dtype: torch.dtype, seed: int, device: torch.device, timing: TimingSettings,
               notes: list[str], log: Callable[[str], None]) -> list[tuple[LinearCase, dict]]:
    """(case, {provider: LinearResult}) per case."""
    case_results = []
    for case in cases:
        inputs = make_linear_inputs(case, dtype, seed, device)
        reference = float32_reference(inputs)
        results = {p: measure_linear(p, case, inputs, reference, backend, device, timing, notes)
                   for p in providers}
        del inputs, reference
        common.release_memory(device)
        base = results.get(TORCH)
        for r in results.values():
            if base is not None and base.measured and r.measured:
                r.speedup = base.ms / r.ms
            if base is not None and base.graphed_ms is not None and r.graphed_ms is not None:
                r.graphed_speedup = base.graphed_ms / r.graphed_ms
            common.note_problem(notes, case.key, r)
        log(f"  {case.key}: " + ", ".join(
            f"{r.label} " + common.progress_line(r, _linear_progress) for r in results.values()))
        case_results.append((case, results))
    return case_results


def _linear_progress(r: LinearResult) -> str:
    text = f"{fmt_ms(r.ms)} ms" + ("" if r.speedup is None else f" ({ratio(r.speedup)}×)")
    if r.graphed_ms is not None:
        text += f", graphed {fmt_ms(r.graphed_ms)} ms" + (
            "" if r.graphed_speedup is None else f" ({ratio(r.graphed_speedup)}×)")
    return text


# ----------------------------------------------------------------------------- optimizer

STABLE_ADAMW, STABLE_ADAMW_FOREACH = "stable-adamw", "stable-adamw-foreach"
ADAMW_FOREACH, ADAMW_FUSED = "adamw-foreach", "adamw-fused"
OPTIMIZERS = (STABLE_ADAMW, STABLE_ADAMW_FOREACH, ADAMW_FOREACH, ADAMW_FUSED)
OPTIMIZER_LABELS = {STABLE_ADAMW: "StableAdamW", STABLE_ADAMW_FOREACH: "StableAdamW foreach",
                    ADAMW_FOREACH: "AdamW foreach", ADAMW_FUSED: "AdamW fused"}
# CLIP's hyper-parameters for every optimizer (β2 0.99 as the StableAdamW paper recommends).
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
# Options beside HYPER; StableAdamW's default fused=None: fused kernels on CUDA, else foreach.
OPTIMIZER_OPTIONS = {STABLE_ADAMW: {}, STABLE_ADAMW_FOREACH: {"fused": False},
                     ADAMW_FOREACH: {"foreach": True}, ADAMW_FUSED: {"fused": True}}


def make_optimizer(key: str, params: Sequence[Tensor]) -> torch.optim.Optimizer:
    if key.startswith("stable"):
        from fusedloss.optim import StableAdamW

        return StableAdamW(params, **HYPER, **{"fused": None, **OPTIMIZER_OPTIONS[key]})
    return torch.optim.AdamW(params, **HYPER, **OPTIMIZER_OPTIONS[key])


def optimizer_call_text(key: str) -> str:
    options = {**HYPER, **OPTIMIZER_OPTIONS[key]}
    name = "fusedloss.optim.StableAdamW" if key.startswith("stable") else "torch.optim.AdamW"
    return f"{name}(params, " + ", ".join(f"{k}={v}" for k, v in options.items()) + ").step()"


def tower_parameters(config: vit.VisionConfig, seed: int,
                     device: torch.device) -> list[Tensor]:
    """The image tower's parameters (float32) with fixed random gradients (1e-2·N(0, 1))."""
    torch.manual_seed(seed)
    with torch.device(device):
        params = list(vit.VisionTransformer(config).parameters())
    generator = torch.Generator(device=device).manual_seed(seed)
    for p in params:
        p.grad = 1e-2 * torch.randn(p.shape, generator=generator, device=device)
    return params


def host_sync_check(step: Callable[[], Any], device: torch.device, steps: int = 2) -> str:
    """``steps`` calls under ``set_sync_debug_mode("error")``: "none" or the first sync's error."""
    if not common.uses_cuda(device):
        return "n/a (no CUDA)"
    common.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            step()
    except RuntimeError as error:
        return "synchronizes: " + common.describe_error(error)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return "none"


@dataclass
class OptimizerResult(common.ProviderResultBase):
    first_call_ms: float | None = None  # the first step, which creates the state
    vs_fused: float | None = None  # ms ÷ fused AdamW's ms
    peak_extra_mib: float | None = None
    host_syncs: str = ""


def run_optimizer(config: vit.VisionConfig, seed: int, device: torch.device,
                  timing: TimingSettings, notes: list[str],
                  log: Callable[[str], None]) -> tuple[int, list[OptimizerResult]]:
    params = tower_parameters(config, seed, device)
    count = sum(p.numel() for p in params)
    log(f"optimizer step over {len(params)} tensors, {count / 1e6:.2f} M parameters")
    results = []
    for key in OPTIMIZERS:
        result = OptimizerResult(provider=key, label=OPTIMIZER_LABELS[key],
                                 call=optimizer_call_text(key))
        optimizer = None
        with common.failures_recorded(result, device):
            try:
                optimizer = make_optimizer(key, params)
            except UNAVAILABLE_ERRORS as error:  # e.g. a torch without fused AdamW here
                result.status, result.note = UNAVAILABLE, common.describe_error(error)
            else:
                result.first_call_ms = common.call_ms(optimizer.step, device)
                result.host_syncs = host_sync_check(optimizer.step, device)
                result.peak_extra_mib = common.peak_extra_mib(optimizer.step, device)
                result.ms = common.median_ms(optimizer.step, device, timing)
        optimizer = None  # its state goes before the next optimizer's is created
        common.release_memory(device)
        common.note_problem(notes, "optimizer", result)
        results.append(result)
    fused = next((r for r in results if r.provider == ADAMW_FUSED and r.measured), None)
    for r in results:
        if fused is not None and r.measured:
            r.vs_fused = r.ms / fused.ms
        log(f"  {r.label}: " + common.progress_line(r, lambda r: (
            f"{fmt_ms(r.ms)} ms/step ({ratio(r.vs_fused)}× fused AdamW), "
            f"host syncs: {r.host_syncs}")))
    return count, results


# ----------------------------------------------------------------------------- end to end

BF16, E2E_SWITCHBACK, E2E_FP8 = "bf16", "switchback", "fp8"
# SwitchBack options per variant (None: the model's own nn.Linear layers).
VARIANTS: dict[str, dict[str, Any] | None] = {BF16: None, E2E_SWITCHBACK: {},
                                              E2E_FP8: {"quant_dtype": "fp8"}}
VARIANT_LABELS = {BF16: "nn.Linear", E2E_SWITCHBACK: "SwitchBack int8", E2E_FP8: "SwitchBack fp8"}
SWAP_INCLUDE = "blocks.*"  # the transformer blocks' linears; not the patch embedding or head
DEFAULT_STEPS, QUICK_STEPS = 300, 3
WARMUP_STEPS, QUICK_WARMUP_STEPS = 20, 1  # left out of the step-time median
BATCH, QUICK_BATCH = 256, 8
LR = 5e-4  # StableAdamW's peak
LR_WARMUP_FRACTION = 0.1
FINAL_LOSS_STEPS = 10  # the final loss: the mean over the last steps


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    warmup_steps: int  # steps left out of the step-time median (their losses count)
    batch: int
    lr: float
    seed: int


@dataclass
class TrainResult(common.ProviderResultBase):
    swapped: int = 0  # linear layers replaced by SwitchBackLinear
    optimizer: str = ""  # its class
    images_per_s: float | None = None
    peak_gib: float | None = None
    final_loss: float | None = None
    final_loss_delta: float | None = None  # final loss − nn.Linear's
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10 % of the steps, then cosine decay to 0.1."""
    warmup = max(1, round(LR_WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    return cosine_decay((step - warmup) / max(1, steps - warmup), 0.1)


def make_train_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """StableAdamW; weight decay on matrices only (open_clip's grouping)."""
    from fusedloss.optim import StableAdamW

    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2],
               "weight_decay": HYPER["weight_decay"]},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    return StableAdamW(groups, lr=lr, betas=HYPER["betas"], eps=HYPER["eps"])


def train_variant(variant: str, vision: vit.VisionConfig, text: vit.TextConfig,
                  settings: TrainSettings, dtype: torch.dtype, backend: str,
                  device: torch.device) -> TrainResult:
    """``settings.steps`` steps of a fresh model (same seed for every variant), each timed by
    :func:`timed`, the batch drawn before it."""
    import fusedloss

    result = TrainResult(provider=variant, label=VARIANT_LABELS[variant])
    options = VARIANTS[variant]
    result.call = "model as built (nn.Linear)" if options is None else (
        f"swap_linear_layers(model.visual, include={SWAP_INCLUDE!r}, " + ", ".join(
            f"{k}={v!r}" for k, v in {**options, "backend": backend}.items()) + ")")
    model = optimizer = None
    with common.failures_recorded(result, device):
        torch.manual_seed(settings.seed)
        model = vit.ClipModel(vision, text).to(device)
        if options is not None:
            from fusedloss.switchback import swap_linear_layers

            try:
                result.swapped = len(swap_linear_layers(
                    model.visual, include=SWAP_INCLUDE, backend=backend, **options))
            except UNAVAILABLE_ERRORS as error:
                result.status, result.note = UNAVAILABLE, common.describe_error(error)
                return result
        optimizer = make_train_optimizer(model, settings.lr)
        result.optimizer = type(optimizer).__name__
        loss_fn = fusedloss.ClipLoss()
        source = vit.SyntheticPairs(vision, text, settings.seed, device)

        def step(images: Tensor, texts: Tensor) -> Tensor:
            with torch.autocast(device.type, dtype=dtype):
                image_features, text_features, scale = model(images, texts)
            loss = loss_fn(image_features, text_features, scale)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        if common.uses_cuda(device):
            torch.cuda.reset_peak_memory_stats(device)
        losses = []
        for index in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * lr_factor(index, settings.steps)
            images, texts = source.batch(settings.batch)
            try:
                ms, loss = timed(step, device, images, texts)
            except UNAVAILABLE_ERRORS as error:
                if index:
                    raise
                result.status, result.note = UNAVAILABLE, common.describe_error(error)
                return result
            losses.append(loss)
            if index >= settings.warmup_steps:
                result.step_ms.append(ms)
        result.losses = [float(v) for v in torch.stack(losses).cpu()]
        result.ms = statistics.median(result.step_ms or [ms])  # fewer steps than warm-up: last
        result.images_per_s = settings.batch / (result.ms * 1e-3)
        if common.uses_cuda(device):
            result.peak_gib = torch.cuda.max_memory_allocated(device) / GIB
        result.final_loss = statistics.fmean(result.losses[-FINAL_LOSS_STEPS:])
        bad = [i for i, v in enumerate(result.losses) if not math.isfinite(v)]
        common.mark_wrong(result, [f"non-finite loss from step {bad[0]}"] if bad else [])
    model = optimizer = None  # noqa: F841 (free the model before the next variant)
    common.release_memory(device)
    return result


def run_e2e(vision: vit.VisionConfig, text: vit.TextConfig, settings: TrainSettings,
            dtype: torch.dtype, backend: str, device: torch.device, notes: list[str],
            log: Callable[[str], None]) -> list[TrainResult]:
    results = []
    for variant in VARIANTS:
        results.append(train_variant(variant, vision, text, settings, dtype, backend, device))
        common.note_problem(notes, "e2e", results[-1])
    base = next((r for r in results if r.provider == BF16 and r.measured), None)
    for r in results:
        if base is not None and r.measured:
            r.final_loss_delta = r.final_loss - base.final_loss
        log(f"  {r.label}: " + common.progress_line(r, lambda r: (
            f"{fmt_ms(r.ms)} ms/step, {count_text(r.images_per_s)} images/s, "
            f"loss {loss_text(r.losses[0])} → {loss_text(r.final_loss)}")))
    return results


# ----------------------------------------------------------------------------- reporting


@dataclass
class Settings:
    parts: list[str]
    widths: list[int]
    tokens: list[int]
    backend: str  # SwitchBack's
    train: TrainSettings
    dtype: str
    seed: int
    quick: bool
    timing: TimingSettings


DEFINITIONS = {
    "linear ms": "median time of one `y = layer(x); y.backward(dy)`, gradients set to None "
    "before it: {timing}",
    "speed-up": "nn.Linear's ms ÷ the provider's ms on the same case",
    "graphed ms": f"the same step captured in a CUDA graph (after {GRAPH_WARMUP_STEPS} eager "
    "side-stream steps) and replayed, without host launch overhead; CUDA only, — where the "
    "capture failed (see note): {timing}",
    "graphed ×": "nn.Linear's graphed ms ÷ the provider's graphed ms on the same case",
    "TFLOP/s": "6·N·in·out ÷ ms",
    "peak MB": "(max_memory_allocated() during one step − memory_allocated() before it − the "
    "bytes of dx, dw and db) / 2^20",
    "saved MB": "bytes the forward saves for the backward (each storage once, parameters left "
    "out, x counted) / 2^20",
    "y / dx / dw err": "relative L2 error against a float32 nn.Linear (TF32 off) on the same "
    "inputs; the nn.Linear row is PyTorch's own error in the dtype",
    "first call ms": "wall time of the untimed first step (compilation, autotuning)",
    "optimizer ms": "median time of `optimizer.step()` over the tower's parameters with fixed "
    "random gradients, after a first step that creates the state: {timing}",
    "× fused": "the optimizer's ms ÷ torch.optim.AdamW(fused=True)'s ms",
    "optimizer peak MB": "(max_memory_allocated during one step − memory_allocated before it) "
    "/ 2^20",
    "host syncs": "two steps of a fresh optimizer under torch.cuda.set_sync_debug_mode('error'):"
    " 'none', or the first synchronizing operation's error",
    "e2e ms/step": "median, after the warm-up steps, of one training step (autocast forward, "
    "ClipLoss, backward, optimizer step, zero_grad) between CUDA events (wall clock without CUDA)",
    "images/s": "batch ÷ ms/step",
    "peak GiB": "torch.cuda.max_memory_allocated() over the whole run / 2^30",
    "final loss": f"mean loss of the last {FINAL_LOSS_STEPS} steps; Δ = it − nn.Linear's",
}


def _speedup(value: float | None) -> str:
    return "—" if value is None else f"{ratio(value)}×"


def _cell(r: common.ProviderResultBase, text: str) -> str:
    return text if r.measured else r.status


def _graphed_cell(r: LinearResult, text: str) -> str:
    if not r.measured:
        return r.status
    return GRAPH_FAILED if r.graphed_ms is None and GRAPH_FAILED in r.note else text


def vision_text(c: vit.VisionConfig) -> str:
    return (f"ViT {c.image_size} px, patch {c.patch_size}, width {c.width}, {c.layers} layers, "
            f"{c.heads} heads, MLP {c.mlp_width}, embedding {c.embed_dim}")


def model_text(config: vit.VisionConfig, text: vit.TextConfig) -> str:
    return (f"image tower: {vision_text(config)}; text: fixed {text.text_dim}-d embeddings → "
            f"MLP {text.hidden} → {config.embed_dim}")


LINEAR_COLUMNS = [  # items: (case, result)
    ("case", lambda i: i[0].key), ("provider", lambda i: i[1].label),
    ("status", lambda i: i[1].status), ("ms", lambda i: _cell(i[1], fmt_ms(i[1].ms))),
    ("speed-up", lambda i: _speedup(i[1].speedup)),
    ("graphed ms", lambda i: fmt_ms(i[1].graphed_ms)),
    ("graphed ×", lambda i: _speedup(i[1].graphed_speedup)),
    ("TFLOP/s", lambda i: "—" if i[1].tflops is None else common.format_tflops(i[1].tflops)),
    ("peak MB", lambda i: common.format_mib(i[1].peak_extra_mib)),
    ("saved MB", lambda i: common.format_mib(i[1].saved_mib)),
    ("y err", lambda i: common.format_error(i[1].y_error)),
    ("dx err", lambda i: common.format_error(i[1].dx_error)),
    ("dw err", lambda i: common.format_error(i[1].dw_error)),
    ("first call ms", lambda i: fmt_ms(i[1].first_call_ms)), ("note", lambda i: i[1].note),
]
OPTIMIZER_COLUMNS = [
    ("optimizer", lambda r: r.label), ("status", lambda r: r.status),
    ("ms/step", lambda r: _cell(r, fmt_ms(r.ms))), ("× fused", lambda r: _speedup(r.vs_fused)),
    ("peak MB", lambda r: common.format_mib(r.peak_extra_mib)),
    ("first step ms", lambda r: fmt_ms(r.first_call_ms)),
    ("host syncs", lambda r: r.host_syncs or "—"), ("note", lambda r: r.note),
]
E2E_COLUMNS = [
    ("variant", lambda r: r.label), ("status", lambda r: r.status),
    ("swapped linears", lambda r: r.swapped), ("ms/step", lambda r: _cell(r, fmt_ms(r.ms))),
    ("images/s", lambda r: count_text(r.images_per_s)),
    ("peak GiB", lambda r: gib_text(r.peak_gib)),
    ("first loss", lambda r: loss_text(r.losses[0] if r.losses else None)),
    ("final loss", lambda r: loss_text(r.final_loss)),
    ("Δ final loss", lambda r: "—" if r.final_loss_delta is None else f"{r.final_loss_delta:+.4f}"),
    ("note", lambda r: r.note),
]


def render_markdown(info: Any, linear: Sequence[tuple[LinearCase, dict]],
                    optimizer: Sequence[OptimizerResult], e2e: Sequence[TrainResult],
                    plot: str | None) -> str:
    env, s, cuda = info.environment, info.settings, common.uses_cuda(info.environment["device"])
    lines = [f"# Low-precision training companions: {env['device_name']}, {env['date']}", ""]
    if s.quick:
        lines += ["> **--quick run**: tiny shapes and a tiny tower; a smoke test of the suite, "
                  "the figures are not representative.", ""]
    rows = [*[row for row in common.environment_rows(env, {}) if row[0] != "peers"],
            common.matmul_row(info.matmul), ("parts", ", ".join(s.parts)),
            ("dtype, seed", f"{s.dtype}, {s.seed}"), ("timing", info.timing),
            ("SwitchBack backend", s.backend),
            ("CUDA graphs (linear)", "on: step replayed from a CUDA graph" if cuda
             else "n/a (no CUDA)")]
    lines += [common.markdown_table(["setting", "value"], rows), "", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.definitions.items()] + [""]
    if LINEAR in s.parts:
        lines += ["## Linear layer forward+backward", "",
                  f"Widths {', '.join(map(str, s.widths))}; shapes {', '.join(SHAPES)} (in → "
                  f"out as multiples of d); tokens {', '.join(map(str, s.tokens))}; {s.dtype}.",
                  "", table(LINEAR_COLUMNS, [(c, r) for c, rs in linear for r in rs.values()]),
                  ""]
    if OPTIMIZER in s.parts:
        lines += ["## Optimizer step", "",
                  f"The parameters of the image tower ({vision_text(info.vision)}): "
                  f"{(info.tower_parameters or 0) / 1e6:.2f} M, float32, random gradients. "
                  f"Hyper-parameters {HYPER}.", "", table(OPTIMIZER_COLUMNS, optimizer), ""]
    if E2E in s.parts:
        t = s.train
        lines += ["## End-to-end CLIP training", "",
                  f"{model_text(info.vision, info.text)}; fusedloss.ClipLoss; StableAdamW "
                  f"(lr {t.lr:g}, 10 % linear warm-up then cosine to 0.1, betas "
                  f"{HYPER['betas']}, eps {HYPER['eps']}, weight decay {HYPER['weight_decay']} "
                  f"on matrices); autocast {s.dtype}; batch {t.batch}; {t.steps} steps, the "
                  f"first {t.warmup_steps} left out of the time; synthetic pairs "
                  "(benchmarks/vit.py SyntheticPairs), the same model initialization and "
                  f"batches for every variant (seed {t.seed}).", "", table(E2E_COLUMNS, e2e), ""]
        curves = [r for r in e2e if r.losses]
        if curves:
            marks = sorted({*range(0, t.steps, max(1, t.steps // 10)), t.steps - 1})
            rows = [[step, *(loss_text(r.losses[step]) if step < len(r.losses) else "—"
                             for r in curves)] for step in marks]
            lines += ["Loss curve (every step in the JSON):", "",
                      common.markdown_table(["step", *(r.label for r in curves)], rows), ""]
        lines += [f"Plot: `{plot}`" if plot else "No plot: matplotlib is not installed.", ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def results_json(info: Any, linear: Sequence[tuple[LinearCase, dict]],
                 optimizer: Sequence[OptimizerResult], e2e: Sequence[TrainResult],
                 plot: str | None) -> dict[str, Any]:
    return {
        "suite": NAME, "environment": info.environment, "matmul": info.matmul,
        "settings": asdict(info.settings), "definitions": info.definitions,
        "linear": [{**asdict(c), "case": c.key, "flops": c.flops,
                    "results": [asdict(r) for r in rs.values()]} for c, rs in linear],
        "optimizer": {"model": asdict(info.vision), "parameters": info.tower_parameters,
                      "hyper_parameters": HYPER,
                      "results": [asdict(r) for r in optimizer]} if optimizer else None,
        "e2e": {"vision": asdict(info.vision), "text": asdict(info.text), "plot": plot,
                "results": [asdict(r) for r in e2e]} if e2e else None,
        "calls": info.calls, "notes": info.notes,
    }


def short_tables(linear: Sequence[tuple[LinearCase, dict]],
                 optimizer: Sequence[OptimizerResult], e2e: Sequence[TrainResult]) -> str:
    parts = []
    if linear:
        others = [p for p in linear[0][1] if p != TORCH]
        graphed = any(r.graphed_ms is not None or GRAPH_FAILED in r.note
                      for _, rs in linear for r in rs.values())
        # eager speed-ups, then (where any was taken: CUDA) the graphed ones
        for suffix, cell, key, speed in (("", _cell, "ms", "speedup"),
                                         (" graphed", _graphed_cell, "graphed_ms",
                                          "graphed_speedup"))[:1 + graphed]:
            columns = [(f"linear fwd+bwd{suffix}", lambda i: i[0].key),
                       (f"nn.Linear{suffix} ms", lambda i, c=cell, k=key: "—"
                        if TORCH not in i[1] else c(i[1][TORCH], fmt_ms(getattr(i[1][TORCH], k))))]
            columns += [(f"{LINEAR_LABELS[p]}{suffix} ×", lambda i, p=p, c=cell, k=speed:
                         c(i[1][p], _speedup(getattr(i[1][p], k)))) for p in others]
            parts += [table(columns, linear, text=True), ""]
    if optimizer:
        parts += [table([OPTIMIZER_COLUMNS[0], OPTIMIZER_COLUMNS[2], OPTIMIZER_COLUMNS[3],
                         OPTIMIZER_COLUMNS[6]], optimizer, text=True), ""]
    if e2e:
        parts += [table([("e2e variant", E2E_COLUMNS[0][1]), E2E_COLUMNS[3], E2E_COLUMNS[4],
                         E2E_COLUMNS[7]], e2e, text=True), ""]
    return "\n".join(parts).rstrip()


# ----------------------------------------------------------------------------- command line


def comma_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers: {text!r}") from error
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def ints(values):
        return ",".join(map(str, values))

    add = parser.add_argument
    add("--parts", type=common.comma_list(PARTS), default=list(PARTS),
        help=f"comma list of {', '.join(PARTS)} (default: all)")
    add("--widths", type=comma_ints, default=None,
        help=f"linear: widths d (default {ints(WIDTHS)}; {ints(QUICK_WIDTHS)} with --quick)")
    add("--tokens", type=comma_ints, default=None,
        help=f"linear: token counts (default {ints(TOKENS)}; {ints(QUICK_TOKENS)} with --quick)")
    add("--steps", type=int, default=None,
        help=f"e2e: steps per variant (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help="tiny shapes and tower, 3 steps: a CPU smoke test")
    add("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add("--warmup-ms", type=float, default=None,
        help=f"do_bench warmup ms (default {DEFAULT_TIMING.warmup_ms:g}; "
        f"{common.QUICK_TIMING.warmup_ms:g} with --quick)")
    add("--rep-ms", type=float, default=None,
        help=f"do_bench rep ms (default {DEFAULT_TIMING.rep_ms:g}; "
        f"{common.QUICK_TIMING.rep_ms:g} with --quick)")
    common.add_matmul_output_arguments(parser)


def settings_from(args: argparse.Namespace, device: torch.device) -> Settings:
    quick = bool(args.quick)

    def pick(value, full, small):
        return value if value is not None else (small if quick else full)

    default = common.QUICK_TIMING if quick else DEFAULT_TIMING
    timing = TimingSettings(warmup_ms=pick(args.warmup_ms, default.warmup_ms, default.warmup_ms),
                            rep_ms=pick(args.rep_ms, default.rep_ms, default.rep_ms))
    train = TrainSettings(steps=max(1, pick(args.steps, DEFAULT_STEPS, QUICK_STEPS)),
                          warmup_steps=QUICK_WARMUP_STEPS if quick else WARMUP_STEPS,
                          batch=QUICK_BATCH if quick else BATCH, lr=LR, seed=args.seed)
    return Settings(parts=[p for p in PARTS if p in args.parts],
                    widths=list(pick(args.widths, WIDTHS, QUICK_WIDTHS)),
                    tokens=list(pick(args.tokens, TOKENS, QUICK_TOKENS)),
                    backend=switchback_backend(device), train=train, dtype=DTYPE,
                    seed=args.seed, quick=quick, timing=timing)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the companions suite needs a CUDA device at full size; use --quick for a CPU "
            "smoke run")
        return 2
    settings = settings_from(args, device)
    notes: list[str] = [common.QUICK_NOTE] if settings.quick else []
    if not common.uses_cuda(device) and settings.backend == "triton":
        notes.append(common.use_triton_interpreter())
    import fusedloss.nn  # noqa: F401  (imported before the collector is frozen)
    import fusedloss.optim  # noqa: F401

    # what exists now is left out of garbage collection: the run's many gc.collect() calls
    # (common.release_memory) then scan only what the run created
    gc.collect()
    gc.freeze()
    try:
        return _run(args, settings, device, notes, log)
    finally:
        gc.unfreeze()


def _run(args: argparse.Namespace, s: Settings, device: torch.device, notes: list[str],
         log: Callable[[str], None]) -> int:
    dtype = common.parse_dtype(s.dtype)
    cuda = common.uses_cuda(device)
    vision, text = (vit.VIT_TINY, vit.TEXT_TINY) if s.quick else (vit.VIT_B_16, vit.TEXT_SMALL)
    environment = common.collect_environment(device)
    log(f"companions on {environment['device_name']}: torch {environment['torch']}, triton "
        f"{environment['triton']}, {s.dtype}, SwitchBack backend {s.backend}, "
        f"parts {', '.join(s.parts)}")
    matmul = common.probe_matmul(device, args.matmul_size, s.quick, s.timing, dtype, log)
    timing = common.do_bench_text(s.timing) if cuda else common.WALL_CLOCK_TIMING
    info = types.SimpleNamespace(
        environment=environment, matmul=matmul, settings=s, vision=vision, text=text,
        tower_parameters=None, calls={}, notes=notes, timing=timing,
        definitions={k: v.format(timing=timing) for k, v in DEFINITIONS.items()})
    linear, optimizer, e2e = [], [], []
    if LINEAR in s.parts:
        cases = linear_cases(s.widths, list(SHAPES), s.tokens)
        log(f"linear forward+backward: {len(cases)} cases × {len(LINEAR_PROVIDERS)} providers"
            + (", eager and replayed from a CUDA graph" if cuda else ""))
        linear = run_linear(cases, LINEAR_PROVIDERS, s.backend, dtype, s.seed, device, s.timing,
                            notes, log)
        for provider in LINEAR_PROVIDERS:
            info.calls[f"linear {provider}"] = layer_call_text(provider, s.backend, dtype)
    if OPTIMIZER in s.parts:
        info.tower_parameters, optimizer = run_optimizer(vision, s.seed, device, s.timing,
                                                         notes, log)
        info.calls.update({f"optimizer {r.provider}": r.call for r in optimizer})
    if E2E in s.parts:
        log(f"e2e: {model_text(vision, text)}; batch {s.train.batch}, "
            f"{s.train.steps} steps per variant")
        e2e = run_e2e(vision, text, s.train, dtype, s.backend, device, notes, log)
        info.calls.update({f"e2e {r.provider}": r.call for r in e2e})
    plot = None
    if e2e:
        stem = common.results_stem(RESULTS_PREFIX, environment["date"],
                                   environment["device_slug"], args.tag)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = save_plot(Path(args.out) / f"{stem}.png", [(
            "CLIP training: loss per step", "step", "CLIP loss",
            [(r.label, range(len(r.losses)), r.losses) for r in e2e if r.losses])], linewidth=1)
        plot = path.name if path else None
        notes.append(f"plot: {plot}" if plot else "no plot: matplotlib not installed")
    common.report_results(
        args.out, RESULTS_PREFIX, args.tag, info.environment, info.notes,
        markdown=render_markdown(info, linear, optimizer, e2e, plot),
        payload=results_json(info, linear, optimizer, e2e, plot),
        tables=short_tables(linear, optimizer, e2e), log=log)
    return 0


SUITE = Suite(
    name=NAME,
    help="SwitchBack linear layers, StableAdamW and a CLIP ViT-B/16 training run",
    add_arguments=add_arguments,
    run=run,
)
