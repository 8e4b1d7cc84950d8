"""Suite ``companions``: the low-precision training companions of docs/companions.md.

Three parts (``--parts``):

- ``linear``: ``y = layer(x); y.backward(dy)`` at CLIP ViT widths d in the shapes d → d,
  d → 4d, 4d → d: ``nn.Linear`` against the SwitchBack variants; time (eager, and on CUDA
  replayed from a CUDA graph), TFLOP/s, memory, errors against a float32 ``nn.Linear``.
- ``optimizer``: one ``StableAdamW`` step (fused and foreach) against ``torch.optim.AdamW``
  (foreach and fused) over a ViT-B/16 image tower's parameters; host synchronizations.
- ``e2e``: a ViT-B/16 CLIP model (``benchmarks/vit.py``) trained on synthetic pairs with
  ``fusedloss.ClipLoss``, with ``nn.Linear`` and with each SwitchBack variant in the blocks.

A provider whose options this SwitchBack does not accept (TypeError, ValueError,
NotImplementedError when built or first called) is recorded ``unavailable``; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import common, vit
from benchmarks.common import UNAVAILABLE, TimingSettings
from benchmarks.suites import Suite
from benchmarks.suites.train import count_text, gib_text, loss_text, timed
from benchmarks.trained_lm import cosine_decay

NAME = "companions"
RESULTS_PREFIX = "companions"
MIB, GIB = common.MIB, float(1 << 30)
DTYPE = "bf16"  # inputs and layers (linear), autocast (e2e)

LINEAR, OPTIMIZER, E2E = "linear", "optimizer", "e2e"
PARTS = (LINEAR, OPTIMIZER, E2E)

# What a SwitchBack version that lacks an option raises, when built or first called.
UNAVAILABLE_ERRORS = (TypeError, ValueError, NotImplementedError)

# Timing budgets: Triton's do_bench defaults.
DEFAULT_TIMING = TimingSettings(warmup_ms=25.0, rep_ms=100.0)

# ----------------------------------------------------------------------------- linear: setup

TORCH, SWITCHBACK, SWITCHBACK_M, SWITCHBACK_Q, FP8 = (
    "torch", "switchback", "switchback-m", "switchback-q", "fp8")
# Options of SwitchBackLinear beside ``backend``; only the non-default ones are passed, so that
# the int8 variants run on a SwitchBack that does not know ``quant_dtype`` yet.
SWITCHBACK_OPTIONS: dict[str, dict[str, Any]] = {
    SWITCHBACK: {},
    SWITCHBACK_M: {"memory_efficient": True},
    SWITCHBACK_Q: {"weight_quantization": "rowwise"},
    FP8: {"quant_dtype": "fp8"},
}
LINEAR_PROVIDERS = (TORCH, *SWITCHBACK_OPTIONS)
LINEAR_LABELS = {
    TORCH: "nn.Linear",
    SWITCHBACK: "SwitchBack",
    SWITCHBACK_M: "SwitchBackM",
    SWITCHBACK_Q: "SwitchBackQ",
    FP8: "SwitchBack fp8",
}

WIDTHS = (768, 1024, 1280, 1664)  # CLIP ViT-B, -L, -H, -G widths
TOKENS = (8192, 16384, 32768, 65536)
SHAPES = {"d-d": (1, 1), "d-4d": (1, 4), "4d-d": (4, 1)}  # (in, out) as multiples of d
QUICK_WIDTHS = (32,)
QUICK_TOKENS = (64, 128)

# Eager steps on a side stream before the capture: autotuning, the gradients' allocation.
GRAPH_WARMUP_STEPS = 3
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
        """Forward 2·N·in·out, input gradient and weight gradient as much again each."""
        return 6.0 * self.tokens * self.in_features * self.out_features


def linear_cases(widths: Sequence[int], shapes: Sequence[str],
                 tokens: Sequence[int]) -> list[LinearCase]:
    """Every width × shape × token count, widths outermost."""
    cases = []
    for width in widths:
        for shape in shapes:
            factor_in, factor_out = SHAPES[shape]
            for n in tokens:
                cases.append(LinearCase(width, shape, factor_in * width, factor_out * width, n))
    return cases


@dataclass
class LinearInputs:
    x: Tensor  # (N, in), requires grad
    dy: Tensor  # (N, out)
    weight: Tensor  # (out, in)
    bias: Tensor  # (out,)


def make_linear_inputs(case: LinearCase, dtype: torch.dtype, seed: int,
                       device: torch.device) -> LinearInputs:
    """x, dy ~ N(0, 1) and nn.Linear's initialization U(±1/sqrt(in)) for the weight and
    bias, drawn in float32 from one seeded generator on the device, then rounded to dtype."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, uniform: bool = False) -> Tensor:
        if uniform:
            bound = case.in_features**-0.5
            values = (2 * torch.rand(shape, generator=generator, device=device) - 1) * bound
        else:
            values = torch.randn(shape, generator=generator, device=device)
        return values.to(dtype)

    return LinearInputs(
        x=draw(case.tokens, case.in_features).requires_grad_(),
        dy=draw(case.tokens, case.out_features),
        weight=draw(case.out_features, case.in_features, uniform=True),
        bias=draw(case.out_features, uniform=True),
    )


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """float32 matmuls without TF32 (its 10-bit mantissa would make a poor reference)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def float32_reference(inputs: LinearInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(y, dx, dw) of a float32 nn.Linear on the same (dtype-rounded) inputs."""
    with full_float32():
        x = inputs.x.detach().float().requires_grad_()
        weight = inputs.weight.float().requires_grad_()
        y = F.linear(x, weight, inputs.bias.float())
        y.backward(inputs.dy.float())
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
    dtype_text = f"dtype={dtype}"
    if provider == TORCH:
        layer = f"nn.Linear(in, out, {dtype_text})"
    else:
        options = {**SWITCHBACK_OPTIONS[provider], "backend": backend}
        text = ", ".join(f"{k}={v!r}" for k, v in options.items())
        layer = f"fusedloss.nn.SwitchBackLinear(in, out, {dtype_text}, {text})"
    return f"layer = {layer}; y = layer(x); y.backward(dy)"


