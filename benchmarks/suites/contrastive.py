"""Suite ``contrastive``: CLIP, NT-Xent and SigLIP losses, ours against PyTorch and inf-cl.

Per case (shape × regime) and provider: an untimed check against a reference (also the
warm-up), the peak memory (:data:`MEMORY_DEFINITION`) and the median forward+backward time
(``do_bench``; calls over :data:`SLOW_MS` are timed individually, see :class:`SlowTiming`).
A provider's exception or out-of-memory becomes its row's status and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks import common
from benchmarks.common import FAILED, NOT_INSTALLED, OK, UNAVAILABLE, TimingSettings
from benchmarks.inputs import (
    PAIR_REGIMES,
    TRAINED_CLUSTER_SIZE,
    TRAINED_LATENT,
    TRAINED_NOISE,
    make_pair_features,
    pair_logit_scale,
)
from benchmarks.providers import (
    CLIP,
    NT_XENT,
    SIGLIP,
    ContrastiveProvider,
    Unavailable,
    contrastive_providers,
    destroy_benchmark_process_group,
)
from benchmarks.suites import Suite

NAME = "contrastive"
RESULTS_PREFIX = "contrastive"

FUSEDLOSS = "fusedloss"
FUSEDLOSS_COMPILE = "fusedloss-compile"
TORCH = "torch"
INF_CL = "inf-cl"
PROVIDER_KEYS = (FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH, INF_CL)
DEFAULT_PROVIDERS = (FUSEDLOSS, TORCH, INF_CL)  # fusedloss-compile on request

# Loss parameters. CLIP's logit_scale comes with the regime (1/0.07 random, 100 trained).
SIGLIP_LOGIT_SCALE = 10.0  # SigLIP's initialization: t' = log 10, b = −10
SIGLIP_LOGIT_BIAS = -10.0
NT_XENT_TEMPERATURE = 0.5  # SimCLR's large-batch temperature

# Sanity bounds of the check (a broken provider, not accuracy: errors are reported).
LOSS_TOLERANCE = 1e-2  # |loss − reference| ≤ LOSS_TOLERANCE · max(1, |reference|)
GRADIENT_ERROR_BOUND = 5e-2  # relative L2 error of a feature gradient
# d logit_scale, d logit_bias: sums over b² entries that largely cancel; the materialized bf16
# loss reaches 0.1 there (SigLIP), so only a grossly wrong scalar fails the check.
SCALAR_ERROR_BOUND = 0.5

# What a reference costs: gradients in float64 while rows² · c ≤ this (CLIP b = 16384 × 512
# and NT-Xent 65536 × 256 qualify, CLIP 65536 × 512 does not); a float32 loss (TF32 products,
# exact for bf16/fp16 inputs) up to REFERENCE_LOSS_MAX_ROWS rows; none above.
REFERENCE_GRADS_MAX_WORK = 1 << 40
REFERENCE_LOSS_MAX_ROWS = 262_144

# Calls slower than SLOW_MS are timed individually instead of by do_bench (see SlowTiming).
SLOW_MS = 500.0
SLOW_REPS = 3
SLOW_BUDGET_MS = 10_000.0

MEMORY_DEFINITION = (
    "peak MB above inputs and gradient buffers = (torch.cuda.max_memory_allocated() during "
    "one forward+backward call − memory_allocated() just before it − the gradients' bytes) "
    "/ 2^20; allocator cache emptied and peak counter reset right before the call"
)
ERROR_DEFINITION = (
    "relative L2 error ‖g − g_ref‖₂ / ‖g_ref‖₂ of each gradient of the mean loss against a "
    "float64 reference of the same inputs, where rows²·c ≤ 2^40; 'err ratio' = that error ÷ "
    "the materialized PyTorch loss's (b×b logits in the input dtype)"
)


# ----------------------------------------------------------------------------- shapes, cases


@dataclass(frozen=True)
class ContrastiveShape:
    """One benchmark shape: the loss, the rows (b; 2B for NT-Xent) and the width c."""

    name: str
    loss: str  # "clip" | "nt-xent" | "siglip"
    rows: int
    width: int
    regimes: tuple[str, ...]  # regimes run by default
    providers: tuple[str, ...]  # providers that run on it (when selected)


_ALL = (FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH, INF_CL)
_OURS = (FUSEDLOSS, FUSEDLOSS_COMPILE)
_BOTH = ("random", "trained")

SHAPES: dict[str, ContrastiveShape] = {
    shape.name: shape
    for shape in (
        ContrastiveShape("clip-16k", CLIP, 16_384, 512, _BOTH, _ALL),
        ContrastiveShape("siglip-16k", SIGLIP, 16_384, 512, ("random",),
                         (FUSEDLOSS, FUSEDLOSS_COMPILE, TORCH)),
        ContrastiveShape("nt-xent-64k", NT_XENT, 65_536, 256, _BOTH, (*_OURS, TORCH)),
        ContrastiveShape("clip-64k", CLIP, 65_536, 512, _BOTH, _ALL),
        ContrastiveShape("clip-128k", CLIP, 131_072, 768, _BOTH, _ALL),
        ContrastiveShape("clip-256k", CLIP, 262_144, 512, _BOTH, _OURS),
        ContrastiveShape("clip-1m", CLIP, 1_048_576, 512, ("random",), _OURS),
    )
}

# --quick shrinks rows by 256 and widths by 8 (clip-1m → 4096 × 64): runs on a CPU.
QUICK_ROWS_DIVISOR = 256
QUICK_WIDTH_DIVISOR = 8


@dataclass(frozen=True)
class Case:
    shape: ContrastiveShape
    regime: str
    rows: int  # b, or 2B for NT-Xent
    width: int  # c

    @property
    def loss(self) -> str:
        return self.shape.loss

    @property
    def key(self) -> str:
        return f"{self.shape.name} {self.regime}"

    @property
    def size_text(self) -> str:
        if self.loss == NT_XENT:
            return f"2×{self.rows // 2}×{self.width}"
        return f"{self.rows}×{self.width}"

    @property
    def label(self) -> str:
        return f"{self.loss} {self.size_text} {self.regime}"

    @property
    def logit_scale(self) -> float:
        if self.loss == CLIP:
            return pair_logit_scale(self.regime)
        if self.loss == SIGLIP:
            return SIGLIP_LOGIT_SCALE
        return 1.0 / NT_XENT_TEMPERATURE

    @property
    def parameters_text(self) -> str:
        if self.loss == CLIP:
            return f"logit_scale {self.logit_scale:.4g}"
        if self.loss == SIGLIP:
            return f"logit_scale {SIGLIP_LOGIT_SCALE:g}, logit_bias {SIGLIP_LOGIT_BIAS:g}"
        return f"τ {NT_XENT_TEMPERATURE:g}"

    def floors_ms(self, tflops: float) -> dict[str, float]:
        """The cost floors (docs/design.md) at a matmul rate of ``tflops``: one pass 8·r²·c/R,
        with reuse 4·r²·c/R."""
        work = float(self.rows) ** 2 * self.width
        to_ms = 1e3 / (tflops * 1e12)
        return {"one_pass": 8 * work * to_ms, "one_pass_reuse": 4 * work * to_ms}

    def floor_ms(self, tflops: float) -> float:
        return self.floors_ms(tflops)["one_pass"]

    @property
    def reference_grads(self) -> bool:
        return self.rows**2 * self.width <= REFERENCE_GRADS_MAX_WORK

    @property
    def reference_loss(self) -> bool:
        return self.rows <= REFERENCE_LOSS_MAX_ROWS


def quick_case_size(shape: ContrastiveShape) -> tuple[int, int]:
    rows = max(16, shape.rows // QUICK_ROWS_DIVISOR)
    return rows - rows % 2, max(16, shape.width // QUICK_WIDTH_DIVISOR)


def select_cases(
    shapes: Sequence[str] | None, regimes: Sequence[str] | None, quick: bool
) -> list[Case]:
    """Every chosen shape (default: all) × the chosen regimes (default: the shape's own)."""
    cases = []
    for name in shapes or list(SHAPES):
        shape = SHAPES[name]
        rows, width = quick_case_size(shape) if quick else (shape.rows, shape.width)
        for regime in regimes or shape.regimes:
            cases.append(Case(shape, regime, rows, width))
    return cases


@dataclass
class CaseInputs:
    """What the loss functions are called with, and what gradients are taken of."""

    args: tuple[Any, ...]
    leaves: tuple[Tensor, ...]
    grad_names: tuple[str, ...]

    @property
    def gradient_bytes(self) -> int:
        return sum(leaf.numel() * leaf.element_size() for leaf in self.leaves)


def make_case_inputs(
    case: Case, *, dtype: torch.dtype, device: torch.device, seed: int
) -> CaseInputs:
    """Features of the case's regime (requiring grad) and its tensor scale / bias."""

    def scalar(value: float) -> Tensor:
        return torch.tensor(value, dtype=torch.float32, device=device, requires_grad=True)

    if case.loss == NT_XENT:
        view1, view2 = make_pair_features(
            case.rows // 2, case.width, case.regime, dtype=dtype, device=device, seed=seed
        )
        features = torch.cat([view1, view2]).requires_grad_(True)
        del view1, view2
        return CaseInputs((features, NT_XENT_TEMPERATURE), (features,), ("dZ",))
    image, text = make_pair_features(
        case.rows, case.width, case.regime, dtype=dtype, device=device, seed=seed
    )
    image.requires_grad_(True)
    text.requires_grad_(True)
    scale = scalar(case.logit_scale)
    if case.loss == CLIP:
        return CaseInputs((image, text, scale), (image, text, scale), ("dI", "dT", "ds"))
    bias = scalar(SIGLIP_LOGIT_BIAS)
    return CaseInputs(
        (image, text, scale, bias), (image, text, scale, bias), ("dI", "dT", "ds", "db")
    )


# ----------------------------------------------------------------------------- reference


@dataclass
class Reference:
    loss: float
    dtype: str  # "float64" or "float32 (TF32 products)"
    directions: tuple[float, float] | None = None  # CLIP: image→text, text→image
    grads: dict[str, Tensor] | None = None


def _as_float(value: Tensor | float) -> float:
    return float(value.detach()) if isinstance(value, Tensor) else float(value)


@contextlib.contextmanager
def _tf32_products(enabled: bool) -> Iterator[None]:
    """TF32 float32 matmuls: exact products for bf16/fp16 values (≤ 10 mantissa bits)."""
    if not enabled:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def contrastive_reference(
    loss: str,
    args: Sequence[Any],
    *,
    with_grads: bool,
    dtype: torch.dtype = torch.float64,
    rows_per_chunk: int = 0,
) -> Reference:
    """The mean loss (and its gradients) of ``args`` in ``dtype``, a block of rows at a time.

    ``args`` as the providers take them: CLIP ``(image, text, logit_scale)``, NT-Xent
    ``(features, τ)``, SigLIP ``(image, text, logit_scale, logit_bias)``. With
    X = s·A Bᵀ (+ bias) and G = ∂loss/∂X, one pass gives the row (and CLIP column)
    log-sum-exps or SigLIP's softplus sums; a second pass rebuilds each block of X, forms G
    and accumulates dA = s·G B, dB = s·Gᵀ A, ds = Σ G ⊙ A Bᵀ, db = Σ G (NT-Xent:
    dZ = dA + dB). At most ``rows_per_chunk`` × (all columns) entries exist at once
    (default: ≤ 256 MiB of them, ≤ 4096 rows).
    """
    if loss == NT_XENT:
        a = args[0].detach().to(dtype)
        b = a
        scale, bias = 1.0 / _as_float(args[1]), 0.0
    else:
        a = args[0].detach().to(dtype)
        b = args[1].detach().to(dtype)
        scale = _as_float(args[2])
        bias = _as_float(args[3]) if loss == SIGLIP else 0.0
    n, m = a.shape[0], b.shape[0]
    device = a.device
    if rows_per_chunk <= 0:
        rows_per_chunk = max(1, min(4096, (256 << 20) // (a.element_size() * m)))
    half = n // 2
    tf32 = dtype == torch.float32 and args[0].dtype in (torch.bfloat16, torch.float16)

    def targets(start: int, stop: int) -> Tensor:
        rows = torch.arange(start, stop, device=device)
        return (rows + half) % n if loss == NT_XENT else rows

    def block_logits(start: int, stop: int) -> Tensor:
        x = a[start:stop] @ b.T
        x.mul_(scale)
        if bias:
            x.add_(bias)
        if loss == NT_XENT:
            local = torch.arange(stop - start, device=device)
            x[local, local + start] = -math.inf
        return x

    row_lse = torch.empty(n, dtype=dtype, device=device)
    target_logit = torch.empty(n, dtype=dtype, device=device)
    col_lse = torch.full((m,), -math.inf, dtype=dtype, device=device)
    sigmoid_total = torch.zeros((), dtype=dtype, device=device)
    grads: dict[str, Tensor] = {}
    if with_grads:
        grad_a = torch.empty_like(a)
        grad_b = torch.zeros_like(b)
        grad_scale = torch.zeros((), dtype=dtype, device=device)
        grad_bias = torch.zeros((), dtype=dtype, device=device)

    def accumulate(start: int, stop: int, g: Tensor) -> None:
        g_b = g @ b
        grad_scale.add_((g_b * a[start:stop]).sum())  # Σ G ⊙ A Bᵀ
        grad_a[start:stop] = g_b.mul_(scale)
        grad_b.addmm_(g.T, a[start:stop], alpha=scale)

    with _tf32_products(tf32):
        for start in range(0, n, rows_per_chunk):
            stop = min(n, start + rows_per_chunk)
            local = torch.arange(stop - start, device=device)
            x = block_logits(start, stop)
            if loss == SIGLIP:  # z = +1 on the diagonal, −1 elsewhere
                diagonal = x[local, local + start]
                sigmoid_total += (
                    F.softplus(x).sum() - F.softplus(diagonal).sum() + F.softplus(-diagonal).sum()
                )
                if with_grads:
                    g = torch.sigmoid(x).div_(n)
                    g[local, local + start] = -torch.sigmoid(-diagonal) / n
                    grad_bias += g.sum()
                    accumulate(start, stop, g)
                continue
            row_lse[start:stop] = torch.logsumexp(x, dim=1)
            target_logit[start:stop] = x[local, targets(start, stop)]
            if loss == CLIP:
                col_lse = torch.logaddexp(col_lse, torch.logsumexp(x, dim=0))
            del x
        if with_grads and loss != SIGLIP:
            for start in range(0, n, rows_per_chunk):
                stop = min(n, start + rows_per_chunk)
                local = torch.arange(stop - start, device=device)
                x = block_logits(start, stop)
                if loss == CLIP:
                    g = (x - row_lse[start:stop, None]).exp_().mul_(0.5)
                    g.add_((x - col_lse[None, :]).exp_(), alpha=0.5)
                else:
                    g = x.sub_(row_lse[start:stop, None]).exp_()
                g[local, targets(start, stop)] -= 1.0
                g.div_(n)
                accumulate(start, stop, g)
                del x, g

    if loss == SIGLIP:
        value, directions = float(sigmoid_total) / n, None
    elif loss == CLIP:
        i2t = float((row_lse - target_logit).mean())
        t2i = float((col_lse - target_logit).mean())
        value, directions = (i2t + t2i) / 2, (i2t, t2i)
    else:
        value, directions = float((row_lse - target_logit).mean()), None
    if with_grads:
        if loss == NT_XENT:
            grads = {"dZ": grad_a.add_(grad_b)}
        else:
            grads = {"dI": grad_a, "dT": grad_b, "ds": grad_scale}
            if loss == SIGLIP:
                grads["db"] = grad_bias
    name = "float64" if dtype == torch.float64 else common.dtype_name(dtype)
    if tf32:
        name += " (TF32 products)"
    return Reference(value, name, directions, grads if with_grads else None)


# ----------------------------------------------------------------------------- results


@dataclass
class SlowTiming:
    """Calls estimated at ≥ ``threshold_ms`` are timed ``reps`` times individually, with
    ``reps = clamp(budget_ms / estimate, 2, max_reps)`` (1 if ``max_reps`` is 1)."""

    threshold_ms: float = SLOW_MS
    max_reps: int = SLOW_REPS
    budget_ms: float = SLOW_BUDGET_MS

    def reps(self, estimate_ms: float) -> int:
        wanted = int(self.budget_ms // max(estimate_ms, 1e-3))
        return max(1, min(self.max_reps, max(2, wanted)))


@dataclass
class ProviderResult(common.ProviderResultBase):
    """One provider on one case: the fields every suite records, then these figures."""

    timing: str = ""  # how ms was measured
    first_call_ms: float | None = None  # the check call (includes compilation)
    peak_extra_mib: float | None = None
    loss: float | None = None
    loss_error: float | None = None  # |loss − reference|
    errors: dict[str, float] = field(default_factory=dict)  # gradient name → rel. L2 error
    ratios: dict[str, float] = field(default_factory=dict)  # error ÷ torch materialized's
    times_floor: float | None = None  # ms ÷ 8·r²·c/R


@dataclass
class CaseResult:
    case: Case
    floors_ms: dict[str, float]
    reference: Reference | None
    results: dict[str, ProviderResult] = field(default_factory=dict)
    note: str = ""


def run_provider(
    provider: ContrastiveProvider,
    case: Case,
    inputs: CaseInputs,
    reference: Reference | None,
    *,
    timing: TimingSettings,
    slow: SlowTiming,
    floor_ms: float | None,
) -> ProviderResult:
    """Check, measure memory, and time one provider on one case; never raises."""
    device = inputs.leaves[0].device
    result = ProviderResult(provider.key, provider.display_name())
    try:
        loss_fn = provider.build(device, case.loss)
    except Unavailable as error:
        result.status = (
            NOT_INSTALLED if provider.is_peer and "not importable" in str(error) else (UNAVAILABLE)
        )
        result.note = str(error)
        return result
    except Exception as error:  # e.g. a process group that could not start
        result.status = FAILED
        result.note = common.describe_error(error)
        return result
    result.call = provider.describe(case.loss)

    def forward_backward() -> tuple[Tensor, ...]:
        return torch.autograd.grad(loss_fn(*inputs.args), inputs.leaves)

    with common.failures_recorded(result, device):
        begin = time.perf_counter()
        _check(result, loss_fn, inputs, reference)
        common.synchronize(device)
        result.first_call_ms = (time.perf_counter() - begin) * 1e3
        common.release_memory(device)
        estimate_ms = result.first_call_ms
        if common.uses_cuda(device):
            begin = time.perf_counter()
            result.peak_extra_mib = common.peak_extra_mib(
                forward_backward, device, inputs.gradient_bytes
            )
            estimate_ms = (time.perf_counter() - begin) * 1e3
        if estimate_ms >= slow.threshold_ms:
            reps = slow.reps(estimate_ms)
            result.ms = common.median_ms_fixed(forward_backward, device, reps)
            result.timing = f"median of {reps} timed call{'s' if reps > 1 else ''}"
        else:
            result.ms = common.median_ms(forward_backward, device, timing)
            result.timing = "do_bench" if common.uses_cuda(device) else "wall-clock median"
        if floor_ms:
            result.times_floor = result.ms / floor_ms
    return result


def _check(
    result: ProviderResult,
    loss_fn: Callable[..., Tensor],
    inputs: CaseInputs,
    reference: Reference | None,
) -> None:
    """First (untimed) call: finite loss and gradients, compared with the reference."""
    problems = []
    loss = loss_fn(*inputs.args)
    grads = torch.autograd.grad(loss, inputs.leaves)
    result.loss = float(loss.detach().float())
    del loss
    if not math.isfinite(result.loss):
        problems.append(f"loss {result.loss}")
    for name, grad in zip(inputs.grad_names, grads, strict=True):
        if not bool(torch.isfinite(grad).all()):
            problems.append(f"{name} not finite")
    if reference is not None:
        result.loss_error, loss_problems = common.check_loss(
            result.loss, reference.loss, LOSS_TOLERANCE
        )
        problems += loss_problems
        if reference.grads is not None:
            for name, grad in zip(inputs.grad_names, grads, strict=True):
                error = common.relative_l2_error(grad, reference.grads[name])
                result.errors[name] = error
                bound = GRADIENT_ERROR_BOUND if grad.dim() else SCALAR_ERROR_BOUND
                if not error <= bound:  # also catches NaN
                    problems.append(f"{name} relative error {error:.2e} > {bound}")
    del grads
    common.mark_wrong(result, problems)


def run_cases(
    cases: Sequence[Case],
    providers: Sequence[ContrastiveProvider],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    timing: TimingSettings,
    slow: SlowTiming,
    tflops: float,
    log: Callable[[str], None] = print,
) -> list[CaseResult]:
    """Run every provider of every case (the shape's providers among those selected)."""
    case_results: list[CaseResult] = []
    for case in cases:
        chosen = [p for p in providers if p.key in case.shape.providers and p.supports(case.loss)]
        case_result = CaseResult(case, case.floors_ms(tflops), None)
        case_results.append(case_result)
        try:
            inputs = make_case_inputs(case, dtype=dtype, device=device, seed=seed)
        except Exception as error:  # e.g. out of memory for the inputs themselves
            case_result.note = f"inputs could not be made: {common.describe_error(error)}"
            log(f"[{case.key}] {case_result.note}")
            common.release_memory(device)
            continue
        case_result.reference, reference_note = _make_reference(case, inputs)
        common.release_memory(device)
        log(_case_header(case, case_result.reference, reference_note))
        if reference_note:
            case_result.note = reference_note
        for provider in chosen:
            outcome = run_provider(
                provider,
                case,
                inputs,
                case_result.reference,
                timing=timing,
                slow=slow,
                floor_ms=case.floor_ms(tflops),
            )
            case_result.results[provider.key] = outcome
            progress = common.progress_line(outcome, _figures_text)
            log(f"  {case.key:<22} {outcome.label:<20} {progress}")
        _fill_error_ratios(case_result)
        del inputs
        common.release_memory(device)
    return case_results


def _make_reference(case: Case, inputs: CaseInputs) -> tuple[Reference | None, str]:
    if not case.reference_loss:
        return None, f"no reference above {REFERENCE_LOSS_MAX_ROWS} rows: loss only checked finite"
    dtype = torch.float64 if case.reference_grads else torch.float32
    with_grads = case.reference_grads
    try:
        return contrastive_reference(case.loss, inputs.args, with_grads=with_grads, dtype=dtype), ""
    except Exception as error:  # an OOM here must not end the run
        return None, f"reference unavailable: {common.describe_error(error)}"


def _case_header(case: Case, reference: Reference | None, note: str) -> str:
    text = f"[{case.key}] {case.label}, {case.parameters_text}: "
    if reference is None:
        return text + note
    text += f"reference loss {reference.loss:.4f} ({reference.dtype}"
    if reference.directions:
        i2t, t2i = reference.directions
        text += f"; image→text {i2t:.4f}, text→image {t2i:.4f}"
    return text + ")"


def _fill_error_ratios(case_result: CaseResult) -> None:
    yardstick = case_result.results.get(TORCH)
    if yardstick is None or not yardstick.errors:
        return
    for result in case_result.results.values():
        for name, error in result.errors.items():
            base = yardstick.errors.get(name)
            if base:
                result.ratios[name] = error / base


def _figures_text(result: ProviderResult) -> str:
    text = (
        f"{common.format_ms(result.ms)} ms ({result.timing}), "
        f"{common.format_mib(result.peak_extra_mib)} MB, loss {result.loss:.5g}"
    )
    if result.times_floor is not None:
        text += f", {result.times_floor:.2f}× floor"
    if result.errors:
        text += ", " + ", ".join(f"{k} {v:.1e}" for k, v in result.errors.items())
    return text


# ----------------------------------------------------------------------------- reports


@dataclass(kw_only=True)
class RunInfo(common.RunInfoBase):
    """The shared run settings, plus the slow-call timing and the fusedloss backend."""

    slow: SlowTiming
    backend: str


def _errors_text(result: ProviderResult) -> str:
    if not result.errors:
        return "—"
    parts = []
    for name, error in result.errors.items():
        ratio = result.ratios.get(name)
        parts.append(f"{name} {error:.1e}" + (f" ({ratio:.2g}×)" if ratio is not None else ""))
    return ", ".join(parts)


def _loss_text(case_result: CaseResult) -> str:
    reference = case_result.reference
    if reference is None:
        ours = case_result.results.get(FUSEDLOSS)
        if ours is not None and ours.loss is not None:
            return f"{ours.loss:.4f} (fusedloss; no reference)"
        return "—"
    text = f"{reference.loss:.4f}"
    if reference.directions:
        text += f" (i→t {reference.directions[0]:.4f}, t→i {reference.directions[1]:.4f})"
    return text


def render_markdown(info: RunInfo, case_results: Sequence[CaseResult]) -> str:
    env = info.environment
    lines = [f"# Contrastive losses: {env['device_name']}, {env['date']}", ""]
    if info.quick:
        lines += [
            "> **--quick run**: rows shrunk 256×, widths 8×, short timing. A smoke test of "
            "the runner; the figures are not representative.",
            "",
        ]
    header_rows = [
        *common.environment_rows(env, info.peer_versions, f", backend {info.backend}"),
        ("dtype, seed", f"{info.dtype}, seed {info.seed}"),
        common.matmul_row(info.matmul),
        (
            "timing",
            (
                "forward+backward = torch.autograd.grad(loss, (features…, logit_scale…)); "
                f"{common.do_bench_text(info.timing)} "
                f"for calls under {info.slow.threshold_ms:g} ms, else the median of "
                f"clamp({info.slow.budget_ms / 1e3:g} s / call, 2, {info.slow.max_reps}) calls "
                "each timed between CUDA events (the 'timing' column says which)"
            )
            if common.uses_cuda(env["device"])
            else common.WALL_CLOCK_TIMING,
        ),
        ("memory", MEMORY_DEFINITION),
        ("gradient error", ERROR_DEFINITION),
        (
            "inputs",
            "bf16 features L2-normalized in fp32 and cast (benchmarks/inputs.py "
            "make_pair_features). random: independent random unit vectors, CLIP logit_scale "
            "1/0.07. trained (trained-like): C = b/"
            f"{TRAINED_CLUSTER_SIZE} clusters with random unit centres c_k, pair i in a random "
            f"cluster k_i (random order), image_i = normalize(c_k + {TRAINED_LATENT:g}·w_i + "
            f"{TRAINED_NOISE:g}·n_i), text_i = normalize(c_k + {TRAINED_LATENT:g}·w_i + "
            f"{TRAINED_NOISE:g}·n'_i) with w, n, n' random unit vectors; CLIP logit_scale 100. "
            "NT-Xent: the two views are the image and text features of B pairs, stacked "
            f"(2B × c), τ = {NT_XENT_TEMPERATURE:g}. SigLIP: logit_scale {SIGLIP_LOGIT_SCALE:g}, "
            f"logit_bias {SIGLIP_LOGIT_BIAS:g} (SigLIP's initialization)",
        ),
        (
            "floor",
            "the one-pass cost floor (docs/design.md) 8·r²·c/R (r = b, or 2B for NT-Xent; "
            "R measured above); 4·r²·c/R if the backward reuses forward statistics well",
        ),
    ]
    lines += [common.markdown_table(["setting", "value"], header_rows), ""]

    columns = common.provider_columns(case_results)
    lines += [
        "## Time and memory",
        "",
        "Median ms / peak MB above inputs and gradient buffers, forward+backward (— = not "
        "run on this shape); floor 8·r²·c/R and fusedloss's time ÷ floor.",
        "",
    ]
    rows = []
    for cr in case_results:
        ours = cr.results.get(FUSEDLOSS)
        rows.append(
            [cr.case.label]
            + [common.time_and_memory_cell(cr.results.get(key), "—") for key, _ in columns]
            + [
                common.format_ms(cr.floors_ms["one_pass"]),
                common.format_ratio(ours.times_floor) if ours else "—",
            ]
        )
    headers = ["case (loss b×c regime)"] + [lbl for _, lbl in columns]
    headers += ["floor 8r²c/R", "fusedloss × floor"]
    lines += [common.markdown_table(headers, rows), ""]

    accuracy_cases = [cr for cr in case_results if any(r.errors for r in cr.results.values())]
    if accuracy_cases:
        lines += [
            "## Gradient accuracy",
            "",
            "Relative L2 error against the float64 reference (÷ torch materialized's error "
            "in parentheses).",
            "",
        ]
        rows = [
            [cr.case.label]
            + [_errors_text(r) if (r := cr.results.get(key)) else "—" for key, _ in columns]
            for cr in accuracy_cases
        ]
        lines += [common.markdown_table(["case"] + [lbl for _, lbl in columns], rows), ""]

    lines += ["## Losses", ""]
    rows = [
        [
            cr.case.label,
            cr.case.parameters_text,
            _loss_text(cr),
            cr.reference.dtype if cr.reference else "—",
        ]
        for cr in case_results
    ]
    lines += [
        common.markdown_table(["case", "parameters", "mean loss (reference)", "reference"], rows),
        "",
    ]

    lines += ["## Cost floors (docs/design.md)", ""]
    rows = [
        [
            cr.case.label,
            common.format_ms(cr.floors_ms["one_pass"]),
            common.format_ms(cr.floors_ms["one_pass_reuse"]),
            common.fastest_cell(cr.results.values()),
        ]
        for cr in case_results
    ]
    headers = ["case", "8·r²·c/R", "4·r²·c/R", "fastest measured"]
    lines += [common.markdown_table(headers, rows), ""]

    lines += ["## All figures", ""]
    rows = []
    for cr in case_results:
        for result in cr.results.values():
            rows.append(
                [
                    cr.case.key,
                    result.label,
                    result.status,
                    common.format_ms(result.ms),
                    result.timing,
                    common.format_ratio(result.times_floor),
                    common.format_mib(result.peak_extra_mib),
                    *common.loss_cells(result),
                    _errors_text(result),
                    common.format_ms(result.first_call_ms),
                    result.note,
                ]
            )
    headers = [
        "case",
        "provider",
        "status",
        "ms",
        "timing",
        "× floor",
        "MB",
        "loss",
        "|loss − ref|",
        "gradient errors",
        "first call ms",
        "note",
    ]
    lines += [common.markdown_table(headers, rows), ""]
    lines += common.closing_sections(info.calls, info.notes)
    return "\n".join(lines)


def results_json(info: RunInfo, case_results: Sequence[CaseResult]) -> dict[str, Any]:
    return {
        "suite": NAME,
        "environment": info.environment,
        "settings": {
            "dtype": info.dtype,
            "seed": info.seed,
            "quick": info.quick,
            "warmup_ms": info.timing.warmup_ms,
            "rep_ms": info.timing.rep_ms,
            "slow": asdict(info.slow),
            "backend": info.backend,
            "providers": info.providers,
        },
        "matmul": info.matmul,
        "peer_versions": info.peer_versions,
        "inputs": {
            "trained": {
                "cluster_size": TRAINED_CLUSTER_SIZE,
                "latent": TRAINED_LATENT,
                "noise": TRAINED_NOISE,
            },
            "logit_scale": {regime: pair_logit_scale(regime) for regime in PAIR_REGIMES},
            "siglip": {"logit_scale": SIGLIP_LOGIT_SCALE, "logit_bias": SIGLIP_LOGIT_BIAS},
            "nt_xent_temperature": NT_XENT_TEMPERATURE,
        },
        "definitions": {
            "memory": MEMORY_DEFINITION,
            "gradient_error": ERROR_DEFINITION,
            "floors": "one pass 8·r²·c/R; with reuse of forward statistics 4·r²·c/R",
            "check": f"|loss − ref| ≤ {LOSS_TOLERANCE}·max(1, |ref|), feature-gradient errors "
            f"≤ {GRADIENT_ERROR_BOUND}, scalar-gradient errors ≤ {SCALAR_ERROR_BOUND}, all "
            "finite; failing rows have status 'wrong'",
        },
        "cases": [
            {
                "case": cr.case.key,
                "shape": cr.case.shape.name,
                "loss": cr.case.loss,
                "rows": cr.case.rows,
                "width": cr.case.width,
                "regime": cr.case.regime,
                "parameters": cr.case.parameters_text,
                "floors_ms": cr.floors_ms,
                "reference": None
                if cr.reference is None
                else {
                    "loss": cr.reference.loss,
                    "dtype": cr.reference.dtype,
                    "directions": cr.reference.directions,
                },
                "note": cr.note,
                "results": [asdict(r) for r in cr.results.values()],
            }
            for cr in case_results
        ],
        "calls": info.calls,
        "notes": info.notes,
    }


def short_tables(case_results: Sequence[CaseResult]) -> str:
    """The terminal summary: mean losses, then one line per case and provider."""
    parts = ["mean loss per case (reference)"]
    rows = [[cr.case.key, cr.case.parameters_text, _loss_text(cr)] for cr in case_results]
    parts += [common.text_table(["case", "parameters", "loss"], rows), ""]
    rows = [
        [
            *common.summary_cells(cr.case.key, result),
            _errors_text(result) if result.errors else "—",
            (("ok" if result.status == OK else "wrong") if result.measured else ""),
        ]
        for cr in case_results
        for result in cr.results.values()
    ]
    headers = [*common.SUMMARY_HEADERS, "gradient errors", "check"]
    parts += [common.text_table(headers, rows)]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        type=common.comma_list(list(SHAPES)),
        help=f"comma list of {', '.join(SHAPES)} (default: all)",
    )
    parser.add_argument(
        "--regimes",
        type=common.comma_list(PAIR_REGIMES),
        help="comma list of random, trained (default: each shape's own; clip-1m and "
        "siglip-16k run random only)",
    )
    parser.add_argument(
        "--providers",
        type=common.comma_list(PROVIDER_KEYS),
        default=list(DEFAULT_PROVIDERS),
        help=f"comma list of {', '.join(PROVIDER_KEYS)} (default: "
        f"{','.join(DEFAULT_PROVIDERS)}); each shape runs those it supports",
    )
    common.add_dtype_seed_arguments(parser)
    common.add_quick_device_timing_arguments(
        parser, "rows/256, widths/8 and short timing: a smoke test that also runs on CPU"
    )
    common.add_matmul_output_arguments(parser)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    device = common.pick_device(args.device)
    if not common.uses_cuda(device) and not args.quick:
        log("the contrastive suite needs a CUDA device at full size; use --quick on a CPU")
        return 2
    quick = bool(args.quick)
    dtype = common.parse_dtype(args.dtype)
    backend = "triton" if common.uses_cuda(device) else "torch"
    timing = common.timing_settings(args.warmup_ms, args.rep_ms, quick)
    slow = SlowTiming()
    notes: list[str] = [common.QUICK_NOTE] if quick else []

    all_providers = contrastive_providers(backend)
    providers = [all_providers[key] for key in args.providers]
    cases = select_cases(args.shapes, args.regimes, quick)
    environment = common.collect_environment(device)
    log(
        f"contrastive on {environment['device_name']}: torch {environment['torch']}, "
        f"triton {environment['triton']}, {common.dtype_name(dtype)}, fusedloss backend "
        f"{backend}, cases: {', '.join(case.key for case in cases)}"
    )
    matmul = common.probe_matmul(device, args.matmul_size, quick, timing, dtype, log)
    try:
        case_results = run_cases(
            cases,
            providers,
            device=device,
            dtype=dtype,
            seed=args.seed,
            timing=timing,
            slow=slow,
            tflops=matmul["tflops"],
            log=log,
        )
    finally:
        destroy_benchmark_process_group()

    for provider in providers:
        process_group_note = getattr(provider, "process_group_note", "")
        if process_group_note:
            notes.append(f"{provider.display_name()}: {process_group_note}")
    calls: dict[str, str] = {}
    for cr in case_results:
        if cr.note:
            notes.append(f"{cr.case.key}: {cr.note}")
        for result in cr.results.values():
            if result.call:
                calls.setdefault(f"{result.label}, {cr.case.loss}", result.call)
            common.note_problem(notes, cr.case.key, result)
    info = RunInfo(
        environment=environment,
        matmul=matmul,
        dtype=common.dtype_name(dtype),
        seed=args.seed,
        quick=quick,
        timing=timing,
        slow=slow,
        backend=backend,
        providers=list(args.providers),
        peer_versions={"inf-cl": common.package_version("inf-cl")},
        calls=calls,
        notes=notes,
    )
    common.report_results(
        args.out,
        RESULTS_PREFIX,
        args.tag,
        info,
        markdown=render_markdown(info, case_results),
        payload=results_json(info, case_results),
        tables=short_tables(case_results),
        log=log,
    )
    return 0


SUITE = Suite(
    name=NAME,
    help="CLIP, NT-Xent and SigLIP losses against materialized PyTorch and inf-cl",
    add_arguments=add_arguments,
    run=run,
)