def forward_backward(layer: nn.Linear, inputs: LinearInputs) -> Callable[[], None]:
    """One training step's worth of the layer: gradients start from None, as after
    ``zero_grad(set_to_none=True)``."""
    def step() -> None:
        clear_grads(layer, inputs)
        layer(inputs.x).backward(inputs.dy)

    return step


def clear_grads(layer: nn.Linear, inputs: LinearInputs) -> None:
    inputs.x.grad = layer.weight.grad = layer.bias.grad = None


def graphed_ms(layer: nn.Linear, inputs: LinearInputs, device: torch.device,
               timing: TimingSettings) -> float | None:
    """Median time of replaying one forward+backward captured in a CUDA graph: the device's
    time for the step without the host's launch overhead. None without CUDA.

    The eager step warms up on a side stream (autotuning, allocations), as capture requires.
    A graph replays into static buffers, so the gradients are not set to None inside it: they
    are set to None once before the capture, the captured backward allocates them from the
    graph's memory pool as the eager step allocates them, and every replay rewrites them in
    place: the same work as the eager step, no accumulation."""
    if not common.uses_cuda(device):
        return None
    graph, _ = common.capture_graph(
        forward_backward(layer, inputs), lambda: layer(inputs.x).backward(inputs.dy), device,
        GRAPH_WARMUP_STEPS, before_capture=lambda: clear_grads(layer, inputs))
    return common.median_ms(graph.replay, device, timing)


def saved_mib(layer: nn.Linear, x: Tensor) -> float:
    """MiB of the tensors the layer's forward saves for its backward (each storage once,
    the layer's parameters left out; the input counts: a network keeps it alive for this)."""
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


# ----------------------------------------------------------------------------- linear: run


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


@dataclass
class LinearCaseResult:
    case: LinearCase
    results: dict[str, LinearResult]


def measure_linear(provider: str, case: LinearCase, inputs: LinearInputs,
                   reference: tuple[Tensor, Tensor, Tensor], backend: str,
                   device: torch.device, timing: TimingSettings,
                   notes: list[str] | None = None) -> LinearResult:
    """The provider's row on the case. A step that cannot be captured in a CUDA graph keeps
    its eager figures: its graphed time stays None and the capture's error goes to the row's
    note and to ``notes``."""
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
        problems = [f"{name} not finite" for name, value in
                    (("y", result.y_error), ("dx", result.dx_error), ("dw", result.dw_error))
                    if not math.isfinite(value)]
        common.mark_wrong(result, problems)
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
               notes: list[str], log: Callable[[str], None]) -> list[LinearCaseResult]:
    case_results = []
    for case in cases:
        inputs = make_linear_inputs(case, dtype, seed, device)
        reference = float32_reference(inputs)
        results = {p: measure_linear(p, case, inputs, reference, backend, device, timing, notes)
                   for p in providers}
        del inputs, reference
        common.release_memory(device)
        base = results.get(TORCH)
        for result in results.values():
            if base is not None and base.measured and result.measured:
                result.speedup = base.ms / result.ms
            if (base is not None and base.graphed_ms is not None
                    and result.graphed_ms is not None):
                result.graphed_speedup = base.graphed_ms / result.graphed_ms
            common.note_problem(notes, case.key, result)
        log(f"  {case.key}: " + ", ".join(
            f"{r.label} " + common.progress_line(r, _linear_progress) for r in results.values()))
        case_results.append(LinearCaseResult(case, results))
    return case_results


def _linear_progress(result: LinearResult) -> str:
    speedup = "" if result.speedup is None else f" ({common.format_ratio(result.speedup)}×)"
    text = f"{common.format_ms(result.ms)} ms{speedup}"
    if result.graphed_ms is not None:
        graphed = ("" if result.graphed_speedup is None
                   else f" ({common.format_ratio(result.graphed_speedup)}×)")
        text += f", graphed {common.format_ms(result.graphed_ms)} ms{graphed}"
    return text


# ----------------------------------------------------------------------------- optimizer

STABLE_ADAMW, STABLE_ADAMW_FOREACH = "stable-adamw", "stable-adamw-foreach"
ADAMW_FOREACH, ADAMW_FUSED = "adamw-foreach", "adamw-fused"
OPTIMIZERS = (STABLE_ADAMW, STABLE_ADAMW_FOREACH, ADAMW_FOREACH, ADAMW_FUSED)
OPTIMIZER_LABELS = {
    STABLE_ADAMW: "StableAdamW",
    STABLE_ADAMW_FOREACH: "StableAdamW foreach",
    ADAMW_FOREACH: "AdamW foreach",
    ADAMW_FUSED: "AdamW fused",
}
# The same hyper-parameters for every optimizer (CLIP's: β2 0.99 as the paper recommends for
# StableAdamW, ε 1e-6, weight decay 0.1 on every tensor here).
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)


def make_optimizer(key: str, params: Sequence[Tensor]) -> torch.optim.Optimizer:
    if key in (STABLE_ADAMW, STABLE_ADAMW_FOREACH):
        from fusedloss.optim import StableAdamW

        # the default: the fused kernels on CUDA, the foreach path elsewhere
        fused = False if key == STABLE_ADAMW_FOREACH else None
        return StableAdamW(params, **HYPER, fused=fused)
    if key == ADAMW_FOREACH:
        return torch.optim.AdamW(params, **HYPER, foreach=True)
    return torch.optim.AdamW(params, **HYPER, fused=True)


def optimizer_call_text(key: str) -> str:
    hyper = ", ".join(f"{k}={v}" for k, v in HYPER.items())
    if key in (STABLE_ADAMW, STABLE_ADAMW_FOREACH):
        fused = ", fused=False" if key == STABLE_ADAMW_FOREACH else ""
        return f"fusedloss.optim.StableAdamW(params, {hyper}{fused}).step()"
    flag = "foreach" if key == ADAMW_FOREACH else "fused"
    return f"torch.optim.AdamW(params, {hyper}, {flag}=True).step()"


def tower_parameters(config: vit.VisionConfig, seed: int,
                     device: torch.device) -> list[Tensor]:
    """The image tower's parameters (float32) with N(0, 1e-4) gradients from the seed."""
    torch.manual_seed(seed)
    with torch.device(device):
        params = list(vit.VisionTransformer(config).parameters())
    generator = torch.Generator(device=device).manual_seed(seed)
    for p in params:
        p.grad = 1e-2 * torch.randn(p.shape, generator=generator, device=device)
    return params


def host_sync_check(step: Callable[[], Any], device: torch.device, steps: int = 2) -> str:
    """``steps`` calls of ``step`` under ``torch.cuda.set_sync_debug_mode("error")``: "none",
    or the first synchronizing call's error. The first step creates the optimizer's state, the
    second is a steady one."""
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
    for result in results:
        if fused is not None and result.measured:
            result.vs_fused = result.ms / fused.ms
        log(f"  {result.label}: " + common.progress_line(result, _optimizer_progress))
    return count, results


def _optimizer_progress(result: OptimizerResult) -> str:
    return (f"{common.format_ms(result.ms)} ms/step ({common.format_ratio(result.vs_fused)}× "
            f"fused AdamW), host syncs: {result.host_syncs}")


# ----------------------------------------------------------------------------- end to end

BF16, E2E_SWITCHBACK, E2E_FP8 = "bf16", "switchback", "fp8"
# SwitchBack options per variant (None: the model's own nn.Linear layers).
VARIANTS: dict[str, dict[str, Any] | None] = {
    BF16: None,
    E2E_SWITCHBACK: {},
    E2E_FP8: {"quant_dtype": "fp8"},
}
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
    """StableAdamW; weight decay 0.1 on matrices, none on gains, biases, the class token and
    the temperature (open_clip's grouping)."""
    from fusedloss.optim import StableAdamW

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": HYPER["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    return StableAdamW(groups, lr=lr, betas=HYPER["betas"], eps=HYPER["eps"])


def train_variant(variant: str, vision: vit.VisionConfig, text: vit.TextConfig,
                  settings: TrainSettings, dtype: torch.dtype, backend: str,
                  device: torch.device) -> TrainResult:
    """``settings.steps`` training steps of a fresh model (same seed for every variant);
    each step between CUDA events with the device synchronized around it (wall clock
    without CUDA), the batch drawn before the step."""
    import fusedloss

    result = TrainResult(provider=variant, label=VARIANT_LABELS[variant])
    options = VARIANTS[variant]
    if options is not None:
        text_options = ", ".join(f"{k}={v!r}" for k, v in {**options, "backend": backend}.items())
        result.call = (f"swap_linear_layers(model.visual, include={SWAP_INCLUDE!r}, "
                       f"{text_options})")
    else:
        result.call = "model as built (nn.Linear)"
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
        # fewer steps than warm-up steps: the last one
        result.ms = statistics.median(result.step_ms or [ms])
        result.images_per_s = settings.batch / (result.ms * 1e-3)
        if common.uses_cuda(device):
            result.peak_gib = torch.cuda.max_memory_allocated(device) / GIB
        result.final_loss = statistics.fmean(result.losses[-FINAL_LOSS_STEPS:])
        bad = [i for i, v in enumerate(result.losses) if not math.isfinite(v)]
        common.mark_wrong(result, [f"non-finite loss from step {bad[0]}"] if bad else [])
    model = optimizer = None  # noqa: F841 (free the model before the next variant)
    common.release_memory(device)
    return result


def run_e2e(vision: vit.VisionConfig, text: vit.TextConfig,
            settings: TrainSettings, dtype: torch.dtype, backend: str, device: torch.device,
            notes: list[str], log: Callable[[str], None]) -> list[TrainResult]:
    results = []
    for variant in VARIANTS:
        result = train_variant(variant, vision, text, settings, dtype, backend, device)
        common.note_problem(notes, "e2e", result)
        results.append(result)
    base = next((r for r in results if r.provider == BF16 and r.measured), None)
    for result in results:
        if base is not None and result.measured:
            result.final_loss_delta = result.final_loss - base.final_loss
        log(f"  {result.label}: " + common.progress_line(result, _train_progress))
    return results


def _train_progress(result: TrainResult) -> str:
    return (f"{common.format_ms(result.ms)} ms/step, {count_text(result.images_per_s)} images/s, "
            f"loss {loss_text(result.losses[0])} → {loss_text(result.final_loss)}")


def plot_losses(path: Path, results: Sequence[TrainResult]) -> Path | None:
    """Loss against step, one line per variant. ``None`` (nothing written) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(8, 5))
    for result in results:
        if result.losses:
            axis.plot(range(len(result.losses)), result.losses, label=result.label, linewidth=1)
    axis.set(xlabel="step", ylabel="CLIP loss", title="CLIP training: loss per step")
    axis.grid(True, alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


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


@dataclass
class RunInfo:
    environment: dict[str, Any]
    matmul: dict[str, Any]
    settings: Settings
    vision: vit.VisionConfig
    text: vit.TextConfig
    tower_parameters: int | None = None
    calls: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


DEFINITIONS = {
    "linear ms": "median time of one `y = layer(x); y.backward(dy)`, gradients set to None "
    "before it: {timing}",
    "speed-up": "nn.Linear's ms ÷ the provider's ms on the same case",
    "graphed ms": "the same step captured once in a torch.cuda.CUDAGraph (after "
    f"{GRAPH_WARMUP_STEPS} eager steps on a side stream) and replayed: the device's time "
    "without the host's launch overhead; CUDA only, — where the capture failed (the note says "
    "why): {timing}",
    "graphed ×": "nn.Linear's graphed ms ÷ the provider's graphed ms on the same case",
    "TFLOP/s": "6·N·in·out ÷ ms",
    "peak MB": "(max_memory_allocated() during one step − memory_allocated() before it − the "
    "bytes of dx, dw and db) / 2^20",
    "saved MB": "bytes of the tensors the forward saves for the backward (each storage once, "
    "parameters left out, x counted) / 2^20",
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
    "e2e ms/step": "median over the steps after the warm-up steps of one training step "
    "(autocast forward, ClipLoss, backward, optimizer step, zero_grad) between CUDA events "
    "(wall clock without CUDA)",
    "images/s": "batch ÷ ms/step",
    "peak GiB": "torch.cuda.max_memory_allocated() over the whole run / 2^30",
    "final loss": f"mean loss of the last {FINAL_LOSS_STEPS} steps; Δ = it − nn.Linear's",
}


def definitions(timing_text: str) -> dict[str, str]:
    return {k: v.format(timing=timing_text) for k, v in DEFINITIONS.items()}


def timing_text(info: RunInfo) -> str:
    if common.uses_cuda(info.environment["device"]):
        return common.do_bench_text(info.settings.timing)
    return common.WALL_CLOCK_TIMING


def graphs_text(info: RunInfo) -> str:
    if not common.uses_cuda(info.environment["device"]):
        return "n/a (no CUDA)"
    return "on: step replayed from a CUDA graph"


def _speedup(value: float | None) -> str:
    return "—" if value is None else f"{common.format_ratio(value)}×"


def _cell(result: common.ProviderResultBase, text: str) -> str:
    return text if result.measured else result.status


def _graphed_cell(result: LinearResult, text: str) -> str:
    if not result.measured:
        return result.status
    return GRAPH_FAILED if result.graphed_ms is None and GRAPH_FAILED in result.note else text


def vision_text(config: vit.VisionConfig) -> str:
    return (f"ViT {config.image_size} px, patch {config.patch_size}, width {config.width}, "
            f"{config.layers} layers, {config.heads} heads, MLP {config.mlp_width}, embedding "
            f"{config.embed_dim}")


def model_text(config: vit.VisionConfig, text: vit.TextConfig) -> str:
    return (f"image tower: {vision_text(config)}; text: fixed {text.text_dim}-d embeddings → "
            f"MLP {text.hidden} → {config.embed_dim}")


def render_markdown(info: RunInfo, linear: Sequence[LinearCaseResult],
                    optimizer: Sequence[OptimizerResult], e2e: Sequence[TrainResult],
                    plot: str | None) -> str:
    env, s = info.environment, info.settings
    lines = [f"# Low-precision training companions: {env['device_name']}, {env['date']}", ""]
    if s.quick:
        lines += ["> **--quick run**: tiny shapes and a tiny tower; a smoke test of the suite, "
                  "the figures are not representative.", ""]
    rows = [
        *[row for row in common.environment_rows(env, {}) if row[0] != "peers"],
        common.matmul_row(info.matmul),
        ("parts", ", ".join(s.parts)),
        ("dtype, seed", f"{s.dtype}, {s.seed}"),
        ("timing", timing_text(info)),
        ("SwitchBack backend", s.backend),
        ("CUDA graphs (linear)", graphs_text(info)),
    ]
    lines += [common.markdown_table(["setting", "value"], rows), ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in definitions(timing_text(info)).items()] + [""]
    if LINEAR in s.parts:
        lines += ["## Linear layer forward+backward", "",
                  f"Widths {', '.join(map(str, s.widths))}; shapes {', '.join(SHAPES)} (in → "
                  f"out as multiples of d); tokens {', '.join(map(str, s.tokens))}; {s.dtype}.",
                  ""]
        headers = ["case", "provider", "status", "ms", "speed-up", "graphed ms", "graphed ×",
                   "TFLOP/s", "peak MB", "saved MB", "y err", "dx err", "dw err",
                   "first call ms", "note"]
        rows = []
        for case_result in linear:
            for r in case_result.results.values():
                rows.append([
                    case_result.case.key, r.label, r.status, _cell(r, common.format_ms(r.ms)),
                    _speedup(r.speedup), common.format_ms(r.graphed_ms),
                    _speedup(r.graphed_speedup),
                    "—" if r.tflops is None else common.format_tflops(r.tflops),
                    common.format_mib(r.peak_extra_mib),
                    common.format_mib(r.saved_mib), common.format_error(r.y_error),
                    common.format_error(r.dx_error), common.format_error(r.dw_error),
                    common.format_ms(r.first_call_ms), r.note,
                ])
        lines += [common.markdown_table(headers, rows), ""]
    if OPTIMIZER in s.parts:
        count = info.tower_parameters or 0
        lines += ["## Optimizer step", "",
                  f"The parameters of the image tower ({vision_text(info.vision)}"
                  f"): {count / 1e6:.2f} M, float32, random gradients. Hyper-parameters "
                  f"{HYPER}.", ""]
        headers = ["optimizer", "status", "ms/step", "× fused", "peak MB", "first step ms",
                   "host syncs", "note"]
        rows = [[r.label, r.status, _cell(r, common.format_ms(r.ms)), _speedup(r.vs_fused),
                 common.format_mib(r.peak_extra_mib), common.format_ms(r.first_call_ms),
                 r.host_syncs or "—", r.note] for r in optimizer]
        lines += [common.markdown_table(headers, rows), ""]
    if E2E in s.parts:
        t = s.train
        lines += ["## End-to-end CLIP training", "",
                  f"{model_text(info.vision, info.text)}; fusedloss.ClipLoss; StableAdamW "
                  f"(lr {t.lr:g}, 10 % linear warm-up then cosine to 0.1, betas "
                  f"{HYPER['betas']}, eps {HYPER['eps']}, weight decay {HYPER['weight_decay']} "
                  f"on matrices); autocast {s.dtype}; batch {t.batch}; {t.steps} steps, the "
                  f"first {t.warmup_steps} left out of the time; synthetic pairs "
                  "(benchmarks/vit.py SyntheticPairs), the same model initialization and "
                  f"batches for every variant (seed {t.seed}).", ""]
        headers = ["variant", "status", "swapped linears", "ms/step", "images/s", "peak GiB",
                   "first loss", "final loss", "Δ final loss", "note"]
        rows = [[r.label, r.status, r.swapped, _cell(r, common.format_ms(r.ms)),
                 count_text(r.images_per_s), gib_text(r.peak_gib),
                 loss_text(r.losses[0] if r.losses else None), loss_text(r.final_loss),
                 "—" if r.final_loss_delta is None else f"{r.final_loss_delta:+.4f}", r.note]
                for r in e2e]
        lines += [common.markdown_table(headers, rows), ""]
        curves = [r for r in e2e if r.losses]
        if curves:
            every = max(1, t.steps // 10)
            marks = sorted({*range(0, t.steps, every), t.steps - 1})
            rows = [[step, *(loss_text(r.losses[step]) if step < len(r.losses) else "—"
                             for r in curves)] for step in marks]
            lines += ["Loss curve (every step in the JSON):", "",
                      common.markdown_table(["step", *(r.label for r in curves)], rows), ""]
        lines += [f"Plot: `{plot}`" if plot else "No plot: matplotlib is not installed.", ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def results_json(info: RunInfo, linear: Sequence[LinearCaseResult],
                 optimizer: Sequence[OptimizerResult], e2e: Sequence[TrainResult],
                 plot: str | None) -> dict[str, Any]:
    return {
        "suite": NAME,
        "environment": info.environment,
        "matmul": info.matmul,
        "settings": asdict(info.settings),
        "definitions": definitions(timing_text(info)),
        "linear": [{**asdict(c.case), "case": c.case.key, "flops": c.case.flops,
                    "results": [asdict(r) for r in c.results.values()]} for c in linear],
        "optimizer": {"model": asdict(info.vision), "parameters": info.tower_parameters,
                      "hyper_parameters": HYPER,
                      "results": [asdict(r) for r in optimizer]} if optimizer else None,
        "e2e": {"vision": asdict(info.vision), "text": asdict(info.text), "plot": plot,
                "results": [asdict(r) for r in e2e]} if e2e else None,
        "calls": info.calls,
        "notes": info.notes,
    }


def short_tables(linear: Sequence[LinearCaseResult], optimizer: Sequence[OptimizerResult],
                 e2e: Sequence[TrainResult]) -> str:
    parts = []
    if linear:
        providers = list(linear[0].results)
        switchbacks = [p for p in providers if p != TORCH]
        rows = []
        for c in linear:
            base = c.results.get(TORCH)
            row = [c.case.key, "—" if base is None else _cell(base, common.format_ms(base.ms))]
            row += [_cell(c.results[p], _speedup(c.results[p].speedup)) for p in switchbacks]
            rows.append(row)
        headers = ["linear fwd+bwd", "nn.Linear ms", *(f"{LINEAR_LABELS[p]} ×"
                                                        for p in switchbacks)]
        parts += [common.text_table(headers, rows), ""]
        # the graphed figures beside them, where the run took any (CUDA)
        if any(r.graphed_ms is not None or GRAPH_FAILED in r.note
               for c in linear for r in c.results.values()):
            rows = []
            for c in linear:
                base = c.results.get(TORCH)
                row = [c.case.key, "—" if base is None
                       else _graphed_cell(base, common.format_ms(base.graphed_ms))]
                row += [_graphed_cell(c.results[p], _speedup(c.results[p].graphed_speedup))
                        for p in switchbacks]
                rows.append(row)
            headers = ["linear fwd+bwd graphed", "nn.Linear graphed ms",
                       *(f"{LINEAR_LABELS[p]} graphed ×" for p in switchbacks)]
            parts += [common.text_table(headers, rows), ""]
    if optimizer:
        rows = [[r.label, _cell(r, common.format_ms(r.ms)), _speedup(r.vs_fused),
                 r.host_syncs or "—"] for r in optimizer]
        parts += [common.text_table(["optimizer", "ms/step", "× fused", "host syncs"], rows),
                  ""]
    if e2e:
        rows = [[r.label, _cell(r, common.format_ms(r.ms)), count_text(r.images_per_s),
                 loss_text(r.final_loss)] for r in e2e]
        parts += [common.text_table(["e2e variant", "ms/step", "images/s", "final loss"], rows),
                  ""]
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
    parser.add_argument("--parts", type=common.comma_list(PARTS), default=list(PARTS),
                        help=f"comma list of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--widths", type=comma_ints, default=None,
                        help=f"linear: widths d (default {','.join(map(str, WIDTHS))}; "
                        f"{','.join(map(str, QUICK_WIDTHS))} with --quick)")
    parser.add_argument("--tokens", type=comma_ints, default=None,
                        help=f"linear: token counts N (default {','.join(map(str, TOKENS))}; "
                        f"{','.join(map(str, QUICK_TOKENS))} with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"e2e: training steps per variant (default {DEFAULT_STEPS}; "
                        f"{QUICK_STEPS} with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, a tiny tower and 3 steps: a smoke test that runs on "
                        "the CPU in seconds")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--warmup-ms", type=float, default=None,
                        help=f"do_bench warmup in ms (default {DEFAULT_TIMING.warmup_ms:g}; "
                        f"{common.QUICK_TIMING.warmup_ms:g} with --quick)")
    parser.add_argument("--rep-ms", type=float, default=None,
                        help=f"do_bench rep in ms (default {DEFAULT_TIMING.rep_ms:g}; "
                        f"{common.QUICK_TIMING.rep_ms:g} with --quick)")
    common.add_matmul_output_arguments(parser)


def settings_from(args: argparse.Namespace, device: torch.device) -> Settings:
    quick = bool(args.quick)

    def pick(value, full, small):
        return value if value is not None else (small if quick else full)

    default = common.QUICK_TIMING if quick else DEFAULT_TIMING
    timing = TimingSettings(
        warmup_ms=default.warmup_ms if args.warmup_ms is None else args.warmup_ms,
        rep_ms=default.rep_ms if args.rep_ms is None else args.rep_ms,
    )
    train = TrainSettings(
        steps=max(1, pick(args.steps, DEFAULT_STEPS, QUICK_STEPS)),
        warmup_steps=QUICK_WARMUP_STEPS if quick else WARMUP_STEPS,
        batch=QUICK_BATCH if quick else BATCH, lr=LR, seed=args.seed,
    )
    return Settings(
        parts=[p for p in PARTS if p in args.parts],
        widths=list(pick(args.widths, WIDTHS, QUICK_WIDTHS)),
        tokens=list(pick(args.tokens, TOKENS, QUICK_TOKENS)),
        backend=switchback_backend(device), train=train, dtype=DTYPE, seed=args.seed,
        quick=quick, timing=timing,
    )


@contextlib.contextmanager
def garbage_collector_frozen() -> Iterator[None]:
    """Objects that exist now are left out of garbage collection until the block ends.

    ``common.release_memory`` runs ``gc.collect()`` a few hundred times per run; frozen, each
    collection scans only what the run created, not all of torch and triton."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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

    with garbage_collector_frozen():
        return _run(args, settings, device, notes, log)


def _run(args: argparse.Namespace, settings: Settings, device: torch.device, notes: list[str],
         log: Callable[[str], None]) -> int:
    dtype = common.parse_dtype(settings.dtype)
    vision, text = (vit.VIT_TINY, vit.TEXT_TINY) if settings.quick else (vit.VIT_B_16,
                                                                           vit.TEXT_SMALL)
    environment = common.collect_environment(device)
    log(f"companions on {environment['device_name']}: torch {environment['torch']}, triton "
        f"{environment['triton']}, {settings.dtype}, SwitchBack backend {settings.backend}, "
        f"parts {', '.join(settings.parts)}")
    matmul = common.probe_matmul(device, args.matmul_size, settings.quick, settings.timing,
                                 dtype, log)
    info = RunInfo(environment=environment, matmul=matmul, settings=settings, vision=vision,
                   text=text, notes=notes)

    linear: list[LinearCaseResult] = []
    if LINEAR in settings.parts:
        cases = linear_cases(settings.widths, list(SHAPES), settings.tokens)
        log(f"linear forward+backward: {len(cases)} cases × {len(LINEAR_PROVIDERS)} providers"
            + (", eager and replayed from a CUDA graph" if common.uses_cuda(device) else ""))
        linear = run_linear(cases, LINEAR_PROVIDERS, settings.backend, dtype, settings.seed,
                            device, settings.timing, notes, log)
        for provider in LINEAR_PROVIDERS:
            info.calls[f"linear {provider}"] = layer_call_text(provider, settings.backend, dtype)
    optimizer: list[OptimizerResult] = []
    if OPTIMIZER in settings.parts:
        info.tower_parameters, optimizer = run_optimizer(vision, settings.seed, device,
                                                         settings.timing, notes, log)
        for r in optimizer:
            info.calls[f"optimizer {r.provider}"] = r.call
    e2e: list[TrainResult] = []
    if E2E in settings.parts:
        log(f"e2e: {model_text(vision, text)}; batch {settings.train.batch}, "
            f"{settings.train.steps} steps per variant")
        e2e = run_e2e(vision, text, settings.train, dtype, settings.backend, device, notes, log)
        for r in e2e:
            info.calls[f"e2e {r.provider}"] = r.call

    plot = None
    if e2e:
        stem = common.results_stem(RESULTS_PREFIX, environment["date"],
                                   environment["device_slug"], args.tag)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = plot_losses(Path(args.out) / f"{stem}.png", e2e)
        plot = path.name if path else None
        notes.append(f"plot: {plot}" if plot else "no plot: matplotlib not installed")
    common.report_results(
        args.out, RESULTS_PREFIX, args.tag, info,
        markdown=render_markdown(info, linear, optimizer, e2e, plot),
        payload=results_json(info, linear, optimizer, e2e, plot),
        tables=short_tables(linear, optimizer, e2e), log=log,
    )
    return 0


SUITE = Suite(
    name=NAME,
    help="SwitchBack linear layers, StableAdamW and a CLIP ViT-B/16 training run",
    add_arguments=add_arguments,
    run=run,
)
